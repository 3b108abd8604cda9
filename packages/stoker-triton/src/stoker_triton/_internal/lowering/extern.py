"""Extern calls: matmul/convolution, and any op without a lowering, run
through aten on real tensors in the wrapper. Never an error: each fallback
op is logged once (logger `stoker.kernels`) and counted in the report.

Invariants: tensor arguments are realized buffers or strided views of one
(`BufferRef`, passed as `as_strided` without a copy); symbolic ints are
`SymRef`s the wrapper evaluates; each tensor the op returns gets an
`extern` buffer whose layout is the FX node's `meta["val"]` layout (the
wrapper restrides when aten returns another layout).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_map

from ..ir import BufferRef, ExternNode, SymRef, contiguous_strides
from .core import LoweringContext, TensorValue, register

aten = torch.ops.aten

# Ops that are extern by design (not a fallback): counted as extern kernels.
EXTERN_BY_DESIGN = (
    aten.mm,
    aten.bmm,
    aten.addmm,
    aten.baddbmm,
    aten.convolution,
    aten.convolution_backward,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
)


def extern_call(ctx: LoweringContext, node: Any, args: Any, kwargs: Any, reason: str | None) -> Any:
    if reason is not None:
        ctx.note_fallback(str(node.target), reason)

    def arg(a: Any) -> Any:
        if isinstance(a, TensorValue):
            tv = ctx.realize(a)
            assert tv.layout is not None
            return tv.layout
        if isinstance(a, sympy.Basic):
            return (
                int(a) if a.is_number and a.is_integer else (float(a) if a.is_number else SymRef(a))
            )
        return a

    xargs = tree_map(arg, tuple(args), is_leaf=lambda a: isinstance(a, TensorValue))
    xkwargs = tree_map(arg, dict(kwargs), is_leaf=lambda a: isinstance(a, TensorValue))
    val = node.meta.get("val")  # None for ops that return nothing (checks, asserts)
    single = isinstance(val, torch.Tensor)
    vals = [val] if single else list(val) if isinstance(val, list | tuple) else [val]
    outs: list[str | None] = []
    results: list[Any] = []
    schema = getattr(node.target, "_schema", None)
    returns = list(schema.returns) if schema is not None else []
    first_ref = next(
        (a for a in torch.utils._pytree.tree_leaves(xargs) if isinstance(a, BufferRef)), None
    )
    for k, v in enumerate(vals):
        if isinstance(v, torch.Tensor):
            name = ctx.new_name("buf")
            size = [ctx.expr(s) for s in v.shape]
            stride = [ctx.expr(s) for s in v.stride()]
            if any(st == 0 and sz != 1 for st, sz in zip(stride, size)):
                # an overlapping (expanded) result: later kernels get a dense copy
                stride = list(contiguous_strides(size))
            buf = ctx.add_buffer(
                name,
                size,
                stride,
                v.dtype,
                "extern",
                ctx.expr(v.storage_offset()),
            )
            outs.append(name)
            results.append(ctx.buffer_value(buf))
            if k < len(returns) and returns[k].alias_info is not None and first_ref is not None:
                # a view of its input: writes through either reach both
                ctx.aliases[name] = ctx.aliases.get(first_ref.buf, first_ref.buf)
        else:
            outs.append(None)
            results.append(None)
    ctx.nodes.append(
        ExternNode(
            ctx.new_name("extern"),
            node.target,
            xargs,
            xkwargs,
            tuple(outs),
            single,
            _mutated(ctx, node, xargs, xkwargs),
        )
    )
    if single:
        return results[0]
    return tuple(results) if not isinstance(val, list) else results


def _mutated(
    ctx: LoweringContext, node: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, ...]:
    """Buffers an op writes in place (schema arguments marked `(a!)`)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return ()
    out: list[str] = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        for leaf in v if isinstance(v, list | tuple) else [v]:
            if isinstance(leaf, BufferRef):
                out.append(leaf.buf)
                if leaf.buf in ctx.aliases:
                    out.append(ctx.aliases[leaf.buf])  # the base a view writes through to
    return tuple(dict.fromkeys(out))


def _by_design(ctx: LoweringContext, node: Any, *args: Any, **kwargs: Any) -> Any:
    return extern_call(ctx, node, args, kwargs, None)


register("extern", *EXTERN_BY_DESIGN)(_by_design)
