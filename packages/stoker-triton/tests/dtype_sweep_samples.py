"""The dtype sweep's samples: at least one per op in stoker-triton's lowering
table (test_triton_dtype_sweep.py fails when a rule has none), each with the
dtypes the op takes. Inputs are named (`In`), built per dtype in
dtype_sweep.make_inputs: x, y (4x8 general values), p (positive), nz
(nonzero), row (8), col (4x1), mask (bool), idx/uidx/gidx/sidx (int64
indices), f32/i64 (promotion partners) and small matmul/convolution operands.
"""

from __future__ import annotations

import torch
from dtype_sweep import ALL, BOOL, DEV, FLOAT, INT, ByDtype, D, In, Sample, sample

aten = torch.ops.aten
prims = torch.ops.prims

X, Y, P, NZ, ROW, COL = In("x"), In("y"), In("p"), In("nz"), In("row"), In("col")
MASK, SH, F32, I64, PROB = In("mask"), In("sh"), In("f32"), In("i64"), In("prob")
IDX, UIDX, GIDX, SIDX, V3, SRC = In("idx"), In("uidx"), In("gidx"), In("sidx"), In("v3"), In("src")
FI = FLOAT + INT
IB = INT + BOOL

# a fill value of the sweep dtype
FILL = ByDtype(lambda dt, dev: True if dt == torch.bool else 1.5 if dt.is_floating_point else 3)
CASTS = (*FLOAT, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


TRANSCENDENTAL = ("exp", "exp2", "expm1", "sin", "cos", "tan", "sinh", "cosh", "tanh", "sigmoid")
POSITIVE_DOMAIN = ("log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal")
SIGN_AND_ROUNDING = ("abs", "neg", "sign", "sgn", "relu", "signbit", "floor", "ceil", "trunc")


def _unary() -> list[Sample]:
    out = [sample(getattr(aten, n).default, X, dtypes=FI) for n in TRANSCENDENTAL]
    out += [sample(getattr(aten, n).default, X, dtypes=FI) for n in ("erf", "erfc", "round")]
    out += [sample(getattr(aten, n).default, P, dtypes=FI) for n in POSITIVE_DOMAIN]
    out += [sample(getattr(aten, n).default, X, dtypes=FI) for n in SIGN_AND_ROUNDING]
    return [
        *out,
        sample(aten.round.decimals, X, decimals=1),
        sample(aten.bitwise_not.default, X, dtypes=IB),
        *(sample(getattr(aten, n).default, X, dtypes=ALL) for n in ("isnan", "isinf")),
        sample(aten.isfinite.default, X, dtypes=ALL),
        sample(aten.logical_not.default, X, dtypes=ALL),
    ]


def _binary() -> list[Sample]:
    t = [
        sample(aten.add.Tensor, X, Y, dtypes=ALL),
        sample(aten.add.Tensor, X, ROW, dtypes=FI, tag="broadcast"),
        sample(aten.add.Tensor, X, Y, alpha=2, dtypes=FI, tag="alpha"),
        sample(aten.add.Tensor, X, F32, dtypes=ALL, tag="float32"),
        sample(aten.add.Scalar, X, 2, dtypes=FI),
        sample(aten.sub.Tensor, X, Y, dtypes=FI),
        sample(aten.sub.Tensor, X, Y, alpha=3, dtypes=FI, tag="alpha"),
        sample(aten.sub.Scalar, X, 1, dtypes=FI),
        sample(aten.mul.Tensor, X, Y, dtypes=ALL),
        sample(aten.mul.Tensor, X, I64, dtypes=ALL, tag="int64"),
        sample(aten.mul.Scalar, X, 0.5, dtypes=FI),
        sample(aten.div.Tensor, X, NZ, dtypes=FI),
        sample(aten.div.Tensor_mode, X, NZ, rounding_mode="floor", dtypes=FI, tag="floor"),
        sample(aten.div.Tensor_mode, X, NZ, rounding_mode="trunc", dtypes=FI, tag="trunc"),
        sample(aten.div.Scalar, X, 3, dtypes=FI),
        sample(prims.div.default, X, NZ, dtypes=FI),
        sample(aten.remainder.Tensor, X, NZ, dtypes=FI),
        sample(aten.remainder.Scalar, X, 3, dtypes=FI),
        sample(aten.remainder.Scalar_Tensor, 5, NZ, dtypes=FI),
        sample(aten.fmod.Tensor, X, NZ, dtypes=FI),
        sample(aten.fmod.Scalar, X, 3, dtypes=FI),
        sample(aten.floor_divide.default, X, NZ, dtypes=FI),
        sample(aten.maximum.default, X, Y, dtypes=ALL),
        sample(aten.minimum.default, X, Y, dtypes=ALL),
        sample(aten.fmax.default, X, Y, dtypes=FI),
        sample(aten.fmin.default, X, Y, dtypes=FI),
        sample(aten.hypot.default, X, Y),
        sample(aten.copysign.Tensor, X, Y, dtypes=FI),
        sample(aten.pow.Tensor_Tensor, P, Y),
        sample(aten.pow.Tensor_Scalar, X, 2, dtypes=FI, tag="2"),
        sample(aten.pow.Tensor_Scalar, X, 3, dtypes=FI, tag="3"),
        sample(aten.pow.Tensor_Scalar, P, 0.5, tag="0.5"),
        sample(aten.pow.Tensor_Scalar, P, -1, tag="-1"),
        sample(aten.pow.Tensor_Scalar, P, 2.5, tag="2.5"),
        sample(aten.pow.Scalar, 2, X),
        sample(aten.where.self, MASK, X, Y, dtypes=ALL),
        sample(aten.where.ScalarOther, MASK, X, 0, dtypes=FI),
        sample(aten.where.ScalarSelf, MASK, 1, Y, dtypes=FI),
        sample(aten.where.Scalar, MASK, 1.0, 0.0, dtypes=(torch.float32,)),
        sample(aten.clamp.default, X, -0.5, 0.5, tag="float"),
        sample(aten.clamp.default, X, -2, 3, dtypes=FI, tag="int"),
        sample(aten.clamp.Tensor, X, ROW, Y, dtypes=FI),
        sample(aten.clamp_min.default, X, 0, dtypes=FI),
        sample(aten.clamp_max.default, X, 1, dtypes=FI),
        sample(aten.clamp_min.Tensor, X, Y, dtypes=FI),
        sample(aten.clamp_max.Tensor, X, Y, dtypes=FI),
        # a negative scalar meets an unsigned tensor: eager casts it to the
        # op's dtype (-1 -> 255 for uint8), a Triton constant must be that value
        sample(aten.clamp_min.default, X, -2, dtypes=INT, tag="negative"),
        sample(aten.clamp_max.default, X, -2, dtypes=INT, tag="negative"),
        sample(aten.add.Scalar, X, -3, dtypes=INT, tag="negative"),
        sample(aten.where.ScalarOther, MASK, X, -1, dtypes=INT, tag="negative"),
        sample(aten.lt.Scalar, X, -1, dtypes=INT, tag="negative"),
        sample(aten.eq.Scalar, X, -1, dtypes=INT, tag="negative"),
    ]
    for op in (aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor):
        t += [sample(op.Tensor, X, Y, dtypes=IB), sample(op.Scalar, X, 5, dtypes=INT)]
    for op in (aten.bitwise_left_shift, aten.bitwise_right_shift):
        t += [sample(op.Tensor, X, SH, dtypes=INT), sample(op.Tensor_Scalar, X, 2, dtypes=INT)]
    for op in (aten.logical_and, aten.logical_or, aten.logical_xor):
        t.append(sample(op.default, X, Y, dtypes=ALL))
    for op in (aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge):
        t += [sample(op.Tensor, X, Y, dtypes=ALL), sample(op.Scalar, X, 0, dtypes=FI)]
    return t


def _casts() -> list[Sample]:
    out = []
    for dt in CASTS:
        # positive values in range: what a float outside an integer type's range
        # becomes is the half-precision helper's rule
        out.append(sample(aten._to_copy.default, P, dtype=dt, dtypes=ALL, tag=_name(dt)))
    out += [
        sample(aten._to_copy.default, X, dtype=torch.int32, dtypes=FI, tag="negative-int32"),
        sample(prims.convert_element_type.default, P, torch.float32, dtypes=ALL, tag="float32"),
        sample(prims.convert_element_type.default, P, torch.bfloat16, dtypes=ALL, tag="bf16"),
        sample(prims.convert_element_type.default, P, torch.int64, dtypes=ALL, tag="int64"),
        sample(aten.clone.default, X, dtypes=ALL),
        sample(aten.copy.default, X, Y, dtypes=ALL),
        sample(aten.copy.default, X, ROW, dtypes=ALL, tag="broadcast"),
        sample(aten.copy.default, X, F32, dtypes=ALL, tag="from-float32"),
        sample(aten.alias.default, X, dtypes=ALL, materialize=True),
        sample(aten.detach.default, X, dtypes=ALL, materialize=True),
        sample(aten.lift_fresh_copy.default, X, dtypes=ALL),
        sample(aten.contiguous.default, X, dtypes=ALL, materialize=True),
    ]
    return out


def _creation() -> list[Sample]:
    size = [4, 8]
    kw = {"dtype": D, "device": DEV}
    uninit = {"values": False}  # empty*: any value is allowed
    num = ByDtype(lambda dt, dev: 0.5 if dt.is_floating_point else 2)
    return [
        sample(aten.full.default, size, FILL, dtypes=ALL, **kw),
        sample(aten.full_like.default, X, FILL, dtypes=ALL),
        sample(aten.scalar_tensor.default, FILL, dtypes=ALL, **kw),
        sample(aten.zeros.default, size, dtypes=ALL, **kw),
        sample(aten.zeros_like.default, X, dtypes=ALL),
        sample(aten.new_zeros.default, X, [3, 5], dtypes=ALL),
        sample(aten.ones.default, size, dtypes=ALL, **kw),
        sample(aten.ones_like.default, X, dtypes=ALL),
        sample(aten.new_ones.default, X, [2, 3], dtypes=ALL),
        sample(aten.new_full.default, X, [2, 3], FILL, dtypes=ALL),
        sample(aten.empty.memory_format, size, dtypes=ALL, **uninit, **kw),
        sample(aten.empty_like.default, X, dtypes=ALL, **uninit),
        sample(aten.empty_strided.default, size, [1, 4], dtypes=ALL, **uninit, **kw),
        sample(aten.empty_permuted.default, size, [1, 0], dtypes=ALL, **uninit, **kw),
        sample(aten.new_empty.default, X, [3], dtypes=ALL, **uninit),
        sample(aten.new_empty_strided.default, X, [3, 2], [2, 1], dtypes=ALL, **uninit),
        sample(aten.arange.default, 10, dtypes=FI, **kw),
        sample(aten.arange.start, 2, 12, dtypes=FI, **kw),
        sample(aten.arange.start_step, 1, 9, num, dtypes=FI, **kw),
        sample(prims.iota.default, 10, start=2, step=3, requires_grad=False, dtypes=INT, **kw),
    ]


def _reductions() -> list[Sample]:
    return [
        sample(aten.sum.default, X, dtypes=ALL),
        sample(aten.sum.dim_IntList, X, [1], dtypes=ALL),
        sample(aten.sum.dim_IntList, X, [0], True, dtypes=FI, tag="keepdim0"),
        sample(aten.sum.dim_IntList, X, [1], dtype=torch.float32, dtypes=FI, tag="float32"),
        # float only: for integers torch's own prims.sum disagrees with itself
        # (its meta says int32 -> int32, its eager kernel returns int64)
        sample(prims.sum.default, X, [1]),
        sample(aten.prod.default, ROW, dtypes=FI),
        sample(aten.prod.dim_int, X, 1, dtypes=FI),
        sample(aten.mean.default, X),
        sample(aten.mean.dim, X, [1]),
        sample(aten.mean.dim, X, [0], True, tag="keepdim0"),
        sample(aten.amax.default, X, [1], dtypes=ALL),
        sample(aten.amin.default, X, [0], dtypes=ALL),
        sample(prims.amax.default, X, [1], dtypes=FI),
        sample(prims.amin.default, X, [0], dtypes=FI),
        sample(aten.max.dim, X, 1, dtypes=ALL),
        sample(aten.min.dim, X, 0, dtypes=ALL),
        sample(aten.argmax.default, X, 1, dtypes=FI),
        sample(aten.argmin.default, X, dtypes=FI),
        sample(aten.any.default, X, dtypes=ALL),
        sample(aten.any.dim, X, 1, dtypes=ALL),
        sample(aten.any.dims, X, [0], dtypes=ALL),
        sample(aten.all.default, X, dtypes=ALL),
        sample(aten.all.dim, X, 0, dtypes=ALL),
        sample(aten.var.correction, X, [1], correction=1),
        sample(aten.var.dim, X, [0]),
        sample(prims.var.default, X, [1], 1.0),
        sample(aten.var_mean.correction, X, [1], correction=0),
        sample(aten.std.correction, X, [0], correction=1),
        sample(aten.std_mean.correction, X, [1], correction=1),
    ]


def _views() -> list[Sample]:
    m = {"dtypes": ALL, "materialize": True}
    return [
        sample(aten.permute.default, X, [1, 0], **m),
        sample(aten.t.default, X, **m),
        sample(aten.transpose.int, X, 0, 1, **m),
        sample(aten.numpy_T.default, X, **m),
        sample(aten.expand.default, ROW, [4, 8], **m),
        sample(prims.broadcast_in_dim.default, ROW, [4, 8], [1], **m),
        sample(aten.unsqueeze.default, X, 1, **m),
        sample(aten.squeeze.dim, COL, 1, **m),
        sample(aten.squeeze.default, COL, **m),
        sample(aten.squeeze.dims, COL, [1], **m),
        sample(aten.slice.Tensor, X, 1, 1, 7, 2, **m),
        sample(aten.select.int, X, 0, 2, **m),
        sample(aten.view.default, X, [8, 4], **m),
        sample(aten._unsafe_view.default, X, [2, 16], **m),
        sample(aten.reshape.default, X, [32], **m),
        sample(prims.reshape.default, X, [8, 4], **m),
        sample(aten.flatten.using_ints, X, **m),
        sample(aten.unflatten.int, X, 1, [2, 4], **m),
        sample(aten.as_strided.default, X, [3, 3], [8, 1], 1, **m),
        sample(aten.as_strided_copy.default, X, [2, 4], [1, 8], **m),
        sample(aten.view_copy.default, X, [16, 2], **m),
        sample(aten.cat.default, [X, Y], 1, **m),
        sample(aten.cat.default, [X, F32], 0, tag="float32", **m),
        sample(aten.constant_pad_nd.default, X, [1, 2, 0, 1], 0.5, tag="float"),
        sample(aten.constant_pad_nd.default, X, [1, 2], 3, dtypes=INT, tag="int"),
        sample(aten.slice_scatter.default, X, COL, 1, 3, 4, dtypes=ALL, tag="column"),
        sample(aten.slice_scatter.default, X, COL, 1, -2, -1, dtypes=ALL, tag="negative"),
        sample(aten.slice_scatter.default, X, Y, dtypes=ALL, tag="whole"),
        sample(aten.split.Tensor, X, 3, 1, **m),
        sample(aten.split.sizes, X, [5, 3], 1, **m),
        sample(aten.split_with_sizes.default, X, [1, 3], 0, **m),
    ]


def _indexing() -> list[Sample]:
    return [
        sample(aten.gather.default, X, 0, GIDX, dtypes=ALL),
        sample(aten.index_select.default, X, 0, IDX, dtypes=ALL),
        sample(aten.index.Tensor, X, [IDX], dtypes=ALL),
        sample(aten.index.Tensor, X, [None, IDX], dtypes=ALL, tag="dim1"),
        sample(aten.index_put.default, X, [UIDX], V3, dtypes=ALL),
        sample(aten.index_put.default, X, [IDX], V3, True, dtypes=FI, tag="accumulate"),
        sample(aten._unsafe_index_put.default, X, [UIDX], V3, dtypes=ALL),
        sample(aten.scatter.src, X, 0, SIDX, SRC, dtypes=ALL),
        sample(aten.scatter.value, X, 0, SIDX, 2, dtypes=FI),
        sample(aten.scatter.reduce, X, 0, GIDX, SRC, reduce="add", dtypes=FI),
        sample(aten.scatter.value_reduce, X, 0, GIDX, 2, reduce="add", dtypes=FI),
        sample(aten.scatter_add.default, X, 0, GIDX, SRC, dtypes=FI),
    ]


def _random() -> list[Sample]:
    r = {"values": False}  # the kernel draws its own numbers: sizes and dtypes only
    return [
        sample(aten.rand.default, [4, 8], dtype=D, device=DEV, **r),
        sample(aten.randn.default, [4, 8], dtype=D, device=DEV, **r),
        sample(aten.rand_like.default, X, **r),
        sample(aten.randn_like.default, X, **r),
        sample(aten.bernoulli.default, PROB, **r),
        sample(aten.bernoulli.p, X, 0.3, **r),
    ]


def _extern() -> list[Sample]:
    conv = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    img, w, cb, go = In("img"), In("w"), In("cb"), In("go")
    return [
        sample(aten.mm.default, X, In("m")),
        sample(aten.addmm.default, In("bias"), X, In("m")),
        sample(aten.bmm.default, In("b3"), In("b3m")),
        sample(aten.baddbmm.default, In("b3a"), In("b3"), In("b3m")),
        sample(aten.convolution.default, img, w, cb, *conv),
        sample(aten.convolution_backward.default, go, img, w, [3], *conv, [True, True, True]),
    ]


SAMPLES: list[Sample] = [
    *_unary(),
    *_binary(),
    *_casts(),
    *_creation(),
    *_reductions(),
    *_views(),
    *_indexing(),
    *_random(),
    *_extern(),
]

# Rules with no CPU sample, and why.
NO_CPU_SAMPLE = {
    "aten::_scaled_dot_product_flash_attention": "eager has no CPU kernel (CUDA only); the "
    "rule is an extern call, so there is no Triton kernel to cross-compile either",
    "aten::_scaled_dot_product_efficient_attention": "eager has no CPU kernel (CUDA only); the "
    "rule is an extern call, so there is no Triton kernel to cross-compile either",
}
