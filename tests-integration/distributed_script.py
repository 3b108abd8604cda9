"""Worker of test_distributed.py: 2 CPU ranks (gloo, 127.0.0.1), eager against stoker.

``python distributed_script.py GROUP OUT.json`` spawns 2 processes that run every
case of GROUP (one spawn per group: process start-up and compiles are the cost),
each case eager first (stoker's compiled autograd off) then compiled, on the same
batches, whose sizes change between steps.  Rank 0 writes one JSON object per
case to OUT.json; test_distributed.py asserts on them.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import stoker
from stoker._internal import distributed as stoker_dist
from stoker._internal.launch import free_port
from stoker._internal.models import GPT, GPTConfig, lm_loss

STEPS = (5, 6, 7, 8)  # batch sizes (the GPT's: 3 fewer)
LOG: list[str] = []  # collectives and markers, in the order they ran on this rank


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


def gpt(checkpoint: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32))
    if checkpoint:
        blocks: Any = model.blocks  # type: ignore[attr-defined]
        for i, b in enumerate(list(blocks)):
            blocks[i] = CkptBlock(b)
    return model


def batch(kind: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = STEPS[step]
    if kind == "gpt":
        seq = torch.randint(0, 32, (n - 3, 9), generator=g)
        return seq[:, :-1], seq[:, 1:]
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def loss_of(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return lm_loss(out, target)
    return ((out - target) ** 2).mean()


def full(p: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(p, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else p).detach().float().clone()


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
    """Log every collective FSDP2 issues (by kind and element count), in call order."""
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
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

    build = gpt if kind == "gpt" else (lambda: mlp(marks))
    stoker.reset()
    m = build()
    d = DDP(m, bucket_cap_mb=bucket_mb)
    eager = train(kind, d, m, rank, accumulate, d.no_sync)
    stoker.reset()
    m = build()
    if order == "outer":
        d = DDP(m, bucket_cap_mb=bucket_mb)
        model: nn.Module = stoker.compile(d, compiled_autograd=compiled_autograd)
    else:
        d = DDP(stoker.compile(m, compiled_autograd=compiled_autograd), bucket_cap_mb=bucket_mb)
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


def ddp_unsupported(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    stoker.reset()
    d = DDP(mlp(), find_unused_parameters=True, gradient_as_bucket_view=True)
    try:
        stoker.compile(d)
    except stoker.StokerConfigError as e:
        return {"error": str(e)}
    finally:
        stoker.reset()
    return {"error": None}


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
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )

    def build() -> nn.Module:
        m = gpt(checkpoint) if kind == "gpt" else mlp(marks)
        parts = list(m.blocks) if kind == "gpt" else m.linears()  # type: ignore[operator]
        for p in parts:
            fully_shard(p, reshard_after_forward=reshard, mp_policy=mp_policy)
        fully_shard(m, reshard_after_forward=reshard, mp_policy=mp_policy)
        return m

    _record_collectives()
    stoker.reset()
    m = build()
    eager = train(kind, m, m, rank)
    stoker.reset()
    m = build()
    comp = train(kind, stoker.compile(m), m, rank)
    out = compare(eager, comp)
    out["graph_positions"] = stoker_dist.backward_collectives()
    stoker.reset()
    return out


GROUPS: dict[str, list[tuple[str, Callable[[int], dict[str, Any]]]]] = {
    "ddp": [
        ("mlp_outer_25mb", lambda r: ddp_case(r, "mlp", "outer", 25)),
        ("mlp_inner_small_no_sync", lambda r: ddp_case(r, "mlp", "inner", 0.001, accumulate=2)),
        ("gpt_outer_small", lambda r: ddp_case(r, "gpt", "outer", 0.01)),
        (
            "mlp_outer_small_no_ca",
            lambda r: ddp_case(r, "mlp", "outer", 0.001, compiled_autograd=False, marks=False),
        ),
        ("unsupported", ddp_unsupported),
    ],
    "fsdp2": [
        ("mlp_reshard_marks", lambda r: fsdp_case(r, "mlp", True, marks=True)),
        ("mlp_no_reshard", lambda r: fsdp_case(r, "mlp", False)),
        ("gpt_reshard_ckpt", lambda r: fsdp_case(r, "gpt", True, checkpoint=True)),
        ("mlp_bf16_params_fp32_reduce", lambda r: fsdp_case(r, "mlp", True, bf16=True)),
    ],
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=90))
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    try:
        for name, case in GROUPS[group]:
            if only and name != only:
                continue
            try:
                results[name] = _jsonable(case(rank))
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
    mp.spawn(worker, args=(free_port(), group, out, only), nprocs=2)
