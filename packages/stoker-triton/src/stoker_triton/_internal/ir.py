"""The loop-level IR: scalar expression trees over index expressions, and the
buffer-producing nodes that the scheduler groups into kernels.

A `Value` is what one element of a tensor is, written in terms of the index
variables of the node that computes it (`x0, x1, ...` for output dims, `r0,
r1, ...` for reduced dims). Index arithmetic is sympy; everything else is a
small tree of `Load`, `Const`, `IndexValue`, `Op`, `Rand`. Values hash once
at construction so DAG-shaped bodies stay cheap to compare and CSE.

Every node prints as one readable line (`str(node)`), and `Program.as_text()`
prints the whole lowered program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, TypeAlias

import sympy
import torch

Expr: TypeAlias = sympy.Expr


@functools.cache
def index_var(prefix: str, i: int) -> sympy.Symbol:
    """The i-th loop variable of a node (`x0`, `r1`): a nonnegative integer (memoized)."""
    return sympy.Symbol(f"{prefix}{i}", integer=True, nonnegative=True)


def contiguous_strides(size: Sequence[Expr]) -> tuple[Expr, ...]:
    """The strides of a contiguous (row-major) tensor of `size` (memoized)."""
    return _contiguous_strides(tuple(size))


@functools.lru_cache(maxsize=1 << 14)
def _contiguous_strides(size: tuple[Expr, ...]) -> tuple[Expr, ...]:
    out: list[Expr] = []
    acc: Expr = sympy.Integer(1)
    for s in reversed(size):
        out.append(acc)
        acc = acc * s
    return tuple(reversed(out))


def product(xs: Sequence[Expr]) -> Expr:
    """The product of sizes (1 for none)."""
    out: Expr = sympy.Integer(1)
    for x in xs:
        out = out * x
    return out


class Value:
    """One element of a tensor, as an expression tree (immutable, hashed once)."""

    __slots__ = ("_hash", "dtype", "size")
    dtype: torch.dtype
    size: int  # number of tree nodes, counting shared subtrees again (a heuristic)

    def children(self) -> tuple[Value, ...]:
        return ()

    def key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _init(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.size = 1 + sum(c.size for c in self.children())
        self._hash = hash((type(self).__name__, *self.key()))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not type(self):
            return False
        assert isinstance(other, Value)
        return self._hash == other._hash and self.key() == other.key()

    def __repr__(self) -> str:
        return format_value(self)


class Load(Value):
    """`buf[index]` (flat element index into the buffer's storage). `indirect`
    binds the `ind*` symbols that appear in `index` to values loaded from
    other tensors (gather/index/embedding)."""

    __slots__ = ("buf", "index", "indirect")

    def __init__(
        self,
        buf: str,
        index: Expr,
        dtype: torch.dtype,
        indirect: tuple[tuple[sympy.Symbol, Value], ...] = (),
    ) -> None:
        self.buf = buf
        self.index = sympy.sympify(index)
        self.indirect = indirect
        self._init(dtype)

    def children(self) -> tuple[Value, ...]:
        return tuple(v for _, v in self.indirect)

    def key(self) -> tuple[Any, ...]:
        return (self.buf, self.index, self.indirect, self.dtype)


class Const(Value):
    """A compile-time constant (python bool/int/float, inf and nan included)."""

    __slots__ = ("value",)

    def __init__(self, value: bool | int | float, dtype: torch.dtype) -> None:
        self.value = value
        self._init(dtype)

    def key(self) -> tuple[Any, ...]:
        # repr keeps nan == nan and 0.0 != -0.0 apart
        return (repr(self.value), self.dtype)


class IndexValue(Value):
    """An integer index expression used as a value (iota, arange, sizes);
    `indirect` binds `ind*` symbols as for `Load`."""

    __slots__ = ("expr", "indirect")

    def __init__(
        self,
        expr: Expr,
        dtype: torch.dtype,
        indirect: tuple[tuple[sympy.Symbol, Value], ...] = (),
    ) -> None:
        self.expr = sympy.sympify(expr)
        self.indirect = indirect
        self._init(dtype)

    def children(self) -> tuple[Value, ...]:
        return tuple(v for _, v in self.indirect)

    def key(self) -> tuple[Any, ...]:
        return (self.expr, self.indirect, self.dtype)


class Op(Value):
    """A pointwise op from the triton op table (`add`, `exp`, `where`, `to`...)."""

    __slots__ = ("args", "name")

    def __init__(self, name: str, args: Sequence[Value], dtype: torch.dtype) -> None:
        self.name = name
        self.args = tuple(args)
        self._init(dtype)

    def children(self) -> tuple[Value, ...]:
        return self.args

    def key(self) -> tuple[Any, ...]:
        return (self.name, self.args, self.dtype)


class Rand(Value):
    """`tl.rand`/`tl.randn` at philox `offset` (an index expression) from the
    per-call seed; `stream` separates the random ops of one graph."""

    __slots__ = ("kind", "offset", "stream")

    def __init__(self, kind: str, stream: int, offset: Expr, dtype: torch.dtype) -> None:
        self.kind = kind
        self.stream = stream
        self.offset = sympy.sympify(offset)
        self._init(dtype)

    def key(self) -> tuple[Any, ...]:
        return (self.kind, self.stream, self.offset, self.dtype)


# The IR's pointwise op names (codegen/ops.py: OPS gives each its Triton form).
POINTWISE_OPS = frozenset(
    """identity add sub mul truediv div_rn truncdiv floordiv remainder fmod neg abs exp exp2 expm1 log
    log2 log10 log1p sqrt rsqrt sin cos tan sinh cosh tanh sigmoid erf erfc reciprocal floor ceil
    trunc round sign relu bitwise_not logical_not isnan isinf isfinite signbit maximum minimum
    fmax fmin hypot copysign bitwise_and bitwise_or bitwise_xor lshift rshift logical_and
    logical_or logical_xor eq ne lt le gt ge where pow to masked""".split()
)


def format_value(v: Value) -> str:
    if isinstance(v, Load):
        ind = "".join(f", {s}={format_value(b)}" for s, b in v.indirect)
        return f"{v.buf}[{v.index}{ind}]"
    if isinstance(v, Const):
        return repr(v.value)
    if isinstance(v, IndexValue):
        return f"index({v.expr})"
    if isinstance(v, Op):
        return f"{v.name}({', '.join(format_value(a) for a in v.args)})"
    if isinstance(v, Rand):
        return f"{v.kind}(seed, stream={v.stream}, offset={v.offset})"
    return object.__repr__(v)


def iter_values(v: Value) -> list[Value]:
    """Every distinct sub-value of `v` (post-order, each once)."""
    seen: set[int] = set()
    out: list[Value] = []
    stack: list[tuple[Value, bool]] = [(v, False)]
    while stack:
        cur, done = stack.pop()
        if done:
            out.append(cur)
            continue
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        stack.append((cur, True))
        stack.extend((c, False) for c in cur.children())
    return out


def loads_of(v: Value) -> list[Load]:
    return [u for u in iter_values(v) if isinstance(u, Load)]


# --------------------------------------------------------------------------
# Buffers and nodes


@dataclasses.dataclass
class Buffer:
    """A tensor the wrapper holds: a graph input, a kernel output, an extern result."""

    name: str
    size: tuple[Expr, ...]
    stride: tuple[Expr, ...]
    offset: Expr  # storage offset in elements (inputs and strided views)
    dtype: torch.dtype
    device: torch.device
    kind: str  # "input" | "kernel" | "extern" | "constant"

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.kind} {str(self.dtype).replace('torch.', '')}"
            f"[{', '.join(map(str, self.size))}] stride=({', '.join(map(str, self.stride))})"
        )


@dataclasses.dataclass
class PointwiseNode:
    """`out[x...] = body` over `size`; stored at `sum(x_i * stride_i)`."""

    name: str
    size: tuple[Expr, ...]
    body: Value  # in terms of x0..x{n-1}
    origins: tuple[str, ...] = ()  # the graph's aten ops it computes (profiles, reports)
    # The dims from outermost to innermost loop, where the buffer is stored in another
    # order than row-major (a channels-last NCHW tensor: (0, 2, 3, 1)), so that the
    # kernel walks its output (and inputs of that layout) in memory order; None: row-major
    order: tuple[int, ...] | None = None

    def __str__(self) -> str:
        walk = "" if self.order is None else f" order={self.order}"
        return f"{self.name} = pointwise[{', '.join(map(str, self.size))}]{walk}: {self.body}"


@dataclasses.dataclass
class ReductionNode:
    """`out[x...] = reduce_{r...} body` with `out` of size `size` (kept dims
    only, contiguous) and the reduced dims `reduce_size`.

    `reduce_type`: sum, prod, max, min, argmax, argmin, any, all,
    welford_mean, welford_m2 (mean and sum of squared deviations: one pass)."""

    name: str
    size: tuple[Expr, ...]
    reduce_size: tuple[Expr, ...]
    reduce_type: str
    body: Value  # in terms of x* and r*
    dtype: torch.dtype  # of the result
    origins: tuple[str, ...] = ()  # the graph's aten ops it computes (profiles, reports)

    def __str__(self) -> str:
        return (
            f"{self.name} = {self.reduce_type}[{', '.join(map(str, self.size))} | "
            f"{', '.join(map(str, self.reduce_size))}]: {self.body}"
        )


@dataclasses.dataclass
class ScatterNode:
    """`target[index] (+)= body` over `size` (x vars); `target` already holds
    its initial value (written by an earlier node); `mode` is add (atomic) or store."""

    name: str  # the target buffer (mutated in place)
    size: tuple[Expr, ...]
    index: Expr  # element index into target, in x vars and ind symbols
    indirect: tuple[tuple[sympy.Symbol, Value], ...]
    body: Value
    mode: str  # "add" | "store"
    origins: tuple[str, ...] = ()  # the graph's aten ops it computes (profiles, reports)

    def __str__(self) -> str:
        ind = "".join(f", {s}={b}" for s, b in self.indirect)
        op = "+=" if self.mode == "add" else "="
        return (
            f"{self.name}[{self.index}{ind}] {op} {self.body}   "
            f"over [{', '.join(map(str, self.size))}]"
        )


@dataclasses.dataclass
class ExternNode:
    """An aten call the wrapper makes on real tensors. `args`/`kwargs` hold
    `BufferRef`s, `SymRef`s and plain python values; `outputs` names one
    buffer per tensor the op returns (None where it returns no tensor)."""

    name: str
    op: Any  # torch OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[str | None, ...]
    single: bool  # the op returns one tensor, not a tuple
    mutated: tuple[str, ...] = ()  # buffers the op writes in place (non-functional graphs)

    def __str__(self) -> str:
        return f"{', '.join(o or '_' for o in self.outputs)} = extern {self.op}({self.args}, {self.kwargs})"


@dataclasses.dataclass(frozen=True)
class BufferRef:
    """An extern argument: the buffer, seen through a strided view."""

    buf: str
    size: tuple[Expr, ...]
    stride: tuple[Expr, ...]
    offset: Expr

    def __repr__(self) -> str:
        return self.buf


@dataclasses.dataclass(frozen=True)
class SymRef:
    """An extern argument or graph output that is a symbolic int."""

    expr: Expr

    def __repr__(self) -> str:
        return f"sym({self.expr})"


Node = PointwiseNode | ReductionNode | ScatterNode | ExternNode


def node_reads(node: Node) -> set[str]:
    """Buffers a node reads."""
    if isinstance(node, ExternNode):
        out: set[str] = set()
        for a in _flatten(node.args) + _flatten(list(node.kwargs.values())):
            if isinstance(a, BufferRef):
                out.add(a.buf)
        return out
    vals: list[Value] = [node.body]
    if isinstance(node, ScatterNode):
        vals += [v for _, v in node.indirect]
    return {ld.buf for v in vals for ld in loads_of(v)}


def node_writes(node: Node) -> tuple[str, ...]:
    if isinstance(node, ExternNode):
        return tuple(o for o in node.outputs if o is not None) + node.mutated
    return (node.name,)


def _flatten(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flatten(e)]
    return [x]


@dataclasses.dataclass
class Program:
    """What lowering produces: buffers, nodes in program order, and outputs.

    `outputs` entries: a buffer name (`Buffer` view info in `output_views`),
    a `SymRef`, or a python constant (None, int)."""

    inputs: list[str | SymRef | None]  # per placeholder: buffer name, symbol, or None (unused)
    buffers: dict[str, Buffer]
    nodes: list[Node]
    outputs: list[Any]
    output_views: dict[int, BufferRef]  # output position -> strided view of a buffer
    symbols: dict[
        sympy.Symbol, tuple[int, str, int]
    ]  # symbol -> (input, size|stride|offset|scalar|item, dim); item: `input.item()`
    symbol_origins: dict[sympy.Symbol, str]  # symbols no input binds -> where each came from
    # float symbols the wrapper computes, in order: symbol -> (python callable, args, kwargs)
    derived: dict[sympy.Symbol, tuple[Any, tuple[Any, ...], dict[str, Any]]]
    constants: dict[str, torch.Tensor]
    random_streams: int  # how many random ops (0: no seed argument)
    device: torch.device
    # IR node indices where each copy of a repeated region starts (and the last ends):
    # the scheduler fuses independent nodes only within one such span (lowering/regions.py)
    barriers: list[int] = dataclasses.field(default_factory=list)
    regions: list[str] = dataclasses.field(default_factory=list)  # the repeated regions found
    reused_nodes: int = 0  # graph nodes lowered by renaming a region's first copy
    lowered_nodes: int = 0  # graph nodes lowered by their rule, constants aside

    def as_text(self) -> str:
        lines = ["# buffers"]
        lines += [f"  {b}" for b in self.buffers.values()]
        lines.append("# nodes")
        lines += [f"  {n}" for n in self.nodes]
        lines.append(f"# outputs: {self.outputs}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.as_text()


def bind_indirect(v: Value, sym: sympy.Symbol, bound: Value) -> Value:
    """Attach `sym = bound` to every Load whose index mentions `sym`."""
    memo: dict[int, Value] = {}

    def go(u: Value) -> Value:
        hit = memo.get(id(u))
        if hit is not None:
            return hit
        out: Value = u
        if isinstance(u, Load):
            ind = tuple((s, go(b)) for s, b in u.indirect)
            if sym in u.index.free_symbols:
                ind = (*ind, (sym, bound))
            if ind != u.indirect:
                out = Load(u.buf, u.index, u.dtype, ind)
        elif isinstance(u, IndexValue):
            ind = tuple((s, go(b)) for s, b in u.indirect)
            if sym in u.expr.free_symbols:
                ind = (*ind, (sym, bound))
            if ind != u.indirect:
                out = IndexValue(u.expr, u.dtype, ind)
        elif isinstance(u, Op):
            args = tuple(go(a) for a in u.args)
            if any(a is not b for a, b in zip(args, u.args)):
                out = Op(u.name, args, u.dtype)
        memo[id(u)] = out
        return out

    return go(v)
