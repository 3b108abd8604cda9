"""Pointwise lowerings: one table row per aten op -> IR op, with its type promotion.

Invariants: the output size and dtype are the FX node's `meta["val"]`; inputs
broadcast against the output size (right-aligned, size-1 dims read index 0);
arithmetic runs in the *compute dtype* (torch's promotion of the inputs,
integers to float for INT_TO_FLOAT ops, then `precision.opmath`: float16 and
bfloat16 compute in float32) and the result is cast to the output dtype, which
rounds it once, where eager rounds (see precision.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch

from ..ir import POINTWISE_OPS, Const, Expr, IndexValue, Op, Value
from .core import (
    LoweringContext,
    LoweringError,
    TensorValue,
    cast,
    const_value,
    register,
    scalar_bound,
    symbolic_value,
)
from .precision import HALF, cuda_scalar_reciprocal, opmath, scalar_operand

aten = torch.ops.aten
prims = torch.ops.prims


def meta_val(node: Any) -> Any:
    return node.meta["val"] if hasattr(node, "meta") else node


def out_size(ctx: LoweringContext, node: Any) -> tuple[Expr, ...]:
    return tuple(ctx.expr(s) for s in meta_val(node).shape)


def broadcast_load(tv: TensorValue, idx: Sequence[Expr]) -> Value:
    """Load `tv` at the output index `idx` (numpy broadcasting)."""
    lead = len(idx) - tv.ndim
    sub = [
        sympy.Integer(0) if (s == 1 and idx[lead + j] is not None) else idx[lead + j]
        for j, s in enumerate(tv.size)
    ]
    return tv.load(tuple(sub))


def to_value(ctx: LoweringContext, a: Any, idx: Sequence[Expr], dtype: torch.dtype) -> Value:
    if isinstance(a, TensorValue):
        return cast(broadcast_load(a, idx), dtype)
    # a Python number as the kernel's dtype holds it (eager casts the scalar to
    # the op's dtype: `uint8 < -1` compares with 255, `uint8 + -1` adds 255)
    if isinstance(a, bool | int | float):
        return Const(const_value(a, dtype), dtype)
    if isinstance(a, sympy.Basic):
        if a.is_number:
            return Const(const_value(int(a) if a.is_integer else float(a), dtype), dtype)
        return symbolic_value(a, dtype)
    raise LoweringError(f"unsupported pointwise argument {a!r}")


def operand(
    ctx: LoweringContext, a: Any, idx: Sequence[Expr], common: torch.dtype, cdt: torch.dtype
) -> Value:
    """Input `a` as eager's TensorIterator hands it to a kernel computing in
    `cdt`: a tensor of another dtype is first converted to the op's `common`
    dtype when that is half (a 0-dim float32 tensor times a bfloat16 one is
    rounded to bfloat16 first), then widened (precision.py)."""
    if isinstance(a, TensorValue) and common in HALF and a.dtype != common:
        return cast(cast(broadcast_load(a, idx), common), cdt)
    return to_value(ctx, a, idx, cdt)


def common_dtype(node: Any, kind: str) -> torch.dtype:
    """torch's promoted dtype of the op (before precision.opmath widens half)."""
    out = meta_val(node).dtype
    if kind == "bool":
        from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

        vals = []
        for a in node.args:
            v = meta_val(a)
            if isinstance(v, torch.SymInt):
                v = 1
            elif isinstance(v, torch.SymFloat):
                v = 1.0
            if isinstance(v, torch.Tensor | bool | int | float):
                vals.append(v)
        # the promoted (result) dtype: half stays half here, opmath widens it
        kind_ = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
        dtype = elementwise_dtypes(*vals, type_promotion_kind=kind_)[1] if vals else out
    else:
        dtype = out
    if kind == "int_to_float" and not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    return dtype


def promote(node: Any, kind: str) -> torch.dtype:
    """The dtype arithmetic runs in (see the module docstring)."""
    return opmath(common_dtype(node, kind))


def make_pointwise(
    ctx: LoweringContext,
    node: Any,
    args: Sequence[Any],
    op: str,
    kind: str = "default",
    compute: torch.dtype | None = None,
) -> TensorValue:
    val = meta_val(node)
    size = out_size(ctx, node)
    if op not in POINTWISE_OPS:
        raise LoweringError(f"no Triton form for {op}")
    common = common_dtype(node, kind)
    cdt = compute or opmath(common)
    if cdt == torch.bool and op not in BOOL_SAFE:
        cdt = torch.int32  # bool arithmetic: compute in int, the cast to bool saturates
    out_dtype = val.dtype
    res_dtype = torch.bool if kind == "bool" else cdt

    def loader(idx: tuple[Expr, ...]) -> Value:
        vs = [operand(ctx, a, idx, common, cdt) for a in args]
        return cast(Op(op, vs, res_dtype), out_dtype)

    return TensorValue(size, out_dtype, ctx.device, loader)


# --------------------------------------------------------------------------
# The table: aten op -> (IR op, promotion kind). "bool": computes in the
# promoted dtype, yields bool. "int_to_float": integer inputs compute in float.

UNARY: dict[Any, tuple[str, str]] = {
    aten.neg: ("neg", "default"),
    aten.abs: ("abs", "default"),
    aten.exp: ("exp", "int_to_float"),
    aten.exp2: ("exp2", "int_to_float"),
    aten.expm1: ("expm1", "int_to_float"),
    aten.log: ("log", "int_to_float"),
    aten.log2: ("log2", "int_to_float"),
    aten.log10: ("log10", "int_to_float"),
    aten.log1p: ("log1p", "int_to_float"),
    aten.sqrt: ("sqrt", "int_to_float"),
    aten.rsqrt: ("rsqrt", "int_to_float"),
    aten.sin: ("sin", "int_to_float"),
    aten.cos: ("cos", "int_to_float"),
    aten.tan: ("tan", "int_to_float"),
    aten.sinh: ("sinh", "int_to_float"),
    aten.cosh: ("cosh", "int_to_float"),
    aten.tanh: ("tanh", "int_to_float"),
    aten.sigmoid: ("sigmoid", "int_to_float"),
    aten.erf: ("erf", "int_to_float"),
    aten.erfc: ("erfc", "int_to_float"),
    aten.reciprocal: ("reciprocal", "int_to_float"),
    aten.floor: ("floor", "default"),
    aten.ceil: ("ceil", "default"),
    aten.trunc: ("trunc", "default"),
    aten.round: ("round", "default"),
    aten.sign: ("sign", "default"),
    aten.sgn: ("sign", "default"),
    aten.relu: ("relu", "default"),
    aten.bitwise_not: ("bitwise_not", "default"),
    aten.logical_not: ("logical_not", "bool"),
    aten.isnan: ("isnan", "bool"),
    aten.isinf: ("isinf", "bool"),
    aten.isfinite: ("isfinite", "bool"),
    aten.signbit: ("signbit", "bool"),
}

BINARY: dict[Any, tuple[str, str]] = {
    aten.mul: ("mul", "default"),
    aten.maximum: ("maximum", "default"),
    aten.minimum: ("minimum", "default"),
    aten.fmax: ("fmax", "default"),
    aten.fmin: ("fmin", "default"),
    aten.remainder: ("remainder", "default"),
    aten.fmod: ("fmod", "default"),
    aten.floor_divide: ("floordiv", "default"),
    aten.hypot: ("hypot", "int_to_float"),
    aten.copysign: ("copysign", "int_to_float"),
    aten.bitwise_and: ("bitwise_and", "default"),
    aten.bitwise_or: ("bitwise_or", "default"),
    aten.bitwise_xor: ("bitwise_xor", "default"),
    aten.bitwise_left_shift: ("lshift", "default"),
    aten.bitwise_right_shift: ("rshift", "default"),
    aten.logical_and: ("logical_and", "bool"),
    aten.logical_or: ("logical_or", "bool"),
    aten.logical_xor: ("logical_xor", "bool"),
    aten.eq: ("eq", "bool"),
    aten.ne: ("ne", "bool"),
    aten.lt: ("lt", "bool"),
    aten.le: ("le", "bool"),
    aten.gt: ("gt", "bool"),
    aten.ge: ("ge", "bool"),
}


BOOL_SAFE = {
    "logical_not",
    "logical_and",
    "logical_or",
    "logical_xor",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "bitwise_not",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "where",
    "identity",
    "isnan",
    "isinf",
    "isfinite",
    "maximum",
    "minimum",
    "abs",
}

# pow with a constant exponent: exact cheap forms
POW_CONST = {2: "square", 1: "identity", 0.5: "sqrt", -0.5: "rsqrt", -1: "reciprocal"}


@register("pointwise", aten.pow)
def pow_(ctx: LoweringContext, node: Any, a: Any, b: Any) -> TensorValue:
    if (
        isinstance(a, TensorValue)
        and isinstance(b, int | float)
        and not isinstance(b, bool)
        and b in POW_CONST
        and (meta_val(node).dtype.is_floating_point or b in (1, 2))
    ):
        name = POW_CONST[b]
        if name == "square":
            val = meta_val(node)
            cdt = promote(node, "default")

            def loader(idx: tuple[Expr, ...]) -> Value:
                v = to_value(ctx, a, idx, cdt)
                return cast(Op("mul", (v, v), cdt), val.dtype)

            return TensorValue(out_size(ctx, node), val.dtype, ctx.device, loader)
        return make_pointwise(ctx, node, [a], name)
    return make_pointwise(ctx, node, [a, b], "pow")


def _unary_rule(op: str, kind: str) -> Any:
    def rule(ctx: LoweringContext, node: Any, x: Any) -> TensorValue:
        dtype = meta_val(node).dtype
        if op in ("floor", "ceil", "trunc", "round") and not dtype.is_floating_point:
            return make_pointwise(ctx, node, [x], "identity", kind)
        return make_pointwise(ctx, node, [x], op, kind)

    return rule


def _binary_rule(op: str, kind: str) -> Any:
    def rule(ctx: LoweringContext, node: Any, a: Any, b: Any) -> TensorValue:
        return make_pointwise(ctx, node, [a, b], op, kind)

    return rule


for _aten_op, (_op, _kind) in UNARY.items():
    register("pointwise", _aten_op)(_unary_rule(_op, _kind))
for _aten_op, (_op, _kind) in BINARY.items():
    register("pointwise", _aten_op)(_binary_rule(_op, _kind))


@register("pointwise", aten.round)
def round_(ctx: LoweringContext, node: Any, x: Any, *, decimals: int = 0) -> TensorValue:
    """`round(x, decimals=d)` as ATen's round_decimals kernel computes it, in
    the op math dtype (float32 for half): `nearbyint(x * 10**d) / 10**d` for
    d > 0, `nearbyint(x / 10**-d) * 10**-d` for d < 0, with `10**|d|` the
    double `std::pow(10, |d|)` cast to that dtype; d == 0 is plain round. The
    division is IEEE (`div_rn`), as eager's compiled kernel divides."""
    dtype = meta_val(node).dtype
    if decimals == 0:
        if not dtype.is_floating_point:
            return make_pointwise(ctx, node, [x], "identity")
        return make_pointwise(ctx, node, [x], "round")
    if not dtype.is_floating_point:  # eager: "round_cpu" not implemented for 'Long'
        raise LoweringError(f"round(decimals={decimals}) of {dtype}: eager has no kernel")
    cdt = promote(node, "default")
    try:
        p = math.pow(10.0, abs(decimals))
    except OverflowError:
        p = math.inf
    scale = Const(float(torch.tensor(p, dtype=torch.float64).to(cdt)), cdt)
    first, then = ("mul", "div_rn") if decimals > 0 else ("div_rn", "mul")

    def loader(idx: tuple[Expr, ...]) -> Value:
        v = Op(first, (to_value(ctx, x, idx, cdt), scale), cdt)
        return cast(Op(then, (Op("round", (v,), cdt), scale), cdt), dtype)

    return TensorValue(out_size(ctx, node), dtype, ctx.device, loader)


@register("pointwise", aten.add, aten.sub)
def add_sub(ctx: LoweringContext, node: Any, a: Any, b: Any, alpha: Any = 1) -> TensorValue:
    op = "add" if node.target in (aten.add.Tensor, aten.add.Scalar) else "sub"
    out_dtype = meta_val(node).dtype
    a, b = (
        scalar_operand(v, out_dtype, ctx.device.type) if isinstance(v, int | float) else v
        for v in (a, b)
    )
    if alpha == 1 or alpha is None:
        return make_pointwise(ctx, node, [a, b], op)
    val = meta_val(node)
    size = out_size(ctx, node)
    common = common_dtype(node, "default")
    cdt = opmath(common)

    def loader(idx: tuple[Expr, ...]) -> Value:
        va, vb = operand(ctx, a, idx, common, cdt), operand(ctx, b, idx, common, cdt)
        vb = Op("mul", (vb, to_value(ctx, alpha, idx, cdt)), cdt)
        return cast(Op(op, (va, vb), cdt), val.dtype)

    return TensorValue(size, val.dtype, ctx.device, loader)


@register("pointwise", aten.div)
def div(
    ctx: LoweringContext, node: Any, a: Any, b: Any, rounding_mode: str | None = None
) -> TensorValue:
    if rounding_mode is None:
        inv = None
        if ctx.device.type == "cuda":  # eager CUDA multiplies by a scalar's reciprocal
            inv = cuda_scalar_reciprocal(b, common_dtype(node, "int_to_float"))
        if inv is not None:
            return make_pointwise(ctx, node, [a, inv], "mul", "int_to_float")
        return make_pointwise(ctx, node, [a, b], "truediv", "int_to_float")
    if rounding_mode == "floor":
        return make_pointwise(ctx, node, [a, b], "floordiv")
    return make_pointwise(ctx, node, [a, b], "truncdiv")


@register("pointwise", prims.div)
def prims_div(ctx: LoweringContext, node: Any, a: Any, b: Any) -> TensorValue:
    dt = meta_val(node).dtype
    return make_pointwise(ctx, node, [a, b], "truediv" if dt.is_floating_point else "truncdiv")


@register("pointwise", aten.where)
def where(ctx: LoweringContext, node: Any, c: Any, a: Any, b: Any) -> TensorValue:
    val = meta_val(node)
    size = out_size(ctx, node)
    cdt = opmath(val.dtype)

    def loader(idx: tuple[Expr, ...]) -> Value:
        vc = to_value(ctx, c, idx, torch.bool)
        return cast(
            Op("where", (vc, to_value(ctx, a, idx, cdt), to_value(ctx, b, idx, cdt)), cdt),
            val.dtype,
        )

    return TensorValue(size, val.dtype, ctx.device, loader)


@register("pointwise", aten.clamp, aten.clamp_min, aten.clamp_max)
def clamp(ctx: LoweringContext, node: Any, x: Any, lo: Any = None, hi: Any = None) -> TensorValue:
    """`max(x, lo)` then `min(.., hi)` (so `lo > hi` gives `hi`); NaN in `x`
    stays NaN. A Python bound is converted to the result dtype as eager's
    kernel converts it (`core.scalar_bound`: checked, a negative one wraps
    into an unsigned dtype); a NaN one makes every element NaN, as eager."""
    if node.target in (aten.clamp_max.default, aten.clamp_max.Tensor):
        lo, hi = None, lo
    val = meta_val(node)
    size = out_size(ctx, node)
    cdt = promote(node, "default")
    lo, hi = (
        Const(scalar_bound(b, val.dtype), val.dtype) if isinstance(b, int | float) else b
        for b in (lo, hi)
    )
    if any(isinstance(b, Const) and b.value != b.value for b in (lo, hi)):
        nan = Const(math.nan, val.dtype)
        return TensorValue(size, val.dtype, ctx.device, lambda idx: nan)

    def bound(b: Any, idx: tuple[Expr, ...]) -> Value:
        return cast(b, cdt) if isinstance(b, Const) else to_value(ctx, b, idx, cdt)

    def loader(idx: tuple[Expr, ...]) -> Value:
        v = to_value(ctx, x, idx, cdt)
        if lo is not None:
            vl = bound(lo, idx)
            v = Op("where", (Op("lt", (v, vl), torch.bool), vl, v), cdt)
        if hi is not None:
            vh = bound(hi, idx)
            v = Op("where", (Op("gt", (v, vh), torch.bool), vh, v), cdt)
        return cast(v, val.dtype)

    return TensorValue(size, val.dtype, ctx.device, loader)


# -- casts and copies ------------------------------------------------------


@register(
    "pointwise",
    aten._to_copy,
    aten.clone,
    aten.alias,
    aten.detach,
    aten.lift_fresh_copy,
    prims.convert_element_type,
    aten.contiguous,
)
def to_copy(ctx: LoweringContext, node: Any, x: Any, *args: Any, **kwargs: Any) -> TensorValue:
    if not isinstance(x, TensorValue):
        raise LoweringError("copy of a non-tensor")
    val = meta_val(node)
    if val.device != x.device:
        raise LoweringError("device change")
    if val.dtype == x.dtype:
        if node.target in (aten.alias.default, aten.detach.default):
            return x  # an alias: the same tensor, layout included
        # a copy: same values, but its layout is its own (an extern that needs
        # the contiguous copy must not get the strided original)
        return TensorValue(x.size, x.dtype, ctx.device, x.load)

    def loader(idx: tuple[Expr, ...]) -> Value:
        return cast(x.load(idx), val.dtype)

    return TensorValue(x.size, val.dtype, ctx.device, loader)


@register("pointwise", aten.copy)
def copy(
    ctx: LoweringContext, node: Any, dst: Any, src: Any, non_blocking: bool = False
) -> TensorValue:
    """`aten.copy(self, src)`, a functionalized ``self.copy_(src)`` (a module's buffer
    written in its forward: InstanceNorm's running stats): a new tensor of self's size
    and dtype holding `src` broadcast; self's values are never read."""
    if not isinstance(src, TensorValue):
        raise LoweringError("copy from a non-tensor")
    val = meta_val(node)
    if val.device != src.device:
        raise LoweringError("device change")
    size = out_size(ctx, node)
    lead = len(size) - src.ndim
    zero = sympy.Integer(0)

    def loader(idx: tuple[Expr, ...]) -> Value:
        at = tuple(
            zero if src.size[j] == 1 and size[lead + j] != 1 else idx[lead + j]
            for j in range(src.ndim)
        )
        return cast(src.load(at), val.dtype)

    return TensorValue(size, val.dtype, ctx.device, loader)


# -- creation ----------------------------------------------------------------


def _fill(ctx: LoweringContext, node: Any, value: Any) -> TensorValue:
    val = meta_val(node)
    size = out_size(ctx, node)
    if isinstance(value, sympy.Basic) and not value.is_number:
        return TensorValue(
            size, val.dtype, ctx.device, lambda idx: symbolic_value(value, val.dtype)
        )
    if isinstance(value, sympy.Basic):
        value = int(value) if value.is_integer else float(value)
    c = Const(const_value(value, val.dtype), val.dtype)
    return TensorValue(size, val.dtype, ctx.device, lambda idx: c)


@register("creation", aten.full, aten.full_like)
def full(ctx: LoweringContext, node: Any, size_or_x: Any, value: Any, **kwargs: Any) -> TensorValue:
    return _fill(ctx, node, value)


@register("creation", aten.scalar_tensor)
def scalar_tensor(ctx: LoweringContext, node: Any, value: Any, **kwargs: Any) -> TensorValue:
    return _fill(ctx, node, value)


@register(
    "creation",
    aten.zeros,
    aten.zeros_like,
    aten.new_zeros,
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.empty_permuted,
    aten.new_empty,
    aten.new_empty_strided,
)
def zeros(ctx: LoweringContext, node: Any, *args: Any, **kwargs: Any) -> TensorValue:
    # empty* gives zeros: any value is allowed and zeros are reproducible
    return _fill(ctx, node, 0)


@register("creation", aten.ones, aten.ones_like, aten.new_ones)
def ones(ctx: LoweringContext, node: Any, *args: Any, **kwargs: Any) -> TensorValue:
    return _fill(ctx, node, 1)


@register("creation", aten.new_full)
def new_full(
    ctx: LoweringContext, node: Any, x: Any, size: Any, value: Any, **kwargs: Any
) -> TensorValue:
    return _fill(ctx, node, value)


@register("creation", aten.arange)
def arange(ctx: LoweringContext, node: Any, *args: Any, **kwargs: Any) -> TensorValue:
    nums = [a for a in args if not isinstance(a, torch.dtype | torch.device | torch.layout)]
    if node.target == aten.arange.default:
        start, _end, step = 0, nums[0], 1
    elif node.target == aten.arange.start:
        start, _end, step = nums[0], nums[1], 1
    else:
        start, _end, step = nums[0], nums[1], nums[2] if len(nums) > 2 else 1
    val = meta_val(node)
    dt = val.dtype
    cdt = torch.float64 if dt.is_floating_point else torch.int64

    def loader(idx: tuple[Expr, ...]) -> Value:
        i = cast(IndexValue(idx[0], torch.int64), cdt)
        v = Op(
            "add",
            (to_value(ctx, start, idx, cdt), Op("mul", (i, to_value(ctx, step, idx, cdt)), cdt)),
            cdt,
        )
        return cast(v, dt)

    return TensorValue(out_size(ctx, node), dt, ctx.device, loader)


@register("creation", prims.iota)
def iota(
    ctx: LoweringContext, node: Any, length: Any, *, start: Any, step: Any, dtype: Any, **kw: Any
) -> TensorValue:
    def loader(idx: tuple[Expr, ...]) -> Value:
        return cast(IndexValue(start + idx[0] * step, torch.int64), dtype)

    return TensorValue(out_size(ctx, node), dtype, ctx.device, loader)
