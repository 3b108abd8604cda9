"""The first compiled-autograd backward of a model: capture, retrace and the whole call.

    STOKER_CACHE_DIR=$(mktemp -d) python -m stoker._internal.bench.benchmarks.autograd_first [--model gpt-m] [--batch 2] [--repeat 3] [--dynamic | --compare] [--checkpoint]

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
and T, and the sizes of the eager loss around it).  ``--static``:
``dynamic=False``.  ``--compare``: ``--static`` and ``--dynamic``, each in a process of
its own (Dynamo's frame cache would hand the second model the first one's forward),
and the ratio of their retraces.  ``--checkpoint``: each of the
model's ``blocks`` under ``torch.utils.checkpoint`` (non-reentrant), so the backward
recomputes the forward.  Per repeat also the views the retrace recorded and their
cost each (µs per view: the fake kernel's time for an ``aten.view``, the symbolic
reshape's sympy work).
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
    ap.add_argument("--static", action="store_true", help="stoker.compile(dynamic=False)")
    ap.add_argument("--compare", action="store_true", help="--static, then --dynamic")
    ap.add_argument("--checkpoint", action="store_true", help="checkpoint each block")
    ap.add_argument(
        "--fsdp2",
        action="store_true",
        help="two gloo ranks on the CPU, each block and the root under fully_shard (FSDP2)",
    )
    a = ap.parse_args(argv)
    if a.compare:
        return _compare(a, argv if argv is not None else sys.argv[1:])
    if a.fsdp2 and "STOKER_BENCH_RANK" not in os.environ:
        return _launch_ranks(a, argv if argv is not None else sys.argv[1:])
    rank = int(os.environ.get("STOKER_BENCH_RANK", "0"))
    if a.fsdp2:
        from stoker._internal.distributed.launch import init_rank

        init_rank(rank, 2, int(os.environ["STOKER_BENCH_PORT"]), "gloo")
    clock = time.process_time if a.cpu else time.perf_counter

    import stoker
    import stoker_autograd
    from stoker._internal.bench.suite import get_entry
    from stoker_autograd._internal import capture, retrace, runtime

    spent = {"capture": 0.0, "retrace": 0.0, "views": 0.0, "n_views": 0}
    begin, end, replay, record = (
        capture.CaptureInstance.begin_capture,
        capture.CaptureInstance.end_capture,
        runtime.retrace,  # type: ignore[attr-defined]
        retrace._record,
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
        out = replay(*args, **kwargs)
        spent["retrace"] += clock() - t0
        return out

    def timed_record(rp: Any, op: Any, *args: Any) -> Any:
        if op not in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            return record(rp, op, *args)
        t0 = clock()
        out = record(rp, op, *args)
        spent["views"] += clock() - t0
        spent["n_views"] += 1
        return out

    capture.CaptureInstance.begin_capture = timed_begin  # type: ignore[assignment, method-assign]
    capture.CaptureInstance.end_capture = timed_end  # type: ignore[assignment, method-assign]
    runtime.retrace = timed_retrace  # type: ignore[attr-defined]
    retrace._record = timed_record  # type: ignore[assignment]

    entry = get_entry(a.model)
    size = {**entry.size, "batch": a.batch}
    args, target = entry.batch(size, torch.Generator().manual_seed(0))
    modes = ["dynamic" if a.dynamic else "static" if a.static else "default"]
    models: dict[str, Any] = {}
    for mode in modes:
        torch.manual_seed(0)
        model = entry.build(size)
        if a.checkpoint:
            blocks = getattr(model, "blocks", None)
            if not isinstance(blocks, torch.nn.ModuleList):
                raise SystemExit(f"--checkpoint: {a.model} has no ModuleList 'blocks'")
            for i, block in enumerate(blocks):
                blocks[i] = _Checkpointed(block)
        if a.fsdp2:
            from torch.distributed.fsdp import fully_shard

            blocks = getattr(model, "blocks", None)
            if not isinstance(blocks, torch.nn.ModuleList):
                raise SystemExit(f"--fsdp2: {a.model} has no ModuleList 'blocks'")
            for block in blocks:
                fully_shard(block)
            fully_shard(model)
        dyn = {"static": False, "dynamic": True, "default": None}[mode]
        models[mode] = (model, stoker.compile(model, backend="aten", dynamic=dyn))
    unit = "CPU seconds" if a.cpu else "seconds"
    what = {"static": ", static sizes", "dynamic": ", symbolic sizes"}
    ckpt = ", checkpointed blocks" if a.checkpoint else ""
    ckpt += ", FSDP2 over 2 gloo ranks (rank 0's figures)" if a.fsdp2 else ""
    say = print if rank == 0 else (lambda *_: None)
    say(
        f"{a.model} (batch {a.batch}{what.get(modes[-1], '')}{ckpt}), first backward per capture, {unit}"
    )
    say(
        f"{'repeat':>6}{'capture':>9}{'retrace':>9}{'views':>7}{'µs/view':>9}"
        f"{'backward':>10}  counters"
    )
    repeats: list[dict[str, Any]] = []
    for i in range(a.repeat):
        for mode in modes:
            model, compiled = models[mode]
            torch._C._dynamo.compiled_autograd.clear_cache()
            model.zero_grad(set_to_none=True)
            stoker_autograd.reset_stats()
            spent.update(capture=0.0, retrace=0.0, views=0.0, n_views=0)
            loss = entry.loss(compiled(*args), target)
            t0 = clock()
            loss.backward()  # type: ignore[no-untyped-call]
            total = clock() - t0
            st = stoker_autograd.stats()
            counters = ", ".join(
                f"{k} {st.get(k, 0)}" for k in ("captures", "compiles", "eager_runs", "disk_hits")
            )
            n = int(spent["n_views"])
            per_view = 1e6 * spent["views"] / n if n else 0.0
            say(
                f"{i:>6}{spent['capture']:>9.3f}{spent['retrace']:>9.2f}{n:>7}"
                f"{per_view:>9.0f}{total:>10.2f}  {counters}"
            )
            repeats.append(
                {
                    "repeat": i,
                    "sizes": mode,
                    "capture": spent["capture"],
                    "retrace": spent["retrace"],
                    "views": n,
                    "us_per_view": per_view,
                    "backward": total,
                    "stats": dict(st),
                }
            )
    doc: dict[str, Any] = {"model": a.model, "unit": unit, "dynamic": a.dynamic, "repeats": repeats}
    if rank == 0:
        write_json(a.json, doc)
    if a.fsdp2:
        torch.distributed.destroy_process_group()


def _launch_ranks(a: argparse.Namespace, argv: list[str]) -> None:
    """``--fsdp2``: this benchmark as two gloo ranks (processes), rank 0 reporting."""
    from stoker._internal.distributed.launch import free_port

    port = str(free_port())
    cmd = [sys.executable, "-m", __spec__.name if __spec__ else "autograd_first", *argv]
    procs = [
        subprocess.Popen(
            cmd,
            env={
                **os.environ,
                "STOKER_BENCH_RANK": str(r),
                "STOKER_BENCH_PORT": port,
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            },
        )
        for r in range(2)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"--fsdp2: a rank failed (exit codes {codes})")


def _compare(a: argparse.Namespace, argv: list[str]) -> None:
    """``--static`` then ``--dynamic``, each in its own process; their retraces' ratio."""
    rest = [x for x in argv if x not in ("--compare", "--dynamic", "--static")]
    if a.json:
        i = rest.index("--json")
        del rest[i : i + 2]
    docs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("static", "dynamic"):
            out = os.path.join(tmp, f"{mode}.json")
            cmd = [sys.executable, "-m", __spec__.name if __spec__ else "autograd_first"]
            subprocess.run([*cmd, *rest, f"--{mode}", "--json", out], check=True)
            with open(out) as f:
                docs[mode] = json.load(f)
    retr = {m: [r["retrace"] for r in d["repeats"]] for m, d in docs.items()}
    view = {m: [r["us_per_view"] for r in d["repeats"]] for m, d in docs.items()}
    ratio = {
        "first": retr["dynamic"][0] / max(retr["static"][0], 1e-9),
        "best": min(retr["dynamic"]) / max(min(retr["static"]), 1e-9),
        "us_per_view_first": view["dynamic"][0] / max(view["static"][0], 1e-9),
    }
    print(
        f"dynamic / static retrace: first repeat {ratio['first']:.2f}x, best of each "
        f"{ratio['best']:.2f}x; per view (first repeat) {ratio['us_per_view_first']:.2f}x"
    )
    write_json(a.json, {"model": a.model, **docs, "ratio": ratio})


class _Checkpointed(torch.nn.Module):
    """``inner`` under non-reentrant activation checkpointing."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, *args, use_reentrant=False)


if __name__ == "__main__":
    main()
