"""Reduction lowerings: one `ReductionNode` per result over any set of dims.

Invariants: a reduction node's output has the kept dims only, contiguous;
`keepdim` is a view on top. Accumulation runs in `precision.accumulate` of the
result dtype (float32 for float16/bfloat16, the dtype itself otherwise; the
graph already asks int64 for integer sums); the result is rounded once. Variance is one pass: `welford_mean` and `welford_m2` read the same
body, the scheduler puts them in one kernel and codegen computes them
together. Everything around a reduction (softmax's exp/div, layer norm's
scale and shift) stays pointwise, so the scheduler can fuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch

from ..ir import Const, Expr, Op, Value, index_var, product
from .core import LoweringContext, LoweringError, TensorValue, cast, register, symbolic_value
from .pointwise import meta_val
from .precision import accumulate, opmath

aten = torch.ops.aten
prims = torch.ops.prims


def _dims(dims: Any, ndim: int) -> list[int]:
    if ndim == 0:
        return []  # a 0-dim tensor: dim 0 / -1 name the tensor itself
    if dims is None or (isinstance(dims, list | tuple) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d + ndim if d < 0 else d for d in dims})


def reduce(
    ctx: LoweringContext,
    x: TensorValue,
    dims: Sequence[int],
    keepdim: bool,
    reduce_type: str,
    dtype: torch.dtype,
    body_fn: Any = None,
) -> TensorValue:
    """Reduce `x` over `dims` (sorted, nonnegative); `body_fn(value) -> value`
    transforms each element before it is reduced."""
    kept = [d for d in range(x.ndim) if d not in dims]
    size = [x.size[d] for d in kept]
    rdims = [d for d in dims if x.size[d] != 1]  # size-1 reduced dims read index 0
    rsize = [x.size[d] for d in rdims]
    idx: list[Expr] = [sympy.Integer(0)] * x.ndim
    for k, d in enumerate(kept):
        idx[d] = index_var("x", k)
    for k, d in enumerate(rdims):
        idx[d] = index_var("r", k)
    acc = accumulate(dtype)
    if reduce_type in ("argmax", "argmin"):
        acc = opmath(x.dtype)
    if reduce_type in ("any", "all"):
        acc = torch.bool
    body = x.load(tuple(idx))
    if body_fn is not None:
        body = body_fn(body)
    body = cast(body, acc)
    res_dtype = torch.int64 if reduce_type in ("argmax", "argmin") else acc
    if product(rsize) == 0:  # reducing nothing: the identity (eager raises for max/min/arg*)
        if reduce_type not in EMPTY_IDENTITY:
            raise LoweringError(f"{reduce_type} of an empty tensor")
        fill = Const(EMPTY_IDENTITY[reduce_type], res_dtype)
        out = TensorValue(size, res_dtype, ctx.device, lambda i: cast(fill, res_dtype))
        return _keep(ctx, _as(ctx, out, dtype, reduce_type), x.ndim, dims, keepdim)
    if not rsize:  # reducing one element: no reduction node

        def single(i: tuple[Expr, ...]) -> Value:
            full: list[Expr] = [sympy.Integer(0)] * x.ndim
            for k, d in enumerate(kept):
                full[d] = i[k]
            v = x.load(tuple(full))
            v = cast(body_fn(v) if body_fn is not None else v, acc)
            return _single(reduce_type, v, res_dtype)

        out = TensorValue(size, res_dtype, ctx.device, single)
        return _keep(ctx, _as(ctx, out, dtype, reduce_type), x.ndim, dims, keepdim)
    out = ctx.add_reduction(size, rsize, reduce_type, body, res_dtype)
    return _keep(ctx, _as(ctx, out, dtype, reduce_type), x.ndim, dims, keepdim)


def _as(ctx: LoweringContext, out: TensorValue, dtype: torch.dtype, kind: str) -> TensorValue:
    """The accumulator's result in the dtype the caller asked for (a float16
    max accumulates in float32 and comes back as float16)."""
    if kind in ("argmax", "argmin") or out.dtype == dtype:
        return out
    return TensorValue(out.size, dtype, ctx.device, lambda idx: cast(out.load(idx), dtype))


EMPTY_IDENTITY: dict[str, bool | int | float] = {
    "sum": 0,
    "prod": 1,
    "any": False,
    "all": True,
    "welford_mean": float("nan"),
    "welford_m2": 0.0,
}


def _single(reduce_type: str, v: Value, dtype: torch.dtype) -> Value:
    """The reduction of the single element `v`."""
    if reduce_type in ("argmax", "argmin"):
        return Const(0, torch.int64)
    if reduce_type == "welford_m2":
        return Const(0.0, dtype)
    if reduce_type in ("any", "all"):
        return Op("ne", (v, Const(0, v.dtype)), torch.bool)
    return cast(v, dtype)


def _keep(
    ctx: LoweringContext, out: TensorValue, ndim: int, dims: Sequence[int], keepdim: bool
) -> TensorValue:
    if not keepdim:
        return out
    kept = [d for d in range(ndim) if d not in dims]
    size = [out.size[kept.index(d)] if d in kept else sympy.Integer(1) for d in range(ndim)]
    return TensorValue(
        size, out.dtype, ctx.device, lambda idx: out.load(tuple(idx[d] for d in kept))
    )


def _finish(ctx: LoweringContext, node: Any, out: TensorValue) -> TensorValue:
    dt = meta_val(node).dtype
    if out.dtype == dt:
        return out
    return TensorValue(out.size, dt, ctx.device, lambda idx: cast(out.load(idx), dt))


def _plain_reduction(kind: str, whole: Any) -> Any:
    """sum/prod: reduce ``dims`` (all of them for the ``whole``-tensor overload)."""

    def rule(
        ctx: LoweringContext,
        node: Any,
        x: TensorValue,
        dims: Any = None,
        keepdim: bool = False,
        *,
        dtype: Any = None,
        **kw: Any,
    ) -> TensorValue:
        if node.target == whole:
            dims, keepdim = None, False
        # `reduce` hands back the graph's dtype (accumulating half inputs in float32)
        return reduce(ctx, x, _dims(dims, x.ndim), keepdim, kind, meta_val(node).dtype)

    return rule


sum_ = register("reduction", aten.sum, prims.sum)(_plain_reduction("sum", aten.sum.default))
prod = register("reduction", aten.prod)(_plain_reduction("prod", aten.prod.default))


@register("reduction", aten.mean)
def mean(
    ctx: LoweringContext,
    node: Any,
    x: TensorValue,
    dims: Any = None,
    keepdim: bool = False,
    *,
    dtype: Any = None,
) -> TensorValue:
    if node.target == aten.mean.default:
        dims, keepdim = None, False
    d = _dims(dims, x.ndim)
    dt = meta_val(node).dtype
    acc = accumulate(dt)
    s = reduce(ctx, x, d, keepdim, "sum", acc)
    n = product([x.size[i] for i in d])
    return TensorValue(
        s.size,
        dt,
        ctx.device,
        lambda idx: cast(Op("truediv", (s.load(idx), _num(n, acc)), acc), dt),
    )


def _num(n: Expr, dtype: torch.dtype) -> Value:
    if n.is_number:
        return Const(float(n) if dtype.is_floating_point else int(n), dtype)
    return symbolic_value(n, dtype)


@register("reduction", aten.amax, aten.amin, prims.amax, prims.amin)
def amax(
    ctx: LoweringContext, node: Any, x: TensorValue, dims: Any = None, keepdim: bool = False
) -> TensorValue:
    kind = "max" if node.target in (aten.amax.default, prims.amax.default) else "min"
    return reduce(ctx, x, _dims(dims, x.ndim), keepdim, kind, x.dtype)


@register("reduction", aten.max.dim, aten.min.dim)
def max_dim(
    ctx: LoweringContext, node: Any, x: TensorValue, dim: int, keepdim: bool = False
) -> tuple[TensorValue, TensorValue]:
    kind = "max" if node.target == aten.max.dim else "min"
    d = _dims(dim, x.ndim)
    return (
        reduce(ctx, x, d, keepdim, kind, x.dtype),
        reduce(ctx, x, d, keepdim, "arg" + kind, torch.int64),
    )


@register("reduction", aten.argmax, aten.argmin)
def argmax(
    ctx: LoweringContext, node: Any, x: TensorValue, dim: Any = None, keepdim: bool = False
) -> TensorValue:
    kind = "argmax" if node.target == aten.argmax.default else "argmin"
    if dim is None:
        # over the flattened tensor: reduce all dims (flat r index = row-major position)
        out = reduce(ctx, x, list(range(x.ndim)), False, kind, torch.int64)
        if keepdim:
            return TensorValue([1] * x.ndim, torch.int64, ctx.device, lambda idx: out.load(()))
        return out
    return reduce(ctx, x, _dims(dim, x.ndim), keepdim, kind, torch.int64)


@register("reduction", aten.any, aten.all)
def any_all(
    ctx: LoweringContext, node: Any, x: TensorValue, dims: Any = None, keepdim: bool = False
) -> TensorValue:
    kind = "any" if node.target in (aten.any.default, aten.any.dim, aten.any.dims) else "all"
    if node.target in (aten.any.default, aten.all.default):
        dims = None
    out = reduce(ctx, x, _dims(dims, x.ndim), keepdim, kind, torch.bool)
    return _finish(ctx, node, out)


def _var_mean(
    ctx: LoweringContext, x: TensorValue, dims: Any, correction: Any, keepdim: bool, dt: torch.dtype
) -> tuple[TensorValue, TensorValue]:
    d = _dims(dims, x.ndim)
    acc = accumulate(dt)
    m = reduce(ctx, x, d, keepdim, "welford_mean", acc)
    m2 = reduce(ctx, x, d, keepdim, "welford_m2", acc)
    n = product([x.size[i] for i in d])
    c = 1 if correction is None else correction
    denom = n - c

    def var_loader(idx: tuple[Expr, ...]) -> Value:
        d = sympy.sympify(denom)
        den = (
            Const(max(float(d), 0.0), acc)
            if d.is_number
            else Op("maximum", (_num(d, acc), Const(0.0, acc)), acc)
        )
        return cast(Op("truediv", (m2.load(idx), den), acc), dt)

    var = TensorValue(m.size, dt, ctx.device, var_loader)
    mean_ = TensorValue(m.size, dt, ctx.device, lambda idx: cast(m.load(idx), dt))
    return var, mean_


def _correction(node: Any, kw: dict[str, Any], args: Sequence[Any]) -> Any:
    if "correction" in kw:
        return kw["correction"]
    if "unbiased" in kw:
        return 1 if kw["unbiased"] else 0
    return 1


@register("reduction", aten.var, aten.var_mean, aten.std, aten.std_mean, prims.var)
def var(ctx: LoweringContext, node: Any, x: TensorValue, *args: Any, **kw: Any) -> Any:
    target = node.target
    name = target._overloadpacket.__name__
    dims = args[0] if args else kw.get("dim")
    keepdim = kw.get("keepdim", False)
    if len(args) >= 2 and isinstance(args[1], bool) and target._overloadname == "dim":
        kw = {**kw, "unbiased": args[1]}
        if len(args) >= 3:
            keepdim = args[2]
    if target == prims.var.default:
        corr = args[1] if len(args) > 1 else kw.get("correction", 1)
    else:
        corr = _correction(node, kw, args)
    vals = meta_val(node)
    dt = (vals[0] if isinstance(vals, tuple | list) else vals).dtype
    v, m = _var_mean(ctx, x, dims, corr, keepdim, dt)
    if name.startswith("std"):
        acc = accumulate(dt)
        vv = v
        v = TensorValue(
            v.size,
            dt,
            ctx.device,
            lambda idx: cast(Op("sqrt", (cast(vv.load(idx), acc),), acc), dt),
        )
    if name.endswith("_mean"):
        return (v, m)
    return v
