"""Lowering machinery: lazy tensor values, the rule table, realization.

A lowered tensor is a `TensorValue`: its size, dtype and a *loader* that
returns the `Value` of one element for a given index. Pointwise ops and views
compose loaders (so they fuse by construction and never copy); a tensor is
*realized* (given a buffer and a node that computes it) only when a
reduction, an extern call, the graph's outputs or a reuse heuristic needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from .. import tiling
from ..devices import DeviceSpec
from ..ir import (
    Buffer,
    BufferRef,
    Expr,
    Load,
    Node,
    PointwiseNode,
    ReductionNode,
    Value,
    contiguous_strides,
    index_var,
    loads_of,
    product,
)
from ..ranges import fold_ranges, loop_ranges

log = logging.getLogger("stoker.kernels")

ZERO = sympy.Integer(0)
# a flat kernel index for the tiling analysis (scheduler.XINDEX / RINDEX)
XI = sympy.Symbol("xindex", integer=True, nonnegative=True)
RI = sympy.Symbol("rindex", integer=True, nonnegative=True)

Loader = Callable[[tuple[Expr, ...]], Value]

# A realized pointwise value read by more than one consumer is stored once
# instead of recomputed when its body has more than this many tree nodes.
REUSE_BODY_LIMIT = 48


class LoweringError(Exception):
    """A rule cannot lower this call; the caller falls back to an extern aten call."""


def channels_last_stride(val: Any) -> tuple[Expr, ...] | None:
    """The strides of ``val`` (an FX node's fake value) where it is a dense channels-last
    tensor (NHWC or NDHWC in memory, rank 4 or 5, static strides); else None."""
    if not isinstance(val, torch.Tensor) or val.ndim not in (4, 5) or val.layout != torch.strided:
        return None
    stride = val.stride()
    if not all(isinstance(s, int) for s in (*stride, *val.shape)):
        return None
    ints = tuple(sympy.Integer(s) for s in stride)
    cl = (0, 2, 3, 1) if val.ndim == 4 else (0, 2, 3, 4, 1)
    order = tiling.memory_order(tuple(sympy.Integer(n) for n in val.shape), ints)
    return ints if order == cl else None


class TensorValue:
    """A lazily computed tensor: element `idx` is `loader(idx)` (memoized)."""

    __slots__ = (
        "_cache",
        "_loader",
        "device",
        "dtype",
        "layout",
        "origins",
        "read_stored",
        "realized",
        "size",
        "stored_stride",
        "users",
        "view_of",
    )

    def __init__(
        self,
        size: Sequence[Expr],
        dtype: torch.dtype,
        device: torch.device,
        loader: Loader,
        layout: BufferRef | None = None,
    ) -> None:
        self.size = tuple(sympy.sympify(s) for s in size)
        self.dtype = dtype
        self.device = device
        self._loader = loader
        self._cache: dict[tuple[Expr, ...], Value] = {}
        self.layout = layout  # set when the tensor is exactly a strided view of a buffer
        self.realized: TensorValue | None = None  # the buffer it was stored in, once
        # once realized, later loads read that buffer (`realize` decides: when recomputing
        # would read more bytes than the stored value, or compute a large body again)
        self.read_stored = False
        # a view of a lazy value: (the value, its layout -> this view's layout), so that
        # realizing the view stores the value and views it (`LoweringContext.realize`)
        self.view_of: tuple[TensorValue, Callable[[BufferRef], BufferRef | None]] | None = None
        self.users = 0
        self.origins: frozenset[str] = frozenset()  # aten ops its loader computes
        # where stored, the layout to store it in when not contiguous: a channels-last
        # value (eager's layout for it, `channels_last_stride`) is stored channels-last
        self.stored_stride: tuple[Expr, ...] | None = None

    def load(self, idx: Sequence[Expr]) -> Value:
        if self.read_stored and self.realized is not None:
            return self.realized.load(idx)
        key = tuple(idx)
        v = self._cache.get(key)
        if v is None:
            v = self._loader(key)
            self._cache[key] = v
        return v

    @property
    def ndim(self) -> int:
        return len(self.size)

    def __repr__(self) -> str:
        return f"TensorValue({list(self.size)}, {self.dtype}, layout={self.layout})"


def strided_loader(ref: BufferRef, dtype: torch.dtype) -> Loader:
    def load(idx: tuple[Expr, ...]) -> Value:
        flat = ref.offset + sum((i * s for i, s in zip(idx, ref.stride)), sympy.Integer(0))
        return Load(ref.buf, flat, dtype)

    return load


@dataclasses.dataclass
class LoweringContext:
    """Everything lowering reads and writes, passed explicitly to every rule."""

    shape_env: Any  # torch ShapeEnv or None (static shapes)
    device: torch.device
    buffers: dict[str, Buffer] = dataclasses.field(default_factory=dict)
    nodes: list[Node] = dataclasses.field(default_factory=list)
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback_reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    # extern results that are views of another buffer (aten view ops run as externs)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    # buffer -> the lazy value realize() stored in it (for in-place writes by externs)
    realized_by: dict[str, TensorValue] = dataclasses.field(default_factory=dict)
    # buffer -> the lazy views realize() gave a view of it (for in-place writes too)
    realized_views: dict[str, list[TensorValue]] = dataclasses.field(default_factory=dict)
    random_streams: int = 0
    # see scheduler.PERSISTENT_RNUMEL_MAX; None: rows are always looped (a CPU), never guarded
    persistent_rnumel_max: int | None = 8192
    spec: DeviceSpec | None = None  # the device's choices (devices.py); None: a GPU's
    _counter: int = 0
    _ind_counter: int = 0

    # -- names -----------------------------------------------------------
    def new_name(self, prefix: str = "buf") -> str:
        name = f"{prefix}{self._counter}"
        self._counter += 1
        return name

    def new_indirect(self) -> sympy.Symbol:
        s = sympy.Symbol(f"ind{self._ind_counter}", integer=True)
        self._ind_counter += 1
        return s

    # -- sizes -----------------------------------------------------------
    def expr(self, s: Any) -> Expr:
        """A python int / SymInt / SymFloat as a sympy expression."""
        if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            e = s.node.expr
            if self.shape_env is not None:
                e = self.shape_env.replace(e)
            return sympy.sympify(e)
        if isinstance(s, bool):
            return sympy.true if s else sympy.false
        return sympy.sympify(s)

    def guard_true(self, cond: sympy.Basic, why: str) -> bool:
        """Decide a size condition. Static: evaluated. Symbolic: evaluated on the
        hint and ADDED AS A GUARD to the shape env (seed 002), so the caller's
        guards recompile when a later input makes it false."""
        cond = sympy.simplify(cond)
        if cond in (sympy.true, sympy.false):
            return bool(cond)
        if self.shape_env is None:
            raise LoweringError(f"symbolic condition {cond} ({why}) without a shape env")
        log.debug("stoker-triton guards %s (%s)", cond, why)
        return bool(self.shape_env.evaluate_expr(cond))

    def statically_known(self, cond: sympy.Basic) -> bool:
        """True only when `cond` holds for every value of the symbols (no guard)."""
        return bool(sympy.simplify(cond) == sympy.true)

    # -- buffers -----------------------------------------------------------
    def add_buffer(
        self,
        name: str,
        size: Sequence[Expr],
        stride: Sequence[Expr] | None,
        dtype: torch.dtype,
        kind: str,
        offset: Expr = ZERO,
    ) -> Buffer:
        size_t = tuple(sympy.sympify(s) for s in size)
        stride_t = tuple(stride) if stride is not None else contiguous_strides(size_t)
        buf = Buffer(name, size_t, stride_t, offset, dtype, self.device, kind)
        self.buffers[name] = buf
        return buf

    def buffer_value(self, buf: Buffer) -> TensorValue:
        # indices are relative to the tensor's data pointer (storage offset applied)
        ref = BufferRef(buf.name, buf.size, buf.stride, sympy.Integer(0))
        return TensorValue(buf.size, buf.dtype, buf.device, strided_loader(ref, buf.dtype), ref)

    def realize(
        self, tv: TensorValue, stride: Sequence[Expr] | None = None, view: bool = True
    ) -> TensorValue:
        """Store `tv` in a buffer (a pointwise node); a no-op when it already is one.
        A lazy view is its value stored and viewed, unless `view` is False (a graph
        output: its own buffer, never a view of another value's)."""
        if tv.layout is not None and stride is None:
            return tv
        if tv.realized is not None and stride is None:
            r = tv.realized  # one buffer per value: a mutation through it stays visible
            if view or r.layout is None or self.is_whole_buffer(r.layout):
                return r
            stride = contiguous_strides(tv.size)  # realized as a view: this one is a copy
        if stride is None and view and tv.view_of is not None:
            viewed = self._realize_view(tv)
            if viewed is not None:
                return viewed
        own = stride is None  # the value's own buffer (a later realize returns it)
        if own and tv.stored_stride is not None:
            stride = tv.stored_stride
        name = self.new_name()
        if product(tv.size) == 0:  # an empty tensor: a buffer, nothing to compute
            return self.buffer_value(self.add_buffer(name, tv.size, stride, tv.dtype, "kernel"))
        idx = tuple(index_var("x", i) for i in range(tv.ndim))
        body = tv.load(idx)
        if body.dtype != tv.dtype:
            body = cast(body, tv.dtype)
        body = fold_ranges(body, loop_ranges(tv.size))
        buf = self.add_buffer(name, tv.size, stride, tv.dtype, "kernel")
        order = tiling.memory_order(tv.size, stride) if stride is not None else None
        self.nodes.append(PointwiseNode(name, tv.size, body, tuple(sorted(tv.origins)), order))
        out = self.buffer_value(buf)
        if own:
            tv.realized = out
            tv.read_stored = _stored_is_cheaper(body, idx, tv.size, tv.dtype)
            self.realized_by[name] = tv
        return out

    def planned_layout(self, tv: TensorValue) -> BufferRef:
        """The layout `realize(tv)` gives `tv` (its buffer's name aside): the layout it has,
        the one it was realized in, a view of its value's planned layout, else contiguous."""
        if tv.layout is not None:
            return tv.layout
        if tv.realized is not None and tv.realized.layout is not None:
            return tv.realized.layout
        if tv.view_of is not None:
            base, relayout = tv.view_of
            lay = relayout(self.planned_layout(base))
            if lay is not None:
                return lay
        stride = tv.stored_stride or contiguous_strides(tv.size)
        return BufferRef("(planned)", tv.size, tuple(stride), ZERO)

    def is_whole_buffer(self, ref: BufferRef) -> bool:
        buf = self.buffers[ref.buf]
        return (ref.size, ref.stride, ref.offset) == (buf.size, buf.stride, 0)

    def _realize_view(self, tv: TensorValue) -> TensorValue | None:
        """A lazy view (a permute, reshape, expand... of a value not stored yet) realized
        as that value stored in its own layout and viewed: an extern gets the transposed
        view of a matmul operand (cuBLAS reads it as it is), not a transposed copy whose
        kernel recomputes the value in transposed order (uncoalesced reads). None when
        the view cannot be taken of the stored layout (a reshape of a strided one)."""
        assert tv.view_of is not None
        base, relayout = tv.view_of
        if relayout(self.planned_layout(base)) is None:
            return None  # known before storing anything: the value would be stored in vain
        stored = self.realize(base)
        if stored.layout is None:
            return None
        lay = relayout(stored.layout)
        if lay is None:
            return None
        out = TensorValue(tv.size, tv.dtype, tv.device, strided_loader(lay, tv.dtype), lay)
        tv.realized = out
        tv.read_stored = True
        self.realized_views.setdefault(lay.buf, []).append(tv)
        return out

    def add_reduction(
        self,
        size: Sequence[Expr],
        reduce_size: Sequence[Expr],
        reduce_type: str,
        body: Value,
        dtype: torch.dtype,
    ) -> TensorValue:
        name = self.new_name()
        buf = self.add_buffer(name, size, None, dtype, "kernel")
        if product(buf.size) != 0:  # an empty result: a buffer, nothing to compute
            body = fold_ranges(body, loop_ranges(buf.size, reduce_size))
            node = ReductionNode(name, buf.size, tuple(reduce_size), reduce_type, body, dtype)
            self.nodes.extend(self._split(node))
        return self.buffer_value(buf)

    def _split(self, node: ReductionNode) -> list[Node]:
        """`node`, or two reductions when `tiling.split_factor` splits it: partial
        results `[S, *size]` over `rnumel / S` elements each, then the reduction
        of the S partials (the same reduction type)."""
        x, r = product(node.size), product(node.reduce_size)
        if node.reduce_type not in tiling.SPLITTABLE:
            return [node]
        xr = {**tiling.flat_vars("x", node.size, XI), **tiling.flat_vars("r", node.reduce_size, RI)}
        outer = tiling.is_outer((ld.index.xreplace(xr) for ld in loads_of(node.body)), XI, RI)
        s = (self.spec.split if self.spec is not None else tiling.split_factor)(x, r, outer)
        if s == 1:
            return [node]
        chunk = r // s
        to_partial: dict[sympy.Symbol, Expr] = {
            index_var("x", k): index_var("x", k + 1) for k in range(len(node.size))
        }
        flat_r = index_var("x", 0) * chunk + index_var("r", 0)
        to_partial.update(tiling.flat_vars("r", node.reduce_size, flat_r))
        pdtype = torch.bool if node.reduce_type in ("any", "all") else node.body.dtype
        pname = self.new_name()
        pbuf = self.add_buffer(pname, (sympy.Integer(s), *node.size), None, pdtype, "kernel")
        partial = ReductionNode(
            pname,
            pbuf.size,
            (sympy.Integer(chunk),),
            node.reduce_type,
            tiling.subs_index(node.body, to_partial),
            pdtype,
        )
        flat_x = sum(
            (index_var("x", k) * st for k, st in enumerate(contiguous_strides(node.size))), ZERO
        )
        load = Load(pname, index_var("r", 0) * x + flat_x, pdtype)
        final = ReductionNode(
            node.name, node.size, (sympy.Integer(s),), node.reduce_type, load, node.dtype
        )
        return [partial, final]

    def note_fallback(self, op: str, reason: str) -> None:
        if op not in self.fallbacks:
            log.info("stoker-triton: %s runs through aten (%s)", op, reason)
            self.fallback_reasons[op] = reason
        self.fallbacks[op] = self.fallbacks.get(op, 0) + 1


def _stored_is_cheaper(
    body: Value, idx: Sequence[Expr], size: Sequence[Expr], dtype: torch.dtype
) -> bool:
    """Whether a value once stored should be read back by its later consumers rather
    than recomputed: when its body is large (`REUSE_BODY_LIMIT`), or when recomputing
    reads more bytes per element than the stored value has (a LayerNorm backward's dx
    reads the gradient and the input; a cast or a scale of one input of the same dtype
    does not pay, and neither does a broadcast of a smaller tensor)."""
    return body.size > REUSE_BODY_LIMIT or recompute_bytes(body, idx, size) > dtype.itemsize


def recompute_bytes(body: Value, idx: Sequence[Expr], size: Sequence[Expr]) -> int:
    """Bytes per element that computing `body` again reads from full-size operands (a
    load whose index moves with every non-trivial dim of `idx`); broadcast operands
    (a bias, a per-row statistic) stay in cache and do not count."""
    full = {v for v, s in zip(idx, size) if s != 1}
    return sum(ld.dtype.itemsize for ld in loads_of(body) if full <= _index_deps(ld))


def _index_deps(ld: Load) -> set[sympy.Basic]:
    """The loop variables a load's address moves with, through a gather's index too (an
    embedding row: the token's position picks the row, the column var the element)."""
    deps = set(ld.index.free_symbols)
    for _, iv in ld.indirect:
        for inner in loads_of(iv):
            deps |= _index_deps(inner)
    return deps


def cast(v: Value, dtype: torch.dtype) -> Value:
    from ..ir import Const, Op

    if v.dtype == dtype:
        return v
    if isinstance(v, Const):
        return Const(const_value(v.value, dtype), dtype)
    return Op("to", (v,), dtype)


def const_value(py: bool | int | float, dtype: torch.dtype) -> bool | int | float:
    """The Python scalar `py` as a `dtype` element holds it, by the rules the
    kernels' casts follow (docs/triton.md, "Half precision and dtype
    semantics"): floats to integers as eager CUDA casts them, integers wrap,
    half values are rounded (through float32, as c10 builds them)."""
    if dtype == torch.bool:
        return bool(py)
    if dtype.is_floating_point:
        if dtype in (torch.float16, torch.bfloat16):
            return float(torch.tensor(float(py), dtype=torch.float32).to(dtype))
        return float(py)
    if isinstance(py, float):  # float -> int32/int64 saturating; narrower ones wrap
        bits = 64 if dtype in (torch.int64, torch.uint8) else 32
        top = 2.0 ** (bits - 1)
        if py != py:  # NaN: 0 through int32, INT64_MIN through int64 (as eager CUDA)
            py = 0 if bits == 32 else -int(top)
        else:
            py = -int(top) if py < -top else int(top) - 1 if py >= top else int(py)
    info = torch.iinfo(dtype)
    wrapped = int(py) & ((1 << info.bits) - 1)
    return wrapped - (1 << info.bits) if info.min < 0 and wrapped > info.max else wrapped


def scalar_bound(py: bool | int | float, dtype: torch.dtype) -> bool | int | float:
    """A Python number converted to `dtype` as c10's `Scalar::to<T>()` does it
    (clamp's bounds): checked, where `const_value` wraps. A negative integer
    wraps into an unsigned dtype (`clamp(uint8, -2)` bounds at 254) when its
    magnitude fits; any other value outside the dtype's range is an error in
    eager, and so `LoweringError` (the op then runs through aten, which raises
    eager's error). Infinities and NaN pass to floating dtypes."""
    if dtype.is_floating_point and isinstance(py, float) and (py != py or abs(py) == math.inf):
        return py
    if dtype.is_floating_point:
        bad = abs(float(py)) > torch.finfo(dtype).max
    elif dtype != torch.bool and not isinstance(py, float):
        info = torch.iinfo(dtype)
        bad = py > info.max or (py < -info.max if info.min == 0 else py < info.min)
    else:
        bad = False
    if bad:
        raise LoweringError(f"the scalar {py!r} cannot be converted to {dtype} without overflow")
    return const_value(py, dtype)


def symbolic_value(e: Expr, dtype: torch.dtype) -> Value:
    """A symbolic scalar as a kernel value in `dtype`: an integer expression (a
    size) in int64; a float one (a SymFloat input, `.item()` of a 0-d input) in
    float64, so a value like 0.87 is not truncated on the way."""
    from ..ir import IndexValue

    e = sympy.sympify(e)
    if e.is_integer:
        return cast(IndexValue(e, torch.int64), dtype)
    # kernels print sums and products (and positive integer powers) of symbols
    if e.atoms(sympy.Function) or any(
        not (p.exp.is_Integer and p.exp > 0) for p in e.atoms(sympy.Pow)
    ):
        raise LoweringError(f"a float expression kernels do not compute: {e}")
    return cast(IndexValue(e, torch.float64), dtype)


# --------------------------------------------------------------------------
# The rule table


Rule = Callable[..., Any]  # (ctx, node, *args, **kwargs) -> TensorValue | tuple | scalar


@dataclasses.dataclass(frozen=True)
class Lowering:
    kind: str  # pointwise | reduction | view | indexing | random | creation | extern
    fn: Rule


LOWERINGS: dict[Any, Lowering] = {}


def register(kind: str, *ops: Any) -> Callable[[Rule], Rule]:
    """Register `fn` as the lowering of every overload of each op in `ops`."""

    def deco(fn: Rule) -> Rule:
        for op in ops:
            overloads = (
                [getattr(op, o) for o in op.overloads()]  # type: ignore[no-untyped-call]
                if isinstance(op, torch._ops.OpOverloadPacket)
                else [op]
            )
            for ov in overloads:
                LOWERINGS[ov] = Lowering(kind, fn)
        return fn

    return deco
