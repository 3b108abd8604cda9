"""Worker of test_distributed.py: eager against stoker on 2 CPU ranks (gloo) or 1 GPU (NCCL).

``python distributed_script.py GROUP OUT.json [CASE]`` spawns the processes of GROUP
(``gloo``: 2 CPU ranks; ``nccl``: 1 GPU rank) that run each of its cases in turn
(one spawn for all: process start-up, imports and the first compile are paid once),
each case eager first (stoker's compiled autograd off) then compiled, on the same
batches, whose sizes change between steps.  Rank 0 writes one JSON object per
case to OUT.json; test_distributed.py asserts on them.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import stoker
from stoker._internal.bench.models import GPT, GPTConfig, lm_loss
from stoker._internal.distributed import collectives
from stoker._internal.distributed import distributed as stoker_dist
from stoker._internal.distributed.launch import free_port

STEPS = (5, 6, 7, 8)  # batch sizes (the GPT's: 3 fewer)
LOG: list[str] = []  # collectives and markers, in the order they ran on this rank
DEVICE = ["cpu"]  # "cuda" under NCCL
# The MLP's sizes become symbolic when they change (automatic dynamic: a recompile in
# step 2); the GPT's are symbolic from the start (its compile is the suite's cost).
DYNAMIC: dict[str, bool | None] = {"mlp": None, "gpt": True}


# ------------------------------------------------------------------ models and batches
class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        LOG.append(f"mark:{ctx.name}")
        return g, None


class Mark(nn.Module):
    """Identity; its backward logs its name (an opaque node in the compiled backward)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Mark.apply(x, self.name)  # type: ignore[no-any-return]


class MLP(nn.Module):
    """Linear, GELU, LayerNorm, Linear, Tanh, Linear; with ``marks``, `Mark` after the
    LayerNorm and the Tanh (graph breaks: Dynamo compiles three graphs)."""

    def __init__(self, marks: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.norm = nn.LayerNorm(32)
        self.marks = marks
        self.m1, self.m2 = Mark("after-norm"), Mark("after-tanh")

    def linears(self) -> list[nn.Module]:
        return [self.l1, self.l2, self.l3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.nn.functional.gelu(self.l1(x)))
        if self.marks:
            h = self.m1(h)
        h = torch.tanh(self.l2(h))
        if self.marks:
            h = self.m2(h)
        return self.l3(h)  # type: ignore[no-any-return]


def mlp(marks: bool = False) -> MLP:
    return MLP(marks)


class CkptBlock(nn.Module):
    """A GPT block under non-reentrant activation checkpointing."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return out  # type: ignore[no-any-return]


def gpt(checkpoint: bool = False, layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=layers, n_head=2, n_embd=32))
    if checkpoint:
        blocks: Any = model.blocks  # type: ignore[attr-defined]
        for i, b in enumerate(list(blocks)):
            blocks[i] = CkptBlock(b)
    return model


def batch(kind: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = STEPS[step]
    if kind == "gpt":
        seq = torch.randint(0, 32, (n - 3, 9), generator=g).to(DEVICE[0])
        return seq[:, :-1], seq[:, 1:]
    return (
        torch.randn(n, 8, generator=g).to(DEVICE[0]),
        torch.randn(n, 4, generator=g).to(DEVICE[0]),
    )


def loss_of(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return lm_loss(out, target)
    return ((out - target) ** 2).mean()


def full(p: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(p, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else p).detach().float().cpu().clone()


# ------------------------------------------------------------------ one training run
def train(
    kind: str,
    model: nn.Module,
    params_of: nn.Module,
    rank: int,
    accumulate: int = 1,
    sync: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """SGD steps; ``accumulate`` micro-batches per step (the first ones under ``sync()``,
    DDP's ``no_sync``).  Returns losses, parameters, counters after step 2, the log."""
    opt = torch.optim.SGD(params_of.parameters(), lr=0.2)
    losses: list[float] = []
    counts: dict[int, dict[str, Any]] = {}
    graphs1 = 0
    LOG.clear()
    for step in range(len(STEPS)):
        for micro in range(accumulate):
            x, y = batch(kind, step, rank + 2 * micro)
            ctx = sync() if (sync is not None and micro < accumulate - 1) else _null()
            with ctx:
                loss = loss_of(kind, model(x), y)
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            graphs1 = _graphs()
        if step in (1, 2):
            counts[step + 1] = {**stoker_autograd_stats(), "dynamo_recompiles": _recompiles()}
    end = {**stoker_autograd_stats(), "dynamo_recompiles": _recompiles()}
    return {
        "losses": losses,
        "params": [full(p) for p in params_of.parameters()],
        "after2": counts[2],
        "after3": counts[3],
        "end": end,
        "graphs_after1": graphs1,
        "log": list(LOG),
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def stoker_autograd_stats() -> dict[str, int]:
    import stoker_autograd

    return stoker_autograd.stats()


def _graphs() -> int:
    r = stoker.last_report()
    return r.n_graphs if r is not None else 0


def _recompiles() -> int:
    r = stoker.last_report()
    return len(r.recompiles) if r is not None else 0


def compare(eager: dict[str, Any], comp: dict[str, Any]) -> dict[str, Any]:
    rel = max(
        ((a - b).abs().max() / a.abs().max().clamp_min(1e-6)).item()
        for a, b in zip(eager["params"], comp["params"], strict=True)
    )
    loss_rel = max(
        abs(a - b) / max(abs(a), 1e-6) for a, b in zip(eager["losses"], comp["losses"], strict=True)
    )
    return {
        "param_rel": rel,
        "loss_rel": loss_rel,
        "eager_losses": eager["losses"],
        "losses": comp["losses"],
        "after2": comp["after2"],
        "after3": comp["after3"],
        "end": comp["end"],
        "graphs_after1": comp["graphs_after1"],
        "eager_log": eager["log"],
        "log": comp["log"],
    }


def _record_collectives() -> None:
    """Log every collective FSDP2 issues (by kind and element count), in call order.
    FSDP2 calls `all_gather_single` / `reduce_scatter_single` on torch 2.13, and
    `all_gather_into_tensor` / `reduce_scatter_tensor` on torch 2.11."""
    names = ("all_gather_single", "reduce_scatter_single", "all_reduce")
    names += ("all_gather_into_tensor", "reduce_scatter_tensor")
    for name in names:
        real = getattr(dist, name, None)
        if real is None or getattr(real, "_logged", False):
            continue

        def logged(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            t = args[0] if args else next(iter(kwargs.values()))
            LOG.append(f"{_name}:{t.numel()}")
            return _real(*args, **kwargs)

        logged._logged = True  # type: ignore[attr-defined]
        setattr(dist, name, logged)


# ------------------------------------------------------------------ DDP cases
def ddp_case(
    rank: int,
    kind: str,
    order: str,
    bucket_mb: float,
    *,
    compiled_autograd: bool = True,
    accumulate: int = 1,
    marks: bool = True,
) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build() -> nn.Module:
        return (gpt(layers=1) if kind == "gpt" else mlp(marks)).to(DEVICE[0])

    ids = [0] if DEVICE[0] == "cuda" else None
    stoker.reset()
    m = build()
    d = DDP(m, bucket_cap_mb=bucket_mb, device_ids=ids)
    eager = train(kind, d, m, rank, accumulate, d.no_sync)
    stoker.reset()
    m = build()
    if order == "outer":
        d = DDP(m, bucket_cap_mb=bucket_mb, device_ids=ids)
        model: nn.Module = stoker.compile(
            d, compiled_autograd=compiled_autograd, dynamic=DYNAMIC[kind]
        )
    else:
        c = stoker.compile(m, compiled_autograd=compiled_autograd, dynamic=DYNAMIC[kind])
        d = DDP(c, bucket_cap_mb=bucket_mb, device_ids=ids)
        model = d
    comp = train(kind, model, m, rank, accumulate, d.no_sync)
    out = compare(eager, comp)
    rec = getattr(d, "_stoker_ddp", None)
    out["mode"] = rec.mode if rec else None
    out["buckets"] = len(rec.buckets) if rec else 0
    out["collectives"] = (
        [[(c.bucket, c.ready, len(c.params)) for c in s] for s in rec.steps] if rec else []
    )
    out["n_params"] = sum(1 for _ in m.parameters())
    out["graph_positions"] = stoker_dist.backward_collectives()
    stoker.reset()
    return out


# ------------------------------------------------------------------ FSDP2 cases
def fsdp_case(
    rank: int,
    kind: str,
    reshard: bool,
    *,
    checkpoint: bool = False,
    marks: bool = False,
    bf16: bool = False,
) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )

    def build() -> nn.Module:
        m = (gpt(checkpoint) if kind == "gpt" else mlp(marks)).to(DEVICE[0])
        parts = list(m.blocks) if kind == "gpt" else m.linears()  # type: ignore[operator]
        for p in parts:
            fully_shard(p, reshard_after_forward=reshard, mp_policy=mp_policy)
        fully_shard(m, reshard_after_forward=reshard, mp_policy=mp_policy)
        return m

    _record_collectives()
    stoker.reset()
    m = build()
    collectives.clear()
    eager = train(kind, m, m, rank)
    eager_steps = collectives.steps()
    stoker.reset()
    m = build()
    collectives.clear()
    comp = train(kind, stoker.compile(m, dynamic=DYNAMIC[kind]), m, rank)
    out = compare(eager, comp)
    out["graph_positions"] = stoker_dist.backward_collectives()
    out["steps_eager"] = [_issued(s) for s in eager_steps]
    out["steps"] = [_issued(s) for s in collectives.steps()]
    out["compiled"] = [s.compiled for s in collectives.steps()]
    out["sites"] = [
        [asdict(c.site) if c.site else None for c in s.issued] for s in collectives.steps()
    ]
    out["summary"] = stoker_dist.summary()
    out["fsdp_groups"] = sum(1 for x in m.modules() if isinstance(x, FSDPModule))
    stoker.reset()
    return out


def _issued(step: collectives.Step) -> list[tuple[str, int, str, str]]:
    return [(c.kind, c.numel, c.dtype, c.phase) for c in step.issued]


CASES: dict[str, Callable[[int], dict[str, Any]]] = {
    # DDP: both compile orders, buckets of 25 MB (one) and small ones, no_sync, graph breaks
    "ddp_mlp_outer_25mb": lambda r: ddp_case(r, "mlp", "outer", 25, marks=False),
    "ddp_mlp_inner_small_no_sync": lambda r: ddp_case(
        r, "mlp", "inner", 0.001, accumulate=2, marks=True
    ),
    "ddp_gpt_outer_small": lambda r: ddp_case(r, "gpt", "outer", 0.01),
    "ddp_mlp_outer_small_no_ca": lambda r: ddp_case(
        r, "mlp", "outer", 0.001, compiled_autograd=False, marks=False
    ),
    # FSDP2: per-layer (per-block) + root, both reshard_after_forward, checkpointing, bf16
    "fsdp2_mlp_reshard_marks": lambda r: fsdp_case(r, "mlp", True, marks=True),
    "fsdp2_mlp_no_reshard": lambda r: fsdp_case(r, "mlp", False),
    "fsdp2_gpt_reshard_ckpt": lambda r: fsdp_case(r, "gpt", True, checkpoint=True),
    "fsdp2_mlp_bf16_params_fp32_reduce": lambda r: fsdp_case(r, "mlp", True, bf16=True),
}
# One spawned job per group: process start-up, imports and Dynamo's first compile are paid once.
GROUPS: dict[str, tuple[str, int, list[str]]] = {  # backend, world size, cases
    "gloo": ("gloo", 2, list(CASES)),
    "nccl": (
        "nccl",
        1,
        [
            "ddp_mlp_outer_25mb",
            "ddp_mlp_inner_small_no_sync",
            "fsdp2_mlp_reshard_marks",
            "fsdp2_mlp_bf16_params_fp32_reduce",
        ],
    ),
}


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return None  # parameters are compared in the worker; too big to write
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def worker(rank: int, port: int, group: str, out: str, only: str | None) -> None:
    backend, world, cases = GROUPS[group]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        DEVICE[0] = "cuda"
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90)
    )
    torch.set_num_threads(1)
    collectives.install()
    results: dict[str, Any] = {}
    try:
        for name in cases:
            if only and name != only:
                continue
            t0 = time.perf_counter()
            try:
                results[name] = _jsonable(CASES[name](rank))
                results[name]["seconds"] = round(time.perf_counter() - t0, 1)
            except Exception:
                results[name] = {"exception": traceback.format_exc()}
                break  # the other rank may be stuck in a collective: stop here
            if rank == 0:
                with open(out, "w") as f:
                    json.dump(results, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    group, out = sys.argv[1], sys.argv[2]
    only = sys.argv[3] if len(sys.argv) > 3 else None
    mp.spawn(worker, args=(free_port(), group, out, only), nprocs=GROUPS[group][1])
