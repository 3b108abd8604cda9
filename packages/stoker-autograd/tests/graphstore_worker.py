"""One process of the warm-start tests: ``python graphstore_worker.py MODEL SEED``.

Builds MODEL twice from one seed (hooks registered on each), runs one backward
on a fresh input made from SEED eagerly and one inside ``stoker_autograd.enable()``,
and prints one JSON line: the counters, the cache outcomes, the largest gradient
difference and what the hooks saw.  STOKER_CACHE_DIR comes from the environment.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.nn as nn

import stoker_autograd
from stoker_autograd._internal import graphstore


class Scale(torch.autograd.Function):
    """Keeps a Python float on ctx: not in the engine's key, read at run time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(x, w)
        return x * w * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        return g * w * ctx.scale, (g * x * ctx.scale).sum(0), None


class WithFunction(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Scale.apply(torch.tanh(self.lin(x)), self.w, self.scale)


def build(name: str, seen: list[str], scale: float) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if name == "mlp-wide":  # the "changed model"
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    if name.startswith("aot-"):  # compiled by stoker_capture.aot_module below
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    if name == "function":
        return WithFunction(scale)
    if name == "hooks":
        m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        m[0].weight.register_hook(lambda g: g * 2.0)
        for pname, p in m.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=pname: seen.append(n))
        return m
    raise SystemExit(f"unknown model {name}")


def count_passes() -> dict[str, int]:
    """How often the reordering passes ran, a captured graph became a module, and the
    compiled backward's code was generated or loaded from the entry; how many FX nodes
    were made during a capture (``begin_capture`` .. ``end_capture``) and how many
    captured graphs were made FX graphs of the engine's walk."""
    import torch.fx as fx

    from stoker_autograd import passes
    from stoker_autograd._internal import runtime
    from stoker_autograd._internal.capture import CaptureInstance
    from stoker_autograd._internal.graph import Walk
    from stoker_capture._internal.runtime.boxed import BoxedGraph

    counts = {
        "passes": 0,
        "captured graph modules": 0,
        "code generated": 0,
        "code loaded": 0,
        "fx nodes made while capturing": 0,
        "captured graphs made": 0,
    }
    run_all, graph_module = passes.run_all, runtime.graph_module
    generate, load = BoxedGraph._generate, BoxedGraph.load
    create_node, to_graph = fx.Graph.create_node, Walk.to_graph
    begin, end = CaptureInstance.begin_capture, CaptureInstance.end_capture
    capturing = [False]

    def counted_create_node(*a: Any, **k: Any) -> Any:
        counts["fx nodes made while capturing"] += capturing[0]
        return create_node(*a, **k)

    def counted_to_graph(self: Walk) -> Any:
        counts["captured graphs made"] += self._graph is None
        return to_graph(self)

    def counted_begin(self: CaptureInstance, *a: Any) -> Any:
        capturing[0] = True
        return begin(self, *a)

    def counted_end(self: CaptureInstance, *a: Any) -> Any:
        try:
            return end(self, *a)
        finally:
            capturing[0] = False

    def counted_generate(self: BoxedGraph) -> Any:
        counts["code generated"] += 1
        return generate(self)

    def counted_load(self: BoxedGraph, stored: Any) -> bool:
        took = load(self, stored)
        counts["code loaded"] += took
        return took

    def counted_run_all(*a: Any, **k: Any) -> Any:
        counts["passes"] += 1
        return run_all(*a, **k)

    def counted_graph_module(*a: Any, **k: Any) -> Any:
        counts["captured graph modules"] += 1
        return graph_module(*a, **k)

    passes.run_all = counted_run_all  # type: ignore[assignment]
    runtime.graph_module = counted_graph_module  # type: ignore[assignment]
    BoxedGraph._generate = counted_generate  # type: ignore[method-assign]
    BoxedGraph.load = counted_load  # type: ignore[method-assign]
    fx.Graph.create_node = counted_create_node  # type: ignore[method-assign]
    Walk.to_graph = counted_to_graph  # type: ignore[method-assign]
    CaptureInstance.begin_capture = counted_begin  # type: ignore[method-assign]
    CaptureInstance.end_capture = counted_end  # type: ignore[method-assign]
    return counts


def main() -> None:
    name, seed = sys.argv[1], int(sys.argv[2])
    counts = count_passes()
    scale = 1.0 + seed  # another float on ctx in every process
    seen_eager: list[str] = []
    seen: list[str] = []
    eager, model = build(name, seen_eager, scale), build(name, seen, scale)
    fwd: Any = model
    if name.startswith("aot-"):  # the forward compiled by stoker-capture: its backward inlined
        import stoker_capture

        # "aot-dynamic": its forward symbolic, and a second step with another batch
        fwd = stoker_capture.aot_module(model, dynamic="dynamic" if "dynamic" in name else "auto")
    gen = torch.Generator().manual_seed(seed)
    diff = 0.0
    with stoker_autograd.enable():
        for batch in (5, 7) if name == "aot-dynamic" else (5,):
            x = torch.randn(batch, 8, generator=gen)
            eager.zero_grad()
            model.zero_grad()
            with stoker_autograd.disabled():
                eager(x).pow(2).sum().backward()
            fwd(x).pow(2).sum().backward()
            diff = max(
                diff,
                *(
                    float((a.grad - b.grad).abs().max())  # type: ignore[operator]
                    for a, b in zip(eager.parameters(), model.parameters(), strict=True)
                ),
            )
    out = {
        "stats": stoker_autograd.stats(),
        "outcomes": graphstore.outcomes,
        "diff": diff,
        "seen": seen,
        "seen_eager": seen_eager,
        "counts": counts,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
