"""Repeated regions (a model's identical blocks) are found, lowered once and compile to the
same kernels as one block: `_internal/lowering/regions.py`, `_internal/codegen/kernelmemo.py`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from triton_helpers import assert_same, fresh

from stoker_triton import compile_graph
from stoker_triton._internal import pipeline
from stoker_triton._internal.codegen import kernelmemo
from stoker_triton._internal.lowering.regions import find_regions

D, T, H, B = 16, 8, 2, 2


def block(x, wqkv, wo, g, b, w1, w2, act=F.gelu):
    y = F.layer_norm(x, (x.shape[-1],), g, b)
    d = x.shape[-1]
    q, k, v = (y @ wqkv).split(d, -1)
    q, k, v = (z.view(B, T, H, d // H).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-1, -2)) / (d // H) ** 0.5
    mask = torch.ones(T, T).tril() == 0
    att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
    x = x + (att @ v).transpose(1, 2).reshape(B, T, d) @ wo
    return x + act(F.layer_norm(x, (d,)) @ w1) @ w2


def params(n: int, d: int = D, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        out += [
            torch.randn(d, 3 * d, generator=g) * 0.2,
            torch.randn(d, d, generator=g) * 0.2,
            1 + 0.1 * torch.randn(d, generator=g),
            0.1 * torch.randn(d, generator=g),
            torch.randn(d, 4 * d, generator=g) * 0.2,
            torch.randn(4 * d, d, generator=g) * 0.2,
        ]
    return [p.requires_grad_() for p in out]


def model(n: int, acts: list[Any] | None = None):
    def f(*a: torch.Tensor) -> torch.Tensor:
        x = a[-1]
        for i in range(n):
            x = block(x, *a[6 * i : 6 * i + 6], act=acts[i] if acts else F.gelu)
        return x

    return f


def joint(f):
    def j(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = f(*a)
        return (out, *torch.autograd.grad((out * out).sum(), a[:-1]))

    return j


def trace(f, args: list[torch.Tensor]) -> torch.fx.GraphModule:
    return make_fx(f, decomposition_table=core_aten_decompositions())(*fresh(args))


def graph_of(n: int, kind: str = "joint", acts: list[Any] | None = None) -> tuple[Any, list[Any]]:
    args = [*params(n), torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))]
    f = model(n, acts)
    return trace(joint(f) if kind == "joint" else f, args), args


def test_identical_blocks_are_one_region():
    gm, _ = graph_of(5, "forward")
    (region,) = find_regions(gm)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    # five blocks, one region: at least four copies of one block's length
    assert region.count >= 4
    assert region.length * 5 >= len(calls) * 0.9 // 1
    assert region.length * region.count <= len(calls)
    # each copy reads its own parameters: copy k's inputs pair copy 0's one to one
    for pairs in region.inputs[1:]:
        assert len({b for _, b in pairs}) == len(pairs)
        assert any(a is not b for a, b in pairs)


def test_a_forward_and_a_backward_region_in_a_joint_graph():
    gm, _ = graph_of(4)
    regions = find_regions(gm)
    assert len(regions) == 2
    fw, bw = regions
    assert fw.start + fw.count * fw.length <= bw.start  # the forward's blocks, then the backward's
    assert fw.count >= 3 and bw.count >= 3


def test_different_blocks_are_not_merged():
    # a GELU block and a ReLU block alternate: no two consecutive blocks are the same
    gm, _ = graph_of(4, "forward", acts=[F.gelu, F.relu, F.gelu, F.relu])
    for r in find_regions(gm):
        nodes = list(gm.graph.nodes)
        for k in range(r.count):
            copy = r.copy_nodes(nodes, k)
            first = r.copy_nodes(nodes, 0)
            assert [n.target for n in copy] == [n.target for n in first]
    # two blocks of different widths
    a = params(1, 16) + params(1, 32, seed=1)
    x = torch.randn(B, T, 16)

    def two(*p: torch.Tensor) -> torch.Tensor:
        y = block(p[-1], *p[:6])
        y = torch.cat([y, y], -1)
        return block(y, *p[6:12])

    gm = trace(two, [*a, x])
    assert find_regions(gm) == []


@pytest.mark.parametrize("kind", ["forward", "joint"])
def test_blocks_compiled_once_match_eager(kind, monkeypatch):
    monkeypatch.setenv("STOKER_TRITON_GRAPH_CACHE", "0")
    monkeypatch.setenv("STOKER_TRITON_REGIONS", "1")
    gm, args = graph_of(3, kind)
    before = dict(pipeline.region_stats)
    fn = compile_graph(gm, args)
    assert pipeline.region_stats["reused nodes"] > before["reused nodes"]
    assert pipeline.region_stats["mismatches"] == before["mismatches"]
    f = model(3)
    want = (joint(f) if kind == "joint" else f)(*args)
    assert_same(fn(*args), want, atol=2e-4, rtol=2e-4)


def _compile_counts(n: int, kind: str) -> dict[str, int]:
    gm, args = graph_of(n, kind)
    before = dict(kernelmemo.stats)
    fn = compile_graph(gm, args)
    rep = fn.report
    return {
        "kernels": len(rep.kernels),
        "modules": len({k.path for k in rep.kernels}),
        "generated": kernelmemo.stats["generated"] - before["generated"],
        "lowered": rep.lowered_nodes,
    }


@pytest.mark.parametrize("kind", ["forward", "joint"])
def test_eight_blocks_compile_what_two_blocks_compile(kind, monkeypatch):
    """Counts, not times: the distinct kernels (modules: one compile each) and the kernel
    sources generated do not grow with depth, nor do the nodes lowered by the rules."""
    monkeypatch.setenv("STOKER_TRITON_GRAPH_CACHE", "0")
    monkeypatch.setenv("STOKER_TRITON_REGIONS", "1")
    monkeypatch.setattr(kernelmemo, "_MEMO", {})
    two = _compile_counts(2, kind)
    monkeypatch.setattr(kernelmemo, "_MEMO", {})
    eight = _compile_counts(8, kind)
    assert eight["kernels"] > 3 * two["kernels"]  # the program itself grows with depth
    # the distinct kernels do not grow: equal for the forward; in the joint graph two
    # blocks' backward is no region (below), whose fusion leaves one kernel more
    assert eight["modules"] <= two["modules"] <= eight["modules"] + (kind == "joint")
    assert eight["generated"] == eight["modules"] and two["generated"] == two["modules"]
    # each block's copy after the first is renamed, not lowered (constants aside: a
    # block's causal mask is made of nodes that read nothing, lowered per block). In
    # the joint graph the first backward block differs from the others (the gradient
    # enters there, no residual to add), so two blocks lower both backward blocks and
    # eight lower that one and one copy of the other seven: as many nodes.
    assert eight["lowered"] == two["lowered"]
