"""``stoker demo --ranks N --parallel ddp|fsdp2``: the demo GPT on N local processes.

Every rank trains an eager copy and a compiled copy of the GPT, both wrapped the
same way (``DDP(model)`` or ``fully_shard`` per block and the root), on its own
batches; rank 0 prints the demo's comparison, then what stoker did for the
parallelism: DDP's reducer mode and the all-reduces of the last step (which
bucket, after how many gradients), the collectives per step of eager and of
stoker side by side, the node of the compiled backward that issued each, and
where in the captured backward graph the nodes that issue collectives sit.  gloo on the CPU; NCCL with one GPU per rank.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

PARALLEL = ("ddp", "fsdp2")


def wrapper(parallel: str, device: str) -> Any:
    """``nn.Module -> nn.Module``: DDP, or FSDP2 per transformer block and the root."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        def wrap_ddp(m: torch.nn.Module) -> torch.nn.Module:
            ids = [torch.cuda.current_device()] if device == "cuda" else None
            # small buckets, so that the small GPT has several to reduce during the backward
            return DDP(m, device_ids=ids, bucket_cap_mb=0.1)

        return wrap_ddp

    from torch.distributed.fsdp import fully_shard

    def wrap_fsdp2(m: torch.nn.Module) -> torch.nn.Module:
        for block in getattr(m, "blocks", []):
            fully_shard(block)
        fully_shard(m)
        return m

    return wrap_fsdp2


def format_distributed(parallel: str, world: int, info: dict[str, Any]) -> str:
    """The collectives part of the demo's output (from `distributed.summary()`)."""
    lines = [f"  parallel: {parallel} on {world} ranks"]
    for d in info.get("ddp", []):
        lines.append(f"  DDP reducer mode: {d['mode']} ({d['why']})")
        lines.append(f"  DDP buckets: {len(d['buckets'])}")
        if d["steps"]:
            last = d["steps"][-1]
            lines.append(f"  all-reduces in the last step: {len(last)}")
            for c in last:
                lines.append(
                    f"    bucket {c['bucket']}: {c['params']} params, {c['bytes']} B, "
                    f"started after {c['after_grads']} gradients were ready"
                )
    lines += format_steps(info)
    sites = info.get("backward_sites", [])
    if sites:
        kinds: dict[str, list[str]] = {}
        for s in sites:
            kinds.setdefault(s["kind"], []).append(
                f"{s['at']}/{s['of']} (+{s['compute_after']} compute after)"
            )
        lines.append("  nodes issuing collectives in the captured backward graph (node/total):")
        for kind, where in kinds.items():
            shown = ", ".join(where[:6]) + (", ..." if len(where) > 6 else "")
            lines.append(f"    {kind} ×{len(where)}: {shown}")
    return "\n".join(lines)


def format_steps(info: dict[str, Any], shown: int = 12) -> list[str]:
    """Collectives per step, the newest eager step beside the newest compiled one, then
    the compiled step's backward collectives in issue order with the node that issued each."""
    eager, comp = info.get("last_eager"), info.get("last_compiled")
    if comp is None:
        return []
    lines = ["  collectives per step (eager | stoker, the newest step of each):"]
    counts_e = eager["counts"] if eager else {}
    for kind, phases in comp["counts"].items():
        cells = [
            f"{phase} {counts_e.get(kind, {}).get(phase, '-')} | {n}"
            for phase, n in sorted(phases.items(), reverse=True)
        ]
        lines.append(f"    {kind:<15} " + "   ".join(cells))
    if eager is None:
        lines.append("    (eager: none seen; DDP's C++ reducer issues its all-reduces from C++)")
    issued = [c for c in comp["issued"] if c["phase"] == "backward"]
    if issued:
        lines.append("  stoker's backward, collectives in issue order (node/total in its graph):")
        for c in issued[:shown]:
            site = c["site"] or {}
            where = (
                f"{site['at']}/{site['of']} (+{site['compute_after']} compute after)"
                if site.get("at") is not None
                else "node not found"
            )
            lines.append(
                f"    {c['kind']} {c['numel']} {c['dtype']} by {site.get('kind', '?')} at {where}"
            )
        if len(issued) > shown:
            lines.append(f"    ... {len(issued) - shown} more")
    return lines


def _rank_main(
    rank: int,
    world: int,
    parallel: str,
    steps: int,
    batch: int,
    backend: str,
    device: str,
    report: str | None,
    seed: int,
    progress: bool,
) -> None:
    from ..distributed import collectives, distributed
    from .demo import format_result, train_side_by_side

    collectives.install()  # before the first (eager) step

    res = train_side_by_side(
        steps=steps,
        batch=batch,
        backend=backend,
        device=f"cuda:{rank}" if device == "cuda" else device,
        report=report if rank == 0 else None,
        seed=seed,
        progress=progress and rank == 0,
        wrap=wrapper(parallel, device),
        data_seed=seed + 1000 * rank,
    )
    if rank == 0:
        print(format_result(res))
        print(format_distributed(parallel, world, distributed.summary()), flush=True)


def run_distributed_demo(
    *,
    ranks: int,
    parallel: str,
    steps: int,
    batch: int,
    backend: str,
    device: str | None,
    report: str | None,
    seed: int,
    progress: bool,
) -> int:
    from ..distributed.launch import spawn
    from .demo import check_demo_args

    if parallel not in PARALLEL:
        raise SystemExit(f"stoker demo: --parallel must be one of {', '.join(PARALLEL)}")
    device = check_demo_args(steps=steps, batch=batch, backend=backend, device=device, ranks=ranks)
    pg = "nccl" if device == "cuda" else "gloo"
    print(
        f"stoker demo: a small GPT under {parallel} on {ranks} local processes ({pg}, {device})",
        file=sys.stderr,
    )
    spawn(
        _rank_main,
        ranks,
        parallel,
        steps,
        batch,
        backend,
        device,
        os.path.abspath(report) if report else None,
        seed,
        progress,
        backend=pg,
    )
    return 0
