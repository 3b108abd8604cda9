"""Backward time: the eager autograd engine vs stoker-autograd (engine-cache hit).

    python -m stoker._internal.bench.benchmarks.autograd [--steps 30] [--json PATH] [--device cpu|cuda]

Two models, each timed side by side in one run (the machine is noisy; compare
within a row): a hook-heavy MLP (a tensor hook, a post-accumulate-grad hook and
module backward hooks on every layer) and a small GPT (4 pre-norm blocks).
Only ``loss.backward()`` is timed, after warm-up steps that capture and compile;
the gradients of the last step are checked against eager.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import stoker_autograd


def hook_heavy_mlp(width: int = 256, depth: int = 8) -> tuple[nn.Module, Callable[[], Any]]:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    counter = {"n": 0}

    def count(*_: Any) -> None:
        counter["n"] += 1

    for mod in model:
        mod.register_full_backward_hook(lambda m, gi, go: count())
    for p in model.parameters():
        p.register_hook(lambda g: g * 1.0)  # type: ignore[no-untyped-call]
        p.register_post_accumulate_grad_hook(count)  # type: ignore[no-untyped-call]
    return model, lambda: torch.randn(64, width)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class SmallGPT(nn.Module):
    def __init__(
        self, vocab: int = 128, d: int = 64, heads: int = 4, layers: int = 4, ctx: int = 32
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))  # type: ignore[no-any-return]


def small_gpt() -> tuple[nn.Module, Callable[[], Any]]:
    return SmallGPT(), lambda: torch.randint(0, 128, (8, 32))


def _backward_ms(model: nn.Module, x: Any, device: str) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(x).float().pow(2).mean()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def time_both(
    eager: nn.Module,
    twin: nn.Module,
    make_input: Callable[[], Any],
    steps: int,
    warmup: int,
    device: str,
) -> tuple[float, float, float]:
    """Median backward ms (eager, stoker), steps interleaved so load spikes hit both,
    and the largest gradient difference of the last step."""
    e_times: list[float] = []
    s_times: list[float] = []
    torch.manual_seed(123)
    with stoker_autograd.enable():
        for i in range(warmup + steps):
            x = make_input().to(device)
            with stoker_autograd.disabled():
                e = _backward_ms(eager, x, device)
            s = _backward_ms(twin, x, device)
            if i >= warmup:
                e_times.append(e)
                s_times.append(s)
    err = max(
        float((a.grad - b.grad).abs().max())
        for a, b in zip(eager.parameters(), twin.parameters())
        if a.grad is not None and b.grad is not None
    )
    return statistics.median(e_times), statistics.median(s_times), err


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    results: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "models": {}}
    rows = []
    for name, make in (("hook-heavy MLP", hook_heavy_mlp), ("small GPT", small_gpt)):
        torch.manual_seed(0)
        model, make_input = make()
        model = model.to(args.device)
        twin = copy.deepcopy(model)  # hooks are deep-copied with their closures
        stoker_autograd.reset_stats()
        eager_ms, stoker_ms, max_err = time_both(
            model, twin, make_input, args.steps, args.warmup, args.device
        )
        st = stoker_autograd.stats()
        results["models"][name] = {
            "eager_backward_ms": eager_ms,
            "stoker_backward_ms": stoker_ms,
            "speedup": eager_ms / stoker_ms,
            "max_grad_diff": max_err,
            "stats": st,
        }
        rows.append((name, eager_ms, stoker_ms, eager_ms / stoker_ms, max_err, st["captures"]))
    print(
        f"backward time, median of {args.steps} steps after {args.warmup} warm-up ({args.device}, torch {torch.__version__})"
    )
    print(
        f"{'model':<16}{'eager ms':>10}{'stoker ms':>11}{'speedup':>9}{'max |dgrad|':>13}{'captures':>10}"
    )
    for name, e, s, sp, err, cap in rows:
        print(f"{name:<16}{e:>10.3f}{s:>11.3f}{sp:>8.2f}x{err:>13.2e}{cap:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
