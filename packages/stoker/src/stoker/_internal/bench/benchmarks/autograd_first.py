"""The first compiled-autograd backward of a model: capture, retrace and the whole call.

    STOKER_CACHE_DIR=$(mktemp -d) python -m stoker._internal.bench.benchmarks.autograd_first [--model gpt-m] [--batch 2] [--repeat 3] [--dynamic]

One `bench --suite gpu` model (default gpt-m, batch 2) through ``stoker.compile``
with the aten executor (no Triton: the backward's compiler only runs aten ops).
Each repeat clears the engine's in-memory cache, so the backward is captured
again: the first repeat is cold, later ones find the warm-start cache
(``autograd/graphs``) that the first wrote, as a new process would, unless
``STOKER_AUTOGRAD_CACHE=0``.  Prints, per repeat, seconds spent in capture
(``begin_capture`` .. ``end_capture``, the reordering passes included), in the
retrace, and in the whole ``loss.backward()`` (which also runs it), plus the
counters.  ``--cpu``: CPU seconds of this process (``time.process_time``) instead of
wall seconds, less disturbed by other jobs; with ``--repeat 1`` on a cache a first
run filled, the capture of a fresh warm process.  ``--dynamic``: the model compiled
with ``dynamic=True``, so the retrace runs over symbolic sizes (the forward's batch
and T, and the sizes of the eager loss around it).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from . import write_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-m")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="CPU seconds, not wall seconds")
    ap.add_argument("--dynamic", action="store_true", help="stoker.compile(dynamic=True)")
    ap.add_argument("--json", help="write the per-repeat figures here")
    a = ap.parse_args(argv)
    clock = time.process_time if a.cpu else time.perf_counter

    import stoker
    import stoker_autograd
    from stoker._internal.bench.suite import get_entry
    from stoker_autograd._internal import capture, runtime

    spent = {"capture": 0.0, "retrace": 0.0}
    begin, end, retrace = (
        capture.CaptureInstance.begin_capture,
        capture.CaptureInstance.end_capture,
        runtime.retrace,  # type: ignore[attr-defined]
    )
    started: dict[int, float] = {}

    def timed_begin(self: Any, *args: Any) -> Any:
        started[id(self)] = clock()
        return begin(self, *args)

    def timed_end(self: Any, *args: Any) -> Any:
        out = end(self, *args)
        spent["capture"] += clock() - started.pop(id(self))
        return out

    def timed_retrace(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        out = retrace(*args, **kwargs)
        spent["retrace"] += clock() - t0
        return out

    capture.CaptureInstance.begin_capture = timed_begin  # type: ignore[assignment, method-assign]
    capture.CaptureInstance.end_capture = timed_end  # type: ignore[assignment, method-assign]
    runtime.retrace = timed_retrace  # type: ignore[attr-defined]

    entry = get_entry(a.model)
    size = {**entry.size, "batch": a.batch}
    torch.manual_seed(0)
    model = entry.build(size)
    args, target = entry.batch(size, torch.Generator().manual_seed(0))
    compiled = stoker.compile(model, backend="aten", dynamic=True if a.dynamic else None)
    unit = "CPU seconds" if a.cpu else "seconds"
    sizes = ", symbolic sizes" if a.dynamic else ""
    print(f"{a.model} (batch {a.batch}{sizes}), first backward per capture, {unit}")
    print(f"{'repeat':>6}{'capture':>9}{'retrace':>9}{'backward':>10}  counters")
    repeats: list[dict[str, Any]] = []
    for i in range(a.repeat):
        torch._C._dynamo.compiled_autograd.clear_cache()
        model.zero_grad(set_to_none=True)
        stoker_autograd.reset_stats()
        spent.update(capture=0.0, retrace=0.0)
        loss = entry.loss(compiled(*args), target)
        t0 = clock()
        loss.backward()  # type: ignore[no-untyped-call]
        total = clock() - t0
        st = stoker_autograd.stats()
        counters = ", ".join(
            f"{k} {st.get(k, 0)}" for k in ("captures", "compiles", "eager_runs", "disk_hits")
        )
        print(f"{i:>6}{spent['capture']:>9.3f}{spent['retrace']:>9.2f}{total:>10.2f}  {counters}")
        repeats.append({"repeat": i, **spent, "backward": total, "stats": dict(st)})
    write_json(a.json, {"model": a.model, "unit": unit, "dynamic": a.dynamic, "repeats": repeats})


if __name__ == "__main__":
    main()
