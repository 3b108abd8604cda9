"""Index arithmetic with symbolic divisors: `x % (2*s0)` must not print as `x % 2*s0`."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import stoker_triton
from stoker_shapes import ShapeContext, Source


def _transpose_through_views(
    x: torch.Tensor, w: torch.Tensor, t: int, n: int
) -> tuple[torch.Tensor]:
    v = x.exp().view(2, t, 32).view(n, 32)
    return (torch.mm(v.permute(1, 0), w).permute(1, 0),)


def test_transposed_write_with_symbolic_sizes_matches_eager() -> None:
    ctx = ShapeContext(policy="dynamic")
    fakes = [
        ctx.fakeify(torch.randn(24, 32), Source.arg(0)),
        ctx.fakeify(torch.randn(24, 16), Source.arg(1)),
        ctx.fakeify(12, Source.arg(2), True),
        ctx.fakeify(24, Source.arg(3), True),
    ]
    with ctx.tracing():
        gm = make_fx(_transpose_through_views)(*fakes)
    fn = stoker_triton.compile_graph(gm, fakes)
    guards = ctx.produce_guards()
    for t in (12, 6, 10):
        args = (torch.randn(2 * t, 32) / 4, torch.randn(2 * t, 16), t, 2 * t)
        assert guards.check(args)
        torch.testing.assert_close(fn(*args)[0], _transpose_through_views(*args)[0])
