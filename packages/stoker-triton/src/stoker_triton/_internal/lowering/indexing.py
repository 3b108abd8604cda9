"""Indexing lowerings: gather-style reads through indirect indices, and
scatter-style writes (index_put, scatter, scatter_add) as `ScatterNode`s.

Invariants: an index tensor's value becomes an `ind*` symbol bound on the
Load that uses it (`ir.bind_indirect`); negative indices wrap once (eager
semantics); indices are not bounds-checked (an out-of-range index is
undefined behaviour, as in a CUDA kernel). A scatter writes into a fresh
copy of its base (never into an input); `accumulate=True` and scatter_add
use atomic adds; plain stores with duplicate indices keep one of the values.
A plain scatter with one index per line (nll_loss's backward) is a pointwise
select instead (`_one_hot`).
An accumulating scatter into a dtype `tl.atomic_add` lacks on sm_90 (int8,
uint8, int16, bool) runs as an aten call in the graph (`_aten_accumulate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch

from ..ir import Const, Expr, Op, ScatterNode, Value, bind_indirect, contiguous_strides, product
from ..ranges import fold_ranges, loop_ranges
from .core import LoweringContext, LoweringError, TensorValue, cast, const_value, register
from .extern import extern_call
from .pointwise import broadcast_load, meta_val, out_size

aten = torch.ops.aten


def _wrapped(v: Value, n: Expr) -> Value:
    """`i + n` where `i < 0`."""
    v = cast(v, torch.int64)
    from ..ir import IndexValue

    nv: Value = Const(int(n), torch.int64) if n.is_number else IndexValue(n, torch.int64)
    return Op(
        "where",
        (Op("lt", (v, Const(0, torch.int64)), torch.bool), Op("add", (v, nv), torch.int64), v),
        torch.int64,
    )


def _load_indirect(
    ctx: LoweringContext, x: TensorValue, sub: list[Any], binds: list[tuple[sympy.Symbol, Value]]
) -> Value:
    v = x.load(tuple(sub))
    for sym, b in binds:
        v = bind_indirect(v, sym, b)
    return v


@register("indexing", aten.gather)
def gather(
    ctx: LoweringContext,
    node: Any,
    x: TensorValue,
    dim: int,
    index: TensorValue,
    sparse_grad: bool = False,
) -> TensorValue:
    dim = dim + x.ndim if dim < 0 else dim

    def loader(idx: tuple[Expr, ...]) -> Value:
        sym = ctx.new_indirect()
        iv = _wrapped(index.load(idx), x.size[dim])
        sub = list(idx)
        sub[dim] = sym
        return _load_indirect(ctx, x, sub, [(sym, iv)])

    return TensorValue(out_size(ctx, node), x.dtype, ctx.device, loader)


@register("indexing", aten.index_select)
def index_select(
    ctx: LoweringContext, node: Any, x: TensorValue, dim: int, index: TensorValue
) -> TensorValue:
    if x.ndim == 0:
        return x  # selecting from a 0-dim tensor: the tensor (indices must be 0)
    dim = dim + x.ndim if dim < 0 else dim

    def loader(idx: tuple[Expr, ...]) -> Value:
        sym = ctx.new_indirect()
        iv = _wrapped(index.load((idx[dim],) if index.ndim else ()), x.size[dim])
        sub = list(idx)
        sub[dim] = sym
        return _load_indirect(ctx, x, sub, [(sym, iv)])

    return TensorValue(out_size(ctx, node), x.dtype, ctx.device, loader)


def _index_plan(
    x: TensorValue, indices: Sequence[TensorValue | None], out_nd: int
) -> tuple[list[int], int, int]:
    """Indexed dims, where the broadcast index dims start in the output, and their count."""
    pos = [i for i, t in enumerate(indices) if t is not None]
    nb = max(t.ndim for t in indices if t is not None)
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    start = pos[0] if adjacent else 0
    return pos, start, nb


def _indexed_loader(
    ctx: LoweringContext, x: TensorValue, indices: Sequence[TensorValue | None], out_nd: int
) -> Any:
    pos, start, nb = _index_plan(x, indices, out_nd)
    rest = [d for d in range(x.ndim) if d not in pos]

    def source_index(idx: Sequence[Expr]) -> tuple[list[Any], list[tuple[sympy.Symbol, Value]]]:
        bidx = list(idx[start : start + nb])
        other = list(idx[:start]) + list(idx[start + nb :])
        sub: list[Any] = [None] * x.ndim
        for d, o in zip(rest, other):
            sub[d] = o
        binds = []
        for d in pos:
            t = indices[d]
            assert t is not None
            if t.dtype == torch.bool:
                raise LoweringError("boolean mask indexing has a data-dependent size")
            sym = ctx.new_indirect()
            binds.append((sym, _wrapped(broadcast_load(t, bidx), x.size[d])))
            sub[d] = sym
        return sub, binds

    return source_index


@register("indexing", aten.index)
def index(
    ctx: LoweringContext, node: Any, x: TensorValue, indices: Sequence[TensorValue | None]
) -> TensorValue:
    indices = list(indices) + [None] * (x.ndim - len(indices))
    size = out_size(ctx, node)
    source_index = _indexed_loader(ctx, x, indices, len(size))

    def loader(idx: tuple[Expr, ...]) -> Value:
        sub, binds = source_index(idx)
        return _load_indirect(ctx, x, sub, binds)

    return TensorValue(size, x.dtype, ctx.device, loader)


def _fresh_copy(ctx: LoweringContext, x: TensorValue) -> str:
    """A new contiguous buffer holding `x` (the scatter target)."""
    tv = TensorValue(x.size, x.dtype, ctx.device, x.load)  # drop the layout: force a copy
    r = ctx.realize(tv)
    assert r.layout is not None
    return r.layout.buf


def _scatter(
    ctx: LoweringContext,
    target: str,
    size: Sequence[Expr],
    index_fn: Any,
    value_fn: Any,
    mode: str,
    dtype: torch.dtype,
) -> TensorValue:
    from ..ir import index_var

    idx = tuple(index_var("x", i) for i in range(len(size)))
    coords, binds = index_fn(idx)
    buf = ctx.buffers[target]
    flat = sum((c * s for c, s in zip(coords, buf.stride)), sympy.Integer(0))
    body = cast(value_fn(idx), dtype)
    if product(size) != 0:  # scattering nothing leaves the copy as it is
        env = loop_ranges(size)
        body = fold_ranges(body, env)
        binds = [(s, fold_ranges(b, env)) for s, b in binds]
        ctx.nodes.append(ScatterNode(target, tuple(size), flat, tuple(binds), body, mode))
    return ctx.buffer_value(buf)


# dtypes tl.atomic_add has on sm_90 (Triton refuses 8- and 16-bit integers)
ATOMIC_ADD_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64}
)


def _aten_accumulate(
    ctx: LoweringContext, node: Any, dtype: torch.dtype, args: Sequence[Any], kwargs: Any
) -> TensorValue | None:
    """An accumulating scatter into `dtype` with no atomic add: aten runs it
    within the compiled graph (an extern call by design, not a fallback; its
    integer sums wrap as eager's). None where a kernel can do it."""
    if dtype in ATOMIC_ADD_DTYPES:
        return None
    out = extern_call(ctx, node, args, kwargs, None)
    assert isinstance(out, TensorValue)
    return out


@register("indexing", aten.index_put, aten._unsafe_index_put)
def index_put(
    ctx: LoweringContext,
    node: Any,
    x: TensorValue,
    indices: Sequence[TensorValue | None],
    values: TensorValue | Any,
    accumulate: bool = False,
) -> TensorValue:
    if accumulate:
        done = _aten_accumulate(ctx, node, x.dtype, (x, indices, values, accumulate), {})
        if done is not None:
            return done
    indices = list(indices) + [None] * (x.ndim - len(indices))
    if any(t is not None and t.dtype == torch.bool for t in indices):
        raise LoweringError("boolean mask index_put")
    pos = [i for i, t in enumerate(indices) if t is not None]
    nb = max(t.ndim for t in indices if t is not None)
    bshape: list[Expr] = [sympy.Integer(1)] * nb
    for t in indices:
        if t is not None:
            for k, s in enumerate(t.size):
                j = nb - t.ndim + k
                if s != 1:
                    bshape[j] = s
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    rest = [x.size[d] for d in range(x.ndim) if d not in pos]
    start = pos[0] if adjacent else 0
    size = rest[:start] + bshape + rest[start:]
    target = _fresh_copy(ctx, x)
    source_index = _indexed_loader(ctx, x, indices, len(size))

    def value_fn(idx: Sequence[Expr]) -> Value:
        if isinstance(values, TensorValue):
            return broadcast_load(values, idx)
        return Const(const_value(values, x.dtype), x.dtype)

    return _scatter(
        ctx, target, size, source_index, value_fn, "add" if accumulate else "store", x.dtype
    )


def _one_hot(
    ctx: LoweringContext, x: TensorValue, dim: int, index: TensorValue, src: Any
) -> TensorValue | None:
    """A plain scatter with one index per line along `dim` that covers every other
    dim of `x` (``zeros.scatter(1, target[:, None], -1.0)`` in nll_loss's backward) as
    a pointwise value: ``idx[dim] == index[.., 0, ..] ? src : x``. No scatter kernel, no
    buffer, and the consumer reads it in its own loop. None where the shape is not that."""
    if x.ndim == 0 or index.ndim != x.ndim or index.size[dim] != 1:
        return None
    if any(index.size[d] != x.size[d] for d in range(x.ndim) if d != dim):
        return None
    if isinstance(src, TensorValue) and (
        src.ndim != x.ndim or any(src.size[d] != x.size[d] for d in range(x.ndim) if d != dim)
    ):
        return None
    from ..ir import IndexValue

    def loader(idx: tuple[Expr, ...]) -> Value:
        line = list(idx)
        line[dim] = sympy.Integer(0)
        at = _wrapped(index.load(tuple(line)), x.size[dim])
        hit = Op("eq", (IndexValue(idx[dim], torch.int64), at), torch.bool)
        if isinstance(src, TensorValue):
            value = cast(src.load(tuple(line)), x.dtype)
        else:
            value = Const(const_value(src, x.dtype), x.dtype)
        return Op("where", (hit, value, x.load(idx)), x.dtype)

    return TensorValue(x.size, x.dtype, ctx.device, loader)


@register("indexing", aten.scatter_add, aten.scatter)
def scatter_add(
    ctx: LoweringContext,
    node: Any,
    x: TensorValue,
    dim: int,
    index: TensorValue,
    src: Any,
    *,
    reduce: str | None = None,
) -> TensorValue:
    if reduce is not None and reduce != "add":
        raise LoweringError(f"scatter reduce={reduce}")
    mode = "add" if node.target == aten.scatter_add.default or reduce == "add" else "store"
    if mode == "add":
        kw = {} if reduce is None else {"reduce": reduce}
        done = _aten_accumulate(ctx, node, x.dtype, (x, dim, index, src), kw)
        if done is not None:
            return done
    dim = dim + x.ndim if dim < 0 else dim
    if mode == "store":
        one_hot = _one_hot(ctx, x, dim, index, src)
        if one_hot is not None:
            return one_hot
    target = _fresh_copy(ctx, x)

    def index_fn(idx: Sequence[Expr]) -> tuple[list[Any], list[tuple[sympy.Symbol, Value]]]:
        sym = ctx.new_indirect()
        sub: list[Any] = list(idx)
        sub[dim] = sym
        return sub, [(sym, _wrapped(index.load(tuple(idx)), x.size[dim]))]

    def value_fn(idx: Sequence[Expr]) -> Value:
        if isinstance(src, TensorValue):
            return src.load(tuple(idx))
        return Const(const_value(src, x.dtype), x.dtype)

    return _scatter(ctx, target, index.size, index_fn, value_fn, mode, x.dtype)


_ = (contiguous_strides, meta_val)
