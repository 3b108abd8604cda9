"""View lowerings: index arithmetic on loaders, never a copy.

Invariants: the output size is the FX node's `meta["val"]` shape; a view of
a tensor that is exactly a strided view of a buffer (`TensorValue.layout`)
keeps a layout too (so extern calls get it without a copy); `cat` and
`constant_pad_nd` are loaders with masked branches (`masked(cond, v, other)`),
so out-of-range lanes never load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from ..ir import BufferRef, Const, Expr, Op, Value, contiguous_strides
from .core import LoweringContext, LoweringError, TensorValue, cast, register, strided_loader
from .pointwise import meta_val, out_size

aten = torch.ops.aten
prims = torch.ops.prims


def _dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


Relayout = Callable[[BufferRef], "BufferRef | None"]


def _view(
    ctx: LoweringContext,
    x: TensorValue,
    size: Sequence[Expr],
    remap: Any,
    relayout: Relayout | None = None,
    whole: bool = True,
) -> TensorValue:
    """A view of `x`: its elements through `remap`; a strided view of `x`'s buffer
    (`relayout` of its layout) when `x` is one. `whole`: the view reaches every
    element of `x` (a permute, reshape, expand...: not a slice), so realizing the
    view may store `x` itself and view it (`LoweringContext.realize`)."""
    lay = relayout(x.layout) if relayout is not None and x.layout is not None else None
    out = TensorValue(size, x.dtype, ctx.device, lambda idx: x.load(tuple(remap(idx))), lay)
    if lay is None and x.layout is None and relayout is not None and whole:
        out.view_of = (x, relayout)
    return out


@register("view", aten.permute)
def permute(ctx: LoweringContext, node: Any, x: TensorValue, dims: Sequence[int]) -> TensorValue:
    dims = [_dim(d, x.ndim) for d in dims]
    inv = [dims.index(i) for i in range(x.ndim)]
    size = [x.size[d] for d in dims]

    def relayout(lay: BufferRef) -> BufferRef:
        return BufferRef(lay.buf, tuple(size), tuple(lay.stride[d] for d in dims), lay.offset)

    return _view(ctx, x, size, lambda idx: [idx[inv[i]] for i in range(x.ndim)], relayout)


@register("view", aten.t, aten.transpose, aten.numpy_T)
def transpose(
    ctx: LoweringContext, node: Any, x: TensorValue, d0: int = 0, d1: int = 1
) -> TensorValue:
    if x.ndim < 2:
        return x
    dims = list(range(x.ndim))
    d0, d1 = _dim(d0, x.ndim), _dim(d1, x.ndim)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    out: TensorValue = permute(ctx, node, x, dims)
    return out


@register("view", aten.expand, prims.broadcast_in_dim)
def expand(
    ctx: LoweringContext, node: Any, x: TensorValue, sizes: Any, bdims: Any = None
) -> TensorValue:
    size = out_size(ctx, node)
    n = len(size)
    if bdims is None:
        bdims = list(range(n - x.ndim, n))
    zero = sympy.Integer(0)

    def remap(idx: Sequence[Expr]) -> list[Expr]:
        return [zero if x.size[j] == 1 and size[d] != 1 else idx[d] for j, d in enumerate(bdims)]

    def relayout(lay: BufferRef) -> BufferRef:
        stride = [zero] * n
        for j, d in enumerate(bdims):
            stride[d] = zero if x.size[j] == 1 and size[d] != 1 else lay.stride[j]
        return BufferRef(lay.buf, tuple(size), tuple(stride), lay.offset)

    return _view(ctx, x, size, remap, relayout)


@register("view", aten.unsqueeze)
def unsqueeze(ctx: LoweringContext, node: Any, x: TensorValue, dim: int) -> TensorValue:
    dim = _dim(dim, x.ndim + 1)
    size = out_size(ctx, node)

    def relayout(lay: BufferRef) -> BufferRef:
        st = list(lay.stride)
        st.insert(dim, sympy.Integer(1))
        return BufferRef(lay.buf, tuple(size), tuple(st), lay.offset)

    return _view(ctx, x, size, lambda idx: [*idx[:dim], *idx[dim + 1 :]], relayout)


@register("view", aten.squeeze)
def squeeze(ctx: LoweringContext, node: Any, x: TensorValue, dims: Any = None) -> TensorValue:
    if dims is None:
        dims = [i for i, s in enumerate(x.size) if s == 1]
    elif isinstance(dims, int):
        dims = [dims]
    drop = {_dim(d, x.ndim) for d in dims if x.size[_dim(d, x.ndim)] == 1} if x.ndim else set()
    keep = [i for i in range(x.ndim) if i not in drop]
    zero = sympy.Integer(0)

    def remap(idx: Sequence[Expr]) -> list[Expr]:
        it = iter(idx)
        return [zero if i in drop else next(it) for i in range(x.ndim)]

    def relayout(lay: BufferRef) -> BufferRef:
        return BufferRef(
            lay.buf,
            tuple(x.size[i] for i in keep),
            tuple(lay.stride[i] for i in keep),
            lay.offset,
        )

    return _view(ctx, x, [x.size[i] for i in keep], remap, relayout)


@register("view", aten.slice)
def slice_(
    ctx: LoweringContext,
    node: Any,
    x: TensorValue,
    dim: int = 0,
    start: Any = None,
    end: Any = None,
    step: int = 1,
) -> TensorValue:
    dim = _dim(dim, x.ndim)
    size = out_size(ctx, node)
    start_e = sympy.Integer(0) if start is None else sympy.sympify(start)
    if start_e.is_number and start_e < 0:
        start_e = sympy.Max(start_e + x.size[dim], 0)
    if start_e.is_number and x.size[dim].is_number:
        start_e = sympy.Min(start_e, x.size[dim])

    def relayout(lay: BufferRef) -> BufferRef:
        st = list(lay.stride)
        off = lay.offset + start_e * st[dim]
        st[dim] = st[dim] * step
        return BufferRef(lay.buf, tuple(size), tuple(st), off)

    def remap(idx: Sequence[Expr]) -> list[Expr]:
        out = list(idx)
        out[dim] = start_e + idx[dim] * step
        return out

    return _view(ctx, x, size, remap, relayout, whole=False)


@register("view", aten.select)
def select(ctx: LoweringContext, node: Any, x: TensorValue, dim: int, index: Any) -> TensorValue:
    dim = _dim(dim, x.ndim)
    i = sympy.sympify(index)
    if i.is_number and i < 0:
        i = i + x.size[dim]
    size = out_size(ctx, node)

    def relayout(lay: BufferRef) -> BufferRef:
        st = list(lay.stride)
        off = lay.offset + i * st[dim]
        del st[dim]
        return BufferRef(lay.buf, tuple(size), tuple(st), off)

    return _view(ctx, x, size, lambda idx: [*idx[:dim], i, *idx[dim:]], relayout, whole=False)


def _same(a: Expr, b: Expr) -> bool:
    return bool(a == b or sympy.expand(a - b) == 0)


def _groups(old: Sequence[Expr], new: Sequence[Expr]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of old and new dims with equal products (None: no such split)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(old) or j < len(new):
        go: list[int] = []
        gn: list[int] = []
        po: Expr = sympy.Integer(1)
        pn: Expr = sympy.Integer(1)
        if i < len(old):
            go.append(i)
            po, i = po * old[i], i + 1
        if j < len(new):
            gn.append(j)
            pn, j = pn * new[j], j + 1
        while not _same(po, pn):
            ratio = sympy.simplify(pn / po)
            if not ratio.is_number:
                return None
            if ratio > 1 and i < len(old):
                go.append(i)
                po, i = po * old[i], i + 1
            elif ratio < 1 and j < len(new):
                gn.append(j)
                pn, j = pn * new[j], j + 1
            else:
                return None
        groups.append((go, gn))
    return groups


@register(
    "view",
    aten.view,
    aten.reshape,
    aten._unsafe_view,
    aten.view_copy,
    prims.reshape,
    aten.flatten,
    aten.unflatten,
)
def view(ctx: LoweringContext, node: Any, x: TensorValue, *args: Any) -> TensorValue:
    size = out_size(ctx, node)
    if meta_val(node).dtype != x.dtype:
        raise LoweringError("view as another dtype")
    old = x.size
    groups = _groups(old, size) or [(list(range(len(old))), list(range(len(size))))]

    def remap(idx: Sequence[Expr]) -> list[Expr]:
        out: list[Expr] = [sympy.Integer(0)] * len(old)
        for go, gn in groups:
            if len(go) == 1 and len(gn) == 1:
                out[go[0]] = idx[gn[0]]
                continue
            nst = contiguous_strides([size[j] for j in gn])
            flat = sum((idx[j] * s for j, s in zip(gn, nst)), sympy.Integer(0))
            ost = contiguous_strides([old[i] for i in go])
            for k, (i, s) in enumerate(zip(go, ost)):
                if old[i] == 1:
                    out[i] = sympy.Integer(0)
                elif k == 0:
                    from torch.utils._sympy.functions import FloorDiv

                    out[i] = FloorDiv(flat, s)
                else:
                    from torch.utils._sympy.functions import ModularIndexing

                    out[i] = ModularIndexing(flat, s, old[i])
        return out

    def relayout(lay: BufferRef) -> BufferRef | None:
        if not all(
            _same(a, b) for a, s, b in zip(lay.stride, old, contiguous_strides(old)) if s != 1
        ):
            return None  # a reshape of a strided layout: not a view of it
        return BufferRef(lay.buf, tuple(size), contiguous_strides(size), lay.offset)

    return _view(ctx, x, size, remap, relayout)


@register("view", aten.as_strided, aten.as_strided_copy)
def as_strided(
    ctx: LoweringContext, node: Any, x: TensorValue, size: Any, stride: Any, offset: Any = None
) -> TensorValue:
    if x.layout is None:
        x = ctx.realize(x)
    assert x.layout is not None
    buf = ctx.buffers[x.layout.buf]
    size_e = tuple(ctx.expr(s) for s in size)
    stride_e = tuple(ctx.expr(s) for s in stride)
    # as_strided's offset is absolute in the storage; loaders index from the data pointer
    off = x.layout.offset if offset is None else ctx.expr(offset) - buf.offset
    ref = BufferRef(buf.name, size_e, stride_e, off)
    return TensorValue(size_e, x.dtype, ctx.device, strided_loader(ref, x.dtype), ref)


@register("view", aten.cat)
def cat(ctx: LoweringContext, node: Any, xs: Sequence[TensorValue], dim: int = 0) -> TensorValue:
    val = meta_val(node)
    size = out_size(ctx, node)
    xs = [x for x in xs if not (x.ndim == 1 and x.size[0] == 0)]
    dim = _dim(dim, len(size))
    xs = [x for x in xs if not (x.size[dim].is_number and int(x.size[dim]) == 0)]
    starts: list[Expr] = []
    acc: Expr = sympy.Integer(0)
    for x in xs:
        starts.append(acc)
        acc = acc + x.size[dim]

    def index(e: Expr) -> Value:
        from ..ir import IndexValue

        return Const(int(e), torch.int64) if e.is_number else IndexValue(e, torch.int64)

    def loader(idx: tuple[Expr, ...]) -> Value:
        from ..ir import IndexValue

        # Each piece loads only where the output index lies in [start, end): a lane
        # outside it would read before or past that input's buffer.
        out: Value | None = None
        pos = IndexValue(idx[dim], torch.int64)
        last = len(xs) - 1
        for k, (x, st) in reversed(list(enumerate(zip(xs, starts)))):
            sub = list(idx)
            sub[dim] = idx[dim] - st
            v = cast(x.load(tuple(sub)), val.dtype)
            conds: list[Value] = []
            if k > 0:
                conds.append(Op("ge", (pos, index(st)), torch.bool))
            if k < last:
                conds.append(Op("lt", (pos, index(st + x.size[dim])), torch.bool))
            if not conds:
                return v  # a single piece
            inside = conds[0] if len(conds) == 1 else Op("bitwise_and", tuple(conds), torch.bool)
            piece = Op("masked", (inside, v, Const(0, val.dtype)), val.dtype)
            out = piece if out is None else Op("where", (inside, piece, out), val.dtype)
        assert out is not None
        return out

    return TensorValue(size, val.dtype, ctx.device, loader)


@register("view", aten.constant_pad_nd)
def constant_pad_nd(
    ctx: LoweringContext, node: Any, x: TensorValue, pad: Sequence[Any], value: Any = 0
) -> TensorValue:
    from ..ir import IndexValue

    val = meta_val(node)
    size = out_size(ctx, node)
    n = len(size)
    lows = {n - 1 - k: ctx.expr(pad[2 * k]) for k in range(len(pad) // 2)}
    fill = Const(float(value) if val.dtype.is_floating_point else int(value), val.dtype)

    def loader(idx: tuple[Expr, ...]) -> Value:
        sub = list(idx)
        conds: list[Value] = []
        for d, lo in lows.items():
            sub[d] = idx[d] - lo
            pos = IndexValue(idx[d] - lo, torch.int64)
            hi = IndexValue(x.size[d], torch.int64)
            conds.append(Op("ge", (pos, Const(0, torch.int64)), torch.bool))
            conds.append(Op("lt", (pos, hi), torch.bool))
        v = cast(x.load(tuple(sub)), val.dtype)
        if not conds:
            return v
        cond = conds[0]
        for c in conds[1:]:
            cond = Op("logical_and", (cond, c), torch.bool)
        return Op("where", (cond, Op("masked", (cond, v, fill), val.dtype), fill), val.dtype)

    return TensorValue(size, val.dtype, ctx.device, loader)


@register("view", aten.slice_scatter)
def slice_scatter(
    ctx: LoweringContext,
    node: Any,
    x: TensorValue,
    src: TensorValue,
    dim: int = 0,
    start: Any = None,
    end: Any = None,
    step: Any = 1,
) -> TensorValue:
    """`x` with `src` written over ``x[start:end:step]`` along `dim` (a functionalized
    write into a slice: circular padding, a slice's backward).  The slice has as many
    elements as `src`, so `end` is not needed."""
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    from ..ir import IndexValue

    if not isinstance(step, int) or step < 1:
        raise LoweringError(f"slice_scatter with step {step!r}")
    val = meta_val(node)
    size = out_size(ctx, node)
    d = _dim(dim, len(size))
    lo = ctx.expr(0 if start is None else start)
    if lo.is_number and lo < 0:
        lo = sympy.Max(lo + size[d], 0)

    def loader(idx: tuple[Expr, ...]) -> Value:
        rel = idx[d] - lo
        pos = IndexValue(rel, torch.int64)
        zero = Const(0, torch.int64)
        inside: Value = Op(
            "logical_and",
            (
                Op("ge", (pos, zero), torch.bool),
                Op("lt", (pos, IndexValue(src.size[d] * step, torch.int64)), torch.bool),
            ),
            torch.bool,
        )
        sub = list(idx)
        sub[d] = rel
        if step != 1:
            on_step = IndexValue(ModularIndexing(rel, 1, step), torch.int64)
            inside = Op("logical_and", (inside, Op("eq", (on_step, zero), torch.bool)), torch.bool)
            sub[d] = FloorDiv(rel, step)
        fill = Const(0.0 if val.dtype.is_floating_point else 0, val.dtype)
        written = Op("masked", (inside, cast(src.load(tuple(sub)), val.dtype), fill), val.dtype)
        return Op("where", (inside, written, cast(x.load(idx), val.dtype)), val.dtype)

    return TensorValue(size, val.dtype, ctx.device, loader)


@register("view", aten.split_with_sizes, aten.split)
def split(
    ctx: LoweringContext, node: Any, x: TensorValue, sizes: Any, dim: int = 0
) -> list[TensorValue]:
    dim = _dim(dim, x.ndim)
    outs = []
    start: Expr = sympy.Integer(0)
    for v in meta_val(node):
        n = ctx.expr(v.shape[dim])
        st = start

        def remap(idx: Sequence[Expr], st: Expr = st) -> list[Expr]:
            out = list(idx)
            out[dim] = idx[dim] + st
            return out

        vsize = tuple(ctx.expr(s) for s in v.shape)

        def relayout(lay: BufferRef, st: Expr = st, vsize: tuple[Expr, ...] = vsize) -> BufferRef:
            return BufferRef(lay.buf, vsize, lay.stride, lay.offset + st * lay.stride[dim])

        outs.append(_view(ctx, x, vsize, remap, relayout, whole=False))
        start = start + n
    return outs
