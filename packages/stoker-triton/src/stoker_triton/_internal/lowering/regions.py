"""Repeated regions: a model's identical blocks, lowered once.

A graph of N identical blocks (a transformer's layers, in its forward, its
backward, or compiled autograd's captured backward) is N copies of one run of
nodes, each copy reading its own parameters and the previous copy's output.
Lowering each copy again costs N times the work of one; so does every stage
after it when the copies come out different. This module finds the copies
(`find_regions`) and lowers every copy after the first by renaming the first
one's lowered IR (`RegionLowering`): its buffers, IR nodes and lazy values are
copied with the buffer names, indirect-index symbols and random streams the
copy's own lowering would have made, in the same order, so the program is the
one lowering each copy would give.

**Finding them.** Each call node gets a local signature: its target, the
structure of its arguments (a node argument is a slot, constants by value)
and its `meta["val"]` (dtype, sizes, strides, offset, device); not its users
(the last block's output feeds the final norm, the others' the next block: where
a copy's users differ, it keeps the first copy's choice of what to store, which
costs a store, never a value). Equal signatures recurring at a fixed distance L (a *period*) mark a
tandem repeat: a run of nodes where node i matches node i + L. The longest
such run over the periods the signatures suggest gives `count` copies of L
nodes; each copy is then checked against the first for dataflow: a node's
argument inside the copy must be the node at the same position in the first
copy, one outside it (a parameter, the previous block's output, a shared
mask) an *external input* whose correspondence with the first copy's is
one-to-one. The parts of the graph before and after a run are searched again,
so a graph may hold several kinds of region.

**Lowering them.** At the start of every copy, the external inputs that are
lazy values (a pointwise expression not stored yet) are stored first, so each
copy reads buffers: the first copy's IR then depends on its inputs only by
buffer name. The scheduler still fuses across a copy's boundary (a block's
last residual add into the next block's layer norm: the stored value is a
pointwise node its consumer's kernel can take in); `Program.barriers` (the IR
index where each copy starts) only keeps it from fusing independent nodes of
one copy into another copy's kernels, so every copy gets the same kernels
(whose sources, identical up to names, are one module and one compile).

A copy whose inputs do not correspond as the first copy's did (another layout,
another kind of value) raises `RegionMismatch`; the caller lowers the graph
again without regions. Graphs that write a tensor in place are lowered
without regions.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx

from ..ir import (
    Buffer,
    BufferRef,
    Const,
    ExternNode,
    IndexValue,
    Load,
    Node,
    Op,
    PointwiseNode,
    Rand,
    ReductionNode,
    ScatterNode,
    Value,
)
from .core import TensorValue, strided_loader

# a region shorter than this many graph nodes is not worth the bookkeeping
MIN_NODES = 8
# how many periods (the most frequent distances between equal signatures) to try
PERIODS_TRIED = 8
# how many kinds of region one graph may hold
MAX_KINDS = 8


class RegionMismatch(Exception):
    """A copy does not correspond to the first one: lower the graph without regions."""


@dataclasses.dataclass
class Region:
    """`count` consecutive copies of `length` graph nodes starting at node `start`
    (positions in the graph's node order); `inputs[k]` pairs each external input
    of copy 0 with copy k's (copy 0's own list pairs each with itself)."""

    start: int
    length: int
    count: int
    inputs: list[list[tuple[torch.fx.Node, torch.fx.Node]]]

    def copy_nodes(self, nodes: Sequence[torch.fx.Node], k: int) -> list[torch.fx.Node]:
        a = self.start + k * self.length
        return list(nodes[a : a + self.length])

    def __str__(self) -> str:
        return f"{self.count} x {self.length} nodes from node {self.start}"


# --------------------------------------------------------------------------
# finding the copies


def _arg_key(a: Any) -> Any:
    """An argument's structure: a node is a slot; constants by type and value."""
    if isinstance(a, torch.fx.Node):
        return "N"
    if isinstance(a, list | tuple):
        return (type(a).__name__, tuple(_arg_key(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _arg_key(v)) for k, v in a.items()))
    if isinstance(a, float):
        return ("f", repr(a))  # keeps nan == nan, 0.0 != -0.0
    if a is None or isinstance(a, bool | int | str):
        return (type(a).__name__, a)
    if isinstance(a, torch.dtype | torch.device | torch.layout | torch.memory_format):
        return (type(a).__name__, str(a))
    raise TypeError(type(a))  # anything else: the node has no signature


def _size_key(s: Any) -> Any:
    if isinstance(s, torch.SymInt):
        return str(s.node.expr)
    return int(s)


def _sizes_key(xs: Any) -> tuple[Any, ...]:
    t = tuple(xs)
    if all(type(x) is int for x in t):
        return t
    return tuple(_size_key(x) for x in t)


def _val_key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided:
            raise TypeError("layout")
        return (
            "T",
            v.dtype,
            _sizes_key(v.shape),
            _sizes_key(v.stride()),
            _size_key(v.storage_offset()),
            v.device,
            v.requires_grad,
        )
    if isinstance(v, list | tuple):
        return tuple(_val_key(x) for x in v)
    if v is None:
        return None
    raise TypeError(type(v))  # a symbolic or Python scalar node: no signature


def signature(n: torch.fx.Node, extra: Callable[[torch.fx.Node], Any] | None = None) -> Any:
    """The node's local signature (None: the node matches no other)."""
    if n.op != "call_function":
        return None
    try:
        return (
            n.target,
            _arg_key(n.args),
            _arg_key(n.kwargs),
            _val_key(n.meta.get("val")),
            extra(n) if extra is not None else None,
        )
    except TypeError:
        return None


def lowering_order(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """`gm`'s nodes with the constants first: each node that reads no other node and
    draws no random numbers (`scalar_tensor(-inf)`, `arange`, `full`), right after the
    placeholders. A trace that shares one such constant between the blocks (made in
    the first block, read by every block's `where`) leaves it inside the first block,
    which then differs from the others; hoisted, the blocks are the same again."""
    nodes = list(gm.graph.nodes)
    first = [n for n in nodes if n.op == "placeholder"] + [n for n in nodes if _constant(n)]
    taken = set(first)
    return first + [n for n in nodes if n not in taken]


def _constant(n: torch.fx.Node) -> bool:
    if n.op != "call_function" or n.all_input_nodes:
        return False
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags and isinstance(
        n.target, torch._ops.OpOverload
    )


def find_regions(
    nodes: Sequence[torch.fx.Node] | torch.fx.GraphModule,
    extra: Callable[[torch.fx.Node], Any] | None = None,
    min_nodes: int = MIN_NODES,
) -> list[Region]:
    """The repeated regions of a graph's nodes (a graph module: in graph order; else
    in the order given, `lowering_order`'s), in that order (see the module doc).
    `extra(node)` adds to each signature (what else the caller's work depends on)."""
    if isinstance(nodes, torch.fx.GraphModule):
        nodes = list(nodes.graph.nodes)
    nodes = list(nodes)
    ids: dict[Any, int] = {}
    seq: list[int] = []
    for i, n in enumerate(nodes):
        s = signature(n, extra)
        seq.append(-1 - i if s is None else ids.setdefault(s, len(ids)))
    found: list[Region] = []
    _search(nodes, seq, 0, len(seq), min_nodes, found)
    return sorted(found, key=lambda r: r.start)


def _search(
    nodes: list[torch.fx.Node],
    seq: list[int],
    lo: int,
    hi: int,
    min_nodes: int,
    found: list[Region],
) -> None:
    if hi - lo < 2 * min_nodes or len(found) >= MAX_KINDS:
        return
    best = _best_run(seq, lo, hi, min_nodes)
    if best is None:
        return
    start, length, count, slack = best
    start = _cut(nodes, start, length, slack)
    region = _checked(nodes, start, length, count)
    if region is None:
        return
    found.append(region)
    _search(nodes, seq, lo, region.start, min_nodes, found)
    _search(nodes, seq, region.start + region.count * region.length, hi, min_nodes, found)


def _best_run(seq: list[int], lo: int, hi: int, min_nodes: int) -> tuple[int, int, int, int] | None:
    """(start, period, copies, slack) of the run in seq[lo:hi] that repeats the most
    nodes; the copies may start anywhere from `start` to `start + slack`."""
    where: dict[int, int] = {}
    gaps: Counter[int] = Counter()
    for i in range(lo, hi):
        s = seq[i]
        if s < 0:
            continue
        prev = where.get(s)
        if prev is not None and i - prev >= min_nodes:
            gaps[i - prev] += 1
        where[s] = i
    best: tuple[int, int, int, int] | None = None
    for period, _ in gaps.most_common(PERIODS_TRIED):
        run = 0
        for i in range(lo, hi - period):
            if seq[i] >= 0 and seq[i] == seq[i + period]:
                run += 1
                continue
            best = _better(i - run, run, period, best)
            run = 0
        best = _better(hi - period - run, run, period, best)
    return best


def _better(
    start: int, run: int, period: int, best: tuple[int, int, int, int] | None
) -> tuple[int, int, int, int] | None:
    """The run of `run` matches at distance `period` from `start`, if it repeats more
    nodes than `best` (the shorter period on a tie)."""
    count = run // period + 1
    if count < 2:
        return best
    saved = (count - 1) * period
    if best is not None:
        best_saved = (best[2] - 1) * best[1]
        if saved < best_saved or (saved == best_saved and period >= best[1]):
            return best
    return (start, period, count, run - (count - 1) * period)


def _cut(nodes: list[torch.fx.Node], start: int, length: int, slack: int) -> int:
    """Where the copies start, from `start` to `start + slack`: where the fewest values
    pass from one copy to the next (a transformer block's residual stream, not the
    middle of its layer norm), each of which the next copy reads from a buffer."""
    if slack == 0:
        return start
    lo, hi = start, start + slack + 2 * length  # every node a cut's two copies hold
    pos = {n: i for i, n in enumerate(nodes[lo:hi], lo)}
    # the cut before node c (c - length: where copy 0 starts) passes node u's value when
    # u < c and a node of the next `length` reads it: count, for each c, the nodes u
    # whose last such reader is at c or later (a difference array over the cuts)
    first = start + length
    crossing = [0] * (slack + 2)
    for u in range(lo, hi):
        readers = [p for v in nodes[u].users if (p := pos.get(v, -1)) > u]
        if not readers:
            continue
        last = max(readers)
        # cuts c with u < c <= last and c - length <= u (u in copy 0 of that cut)
        a, b = max(u + 1, first), min(last, u + length, first + slack)
        if a <= b:
            crossing[a - first] += 1
            crossing[b - first + 1] -= 1
    best, best_n, run = 0, -1, 0
    for o in range(slack + 1):
        run += crossing[o]
        if best_n < 0 or run < best_n:
            best, best_n = o, run
    return start + best


def _checked(nodes: list[torch.fx.Node], start: int, length: int, count: int) -> Region | None:
    """The region with the copies (from the first) whose dataflow matches copy 0's."""
    first = nodes[start : start + length]
    pos0 = {n: i for i, n in enumerate(first)}
    ext0 = _external(first, pos0)
    inputs = [[(a, a) for a in ext0]]
    for k in range(1, count):
        copy = nodes[start + k * length : start + (k + 1) * length]
        pairs = _correspond(first, pos0, copy)
        if pairs is None:
            count = k
            break
        inputs.append([(a, pairs[a]) for a in ext0])
    if count < 2:
        return None
    return Region(start, length, count, inputs)


def _external(copy: list[torch.fx.Node], pos: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    """The nodes outside `copy` that its nodes read, in order of first use."""
    out: dict[torch.fx.Node, None] = {}
    for n in copy:
        for a in n.all_input_nodes:
            if a not in pos:
                out.setdefault(a, None)
    return list(out)


def _correspond(
    first: list[torch.fx.Node], pos0: dict[torch.fx.Node, int], copy: list[torch.fx.Node]
) -> dict[torch.fx.Node, torch.fx.Node] | None:
    """copy 0's external inputs -> `copy`'s, or None when the dataflow differs."""
    posk = {n: i for i, n in enumerate(copy)}
    fwd: dict[torch.fx.Node, torch.fx.Node] = {}
    back: dict[torch.fx.Node, torch.fx.Node] = {}
    for n0, nk in zip(first, copy):
        a0s = _node_args(n0)
        aks = _node_args(nk)
        if len(a0s) != len(aks):
            return None
        for a0, ak in zip(a0s, aks):
            i0, ik = pos0.get(a0), posk.get(ak)
            if (i0 is None) != (ik is None):
                return None
            if i0 is not None:
                if i0 != ik:
                    return None
                continue
            if fwd.setdefault(a0, ak) is not ak or back.setdefault(ak, a0) is not a0:
                return None
    return fwd


def _node_args(n: torch.fx.Node) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []

    def note(a: torch.fx.Node) -> torch.fx.Node:
        out.append(a)
        return a

    torch.fx.node.map_arg((n.args, n.kwargs), note)
    return out


# --------------------------------------------------------------------------
# lowering the copies


_NUM = re.compile(r"^(.*?)(\d+)$")


class Renamer:
    """Copies IR from one copy's names to another's: buffers by `bufs`, indirect
    symbols by `syms`, random streams shifted by `stream_shift` from `stream_lo` on."""

    def __init__(
        self,
        bufs: dict[str, str],
        syms: dict[sympy.Symbol, sympy.Symbol],
        stream_lo: int,
        stream_shift: int,
    ) -> None:
        self.bufs = bufs
        self.syms = syms
        self.stream_lo = stream_lo
        self.stream_shift = stream_shift
        self._memo: dict[int, tuple[Value, Value]] = {}  # id(old) -> (old, new): old kept alive

    def buf(self, name: str) -> str:
        return self.bufs.get(name, name)

    def expr(self, e: Any) -> Any:
        if self.syms and isinstance(e, sympy.Basic) and e.free_symbols & self.syms.keys():
            return e.xreplace(self.syms)
        return e

    def value(self, v: Value) -> Value:
        hit = self._memo.get(id(v))
        if hit is not None:
            return hit[1]
        out: Value
        if isinstance(v, Load):
            ind = self._indirect(v.indirect)
            buf = self.buf(v.buf)
            index = self.expr(v.index)
            out = (
                v
                if (buf, index, ind) == (v.buf, v.index, v.indirect)
                else Load(buf, index, v.dtype, ind)
            )
        elif isinstance(v, Op):
            args = tuple(self.value(a) for a in v.args)
            out = v if all(a is b for a, b in zip(args, v.args)) else Op(v.name, args, v.dtype)
        elif isinstance(v, IndexValue):
            ind = self._indirect(v.indirect)
            expr = self.expr(v.expr)
            out = v if (expr, ind) == (v.expr, v.indirect) else IndexValue(expr, v.dtype, ind)
        elif isinstance(v, Rand):
            s = v.stream + self.stream_shift if v.stream >= self.stream_lo else v.stream
            out = v if s == v.stream else Rand(v.kind, s, v.offset, v.dtype)
        elif isinstance(v, Const):
            out = v
        else:
            raise RegionMismatch(f"an IR value of kind {type(v).__name__}")
        self._memo[id(v)] = (v, out)
        return out

    def _indirect(
        self, ind: tuple[tuple[sympy.Symbol, Value], ...]
    ) -> tuple[tuple[sympy.Symbol, Value], ...]:
        return tuple((self.syms.get(s, s), self.value(b)) for s, b in ind)

    def node(self, n: Node) -> Node:
        """`n` renamed (its other fields, sizes and origins, as they are)."""
        if isinstance(n, PointwiseNode | ReductionNode):
            return dataclasses.replace(n, name=self.buf(n.name), body=self.value(n.body))
        if isinstance(n, ScatterNode):
            return dataclasses.replace(
                n,
                name=self.buf(n.name),
                index=self.expr(n.index),
                indirect=self._indirect(n.indirect),
                body=self.value(n.body),
            )
        assert isinstance(n, ExternNode)
        return dataclasses.replace(
            n,
            name=self.buf(n.name),
            args=self._args(n.args),
            kwargs=self._args(n.kwargs),
            outputs=tuple(None if o is None else self.buf(o) for o in n.outputs),
            mutated=tuple(self.buf(b) for b in n.mutated),
        )

    def _args(self, a: Any) -> Any:
        if isinstance(a, BufferRef):
            return BufferRef(self.buf(a.buf), a.size, a.stride, a.offset)
        if isinstance(a, tuple):
            return tuple(self._args(x) for x in a)
        if isinstance(a, list):
            return [self._args(x) for x in a]
        if isinstance(a, dict):
            return {k: self._args(v) for k, v in a.items()}
        return a


@dataclasses.dataclass
class _Record:
    """What lowering copy 0 of a region did, taken when its last node was lowered."""

    ext_values: list[Any]  # env values of its external inputs (after they were stored)
    node_values: list[Any]  # env value of each of its nodes
    ir: list[Node]  # the IR nodes it added
    buffers: list[Buffer]  # the buffers it added, in order
    counter: tuple[int, int]  # ctx name counter before and after
    ind: tuple[int, int]  # indirect-symbol counter before and after
    streams: tuple[int, int]  # random streams before and after
    fallbacks: dict[str, int]  # fallback ops it counted
    aliases: dict[str, str]  # extern views it added
    realized_by: dict[str, Any]  # its buffers -> the lazy value stored in each


class LazyEnv(dict[torch.fx.Node, Any]):
    """`lower_graph`'s node -> value map, where a copy's values are made on first read:
    only a value some node outside the copy reads (the next block, an output) is ever
    needed, and making each copy's every value allocates enough to set off the cyclic
    garbage collector over the whole process."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[torch.fx.Node, Callable[[], Any]] = {}

    def __missing__(self, key: torch.fx.Node) -> Any:
        make = self.pending.pop(key, None)
        if make is None:
            raise KeyError(key)
        v = self[key] = make()
        return v

    def get(self, key: torch.fx.Node, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default


class RegionLowering:
    """`lower_graph`'s hook: copy 0 of each region is lowered as usual and recorded
    (`after`), every later copy is made from the record (`before`)."""

    def __init__(
        self,
        ctx: Any,
        nodes: list[torch.fx.Node],
        env: dict[torch.fx.Node, Any],
        regions: list[Region],
    ) -> None:
        self.ctx = ctx
        self.env = env
        self.regions = regions
        # node -> (region index, copy index) for the first node of each copy
        self.starts: dict[torch.fx.Node, tuple[int, int]] = {}
        self.ends: dict[torch.fx.Node, int] = {}  # the last node of copy 0 -> region index
        self.skip: set[torch.fx.Node] = set()
        for r, reg in enumerate(regions):
            for k in range(reg.count):
                copy = reg.copy_nodes(nodes, k)
                self.starts[copy[0]] = (r, k)
                if k == 0:
                    self.ends[copy[-1]] = r
                else:
                    self.skip.update(copy)
        self.copies = [[reg.copy_nodes(nodes, k) for k in range(reg.count)] for reg in regions]
        # external inputs every copy reads (a mask, a shared weight): the same value for all
        self.shared = [
            {a for i, (a, _) in enumerate(reg.inputs[0]) if all(p[i][1] is a for p in reg.inputs)}
            for reg in regions
        ]
        self.pos = {n: i for i, n in enumerate(nodes)}
        self.lazy: dict[int, set[torch.fx.Node]] = {}  # inputs left lazy (see `_lazy_inputs`)
        self.records: dict[int, _Record] = {}
        self._open: dict[int, dict[str, Any]] = {}
        self.barriers: list[int] = []  # IR index where each copy starts (and the last ends)
        self.reused_nodes = 0  # graph nodes made by renaming

    # -- the hook ------------------------------------------------------------
    def before(self, node: torch.fx.Node) -> bool:
        """Called before `node` is lowered; True when it is part of a copy made here."""
        hit = self.starts.get(node)
        if hit is not None:
            r, k = hit
            reg = self.regions[r]
            self.barriers.append(len(self.ctx.nodes))
            if k == 0:
                self.lazy[r] = self._lazy_inputs(r)
            keep = self.shared[r] | self.lazy[r]
            self._store_inputs([b for a, b in reg.inputs[k] if a not in keep])
            if k == 0:
                self._begin(r)
            else:
                self._instantiate(r, k)
                if k == reg.count - 1:
                    self.barriers.append(len(self.ctx.nodes))
                return True
        return node in self.skip

    def after(self, node: torch.fx.Node) -> None:
        """Called after `node` was lowered."""
        r = self.ends.get(node)
        if r is not None:
            self._end(r)

    # -- copy 0 ----------------------------------------------------------------
    def _lazy_inputs(self, r: int) -> set[torch.fx.Node]:
        """Copy 0's external inputs that stay lazy in every copy: a value computed before
        the region (a forward's activation that a backward block recomputes from) whose
        every copy's counterpart is the same expression over other buffers of the same
        layouts. Storing it would add a kernel and a round trip through memory per copy;
        each copy's IR inlines its own input's expression instead, as without regions."""
        reg = self.regions[r]
        out: set[torch.fx.Node] = set()
        for i, (a0, _) in enumerate(reg.inputs[0]):
            v0 = self.env.get(a0)
            if a0 in self.shared[r] or not isinstance(v0, TensorValue) or v0.layout is not None:
                continue
            others = [p[i][1] for p in reg.inputs[1:]]
            if all(self.pos[a] < reg.start for a in others) and all(
                self._unify(v0, self.env.get(a), {}) for a in others
            ):
                out.add(a0)
        return out

    def _unify(self, v0: Any, vk: Any, bufs: dict[str, str]) -> bool:
        """Whether lazy `vk` is `v0` over other buffers (`bufs`: the names, filled in)."""
        from ..ir import index_var

        if not isinstance(vk, TensorValue) or vk.layout is not None:
            return False
        if (v0.size, v0.dtype) != (vk.size, vk.dtype):
            return False
        idx = tuple(index_var("x", i) for i in range(len(v0.size)))
        n = len(self.ctx.nodes)
        a, b = v0.load(idx), vk.load(idx)
        if len(self.ctx.nodes) != n:
            raise RegionMismatch("a lazy value that adds IR when loaded")
        return _same_tree(a, b, bufs, self.ctx.buffers, set())

    def _store_inputs(self, inputs: list[torch.fx.Node]) -> None:
        """Store each lazy tensor among this copy's own external inputs (see the module
        doc); one every copy reads is the same value for all, lazy or not."""
        for a in inputs:
            v = self.env.get(a)
            new = self._stored(v)
            if new is not v:
                self.env[a] = new

    def _stored(self, v: Any) -> Any:
        if isinstance(v, TensorValue) and v.layout is None:
            return self.ctx.realize(v)
        if isinstance(v, list | tuple):
            items = [self._stored(x) for x in v]
            if any(a is not b for a, b in zip(items, v)):
                return type(v)(items)
        return v

    def _begin(self, r: int) -> None:
        ctx = self.ctx
        self._open[r] = {
            "ext": [self.env.get(a) for a, _ in self.regions[r].inputs[0]],
            "n": len(ctx.nodes),
            "bufs": len(ctx.buffers),
            "counter": ctx._counter,
            "ind": ctx._ind_counter,
            "streams": ctx.random_streams,
            "fallbacks": dict(ctx.fallbacks),
            "aliases": dict(ctx.aliases),
        }

    def _end(self, r: int) -> None:
        ctx = self.ctx
        o = self._open.pop(r)
        reg = self.regions[r]
        ext_now = [self.env.get(a) for a, _ in reg.inputs[0]]
        if any(a is not b for a, b in zip(ext_now, o["ext"])):
            raise RegionMismatch("a copy changed the value of one of its inputs")
        # the copy's values stay as they are now, for the copies made from them: the
        # rest of the graph gets stand-ins (`_shadow`) that it may store and view
        values = [self.env.get(n) for n in self.copies[r][0]]
        stand_ins: dict[int, Any] = {}
        for n, v in zip(self.copies[r][0], values):
            self.env[n] = _shadow(v, stand_ins)
        buffers = list(ctx.buffers.values())[o["bufs"] :]
        realized_by = {
            b.name: ctx.realized_by[b.name] for b in buffers if b.name in ctx.realized_by
        }
        fallbacks = {
            op: c - o["fallbacks"].get(op, 0)
            for op, c in ctx.fallbacks.items()
            if c != o["fallbacks"].get(op, 0)
        }
        self.records[r] = _Record(
            ext_values=o["ext"],
            node_values=values,
            ir=list(ctx.nodes[o["n"] :]),
            buffers=buffers,
            counter=(o["counter"], ctx._counter),
            ind=(o["ind"], ctx._ind_counter),
            streams=(o["streams"], ctx.random_streams),
            fallbacks=fallbacks,
            aliases={k: v for k, v in ctx.aliases.items() if k not in o["aliases"]},
            realized_by=realized_by,
        )
        if reg.count == 1:
            self.barriers.append(len(ctx.nodes))

    # -- copies 1.. --------------------------------------------------------------
    def _instantiate(self, r: int, k: int) -> None:
        ctx = self.ctx
        rec = self.records.get(r)
        if rec is None:
            raise RegionMismatch("copy 0 of a region was not lowered")
        bufs: dict[str, str] = {}
        seen: dict[int, Any] = {}  # id(copy 0's value) -> copy k's
        for v0, (_, a) in zip(rec.ext_values, self.regions[r].inputs[k]):
            self._pair(v0, self.env.get(a), bufs, seen)
        # the names copy k's own lowering would have made: the same counters, shifted
        shift = ctx._counter - rec.counter[0]
        for b in rec.buffers:
            bufs[b.name] = _shifted(b.name, shift, rec.counter)
        for ir_node in rec.ir:
            if isinstance(ir_node, ExternNode):
                bufs[ir_node.name] = _shifted(ir_node.name, shift, rec.counter)
        syms = {
            sympy.Symbol(f"ind{i}", integer=True): sympy.Symbol(
                f"ind{i - rec.ind[0] + ctx._ind_counter}", integer=True
            )
            for i in range(*rec.ind)
        }
        ren = Renamer(bufs, syms, rec.streams[0], ctx.random_streams - rec.streams[0])
        for b in rec.buffers:
            nb = dataclasses.replace(b, name=bufs[b.name])
            ctx.buffers[nb.name] = nb
        ctx.nodes.extend(ren.node(ir_node) for ir_node in rec.ir)
        ctx._counter += rec.counter[1] - rec.counter[0]
        ctx._ind_counter += rec.ind[1] - rec.ind[0]
        ctx.random_streams += rec.streams[1] - rec.streams[0]
        for op, c in rec.fallbacks.items():
            ctx.fallbacks[op] = ctx.fallbacks.get(op, 0) + c
        for alias, base in rec.aliases.items():
            ctx.aliases[ren.buf(alias)] = ren.buf(base)
        clone = _Cloner(ctx, ren, seen)
        env = self.env
        for n, v in zip(self.copies[r][k], rec.node_values):
            if isinstance(env, LazyEnv):  # made when a later node reads it (most never are)
                env.pending[n] = functools.partial(clone.value, v)
            else:
                env[n] = clone.value(v)
        for name, tv in rec.realized_by.items():
            ctx.realized_by[bufs[name]] = clone.value(tv)
        self.reused_nodes += len(self.copies[r][k])

    def _pair(self, v0: Any, vk: Any, bufs: dict[str, str], seen: dict[int, Any]) -> None:
        """Map copy 0's external input value `v0` onto copy k's `vk`."""
        if v0 is vk:
            return
        if isinstance(v0, TensorValue) and v0.layout is None:
            if not self._unify(v0, vk, bufs):
                raise RegionMismatch("a lazy input that is not the first copy's over other buffers")
            seen[id(v0)] = vk
            return
        if isinstance(v0, TensorValue) and isinstance(vk, TensorValue):
            a, b = v0.layout, vk.layout
            if (
                a is None
                or b is None
                or (a.size, a.stride, a.offset, v0.dtype)
                != (
                    b.size,
                    b.stride,
                    b.offset,
                    vk.dtype,
                )
            ):
                raise RegionMismatch("an input of another layout")
            if bufs.setdefault(a.buf, b.buf) != b.buf:
                raise RegionMismatch("one input buffer read as two")
            seen[id(v0)] = vk
            return
        if isinstance(v0, list | tuple) and isinstance(vk, list | tuple) and len(v0) == len(vk):
            for x, y in zip(v0, vk):
                self._pair(x, y, bufs, seen)
            seen[id(v0)] = vk
            return
        if type(v0) is type(vk) and not isinstance(v0, TensorValue) and v0 == vk:
            return
        raise RegionMismatch(f"inputs of other kinds: {type(v0).__name__}, {type(vk).__name__}")


def _same_tree(
    a: Value, b: Value, bufs: dict[str, str], buffers: dict[str, Buffer], done: set[tuple[int, int]]
) -> bool:
    """Whether `b` is `a` with its loads' buffers renamed by `bufs` (which this fills in:
    one name for each buffer, of the same layout)."""
    if a is b or (id(a), id(b)) in done:
        return True
    if type(a) is not type(b) or a.dtype != b.dtype:
        return False
    if isinstance(a, Load):
        assert isinstance(b, Load)
        if a.index != b.index or a.indirect or b.indirect:
            return False
        if bufs.setdefault(a.buf, b.buf) != b.buf:
            return False
        x, y = buffers[a.buf], buffers[b.buf]
        if (x.size, x.stride, x.offset, x.dtype) != (y.size, y.stride, y.offset, y.dtype):
            return False
    elif isinstance(a, Op):
        assert isinstance(b, Op)
        if a.name != b.name or len(a.args) != len(b.args):
            return False
        if not all(_same_tree(x, y, bufs, buffers, done) for x, y in zip(a.args, b.args)):
            return False
    elif a != b:  # constants, index values, random numbers: equal or nothing
        return False
    done.add((id(a), id(b)))
    return True


def _shifted(name: str, shift: int, span: tuple[int, int]) -> str:
    m = _NUM.match(name)
    if m is None or not span[0] <= int(m.group(2)) < span[1]:
        raise RegionMismatch(f"a buffer name not made by the copy's counter: {name}")
    return f"{m.group(1)}{int(m.group(2)) + shift}"


def _shadow(v: Any, done: dict[int, Any]) -> Any:
    """A stand-in for the first copy's value `v` that the rest of the graph holds: storing
    it (the next block's input, an output) marks the stand-in, so that `v` stays as it was
    at the end of the copy, what every later copy is made from (a stored value reads its
    buffer from then on: a buffer of the first copy's). It loads through `v`."""
    if isinstance(v, list | tuple):
        return type(v)(_shadow(x, done) for x in v)
    if not isinstance(v, TensorValue) or v.layout is not None:
        return v  # a buffer's value: storing it again is a no-op or a new copy
    hit = done.get(id(v))
    if hit is not None:
        return hit
    out = TensorValue(v.size, v.dtype, v.device, v.load)
    done[id(v)] = out
    out.realized, out.read_stored = v.realized, v.read_stored
    out.users, out.origins = v.users, v.origins
    if v.view_of is not None:  # storing the view stores its value: that one's stand-in
        out.view_of = (_shadow(v.view_of[0], done), v.view_of[1])
    return out


class _Cloner:
    """Copy k's values: copy 0's (as they were at the end of its span: `_shadow`), with
    every IR value they yield renamed."""

    def __init__(self, ctx: Any, ren: Renamer, seen: dict[int, Any]) -> None:
        self.ctx = ctx
        self.ren = ren
        self.seen = seen

    def value(self, v: Any) -> Any:
        hit = self.seen.get(id(v))
        if hit is not None:
            return hit
        if isinstance(v, TensorValue):
            out = self._tensor(v)
        elif isinstance(v, list | tuple):
            out = type(v)(self.value(x) for x in v)
        else:
            return v  # sizes, Python values: the same for every copy
        self.seen[id(v)] = out
        return out

    def _tensor(self, v: Any) -> Any:
        ren = self.ren
        if v.layout is not None:
            ref = BufferRef(ren.buf(v.layout.buf), v.layout.size, v.layout.stride, v.layout.offset)
            out = TensorValue(v.size, v.dtype, v.device, strided_loader(ref, v.dtype), ref)
        else:
            out = TensorValue(v.size, v.dtype, v.device, functools.partial(self._load, v))
        out.users = v.users
        out.origins = v.origins
        self.seen[id(v)] = out  # (a stored value, or a view, may point back at it)
        if v.realized is not None:
            out.realized = self.value(v.realized)
            out.read_stored = v.read_stored
        if v.view_of is not None:
            base, relayout = v.view_of
            out.view_of = (self.value(base), relayout)  # (a map of layouts: no names)
        return out

    def _load(self, v: Any, idx: tuple[Any, ...]) -> Value:
        n = len(self.ctx.nodes)
        got = v.load(idx)
        if len(self.ctx.nodes) != n:  # a loader that lowers: no renaming can follow it
            raise RegionMismatch("a lazy value that adds IR when loaded")
        return self.ren.value(got)
