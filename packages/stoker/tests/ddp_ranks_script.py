"""Worker of test_stoker_ddp_ranks.py: eager DDP against stoker's reducer on 2 gloo ranks.

``python ddp_ranks_script.py OUT.json`` spawns 2 CPU processes; each runs every case
(a DDP setting) twice on the same fresh random batches (its own per rank and step):
eager DDP (compiled autograd off, DDP's C++ reducer) and ``stoker.compile(DDP(model))``
(stoker's bucketed reducer), with AdamW.  Rank 0 writes, per case, the largest
relative difference of the gradients (every backward) and of the parameters (every
step), and what the reducer did: buckets, segments of the newest compiled backward,
hooks, which node issued each all-reduce of the last step.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

CASES: dict[str, dict[str, Any]] = {
    "one_bucket": {"bucket_cap_mb": 25.0},
    "small_buckets": {"bucket_cap_mb": 0.0002},
    "small_buckets_no_sync": {"bucket_cap_mb": 0.0002, "accumulate": 2},
    "bucket_view": {"bucket_cap_mb": 0.0002, "gradient_as_bucket_view": True},
}
STEPS = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.norm = nn.Linear(8, 32), nn.LayerNorm(32)
        self.l2, self.l3 = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.nn.functional.gelu(self.l1(x)))
        return self.l3(torch.tanh(self.l2(h)))  # type: ignore[no-any-return]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).norm() / y.norm().clamp_min(1e-12)) for x, y in zip(a, b, strict=True))


def _train(model: nn.Module, ddp: DDP, rank: int, accumulate: int) -> dict[str, Any]:
    opt = torch.optim.AdamW(ddp.module.parameters(), lr=1e-2)
    grads, params = [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x, y = torch.randn(5 + step, 8, generator=g), torch.randn(5 + step, 4, generator=g)
            sync = micro == accumulate - 1
            with ddp.no_sync() if not sync else _null():
                ((model(x) - y) ** 2).mean().backward()
        grads.append([p.grad.detach().clone() for p in ddp.module.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)  # in place too: versions, not only None
        params.append([p.detach().clone() for p in ddp.module.parameters()])
    return {"grads": grads, "params": params}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _case(rank: int, settings: dict[str, Any]) -> dict[str, Any]:
    import stoker
    from stoker._internal.api.backend import SWITCH
    from stoker._internal.distributed import collectives
    from stoker._internal.distributed.collectives import comm_sites

    kw = {k: v for k, v in settings.items() if k != "accumulate"}
    accumulate = settings.get("accumulate", 1)
    base = Net()
    stoker.reset()
    with stoker.autograd_enabled(False):
        ref = DDP(copy.deepcopy(base), **kw)
        eager = _train(ref, ref, rank, accumulate)
    ddp = DDP(copy.deepcopy(base), **kw)
    got = _train(stoker.compile(ddp), ddp, rank, accumulate)
    newest = SWITCH.session.graphs[-1]
    last = collectives.last(compiled=True)
    rec = ddp._stoker_ddp
    return {
        "grad_rel": max(_rel(a, b) for a, b in zip(got["grads"], eager["grads"], strict=True)),
        "param_rel": max(_rel(a, b) for a, b in zip(got["params"], eager["params"], strict=True)),
        "n_params": len(list(base.parameters())),
        "buckets": len(rec.buckets),
        "reductions": [len(s) for s in rec.steps],
        "segments": len(newest.variants[-1].fn.segments),
        "hooks": sum(s["kind"] == "post_acc_grad_hook" for s in comm_sites(newest.gm.graph)),
        "counting": ddp._stoker_reducer.counting,
        "last_step_sites": [c.site.kind if c.site else None for c in last.issued] if last else [],
    }


def _rank(rank: int, world: int, out: str) -> None:
    from stoker._internal.distributed import collectives

    collectives.install()
    results: dict[str, Any] = {}
    for name, settings in CASES.items():
        try:
            results[name] = _case(rank, settings)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    from stoker._internal.distributed.launch import spawn

    spawn(_rank, 2, sys.argv[1])
