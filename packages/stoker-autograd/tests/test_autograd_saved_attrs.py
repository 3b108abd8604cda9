"""Backward nodes whose saved attributes are size lists, optional scales, dtypes and
flags, retraced with changing input sizes (the recompile makes those sizes symbolic).

The upsample backwards (``UpsampleNearest1DBackward0``, bilinear, bicubic, ...)
failed there: their C++ fake kernel reads a list mixing ints and SymInts as
``int[]`` (``isIntList() INTERNAL ASSERT FAILED ... GenericList``) and the backward
ran uncompiled with a warning; `symbolic_decomps` decomposes them while a size is
symbolic.  Every case trains a tiny model through stoker-autograd (and the
interpolate models through ``stoker.compile`` with the aten executor) on fresh
inputs of several sizes and checks the forward, every gradient against eager, and
that stoker-autograd never fell back.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stoker_autograd

Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (weight, x) -> output
LENGTHS = (6, 6, 8, 10)  # the change after two steps makes the sizes symbolic


def _2d(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(-1).expand(-1, -1, -1, 3) * torch.linspace(0.5, 1.5, 3)


def _3d(x: torch.Tensor) -> torch.Tensor:
    return _2d(x).unsqueeze(-1).expand(-1, -1, -1, -1, 2).contiguous()


def _embedding_bag(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ids = (x.abs() * 7).long().flatten() % 5
    table = w.reshape(-1, 3)[:5]
    return F.embedding_bag(ids, table, torch.tensor([0, 2]), mode="mean") * x.mean()


def _index_put(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = (x * w[0]).transpose(0, 2)  # (n, 3, 2): index the length dim
    idx = torch.tensor([0, 2, 0])
    return y.index_put((idx,), y[:3] * w[1], accumulate=True)


# (weight, x) -> output; x is (2, 3, n) with n in LENGTHS, the weight is (3,) or (15,)
CASES: dict[str, Fn] = {
    "nearest1d_scale": lambda w, x: F.interpolate(x * w[:3, None], scale_factor=2.0),
    "nearest1d_size": lambda w, x: F.interpolate(x * w[:3, None], size=11),
    "nearest_exact1d": lambda w, x: F.interpolate(x * w[:3, None], size=7, mode="nearest-exact"),
    "linear1d": lambda w, x: F.interpolate(x * w[:3, None], scale_factor=1.5, mode="linear"),
    "nearest2d_scale": lambda w, x: F.interpolate(_2d(x * w[:3, None]), scale_factor=2.0),
    "bilinear_scale": lambda w, x: F.interpolate(
        _2d(x * w[:3, None]), scale_factor=2.0, mode="bilinear"
    ),
    "bilinear_size_ac": lambda w, x: F.interpolate(
        _2d(x * w[:3, None]), size=(4, 5), mode="bilinear", align_corners=True
    ),
    "bicubic": lambda w, x: F.interpolate(_2d(x * w[:3, None]), scale_factor=1.7, mode="bicubic"),
    "nearest3d": lambda w, x: F.interpolate(_3d(x * w[:3, None]), scale_factor=2.0),
    "trilinear": lambda w, x: F.interpolate(_3d(x * w[:3, None]), size=(5, 4, 3), mode="trilinear"),
    "adaptive_avg": lambda w, x: F.adaptive_avg_pool2d(_2d(x * w[:3, None]), (3, 2)),
    "adaptive_max": lambda w, x: F.adaptive_max_pool2d(_2d(x * w[:3, None]), (3, 2)),
    "max_pool_indices": lambda w, x: F.max_pool2d(
        _2d(x * w[:3, None]), 2, ceil_mode=True, return_indices=True
    )[0],
    "pad_constant": lambda w, x: F.pad(x * w[:3, None], (1, 2), value=0.5),
    "pad_reflect": lambda w, x: F.pad(x * w[:3, None], (2, 1), mode="reflect"),
    "pad_replicate": lambda w, x: F.pad(_2d(x * w[:3, None]), (1, 1, 2, 0), mode="replicate"),
    "unfold_fold": lambda w, x: F.fold(
        F.unfold(_2d(x * w[:3, None]), (2, 2)), (x.shape[2], 3), (2, 2)
    ),
    "tensor_unfold": lambda w, x: (x * w[:3, None]).unfold(2, 3, 2),
    "index_put": _index_put,
    "roll": lambda w, x: (x * w[:3, None]).roll((2, -1), (2, 1)),
    "repeat": lambda w, x: (x * w[:3, None]).repeat(2, 1, 3),
    "expand": lambda w, x: (x * w[:3, None]).unsqueeze(1).expand(-1, 4, -1, -1),
    "narrow_slice": lambda w, x: (x * w[:3, None]).narrow(2, 1, 3)[:, 1:, ::2],
    "cumsum_dtype": lambda w, x: (x * w[:3, None]).cumsum(2, dtype=torch.float64),
    "std_var": lambda w, x: (
        (x * w[:3, None]).std(2, correction=0)
        + (x * w[:3, None]).var((1, 2), correction=2, keepdim=True)
    ),
    "embedding_bag": _embedding_bag,
}


def _no_fallback(caught: list[warnings.WarningMessage]) -> None:
    ours = [str(w.message) for w in caught if "stoker-autograd" in str(w.message)]
    assert not ours, ours
    stats = stoker_autograd.stats()
    assert stats["fallbacks"] == 0 and stats["compiles"] >= 2, stats


@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_attrs_retrace(name: str) -> None:
    fn = CASES[name]
    torch.manual_seed(0)
    w = torch.randn(15, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stoker_autograd.enable():
            for n in LENGTHS:
                x = torch.randn(2, 3, n, requires_grad=True)
                xr = x.detach().clone().requires_grad_(True)
                out = fn(w, x)
                g_out = torch.randn_like(out)
                got = torch.autograd.grad(out, (w, x), g_out)
                with stoker_autograd.disabled():
                    ref_out = fn(w, xr)
                    ref = torch.autograd.grad(ref_out, (w, xr), g_out)
                torch.testing.assert_close(out, ref_out)
                for a, b, what in zip(got, ref, ("weight", "x"), strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{what} at {n}")
    _no_fallback(caught)


class UpNet(nn.Module):
    """conv, interpolate, conv: the backward holds an upsample node between convs."""

    def __init__(self, mode: str, dims: int) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.c1 = conv(3, 4, 3, padding=1)
        self.c2 = conv(4, 2, 3, padding=1)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = F.interpolate(self.c1(x), scale_factor=2.0, mode=self.mode)
        out: torch.Tensor = self.c2(up)
        return out


@pytest.mark.parametrize(("mode", "dims"), [("nearest", 1), ("linear", 1), ("bilinear", 2)])
def test_conv_interpolate_conv(mode: str, dims: int) -> None:
    """The model and a plain interpolate of a parameter, under stoker-autograd alone."""
    torch.manual_seed(0)
    model = UpNet(mode, dims)
    ref = copy.deepcopy(model)
    p = nn.Parameter(torch.randn(2, 3, *[4] * dims))
    p_ref = nn.Parameter(p.detach().clone())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stoker_autograd.enable():
            for n in LENGTHS:
                x = torch.randn(2, 3, *[n] * dims)
                for m, q in ((model, p), (ref, p_ref)):
                    m.zero_grad()
                    q.grad = None
                    ctx: Any = stoker_autograd.disabled() if m is ref else contextlib.nullcontext()
                    with ctx:
                        loss = m(x).pow(2).sum() + F.interpolate(q, scale_factor=2.0).sin().sum()
                        loss.backward()
                _same_grads(model, ref, f"n={n}")
                torch.testing.assert_close(p.grad, p_ref.grad)
    _no_fallback(caught)


@pytest.mark.parametrize(("mode", "dims"), [("nearest", 1), ("bilinear", 2)])
def test_stoker_compile_interpolate(mode: str, dims: int) -> None:
    """Through ``stoker.compile`` (aten executor, compiled autograd), sizes changing."""
    stoker = pytest.importorskip("stoker")
    torch.manual_seed(0)
    model = UpNet(mode, dims)
    ref = copy.deepcopy(model)
    stoker.reset()
    try:
        compiled = stoker.compile(model, backend="aten")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in LENGTHS:
                x = torch.randn(2, 3, *[n] * dims)
                model.zero_grad()
                ref.zero_grad()
                out = compiled(x)
                out.pow(2).sum().backward()
                with stoker.autograd_enabled(False):
                    ref_out = ref(x)
                    ref_out.pow(2).sum().backward()
                torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
                _same_grads(model, ref, f"n={n}")
        ours = [str(w.message) for w in caught if "stoker" in str(w.message)]
        assert not ours, ours
        assert stoker_autograd.stats()["fallbacks"] == 0, stoker_autograd.stats()
    finally:
        stoker.reset()


def _same_grads(model: nn.Module, ref: nn.Module, where: str) -> None:
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4, msg=f"{name} {where}")


_aten = torch.ops.aten
# (op, spatial dims, arguments after input_size); scales only where the op takes them
DECOMP_CASES = [
    (_aten.upsample_nearest1d_backward.default, 1, [None]),
    (_aten._upsample_nearest_exact1d_backward.default, 1, [None]),
    (_aten.upsample_nearest3d_backward.default, 3, [None] * 3),
    (_aten._upsample_nearest_exact3d_backward.default, 3, [None] * 3),
    *[
        case
        for ac in (False, True)
        for case in (
            (_aten.upsample_linear1d_backward.default, 1, [ac, None]),
            (_aten.upsample_bilinear2d_backward.default, 2, [ac, None, None]),
            (_aten.upsample_bilinear2d_backward.default, 2, [ac, 1.7, 2.3]),
            (_aten.upsample_trilinear3d_backward.default, 3, [ac, None, None, None]),
            (_aten.upsample_bicubic2d_backward.default, 2, [ac, 2.0, 3.0]),
        )
    ],
]


@pytest.mark.parametrize(("op", "n", "rest"), DECOMP_CASES, ids=lambda c: str(c))
def test_symbolic_decompositions_match_eager(op: Any, n: int, rest: list[Any]) -> None:
    """Traced with symbolic sizes the op is decomposed (no node of it is left); the
    graph equals the eager op at other sizes, upsampling and downsampling.  With
    static sizes the decomposition declines (the op is recorded as it is)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_autograd._internal.symbolic_decomps import SYMBOLIC_DECOMPOSITIONS

    def f(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = op(g, list(g.shape[2:]), list(x.shape), *rest)
        return out

    def traced(mode: str) -> torch.fx.GraphModule:
        ins = (torch.randn(2, 3, *[11, 6, 9][:n]), torch.randn(2, 3, *[5, 3, 4][:n]))
        return make_fx(f, tracing_mode=mode, decomposition_table=SYMBOLIC_DECOMPOSITIONS)(*ins)

    gm = traced("symbolic")
    assert all(node.target is not op for node in gm.graph.nodes), gm.code
    assert any(node.target is op for node in traced("real").graph.nodes)
    torch.manual_seed(0)
    scales = rest[-n:]
    for ins, outs in (([7, 4, 2], [13, 9, 5]), ([6, 5, 3], [3, 2, 2])):
        if all(s is not None for s in scales) and not (len(rest) > n and rest[0]):
            outs = [int(i * s) for i, s in zip(ins, scales, strict=False)]
        g, x = torch.randn(2, 3, *outs[:n]), torch.randn(2, 3, *ins[:n])
        torch.testing.assert_close(gm(g, x), f(g, x), atol=2e-5, rtol=1e-5)
