"""How a model's compiled backward is cut, and what compiling it with stoker-triton costs.

    STOKER_CACHE_DIR=$(mktemp -d) STOKER_TRITON_CHECK_TARGETS= \\
        python -m stoker._internal.bench.benchmarks.segments [--model gpt-m] [--batch 2] [--device cpu|cuda]

Runs one training step of a `bench --suite gpu` model through ``stoker.compile``
(aten executor: the step itself compiles nothing with Triton), takes the
retraced backward graph stoker-autograd compiled, and compiles it again with
``stoker_triton.compile_graph`` the way the stoker backend does: split into
segments at Python calls (``SegmentedBackward``).  Prints the number of
segments, the Python calls between them, the Triton kernels and extern calls
they hold, and the compile time (on the CPU under TRITON_INTERPRET=1: code
generation without a GPU compile; an empty ``STOKER_CACHE_DIR`` makes it cold).
The batch does not change the graph's structure; it only makes the step cheaper.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from . import write_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-m")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the counts and the compile time here")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton jits anything

    import stoker
    import stoker_triton
    from stoker._internal.api.backend import SWITCH
    from stoker._internal.bench.suite import get_entry
    from stoker_autograd._internal.segments import SegmentedBackward, _Call

    entry = get_entry(a.model)
    size = {**entry.size, "batch": a.batch}
    torch.manual_seed(0)
    model = entry.build(size).to(a.device)
    args, target = entry.batch(size, torch.Generator().manual_seed(0))
    args = tuple(x.to(a.device) for x in args)
    entry.loss(stoker.compile(model, backend="aten")(*args), target.to(a.device)).backward()  # type: ignore[no-untyped-call]
    retraced = SWITCH.session.graphs[-1].last_retraced
    if retraced is None:
        raise SystemExit("the backward was not retraced (see the stoker-autograd warning)")

    kernels, externs = 0, 0

    def compile_segment(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        nonlocal kernels, externs
        fn = stoker_triton.compile_graph(gm, example_inputs)
        kernels += fn.report.n_kernels  # type: ignore[attr-defined]
        externs += len(fn.report.extern_calls)  # type: ignore[attr-defined]
        return fn

    t0 = time.perf_counter()
    run = SegmentedBackward(retraced.gm, compile_segment)
    seconds = time.perf_counter() - t0
    calls = sum(isinstance(s, _Call) for s in run.steps)
    print(
        f"{a.model} backward: {len(run.segments)} segments, {calls} Python calls, "
        f"{kernels} Triton kernels, {externs} extern calls; compile {seconds:.1f} s "
        f"(STOKER_TRITON_CHECK_TARGETS={os.environ.get('STOKER_TRITON_CHECK_TARGETS')!r})"
    )
    write_json(
        a.json,
        {
            "model": a.model,
            "segments": len(run.segments),
            "python_calls": calls,
            "kernels": kernels,
            "extern_calls": externs,
            "compile_s": seconds,
        },
    )


if __name__ == "__main__":
    main()
