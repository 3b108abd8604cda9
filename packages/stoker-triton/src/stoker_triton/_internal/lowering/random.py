"""Random lowerings: `tl.rand`/`tl.randn` (Philox) from a per-call seed.

Invariants: the wrapper draws one seed per call from torch's CPU generator
(`runtime.new_seed`), so results are reproducible under `torch.manual_seed`
and differ between calls; each random op of a graph is its own *stream*
(the seed is offset per stream); the Philox offset is the element's
row-major position, so the values do not depend on block sizes or fusion.
The numbers differ from eager's generator: same distribution, not same bits.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from ..ir import Expr, Op, Rand, Value, contiguous_strides
from .core import LoweringContext, TensorValue, cast, register
from .pointwise import broadcast_load, meta_val, out_size, to_value

aten = torch.ops.aten


def _random(ctx: LoweringContext, node: Any, kind: str) -> TensorValue:
    size = out_size(ctx, node)
    dt = meta_val(node).dtype
    stream = ctx.random_streams
    ctx.random_streams += 1
    strides = contiguous_strides(size)

    def loader(idx: tuple[Expr, ...]) -> Value:
        flat = sum((i * s for i, s in zip(idx, strides)), sympy.Integer(0))
        return cast(Rand(kind, stream, flat, torch.float32), dt)

    return TensorValue(size, dt, ctx.device, loader)


@register("random", aten.rand, aten.rand_like)
def rand(ctx: LoweringContext, node: Any, *args: Any, **kwargs: Any) -> TensorValue:
    return _random(ctx, node, "rand")


@register("random", aten.randn, aten.randn_like)
def randn(ctx: LoweringContext, node: Any, *args: Any, **kwargs: Any) -> TensorValue:
    return _random(ctx, node, "randn")


@register("random", aten.bernoulli)
def bernoulli(
    ctx: LoweringContext, node: Any, x: TensorValue, p: Any = None, **kwargs: Any
) -> TensorValue:
    u = _random(ctx, node, "rand")
    dt = meta_val(node).dtype

    def loader(idx: tuple[Expr, ...]) -> Value:
        prob = (
            to_value(ctx, p, idx, torch.float32)
            if p is not None
            else cast(broadcast_load(x, idx), torch.float32)
        )
        return cast(Op("lt", (u.load(idx), prob), torch.bool), dt)

    return TensorValue(u.size, dt, ctx.device, loader)
