"""A warm start on the CPU, by stage, and beside Inductor's warm CPU start.

    python -m stoker._internal.bench.benchmarks.warm [--model gpt-m] [--batch 2] [--repeat 3] [--keep DIR] [--inductor]

Two kinds of process train one step of a GPU-suite model (`stoker/_internal/bench/suite.py`)
with `stoker.compile`, through Triton's *real* launch path on the CPU: ``TRITON_INTERPRET=0``
and `stoker_triton._internal.fakegpu` (kernels cross-compiled for sm_90 with ptxas, written to
Triton's disk cache, "loaded" and "launched" by stubs). CPU tensors stand in for CUDA ones:
the stoker executor is forced to "triton" for them (`config.resolve_backend`), the one
workaround; the stub launches write nothing, so losses are garbage, not timed correctness.

1. a cold process fills STOKER_CACHE_DIR and TRITON_CACHE_DIR (a temp dir);
2. ``--repeat`` warm processes, each a new interpreter, time their first and second step
   (wall and CPU, unprofiled: min / median / max over the repeats);
3. one more warm process times its first step under cProfile and reports per stage
   (inclusive CPU seconds) and, with ``--imports N``, runs under ``python -X importtime``
   for its slowest imports.

``--inductor`` adds the same model under ``torch.compile(model, backend="inductor")`` on
the CPU (its C++ code generation: a C++ compiler must be on the PATH): a cold process
fills a fresh TORCHINDUCTOR_CACHE_DIR, then ``--repeat`` warm processes load from it, and
both warm first steps are printed side by side. Inductor's CPU step computes the model
(its second step is that compute alone); stoker's stub launches compute nothing, so
compare "first step - second step", the start-up cost, as well as the first step.

The stages (cProfile's cumulative time of the function that owns each; they nest, so
they do not add up): see `STAGES`. Counters: kernel modules loaded, `triton.jit`
JITFunctions made, Triton compiles (`triton.compile`), compiled-autograd FX graphs built.
`COLD_ONLY` lists modules a warm process must not import (it never runs them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

# stage -> (module file suffix, function name) whose cumulative time is the stage
STAGES: dict[str, tuple[str, str]] = {
    "process to end of first step": ("", "-"),  # CPU time of the whole process
    "first step (all)": ("bench/benchmarks/warm.py", "step"),
    "Dynamo (convert_frame)": ("convert_frame.py", "_compile"),
    "stoker backend": ("stoker/_internal/api/backend.py", "__call__"),
    "capture (stage 1, cache)": ("stoker_capture/_internal/dynamo.py", "backend"),
    "compiled-graph load (triton)": ("stoker_triton/_internal/graphcache.py", "load"),
    "kernel modules load": ("stoker_triton/_internal/modcache/modules.py", "load_stored"),
    "  triton.jit (JITFunction)": ("triton/runtime/jit.py", "jit"),
    "first launches (JITFunction.run)": ("triton/runtime/jit.py", "run"),
    "  Triton compile": ("triton/compiler/compiler.py", "compile"),
    "compiled autograd (end_capture)": ("stoker_autograd/_internal/capture.py", "end_capture"),
    "  autograd cache key": ("stoker_autograd/_internal/graphstore.py", "key"),
    "  autograd graph text": ("stoker_autograd/_internal/graphstore.py", "graph_text"),
    "backward (all)": ("torch/_tensor.py", "backward"),
    "optimizer step": ("torch/optim/optimizer.py", "wrapper"),
}


# A cold first step, by stage (`--cold`): each wraps the function(s) named and times
# their calls (wall and CPU of this process, inclusive, outermost call only): unlike
# cProfile's, these times are not inflated by the profiler, and waits count.
# stage -> (module, attribute path)
COLD_STAGES: dict[str, tuple[str, str]] = {
    "Dynamo (convert_frame._compile)": ("torch._dynamo.convert_frame", "_compile"),
    "stoker backend": ("stoker._internal.api.backend", "StokerBackend.__call__"),
    "  capture: state (fake forward)": ("stoker_capture._internal.api", "create_aot_state"),
    "  capture: joint trace (stage 1)": (
        "stoker_capture._internal.api",
        "aot_stage1_graph_capture",
    ),
    "  stage 2 (partition + compile fw, bw)": (
        "stoker_capture._internal.api",
        "aot_stage2_compile",
    ),
    "compile_graph (all graphs)": ("stoker_triton._internal.pipeline", "compile_graph_impl"),
    "forward run (compiled)": (
        "stoker_capture._internal.runtime.function",
        "CompiledFunction.forward",
    ),
    "backward (all)": ("torch", "Tensor.backward"),
    "  compiled autograd: first run (eager)": (
        "stoker_autograd._internal.runtime",
        "_Recorder.run",
    ),
    "  compiled autograd: retrace": ("stoker_autograd._internal.runtime", "retrace"),
    "  compiled autograd: compile": (
        "stoker_autograd._internal.runtime",
        "CompiledBackward._compiled",
    ),
    "wait for workers (first launches)": (
        "stoker_triton._internal.runtime.launcher",
        "Launcher._await_precompile",
    ),
    "Triton launches (JITFunction.run)": ("triton.runtime.jit", "JITFunction.run"),
    "  Triton compile in this process": ("triton.runtime.jit", "compile"),
    "cache writes (DiskCache.put)": ("stoker_shapes._internal.diskcache", "DiskCache.put"),
    "  binary records (warmload.record)": ("stoker_triton._internal.runtime.warmload", "record"),
    "optimizer step": ("torch.optim.adamw", "AdamW.step"),
}


# Modules only a cold start runs (capture's min-cut partitioner, the backward's
# reordering passes and retrace decompositions, stoker-triton's lowering, scheduler and
# code generation), each with the modules under it: a warm process, which loads every
# graph from the caches, imports none of them (tests-integration/test_tools_smoke.py
# checks it, and that a cold process imports each, so that a renamed module fails there).
COLD_ONLY: tuple[str, ...] = (
    "stoker_capture._internal.partition.mincut",
    "stoker_capture._internal.partition.ops",
    "stoker_autograd.passes",
    "stoker_autograd._internal.symbolic_decomps",
    "stoker_triton._internal.lowering",
    "stoker_triton._internal.scheduler",
    "stoker_triton._internal.codegen.kernel",
    "stoker_triton._internal.codegen.wrapper",
)


def cold_only(modules: list[str]) -> list[str]:
    """The entries of `COLD_ONLY` that ``modules`` holds (a module or one under it)."""
    return [e for e in COLD_ONLY if any(m == e or m.startswith(e + ".") for m in modules)]


def _wrap_stages(
    table: dict[str, tuple[str, str]],
) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """Wrap each function of `table` with a timer: stage -> [calls, wall s, CPU s];
    and each `compile_graph_impl` call's record (wall, CPU, its report's stages)."""
    import importlib

    times: dict[str, list[float]] = {}
    graphs: list[dict[str, Any]] = []
    for stage, (modname, attr) in table.items():
        try:
            owner: Any = importlib.import_module(modname)
            *parents, name = attr.split(".")
            for p in parents:
                owner = getattr(owner, p)
            fn = getattr(owner, name)
        except (ImportError, AttributeError) as e:
            print(f"bench_warm: stage {stage!r} not timed: {e}", file=sys.stderr)
            continue
        row = times[stage] = [0, 0.0, 0.0]
        setattr(owner, name, _timer(fn, row, graphs if name == "compile_graph_impl" else None))
    return times, graphs


def _timer(fn: Any, row: list[float], graphs: list[dict[str, Any]] | None) -> Any:
    import functools
    import traceback

    depth = [0]

    @functools.wraps(fn)
    def timed(*a: Any, **k: Any) -> Any:
        if depth[0]:
            return fn(*a, **k)
        depth[0] += 1
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            out = fn(*a, **k)
        finally:
            depth[0] -= 1
            w, c = time.perf_counter() - w0, time.process_time() - c0
            row[0] += 1
            row[1] += w
            row[2] += c
        if graphs is not None:
            rep = getattr(out, "report", None)
            stack = "".join(traceback.format_stack(limit=40))
            graphs.append(
                {
                    "by": "compiled autograd" if "stoker_autograd" in stack else "capture",
                    "wall": w,
                    "cpu": c,
                    "kernels": len(getattr(rep, "kernels", ()) or ()),
                    "cache": getattr(rep, "cache", None),
                    "stages_ms": dict(getattr(rep, "timings_ms", {}) or {}),
                }
            )
        return out

    return timed


def stand_in() -> None:
    """Triton's real launch path on the CPU: the stand-in sm_90 driver, and CPU tensors
    taking stoker's Triton executor (the one workaround: CUDA inputs would). Call with
    ``TRITON_INTERPRET=0`` set before triton is imported."""
    from stoker._internal import config
    from stoker._internal.api import backend
    from stoker_triton._internal.fakegpu import install

    install()
    config.resolve_backend = lambda requested, devices: "triton"
    if hasattr(backend, "resolve_backend"):
        backend.resolve_backend = config.resolve_backend


def _worker(
    model: str,
    batch: int | None,
    profile_out: str | None,
    steps: int,
    smoke: bool,
    cold: bool = False,
    workers: int = 0,
    profile: bool = True,
) -> dict[str, Any]:
    t_start = time.process_time()
    w_start = time.perf_counter()
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    t_torch = time.process_time()
    import stoker
    from stoker._internal.bench.suite import get_entry

    t_stoker = time.process_time()
    stand_in()
    cold_times: dict[str, list[float]] = {}
    graphs: list[dict[str, Any]] = []
    if cold:  # as on a GPU: compile workers, each kernel's compile queued as it loads
        from stoker_triton._internal import pipeline, runtime
        from stoker_triton._internal.compile import xcompile

        def gpu_target(device: Any) -> tuple[str, Any, int] | None:
            return ("cuda", 90, 32)

        runtime.native_target = pipeline.native_target = gpu_target  # type: ignore[attr-defined]
        if workers:
            xcompile.cpu_count = lambda: workers

    counts = _count_calls()
    if cold:
        cold_times, graphs = _wrap_stages(COLD_STAGES)
    entry = get_entry(model)
    size = dict(entry.sized(smoke))
    if batch is not None:
        size["batch"] = batch
    torch.manual_seed(0)
    net = entry.build(size)
    inputs, target = entry.batch(size, torch.Generator().manual_seed(0))
    fn = stoker.compile(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step() -> None:
        loss = entry.loss(fn(*inputs), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    import cProfile
    import pstats

    before = dict(counts)
    prof = cProfile.Profile(time.process_time)
    t0, w0 = time.process_time(), time.perf_counter()
    prof.runcall(step) if profile else step()
    first, first_wall = time.process_time() - t0, time.perf_counter() - w0
    process_wall = time.perf_counter() - w_start
    if not profile:
        prof.runcall(lambda: None)
    stats = pstats.Stats(prof)
    if profile_out:
        stats.dump_stats(profile_out)
    stages = {name: 0.0 for name in STAGES}
    for (file, _line, func), row in stats.stats.items():  # type: ignore[attr-defined]
        for name, (suffix, fname) in STAGES.items():
            if func == fname and file.replace(os.sep, "/").endswith(suffix):
                stages[name] += row[3]  # cumulative
    stages["first step (all)"] = first
    stages["process to end of first step"] = time.process_time()
    cold_rows = {k: list(v) for k, v in cold_times.items()}  # the first step's only
    n_graphs = len(graphs)
    cold_rows["first step (all)"] = [1, first_wall, first]
    if cold:  # distinct kernel sources the first step stored (one compile each)
        kdir = os.path.join(os.environ.get("STOKER_CACHE_DIR", ""), "triton", "kernels")
        counts["kernel modules stored"] = len(os.listdir(kdir)) if os.path.isdir(kdir) else 0
        before.setdefault("kernel modules stored", 0)
    cold_rows["process to end of first step"] = [
        1,
        time.perf_counter() - w_start,
        time.process_time(),
    ]
    timed = _timed_steps(step, steps, first_wall, first, process_wall)
    modules: dict[str, int] = {}
    for name in list(sys.modules):
        top = name.split(".")[0]
        modules[top] = modules.get(top, 0) + 1
    rep = getattr(fn, "stoker_report", None)
    import stoker_autograd

    return {
        "imports: torch": t_torch - t_start,
        "imports: stoker (+ triton)": t_stoker - t_torch,
        "stages": stages,
        "counts": {k: v - before[k] for k, v in counts.items()},  # in the first step
        "counts before": before,
        "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1])[:12]),
        "stoker modules": sorted(m for m in sys.modules if m.startswith("stoker")),
        "summary": rep.summary() if rep is not None else {},
        "autograd": stoker_autograd.stats(),
        "cold": cold_rows,
        "graphs": graphs[:n_graphs],
        "timed": timed,
    }


def _timed_steps(
    step: Any, steps: int, first_wall: float, first_cpu: float, process_wall: float
) -> dict[str, float]:
    """Run the steps after the first (a cold process: its second step compiles what the
    first ran eagerly); the first's and the second's wall and CPU seconds."""
    timed = {
        "first step wall": first_wall,
        "first step CPU": first_cpu,
        "process to end of first step wall": process_wall,
    }
    for i in range(steps - 1):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        if i == 0:
            timed["second step wall"] = time.perf_counter() - w0
            timed["second step CPU"] = time.process_time() - c0
    return timed


def _inductor_worker(model: str, batch: int | None, steps: int, smoke: bool) -> dict[str, Any]:
    """One process training ``model`` under ``torch.compile(backend="inductor")`` on the
    CPU: the same model, batch, loss and optimizer as the stoker worker."""
    w_start = time.perf_counter()
    import torch

    from stoker._internal.bench.suite import get_entry

    entry = get_entry(model)
    size = dict(entry.sized(smoke))
    if batch is not None:
        size["batch"] = batch
    torch.manual_seed(0)
    net = entry.build(size)
    inputs, target = entry.batch(size, torch.Generator().manual_seed(0))
    fn = torch.compile(net, backend="inductor")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step() -> None:
        loss = entry.loss(fn(*inputs), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    t0, w0 = time.process_time(), time.perf_counter()
    step()
    first, first_wall = time.process_time() - t0, time.perf_counter() - w0
    timed = _timed_steps(step, steps, first_wall, first, time.perf_counter() - w_start)
    from torch._dynamo.utils import counters

    caches = {f"{k}.{n}": v for k in ("inductor", "aot_autograd") for n, v in counters[k].items()}
    return {"timed": timed, "caches": {k: v for k, v in caches.items() if "cache" in k}}


def _count_calls() -> dict[str, int]:
    """Counters of JITFunctions made, Triton compiles and FX graphs of compiled autograd."""
    import triton
    from triton.runtime import jit

    counts = {
        "JITFunction": 0,
        "triton.compile": 0,
        "Triton cache misses": 0,
        "autograd FX graphs": 0,
    }

    def listener(**k: Any) -> None:  # a compile that found no binary in Triton's cache
        counts["Triton cache misses"] += not k.get("cache_hit", False)

    triton.knobs.compilation.listener = listener
    init = jit.JITFunction.__init__

    def counted_init(self: Any, *a: Any, **k: Any) -> None:
        counts["JITFunction"] += 1
        if os.environ.get("BENCH_WARM_WHO") and counts["JITFunction"] == 1:
            import traceback

            traceback.print_stack(file=sys.stderr)
        init(self, *a, **k)

    jit.JITFunction.__init__ = counted_init
    import triton.compiler.compiler as tcc

    comp = tcc.compile

    def counted_compile(*a: Any, **k: Any) -> Any:
        counts["triton.compile"] += 1
        return comp(*a, **k)

    tcc.compile = counted_compile
    triton.compile = counted_compile
    triton.compiler.compile = counted_compile  # what JITFunction's binder imports
    jit.compile = counted_compile
    try:
        from stoker_autograd._internal import graph, graphstore, retrace, runtime

        gm = graph.graph_module

        def counted_gm(*a: Any, **k: Any) -> Any:
            counts["autograd FX graphs"] += 1
            return gm(*a, **k)

        # the stages that build one: the captured graph, the retraced one, a loaded one
        for stage in (runtime, retrace, graphstore):
            stage.graph_module = counted_gm  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        pass
    return counts


def _run(
    env: dict[str, str],
    args: list[str],
    timeout: float,
    flags: tuple[str, ...] = (),
    stderr: list[str] | None = None,
) -> dict[str, Any]:
    p = subprocess.run(
        [
            sys.executable,
            *flags,
            "-W",
            "ignore",
            "-m",
            "stoker._internal.bench.benchmarks.warm",
            "--worker",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if p.returncode != 0:
        raise SystemExit(f"worker failed:\n{p.stderr[-4000:]}")
    if stderr is not None:
        stderr.append(p.stderr)
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def _imports(stderr: str, top: int) -> list[tuple[float, str]]:
    """The slowest imports in ``python -X importtime``'s report (cumulative, seconds)."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cum, name = line[len("import time:") :].split("|")
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        rows.append((int(cum) / 1e6, depth, name.strip()))
    # the modules imported directly by the program or by one of them (depth 0 and 1)
    return sorted(((s, "  " * d + n) for s, d, n in rows if d <= 1), reverse=True)[:top]


def _spread(vs: list[float]) -> str:
    """min / median / max."""
    import statistics

    return f"{min(vs):6.2f} / {statistics.median(vs):6.2f} / {max(vs):6.2f}"


# (row, key of `timed`): the warm first step, stoker beside Inductor
SIDE_BY_SIDE = (
    ("process start to end of first step, wall", "process to end of first step wall"),
    ("first step, wall", "first step wall"),
    ("first step, CPU", "first step CPU"),
    ("second step, wall", "second step wall"),
    ("second step, CPU", "second step CPU"),
    ("first - second step, wall", "start-up wall"),
    ("first - second step, CPU", "start-up CPU"),
)


def _side_rows(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {}
    for r in runs:
        t = dict(r["timed"])
        for unit in ("wall", "CPU"):
            t[f"start-up {unit}"] = t[f"first step {unit}"] - t.get(f"second step {unit}", 0.0)
        for _, key in SIDE_BY_SIDE:
            rows.setdefault(key, []).append(t.get(key, float("nan")))
    return rows


def _inductor_arm(
    root: str, model: str, batch: int, smoke: bool, repeat: int, flags: tuple[str, ...]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Inductor on the CPU: a cold process filling a fresh TORCHINDUCTOR_CACHE_DIR, then
    ``repeat`` warm processes reading it."""
    import shutil

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise SystemExit(
            "bench_warm --inductor: Inductor's CPU backend compiles C++ and no C++ compiler "
            "was found (c++, g++ or $CXX); install one or leave out --inductor"
        )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor")}
    iargs = ["--inductor-arm", "--model", model, "--batch", str(batch), "--steps", "2"]
    iargs += ["--smoke"] if smoke else []
    t0 = time.perf_counter()
    cold = _run(env, iargs, 3600)
    print(f"Inductor cold process: {time.perf_counter() - t0:.1f} s wall ({cxx})")
    return cold, [_run(env, iargs, 1800, flags) for _ in range(repeat)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-m")
    ap.add_argument("--batch", type=int, default=2, help="batch size (kernels do not change)")
    ap.add_argument("--smoke", action="store_true", help="the model at its tiny smoke size")
    ap.add_argument(
        "--repeat", type=int, default=3, help="warm processes (min / median / max reported)"
    )
    ap.add_argument("--keep", help="cache directory to use and keep (default: a temp dir)")
    ap.add_argument("--imports", type=int, default=15, help="slowest imports to list (0: none)")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--warm-only", action="store_true", help="reuse the filled --keep directory")
    ap.add_argument(
        "--inductor",
        action="store_true",
        help="also Inductor's cold then warm CPU start on the same model, side by side",
    )
    ap.add_argument(
        "--no-pyc",
        action="store_true",
        help="warm processes read no bytecode cache (as on the GPU image): imports compile sources",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="break down a cold first step instead: --repeat processes, each with empty caches",
    )
    ap.add_argument("--workers", type=int, default=0, help="--cold: compile workers (0: per CPU)")
    ap.add_argument(
        "--profile", action="store_true", help="--cold: also cProfile the step (CPU stages)"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inductor-arm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stages", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker and a.inductor_arm:
        print(json.dumps(_inductor_worker(a.model, a.batch, a.steps, a.smoke)))
        return 0
    if a.worker:
        out = _worker(
            a.model,
            a.batch,
            a.profile_out,
            a.steps,
            a.smoke,
            a.cold,
            a.workers,
            a.profile or a.stages,
        )
        print(json.dumps(out))
        return 0
    if a.cold:
        return _cold_main(a)
    root = a.keep or tempfile.mkdtemp(prefix="stoker-warm-")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "STOKER_CACHE_DIR": os.path.join(root, "stoker"),
        "TRITON_CACHE_DIR": os.path.join(root, "triton"),
        "STOKER_TRITON_CHECK_TARGETS": "",
    }
    wargs = ["--model", a.model, "--batch", str(a.batch), *(["--smoke"] if a.smoke else [])]
    t0 = time.perf_counter()
    # two steps: the first backward runs the captured graph eagerly, the second compiles it
    cold = (
        _run(env, [*wargs, "--steps", "2"], 1800)
        if not a.warm_only
        else {"stages": {}, "counts": {}, "timed": {}}
    )
    print(f"cold process: {time.perf_counter() - t0:.1f} s wall; caches in {root}")
    flags: tuple[str, ...] = ()
    if a.no_pyc:  # the GPU image: every module compiled from source in every process
        flags = ("-X", f"pycache_prefix={tempfile.mkdtemp(prefix='stoker-nopyc-')}")
    wenv = {**env, "PYTHONDONTWRITEBYTECODE": "1"} if a.no_pyc else env
    # unprofiled warm processes (the timings), then one under cProfile (the stages) and,
    # with --imports, under -X importtime (its imports happen before the profile starts)
    warms = [_run(wenv, [*wargs, "--steps", "2"], 900, flags) for _ in range(a.repeat)]
    err: list[str] = []
    iflags = ("-X", "importtime") if a.imports else ()
    detail = _run(wenv, [*wargs, "--stages"], 900, (*flags, *iflags), err)
    inductor: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
    if a.inductor:
        inductor = _inductor_arm(root, a.model, a.batch, a.smoke, a.repeat, flags)
    pyc = ", no bytecode cache" if a.no_pyc else ""
    print(
        f"\nwarm first step of {a.model} (batch {a.batch}{pyc}), seconds, "
        f"min / median / max of {a.repeat} processes:"
    )
    srows = _side_rows(warms)
    irows = _side_rows(inductor[1]) if inductor else {}
    head = f"  {'':42s} {'stoker (stand-in sm_90)':>24s}"
    print(head + (f" {'Inductor (CPU, C++)':>24s}" if inductor else ""))
    for label, key in SIDE_BY_SIDE:
        line = f"  {label:42s} {_spread(srows[key]):>24s}"
        print(line + (f" {_spread(irows[key]):>24s}" if inductor else ""))
    c, ic = cold.get("timed", {}), inductor[0]["timed"] if inductor else {}
    line = f"  {'cold process: first step, wall':42s} {c.get('first step wall', 0.0):24.2f}"
    print(line + (f" {ic.get('first step wall', 0.0):24.2f}" if inductor else ""))
    if inductor:
        print(f"  Inductor's caches, a warm process: {inductor[1][0]['caches']}")
    print("\nthe warm first step by stage (one more warm process, under cProfile; CPU s):")
    for k, v in detail["stages"].items():
        print(f"  {k:40s} {v:8.2f}")
    for k in ("imports: torch", "imports: stoker (+ triton)"):
        print(f"  {k:40s} {detail[k]:8.2f}")
    print(f"  counts cold: {cold['counts']}")
    print(f"  counts warm: {warms[0]['counts']}")
    print(f"  modules of a warm process: {warms[0]['modules']}")
    imported = cold_only(warms[0]["stoker modules"])
    print(f"  cold-only modules a warm process imported: {imported or 'none'}")
    s = warms[0]["summary"]
    print(
        "  warm caches: graphs",
        {
            k: s.get(k)
            for k in (
                "cache",
                "cache_hits",
                "cache_misses",
                "graph_cache_hits",
                "capture_cache_hits",
                "kernels",
            )
        },
        "autograd",
        {k: warms[0]["autograd"].get(k) for k in ("disk_hits", "compiles")},
    )
    if a.imports:
        print(
            f"\nslowest imports of a warm process (-X importtime, cumulative s, top {a.imports}):"
        )
        for sec, name in _imports(err[0], a.imports):
            print(f"  {sec:6.2f}  {name}")
    if a.json:
        with open(a.json, "w") as f:
            res = {"cold": cold, "warm": warms, "detail": detail}
            if inductor:
                res["inductor"] = {"cold": inductor[0], "warm": inductor[1]}
            json.dump(res, f, indent=1)
    return 0


def _cold_main(a: argparse.Namespace) -> int:
    """`--cold`: where a cold first step's wall and CPU go (main process)."""
    wargs = ["--model", a.model, "--batch", str(a.batch), "--cold", "--workers", str(a.workers)]
    wargs += [*(["--smoke"] if a.smoke else []), *(["--profile"] if a.profile else [])]
    flags: tuple[str, ...] = ()
    env = {**os.environ, "TRITON_INTERPRET": "0", "STOKER_TRITON_CHECK_TARGETS": ""}
    if a.no_pyc:
        flags = ("-X", f"pycache_prefix={tempfile.mkdtemp(prefix='stoker-nopyc-')}")
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    runs = []
    for _ in range(a.repeat):
        root = tempfile.mkdtemp(prefix="stoker-cold-")
        env["STOKER_CACHE_DIR"] = os.path.join(root, "stoker")
        env["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
        t0 = time.perf_counter()
        runs.append(_run(env, wargs, 1800, flags))
        print(f"cold process: {time.perf_counter() - t0:.1f} s wall", file=sys.stderr)
        if not a.keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    pyc = ", no bytecode cache" if a.no_pyc else ""
    print(f"cold first step of {a.model} (batch {a.batch}{pyc}), min of {a.repeat} processes:")
    print(
        f"  {'stage (inclusive; indented: inside the one above)':52s} {'calls':>5s} "
        f"{'wall s':>7s} {'CPU s':>7s}"
    )
    print(
        f"  {'imports: torch (CPU)':52s} {'':5s} {'':7s} "
        f"{min(r['imports: torch'] for r in runs):7.2f}"
    )
    for k in runs[0]["cold"]:
        rows = [r["cold"][k] for r in runs if k in r["cold"]]
        print(
            f"  {k:52s} {int(rows[0][0]):5d} {min(r[1] for r in rows):7.2f} "
            f"{min(r[2] for r in rows):7.2f}"
        )
    print("  compile_graph calls (first process; report stages in s):")
    for g in runs[0]["graphs"]:
        st = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in g["stages_ms"].items())
        print(
            f"    {g['by']:18s} {g['kernels']:3d} kernels {g['cache'] or '':>14s} "
            f"wall {g['wall']:5.2f} CPU {g['cpu']:5.2f}: {st}"
        )
    print(f"  counts: {runs[0]['counts']}")
    if a.profile:
        print("  cProfile CPU stages (first process):")
        for k, v in runs[0]["stages"].items():
            print(f"    {k:50s} {v:7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
