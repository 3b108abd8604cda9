"""CPU time of one *steady* training step, by part (is the step CPU-bound?).

    python -m stoker._internal.bench.benchmarks.step_cpu [--model tiny-gpt] [--size smoke|full] [--batch N]
                                   [--steps 30] [--rounds 5] [--no-optimizer] [--profile N]

A GPU-suite model (`stoker/_internal/bench/suite.py`) trains with `stoker.compile`
through Triton's *real* launch path on the CPU: ``TRITON_INTERPRET=0`` and the
stand-in sm_90 driver (`warm.stand_in`: kernels cross-compiled, their launches
stubs). After the warm-up steps (the first compiles the forward, the second
compiled autograd's backward), each round times ``--steps`` steady steps: forward,
loss, ``zero_grad``, ``loss.backward()``, AdamW (the suite's step; ``--no-optimizer``
for the small table's forward + backward). What is left is what a GPU step pays on
the host too: Python, guards, launches; the sizes are the model's tiny smoke size
by default, so the extern matmuls' CPU arithmetic stays small (and is shown apart).

Reported (µs per step, the thread's CPU time, best round):

- the step, plain (no instrumentation), and the same step eager (its CPU op
  dispatch and arithmetic, for scale);
- the instrumented step by part, *exclusive* times (each part without the parts
  inside it; the wrapper's own cost, calibrated, taken off its caller): Dynamo's
  guard check and frame entry, stoker's forward runtime, the generated graph
  wrappers, kernel launches (count, µs each), extern calls (aten ops the wrapper
  calls: matmuls, at these sizes mostly dispatch), compiled autograd (the C++
  engine: cache lookup and graph walk; torch's Python around it; stoker-autograd's
  router: the scope decision and the hook set for the call; our runtime wrapper; its guard check; the segment
  dispatch; accumulate-grad), the optimizer, and the eager rest of the step.

``--profile N``: cProfile N steady steps and print the top functions by own time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# The parts' clock: the thread's CPU time (a part the machine took the core away in
# does not count the wait); a read costs about a microsecond, calibrated away below.
CLOCK = time.thread_time_ns


class Parts:
    """Exclusive CPU time per named part: `wrap` a callable, and each call adds its time
    minus the time of the wrapped calls inside it; the phase (forward, backward,
    optimizer) prefixes each part's name."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[int] = []
        self.phase = ""
        self.on = False
        # (part, callable, args, kwargs) of the calls of parts wrapped with `record`, while set
        self.recorded: list[tuple[str, Callable[..., Any], Any, Any]] | None = None

    def wrap(
        self, name: str, fn: Callable[..., Any], phase: str | None = None, record: bool = False
    ) -> Any:
        clock = CLOCK
        stack, ns, calls = self.stack, self.ns, self.calls

        def timed(*a: Any, **k: Any) -> Any:
            if not self.on:
                if record and self.recorded is not None:
                    self.recorded.append((name, fn, a, k))
                return fn(*a, **k)
            before = self.phase
            if phase is not None:
                self.phase = phase
            key = f"{self.phase}{name}"
            stack.append(0)
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                dt = clock() - t0
                child = stack.pop()
                ns[key] = ns.get(key, 0) + dt - child
                calls[key] = calls.get(key, 0) + 1
                if stack:
                    stack[-1] += dt
                self.phase = before

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def patch(self, owner: Any, attr: str, name: str, record: bool = False) -> None:
        setattr(owner, attr, self.wrap(name, getattr(owner, attr), record=record))


def _calibrate(parts: Parts) -> tuple[float, float]:
    """What the timing wrapper itself adds, in ns per wrapped call: to the call's own
    exclusive time, and to its caller's (each less what a call of the bare function costs)."""
    inner = parts.wrap("calibrate inner", lambda: None)
    bare = lambda: None  # noqa: E731
    n = 2000

    def loop(f: Callable[[], None]) -> None:
        for _ in range(n):
            f()

    outer = parts.wrap("calibrate outer", loop)
    parts.phase = ""
    own, caller, plain = float("inf"), float("inf"), float("inf")
    for _ in range(7):
        parts.on = True
        parts.ns.clear()
        outer(inner)
        parts.on = False
        own = min(own, parts.ns["calibrate inner"] / n)
        caller = min(caller, parts.ns["calibrate outer"] / n)
        t0 = CLOCK()
        loop(bare)
        plain = min(plain, (CLOCK() - t0) / n)
    parts.ns.clear()
    parts.calls.clear()
    return max(0.0, own), max(0.0, caller - plain)


def _replay(
    recorded: list[tuple[str, Callable[..., Any], Any, Any]], rounds: int
) -> dict[str, float]:
    """CPU µs per call of each recorded part, its calls of one step replayed alone
    (the same callables and arguments: the steady path), best of `rounds`; without
    grad, as the wrapper calls them."""
    import torch

    with torch.no_grad():
        return _replay_no_grad(recorded, rounds)


def _replay_no_grad(
    recorded: list[tuple[str, Callable[..., Any], Any, Any]], rounds: int
) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in dict.fromkeys(r[0] for r in recorded):
        mine = [(f, a, k) for r, f, a, k in recorded if r == name]
        reps = max(1, 2000 // len(mine))
        best = float("inf")
        for _ in range(rounds):
            t0 = time.thread_time()
            for _ in range(reps):
                for f, a, k in mine:
                    f(*a, **k)
            best = min(best, (time.thread_time() - t0) / (reps * len(mine)) * 1e6)
        out[name] = best
    return out


class _TimedEngine:
    """The engine object the router forwards to, its ``run_backward`` timed."""

    def __init__(self, real: Any, run_backward: Callable[..., Any]) -> None:
        self._real, self.run_backward = real, run_backward

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _instrument(parts: Parts) -> None:
    """Wrap stoker's steady-step entry points (by class or module attribute)."""
    from torch.autograd.variable import Variable

    from stoker_autograd._internal import engine as ag_engine
    from stoker_autograd._internal import runtime as ag_runtime
    from stoker_autograd._internal import segments
    from stoker_capture._internal.stages import compile as cap_compile
    from stoker_triton._internal import graphcache, pipeline
    from stoker_triton._internal.modcache import modules
    from stoker_triton._internal.runtime import fastlaunch, launcher

    parts.patch(cap_compile.CompiledFn, "__call__", "stoker forward runtime (CompiledFn)")
    # (the boxed entries: `__call__` boxes its arguments and calls them; the backward's
    # segments and compiled graphs are called boxed)
    parts.patch(pipeline.CompiledGraph, "call_boxed", "graph wrapper (generated)")
    # a launch: what the wrapper calls (`Launcher.go`): the slow path until a binary is
    # kept, then the generated lean function (each one timed as it is made)
    if not hasattr(launcher.Launcher, "_go"):  # an older checkout: wrappers call the launcher
        parts.patch(launcher.Launcher, "__call__", "kernel launch", record=True)
    else:
        _instrument_go(parts, launcher.Launcher, fastlaunch.FastPath)
    # the router (stoker_autograd's engine): which backward to compile, the hook per call;
    # then the C++ engine it calls (the engine object it forwards to, timed)
    parts.patch(ag_engine, "_route", "compiled autograd: scope decision, hook per call")
    ag_engine._install()
    router = Variable._execution_engine
    router._real = _TimedEngine(  # type: ignore[attr-defined, union-attr]
        router._real,  # type: ignore[attr-defined, union-attr]
        parts.wrap(
            "autograd engine (C++: cache lookup, graph walk)",
            router._real.run_backward,  # type: ignore[attr-defined, union-attr]
        ),
    )
    parts.patch(ag_runtime, "runtime_wrapper", "compiled autograd: runtime_wrapper")
    parts.patch(ag_runtime.CompiledBackward, "__call__", "compiled autograd: guards, arguments")
    parts.patch(segments.SegmentedBackward, "call_boxed", "compiled autograd: segment dispatch")
    parts.patch(segments, "_apply_accumulates", "compiled autograd: accumulate-grad")

    # extern calls: the callables among a wrapper's constants (aten ops, size functions)
    def externs(make_call: Callable[..., Any]) -> Callable[..., Any]:
        def made(launchers: Any, consts: dict[str, Any]) -> Any:
            wrapped = {
                k: parts.wrap("extern call", v, record=True) if _is_op(v) else v
                for k, v in consts.items()
            }
            return make_call(launchers, wrapped)

        return made

    def loader(load: Callable[..., Any]) -> Callable[..., Any]:
        def loaded(*a: Any) -> Any:
            got = load(*a)
            mod = got[0] if got is not None else None
            if hasattr(mod, "make_call") and not getattr(mod.make_call, "_parts", False):  # type: ignore[union-attr]
                mod.make_call = externs(mod.make_call)  # type: ignore[union-attr]
                mod.make_call._parts = True  # type: ignore[union-attr]
            return got

        return loaded

    for mod in (modules, graphcache, pipeline):
        for attr in ("load_module", "load_stored"):
            if hasattr(mod, attr):
                setattr(mod, attr, loader(getattr(mod, attr)))


def _instrument_go(parts: Parts, launcher: Any, fast_path: Any) -> None:
    """Time `Launcher.go`: its slow path, and each lean function as it is made."""
    parts.patch(launcher, "_go", "kernel launch", record=True)
    make_lean = fast_path.lean

    def timed_lean(self: Any, *a: Any) -> Any:
        return parts.wrap("kernel launch", make_lean(self, *a), record=True)

    fast_path.lean = timed_lean


def _is_op(v: Any) -> bool:
    import torch

    return isinstance(v, torch._ops.OpOverload | torch._ops.OpOverloadPacket)


def _per_step_us(step: Callable[[], None], steps: int, rounds: int) -> float:
    """The thread's CPU µs per step, best of `rounds` rounds of `steps` steps."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(steps):
            step()
        best = min(best, (time.thread_time() - t0) / steps * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--size", choices=("smoke", "full"), default="smoke")
    ap.add_argument("--batch", type=int, help="batch size (the kernels do not change)")
    ap.add_argument("--steps", type=int, default=30, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the best is reported")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--no-optimizer", action="store_true", help="forward + backward only")
    ap.add_argument("--profile", type=int, default=0, help="cProfile this many steps")
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("STOKER_TRITON_CHECK_TARGETS", "")
    import torch

    import stoker
    from stoker._internal.bench.suite import get_entry

    from .warm import stand_in

    stand_in()
    # one thread: the extern ops' arithmetic is not what is measured, and an OpenMP pool
    # on a loaded machine waits for its descheduled threads
    torch.set_num_threads(1)
    parts = Parts()
    _instrument(parts)
    entry = get_entry(a.model)
    size = dict(entry.sized(a.size == "smoke"))
    if a.batch is not None:
        size["batch"] = a.batch
    torch.manual_seed(0)
    net = entry.build(size)
    inputs, target = entry.batch(size, torch.Generator().manual_seed(0))
    optimize = entry.optimizer and not a.no_optimizer

    def stepper(model: Any, params: list[torch.nn.Parameter]) -> Callable[[], None]:
        opt = torch.optim.AdamW(params, lr=1e-3) if optimize else None
        forward = parts.wrap("Dynamo guards, frame entry", model, phase="forward: ")
        backward = parts.wrap(
            "loss.backward() (torch's Python: gradients, engine entry)",
            lambda loss: loss.backward(),
            phase="backward: ",
        )
        opt_step = parts.wrap("AdamW step", opt.step if opt else lambda: None, "optimizer: ")

        def body() -> None:
            loss = entry.loss(forward(*inputs), target)
            for p in params:
                p.grad = None
            backward(loss)
            if opt is not None:
                opt_step()

        return parts.wrap("loss, zero_grad, the step's Python", body, phase="eager rest: ")  # type: ignore[no-any-return]

    params = list(net.parameters())
    eager_step = stepper(net, params)
    for _ in range(a.warmup):
        eager_step()
    # eager first (its backward would stay on the eager engine after stoker.compile too)
    eager = _per_step_us(eager_step, a.steps, a.rounds)
    compiled = stoker.compile(net)
    step = stepper(compiled, params)
    for _ in range(a.warmup):
        step()
    report = getattr(compiled, "stoker_report", None)
    summary = report.summary() if report is not None else {}
    import stoker_autograd

    ag_before = dict(stoker_autograd.stats())
    plain = _per_step_us(step, a.steps, a.rounds)
    # launches and extern calls of one step, replayed alone
    parts.recorded = []
    step()
    replayed = _replay(parts.recorded, a.rounds)
    parts.recorded = None
    # instrumented steps: each part's median over the steps, less the timing wrappers' own cost
    own, caller = _calibrate(parts)
    per_step: dict[str, list[int]] = {}
    calls: dict[str, int] = {}
    for _ in range(a.rounds * a.steps):
        parts.ns.clear()
        parts.calls.clear()
        parts.on = True
        step()
        parts.on = False
        for k, v in parts.ns.items():
            per_step.setdefault(k, []).append(v)
        calls = dict(parts.calls)
    best = {k: statistics.median(v) / 1e3 for k, v in per_step.items()}
    inner_calls = _inner_counts(calls)
    for k in best:
        cost = calls.get(k, 0) * own + inner_calls.get(k, 0) * caller
        best[k] = max(0.0, best[k] - cost / 1e3)
    ag_after = stoker_autograd.stats()
    compiles = {k: ag_after[k] - ag_before[k] for k in ("compiles", "eager_runs", "fallbacks")}
    print(
        f"steady step of {a.model} ({a.size} size {size}, "
        f"{'AdamW' if optimize else 'no optimizer'}), CPU µs per step, "
        f"best of {a.rounds} rounds of {a.steps} steps"
    )
    print(f"  stoker step (thread CPU time)                 {plain:10.1f}")
    print(f"  eager step (CPU op dispatch and arithmetic)   {eager:10.1f}")
    print(
        "  by part (thread CPU time of instrumented steps, median, exclusive; the timing wrapper's"
    )
    print(
        f"  own cost, {own / 1e3:.2f} µs per call and {caller / 1e3:.2f} µs to its caller, taken off):"
    )
    print(f"  {'part':58s} {'µs':>8s} {'calls':>6s} {'µs/call':>8s}")
    for k in sorted(best, key=_order):
        n = calls.get(k, 0)
        per = best[k] / n if n else 0.0
        print(f"  {k:58s} {best[k]:8.1f} {n:6.0f} {per:8.2f}")
    print(f"  {'sum of the parts':58s} {sum(best.values()):8.1f}")
    for name, us in replayed.items():
        n = sum(v for k, v in calls.items() if k.endswith(name))
        print(f"  {name} replayed alone: {n:.0f} per step, {us:.2f} µs each, {n * us:.1f} µs")
    print(f"  in the timed steps: {compiles} (must be 0); graphs {summary.get('kernels')} kernels")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "model": a.model,
                    "size": size,
                    "step_us": plain,
                    "eager_step_us": eager,
                    "parts_us": best,
                    "calls_per_step": calls,
                    "replayed_us_per_call": replayed,
                    "timed_steps": compiles,
                },
                f,
                indent=1,
            )
    if a.profile:
        _profile(step, a.profile)
    return 0 if not any(compiles.values()) else 1


def _inner_counts(calls: dict[str, int]) -> dict[str, int]:
    """Per part, the wrapped calls made directly inside it: the parts `_NESTS` names."""
    out: dict[str, int] = {}
    for k in calls:
        phase = next((p for p in _PHASES if k.startswith(p)), "")
        for child in _NESTS.get(k[len(phase) :], ()):
            # in its own phase; a part that starts a phase (the step's parts) in that one
            n = calls.get(phase + child) or sum(calls.get(p + child, 0) for p in _PHASES)
            out[k] = out.get(k, 0) + n
    return out


# part -> the parts called directly inside it (the wrappers' cost is taken off it)
_NESTS: dict[str, tuple[str, ...]] = {
    "loss, zero_grad, the step's Python": (
        "Dynamo guards, frame entry",
        "loss.backward() (torch's Python: gradients, engine entry)",
        "AdamW step",
    ),
    # the router forwards straight to the engine when nothing is in scope (the eager
    # step), through the scope decision otherwise
    "loss.backward() (torch's Python: gradients, engine entry)": (
        "compiled autograd: scope decision, hook per call",
        "autograd engine (C++: cache lookup, graph walk)",
    ),
    "Dynamo guards, frame entry": ("stoker forward runtime (CompiledFn)",),
    "stoker forward runtime (CompiledFn)": ("graph wrapper (generated)",),
    "graph wrapper (generated)": ("kernel launch", "extern call"),
    "compiled autograd: scope decision, hook per call": (
        "autograd engine (C++: cache lookup, graph walk)",
    ),
    "autograd engine (C++: cache lookup, graph walk)": ("compiled autograd: runtime_wrapper",),
    "compiled autograd: runtime_wrapper": ("compiled autograd: guards, arguments",),
    "compiled autograd: guards, arguments": ("compiled autograd: segment dispatch",),
    "compiled autograd: segment dispatch": (
        "graph wrapper (generated)",
        "compiled autograd: accumulate-grad",
    ),
}

_PHASES = ("forward: ", "backward: ", "optimizer: ", "eager rest: ")


def _order(k: str) -> tuple[int, str]:
    for i, p in enumerate(_PHASES):
        if k.startswith(p):
            return (i, "")
    return (len(_PHASES), k)


def _profile(step: Callable[[], None], n: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(lambda: [step() for _ in range(n)])  # type: ignore[func-returns-value]
    print(f"\ncProfile of {n} steps, top 25 by own time:")
    st = pstats.Stats(prof, stream=sys.stdout)
    st.sort_stats("tottime").print_stats(os.environ.get("BENCH_STEP_FILTER", ""), 25)
    if os.environ.get("BENCH_STEP_CALLEES"):
        st.sort_stats("cumulative").print_callees(os.environ["BENCH_STEP_CALLEES"])


if __name__ == "__main__":
    raise SystemExit(main())
