"""Segments per compiled backward and step time of a model under DDP, eager and stoker.

    python -m stoker._internal.bench.benchmarks.ddp [--model gpt-m] [--size smoke|full] [--ranks 2]
        [--bucket-mb 25 0.05 0.01] [--steps 12] [--backend aten] [--set layers=4 ...]

Spawns ``--ranks`` local processes (gloo, CPU); for each ``bucket_cap_mb`` every rank
trains a `bench --suite gpu` model (AdamW, the same batch shape every step) under
eager DDP and under ``stoker.compile(DDP(model))`` (stoker's bucketed reducer,
compiled autograd on).  Rank 0 prints the DDP buckets, the parameters, the segments
of the newest compiled backward (after the buckets were rebuilt) and the
post-accumulate-grad hooks in its captured graph, ``stoker_autograd.stats()`` over
the run, and the median and least step time (and the median CPU time of the rank's
process, less swayed by other jobs) of the steps after the first three, eager and
stoker.  CPU timings on a shared machine swing: compare runs made side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from . import write_json


def _steps(
    model: Any, entry: Any, size: dict[str, int], n: int, rank: int
) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args, target = entry.batch(size, torch.Generator().manual_seed(rank))
    times, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        entry.loss(model(*args), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu


def _figures(times: tuple[list[float], list[float]]) -> dict[str, float]:
    """The steady steps' wall ms (median, least) and this process's CPU ms (median)."""
    wall, cpu = times[0][3:], times[1][3:]
    return {
        "median_ms": 1e3 * statistics.median(wall),
        "least_ms": 1e3 * min(wall),
        "cpu_median_ms": 1e3 * statistics.median(cpu),
    }


def _ms(times: tuple[list[float], list[float]]) -> str:
    """Wall ms (median / least) and CPU ms of this process (median) of the steady steps."""
    wall, cpu = times[0][3:], times[1][3:]
    med, least = 1e3 * statistics.median(wall), 1e3 * min(wall)
    return f"{med:.1f} / {least:.1f} (cpu {1e3 * statistics.median(cpu):.1f})"


def _rank(rank: int, world: int, a: argparse.Namespace) -> None:
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    import stoker
    import stoker_autograd
    from stoker._internal.api.backend import SWITCH
    from stoker._internal.bench.suite import get_entry
    from stoker._internal.distributed.collectives import comm_sites

    entry = get_entry(a.model)
    size = {**entry.sized(a.size == "smoke"), **dict(kv.split("=") for kv in a.set)}
    size = {k: int(v) for k, v in size.items()}
    torch.manual_seed(0)
    base = entry.build(size)
    doc: list[dict[str, Any]] = []
    for mb in a.bucket_mb:
        with stoker.autograd_enabled(False):
            eager = _steps(DDP(copy.deepcopy(base), bucket_cap_mb=mb), entry, size, a.steps, rank)
        stoker.reset()
        ddp = DDP(copy.deepcopy(base), bucket_cap_mb=mb)
        compiled = stoker.compile(ddp, backend=a.backend)
        stoker_autograd.reset_stats()
        times = _steps(compiled, entry, size, a.steps, rank)  # buckets rebuilt after step 1
        st = stoker_autograd.stats()
        newest = SWITCH.session.graphs[-1]
        hooks = sum(s["kind"] == "post_acc_grad_hook" for s in comm_sites(newest.gm.graph))
        segments = len(getattr(newest.variants[-1].fn, "segments", ()))
        rec: Any = ddp._stoker_ddp
        if rank == 0:
            n = sum(1 for p in base.parameters() if p.requires_grad)
            print(
                f"{a.model}[{a.size}] bucket_cap_mb={mb}: {len(rec.buckets)} buckets, "
                f"{n} params; the newest backward: {segments} segments, {hooks} post-acc-grad "
                f"hooks (run: {st['captures']} captures, {st['compiles']} compiles, "
                f"{st['disk_hits']} disk hits, {st['segments']} segments); "
                f"step ms (median / least, steps 4..{a.steps}): eager DDP {_ms(eager)}, "
                f"stoker {_ms(times)}",
                flush=True,
            )
            doc.append(
                {
                    "case": f"bucket_cap_mb={mb}",
                    "buckets": len(rec.buckets),
                    "params": n,
                    "segments": segments,
                    "post_acc_grad_hooks": hooks,
                    "stats": {k: st[k] for k in ("captures", "compiles", "disk_hits", "segments")},
                    "eager": _figures(eager),
                    "stoker": _figures(times),
                }
            )
            write_json(a.json, doc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-m")
    ap.add_argument("--size", choices=("smoke", "full"), default="smoke")
    ap.add_argument("--set", nargs="*", default=[], help="size overrides: layers=4 ...")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 0.05, 0.01])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--backend", default="aten")
    ap.add_argument("--json", help="write rank 0's figures here")
    a = ap.parse_args(argv)
    from stoker._internal.distributed.launch import spawn

    spawn(_rank, a.ranks, a)


if __name__ == "__main__":
    main()
