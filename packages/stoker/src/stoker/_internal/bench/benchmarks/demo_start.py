"""`stoker demo`'s first step, cold and warm, by stage (the CPU warm-start target).

    python -m stoker._internal.bench.benchmarks.demo_start [--backend aten,interpret] [--warm 2] [--batch 16] [--no-freeze]

The target: on the CPU, with the aten and interpreter executors, `stoker demo` warm is
within 2x of eager's first step plus load time. For each executor, one cold process
(empty STOKER_CACHE_DIR and TRITON_CACHE_DIR) and then ``--warm`` warm processes (the
caches it left), each a new interpreter, do what `stoker demo` does first: the eager
GPT's first training step (forward, loss, backward, AdamW), then the compiled copy's
first step (same weights, same batch), inside the demo's loop's `frozen_heap` (its setup's
objects out of the cyclic GC's reach; the time the GC takes in the compiled first step, and
its full collections, are printed too; ``--no-freeze`` runs them without it). Each stage below is a wrapped function, timed per
outermost call in CPU seconds of the process (no profiler), so they nest:

- Dynamo (`convert_frame._compile`: its frame trace, guards; stoker's backend inside);
- stoker's backend, and in it the captured-graph cache load and stoker-triton's
  compiled-graph loads (the interpreter executor);
- the backward, and in it compiled autograd's capture (from `begin_capture` to
  `end_capture`'s return), its stored-backward load (a warm start) or its eager first
  run, retrace and compile (a cold one).

"load" is what a warm start does instead of compiling: Dynamo's trace (stoker's backend
inside) plus compiled autograd's capture (its key) and load; "run" is the rest of the compiled first step,
to be read against the eager first step (the target: run <= 2x eager), or, for an
executor slower than eager at every step (the interpreter runs Triton kernels in
NumPy), against the compiled steady step (the third). Prints a table;
``--json`` writes the raw numbers.
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

from .warm import COLD_STAGES, _wrap_stages

# stage -> (module, attribute path); see the module docstring. Stages the cold bench
# times too are taken from its table.
STAGES: dict[str, tuple[str, str]] = {
    "Dynamo (convert_frame._compile)": COLD_STAGES["Dynamo (convert_frame._compile)"],
    "  stoker backend": COLD_STAGES["stoker backend"],
    "    captured-graph load": ("stoker_capture._internal.capcache", "CaptureCache.load"),
    "    compiled-graph loads (Triton)": ("stoker_triton._internal.pipeline", "_load_cached"),
    "backward (all)": COLD_STAGES["backward (all)"],
    "  compiled autograd: stored backward load": (
        "stoker_autograd._internal.runtime",
        "CompiledBackward._load",
    ),
    **{
        stage: COLD_STAGES[stage]
        for stage in (
            "  compiled autograd: first run (eager)",
            "  compiled autograd: retrace",
            "  compiled autograd: compile",
        )
    },
}
CAPTURE = "  compiled autograd: capture (begin_capture .. end_capture)"
LOAD = (
    "Dynamo (convert_frame._compile)",
    CAPTURE,
    "  compiled autograd: stored backward load",
)


def _time_capture(times: dict[str, list[float]]) -> None:
    """Compiled autograd's capture, from `begin_capture`'s call to `end_capture`'s return:
    the C++ engine calls stoker-autograd's callbacks in between (the cache key is built
    from what they record)."""
    from stoker_autograd._internal.capture import CaptureInstance

    row = times[CAPTURE] = [0, 0.0, 0.0]
    begin, end = CaptureInstance.begin_capture, CaptureInstance.end_capture
    t0 = [0.0]

    def timed_begin(self: Any, *a: Any, **k: Any) -> Any:
        t0[0] = time.process_time()
        return begin(self, *a, **k)

    def timed_end(self: Any, *a: Any, **k: Any) -> Any:
        try:
            return end(self, *a, **k)
        finally:
            row[0] += 1
            row[2] += time.process_time() - t0[0]

    CaptureInstance.begin_capture = timed_begin  # type: ignore[method-assign]
    CaptureInstance.end_capture = timed_end  # type: ignore[method-assign]


def _gc_timer() -> list[float]:
    """[CPU s in the cyclic GC, full collections], counted while the list's owner runs."""
    import gc

    row = [0.0, 0.0]
    t0 = [0.0]

    def cb(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            t0[0] = time.process_time()
        else:
            row[0] += time.process_time() - t0[0]
            row[1] += info["generation"] == 2

    gc.callbacks.append(cb)
    return row


def demo_setup(batch: int) -> tuple[Any, Any, Any, Any]:
    """The demo's model twice from the same weights (eager, to compile) and one batch of
    the demo's data: (eager, model, x, y)."""
    import copy

    import torch

    from stoker._internal.bench.demo import get_batch, make_data
    from stoker._internal.bench.models import GPT, GPTConfig

    cfg = GPTConfig()
    data, vocab = make_data(cfg.block_size, "cpu")
    cfg = GPTConfig(vocab_size=vocab)
    torch.manual_seed(0)
    eager = GPT(cfg)
    model = copy.deepcopy(eager)
    x, y = get_batch(data, cfg.block_size, batch, torch.Generator().manual_seed(0))
    return eager, model, x, y


def _worker(backend: str, batch: int, freeze: bool = True) -> dict[str, Any]:
    import contextlib

    import torch

    import stoker
    from stoker._internal.bench.models import lm_loss

    torch.set_num_threads(1)
    times, _ = _wrap_stages(STAGES)
    _time_capture(times)
    eager, model, x, y = demo_setup(batch)

    def step(net: Any, opt: torch.optim.Optimizer) -> float:
        t0 = time.process_time()
        loss = lm_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return time.process_time() - t0

    # the demo's loop runs with its setup's objects frozen (`demo.frozen_heap`; absent in
    # older trees): a full GC collection in the first compiled step walks less
    from stoker._internal.bench import demo

    freezer = getattr(demo, "frozen_heap", None) if freeze else None
    loop = freezer() if freezer is not None else contextlib.nullcontext()
    compiled = stoker.compile(model, backend=backend)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    opt_c = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with loop:
        with stoker.autograd_enabled(False):
            t_eager = step(eager, opt_e)
            t_eager_2 = step(eager, opt_e)
        for row in times.values():  # the eager steps' backward is not a stage
            row[:] = [0, 0.0, 0.0]
        gc_row = _gc_timer()
        t_compiled = step(compiled, opt_c)
        gc_first = list(gc_row)
        stages = {k: v[2] for k, v in times.items()}
        calls = {k: v[0] for k, v in times.items()}
        step(compiled, opt_c)  # compiled autograd's compile lands here, cold
        t_compiled_3 = step(compiled, opt_c)
    rep = getattr(compiled, "stoker_report", None)
    summary = rep.summary() if rep is not None else {}
    return {
        "eager first step": t_eager,
        "eager second step": t_eager_2,
        "compiled first step": t_compiled,
        "compiled third step": t_compiled_3,
        "stages": stages,
        "calls": calls,
        "gc in the compiled first step": gc_first,
        "summary": summary,
    }


def _run(backend: str, batch: int, env: dict[str, str], freeze: bool) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-W",
        "ignore",
        "-m",
        "stoker._internal.bench.benchmarks.demo_start",
        "--worker",
        backend,
        "--batch",
        str(batch),
    ]
    cmd += [] if freeze else ["--no-freeze"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"bench_demo_start: worker ({backend}) failed:\n{p.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def _table(backend: str, cold: dict[str, Any], warm: list[dict[str, Any]]) -> str:
    best = min(warm, key=lambda r: r["compiled first step"])
    cols = [("cold", cold), ("warm (fastest)", best)]
    lines = [
        f"executor {backend}: CPU s, the demo's GPT, first step",
        f"| stage | {' | '.join(c for c, _ in cols)} |",
        "|---|" + "---|" * len(cols),
    ]

    def row(name: str, vals: list[float]) -> None:
        lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")

    row("eager first step", [r["eager first step"] for _, r in cols])
    row("**compiled first step**", [r["compiled first step"] for _, r in cols])
    for stage in [*STAGES, CAPTURE]:
        row(stage, [r["stages"].get(stage, 0.0) for _, r in cols])
    gc = [r.get("gc in the compiled first step", [0.0, 0.0]) for _, r in cols]
    row("cyclic GC in the compiled first step", [g[0] for g in gc])
    row("  full collections in it", [g[1] for g in gc])
    load = [sum(r["stages"].get(s, 0.0) for s in LOAD) for _, r in cols]
    row("load (Dynamo + compiled autograd's capture and load)", load)
    run = [r["compiled first step"] - ld for (_, r), ld in zip(cols, load)]
    row("run (compiled first step - load)", run)
    row("eager second step", [r["eager second step"] for _, r in cols])
    row("compiled third step (steady)", [r["compiled third step"] for _, r in cols])
    w = best
    ratio = w["compiled first step"] / (2 * w["eager first step"] + load[1])
    # an executor slower than eager in every step (the interpreter) is read against its own
    # steady step: what the warm start adds to it
    steady = w["compiled third step"]
    ratio_steady = w["compiled first step"] / (2 * max(w["eager first step"], steady) + load[1])
    lines.append(
        f"warm first step / (2 x eager first step + load) = {ratio:.2f}; "
        f"/ (2 x max(eager first, compiled steady) + load) = {ratio_steady:.2f} "
        f"(target <= 1; warm first steps: "
        + ", ".join(f"{r['compiled first step']:.3f}" for r in warm)
        + ")"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="aten,interpret", help="executors, comma-separated")
    ap.add_argument("--warm", type=int, default=2, help="warm processes per executor")
    ap.add_argument("--batch", type=int, default=16, help="the demo's batch")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument(
        "--no-freeze", action="store_true", help="run the steps without the demo's frozen_heap"
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(_worker(a.worker, a.batch, not a.no_freeze)))
        return 0
    results: dict[str, Any] = {}
    for backend in a.backend.split(","):
        with tempfile.TemporaryDirectory(prefix="stoker-demo-start-") as d:
            env = {
                **os.environ,
                "STOKER_CACHE_DIR": os.path.join(d, "stoker"),
                "TRITON_CACHE_DIR": os.path.join(d, "triton"),
            }
            if backend == "interpret":
                env["TRITON_INTERPRET"] = "1"
            cold = _run(backend, a.batch, env, not a.no_freeze)
            warm = [_run(backend, a.batch, env, not a.no_freeze) for _ in range(a.warm)]
        results[backend] = {"cold": cold, "warm": warm}
        print(_table(backend, cold, warm), flush=True)
        print()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
