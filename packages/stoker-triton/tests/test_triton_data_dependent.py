"""Graphs whose sizes depend on tensor data run through aten, never an error."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import stoker_triton
from stoker_shapes import ShapeContext, Source


def _select_positive(x: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.masked_select(x, x > 0) * 2,)


def test_data_dependent_size_graph_falls_back_to_aten_whole() -> None:
    ctx = ShapeContext()
    fx_ = ctx.fakeify(torch.randn(6, 4), Source.arg(0))
    with ctx.tracing():
        gm = make_fx(_select_positive)(fx_)
    fn = stoker_triton.compile_graph(gm, [fx_])
    assert fn.report.fallback_ops == {"<whole graph>": 1}
    assert "unbacked" in fn.report.fallback_reasons["<whole graph>"]
    for _ in range(3):
        x = torch.randn(6, 4)
        torch.testing.assert_close(fn(x)[0], _select_positive(x)[0])
