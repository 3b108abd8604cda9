"""What every stage knows about a captured backward graph (the bottom of the stages).

A captured graph takes five lists, `PLACEHOLDERS`; a `Position` names one integer
of its inputs (a size of an input tensor, a lifted size, an int scalar, a size of
what an unpack hook returned).  `Walk` is the captured graph as the engine's walk
made it, one `WalkNode` record per node, made an ``fx.Graph`` only when one is
needed (a warm-start hit never needs it).  `graph_module` makes a graph a module
without generating its code yet, `fake_tensor` builds a fake tensor of given metadata
directly, and `check_sizes` is the call a retraced graph makes after each opaque
call (a hook, a custom backward) to check the size of what it returned.

This module imports no other stage: capture, the passes, retrace, segments, the
disk cache and the runtime all import it (`stoker_autograd._internal`'s docstring
has the order).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.proxy_tensor import PythonKeyTracer
from torch.fx.graph import _Namespace

PLACEHOLDERS = ("inputs", "sizes", "scalars", "hooks", "packed_data")
"""The captured graph's placeholders, in order: the engine calls it with these lists."""

Position = tuple[int, int, int]  # (0 inputs | 1 sizes | 2 scalars | 3 unpacked, index, dim or -1)


class WalkNode:
    """One node of a captured graph before it is an ``fx.Node``: what the capture
    callbacks, the tracer and the proxy mode read and write of a node while the engine
    walks (op, target, arguments with other `WalkNode`s in them, kwargs, name, meta)."""

    __slots__ = ("_make", "args", "kwargs", "meta", "name", "next", "node", "op", "prev", "target")

    def __init__(
        self,
        op: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str,
        make: tuple[str | None, Any, WalkNode | None],
    ) -> None:
        self.op, self.target, self.args, self.kwargs, self.name = op, target, args, kwargs, name
        self.meta: dict[str, Any] = {}
        # (the name asked for, type_expr, the node it was inserted after or None)
        self._make = make
        self.prev: WalkNode = self
        self.next: WalkNode = self
        self.node: fx.Node | None = None  # the node made of it (`Walk.to_graph`)

    def __fx_create_arg__(self, tracer: Any) -> WalkNode:
        return self  # an argument of a later node, as an fx.Node would be

    @property
    def all_input_nodes(self) -> list[WalkNode]:
        """The walk's nodes among its arguments, once each, in order (as ``fx.Node``'s)."""
        seen: dict[WalkNode, None] = {}
        _each_walk_node((self.args, self.kwargs), seen)
        return list(seen)

    @property
    def stack_trace(self) -> str | None:
        return self.meta.get("stack_trace")

    @stack_trace.setter
    def stack_trace(self, trace: str | None) -> None:
        self.meta["stack_trace"] = trace

    def __repr__(self) -> str:
        return self.name


class Walk:
    """The captured graph as the engine's walk made it: what the capture's tracer takes
    for its ``fx.Graph`` (``create_node``, ``inserting_after``, ``_target_to_str``),
    keeping each node as a `WalkNode` record (~1 us; an ``fx.Node`` costs ~18 us).

    Its nodes, in graph order, have the names an ``fx.Graph`` would have given them;
    `to_graph` makes that graph, node for node (the same creation order, insertion
    points and names), when a miss, an eager run or a retrace needs it."""

    def __init__(self) -> None:
        self._root = WalkNode("root", None, (), {}, "", (None, None, None))
        self._made: list[WalkNode] = []  # in creation order
        self._names = _Namespace()
        self._after: WalkNode | None = None  # `inserting_after`'s node, else the end
        self._graph: fx.Graph | None = None
        self._strs: dict[Any, str] = {}  # target -> its name (`_target_to_str`)

    def _target_to_str(self, target: Any) -> str:
        """The name ``fx.Graph`` gives a node of ``target`` (once per target: a walk has
        a few dozen targets and a thousand nodes)."""
        try:
            return self._strs[target]
        except KeyError:
            text = self._strs[target] = fx.Graph._target_to_str(self, target)  # type: ignore[arg-type]
            return text
        except TypeError:  # not hashable
            return fx.Graph._target_to_str(self, target)  # type: ignore[arg-type]

    def create_node(
        self,
        op: str,
        target: Any,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        name: str | None = None,
        type_expr: Any | None = None,
    ) -> WalkNode:
        if self._graph is not None:
            raise RuntimeError("stoker-autograd: a walk gets no node once it is a graph")
        candidate = name if name is not None else self._target_to_str(target)
        after = self._after
        w = WalkNode(
            op,
            target,
            args if args is not None else (),
            kwargs if kwargs is not None else {},
            self._names.create_name(candidate, None),
            (name, type_expr, after),
        )
        prev = after if after is not None else self._root.prev
        w.prev, w.next = prev, prev.next
        prev.next.prev = w
        prev.next = w
        self._made.append(w)
        return w

    @contextmanager
    def inserting_after(self, node: WalkNode) -> Iterator[None]:
        """Nodes made inside go right after ``node`` (each one: as ``fx.Graph``'s)."""
        before, self._after = self._after, node
        try:
            yield
        finally:
            self._after = before

    @property
    def nodes(self) -> _Nodes:
        """The nodes in graph order (``reversed`` too)."""
        return _Nodes(self._root)

    @property
    def last(self) -> WalkNode:
        """The last node in graph order (the root when there is none)."""
        return self._root.prev

    def __len__(self) -> int:
        return len(self._made)

    def to_graph(self) -> fx.Graph:
        """The ``fx.Graph`` of this walk (made once): each node made in the order, at
        the place and with the name the walk's was, its meta moved to it."""
        if self._graph is not None:
            return self._graph
        g = fx.Graph(tracer_cls=PythonKeyTracer)
        for w in self._made:
            name, type_expr, after = w._make
            args, kwargs = _on_graph(w.args), _on_graph(w.kwargs)
            if after is None:
                n = g.create_node(w.op, w.target, args, kwargs, name, type_expr)
            else:
                assert after.node is not None
                with g.inserting_after(after.node):
                    n = g.create_node(w.op, w.target, args, kwargs, name, type_expr)
            if n.name != w.name:  # the names the walk handed out (meta may hold them)
                raise AssertionError(f"stoker-autograd: walk node {w.name} became {n.name}")
            n.meta = w.meta
            w.node = n
        self._graph = g
        return g


class _Nodes:
    """A walk's nodes in graph order, as ``fx.Graph.nodes`` gives them."""

    def __init__(self, root: WalkNode) -> None:
        self._root = root

    def __iter__(self) -> Iterator[WalkNode]:
        w = self._root.next
        while w is not self._root:
            yield w
            w = w.next

    def __reversed__(self) -> Iterator[WalkNode]:
        w = self._root.prev
        while w is not self._root:
            yield w
            w = w.prev


def _each_walk_node(a: Any, seen: dict[WalkNode, None]) -> None:
    """Add each `WalkNode` in the (nested) argument ``a`` to ``seen``, in order."""

    def add(x: Any) -> Any:
        if type(x) is WalkNode:
            seen[x] = None
        return x

    fx.node.map_aggregate(a, add)


def _on_graph(a: Any) -> Any:
    """``a`` with each `WalkNode` replaced by the node made of it."""

    def made(x: Any) -> Any:
        return x.node if type(x) is WalkNode else x

    return fx.node.map_aggregate(a, made)


def graph_module(root: torch.nn.Module, graph: fx.Graph, name: str) -> fx.GraphModule:
    """A GraphModule whose Python code is generated on its first call or print, not now:
    a backward replayed by segments, or loaded from the disk cache, never needs it
    (~0.1 ms per node)."""
    return _LazyGraphModule(root, graph, name)


def fake_tensor(
    fake_mode: FakeTensorMode,
    size: Sequence[int],
    stride: Sequence[int],
    offset: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A fake tensor of this metadata, built directly (~0.02 ms; through the fake
    mode's dispatch ~2 ms): a meta tensor wrapped with its device."""
    if offset:  # a view into a storage that holds all of it
        span = 0 if 0 in size else 1 + sum((n - 1) * st for n, st in zip(size, stride))
        base = torch.empty(offset + span, dtype=dtype, device="meta")
        meta = base.as_strided(size, stride, offset)
    else:
        meta = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    return FakeTensor(fake_mode, meta, torch.device(device))


def contiguous_strides(size: Sequence[int]) -> list[int]:
    """The strides of a contiguous tensor of ``size``."""
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(int(n), 1)
    return strides[::-1]


def check_sizes(t: torch.Tensor | None, expected: Sequence[int], what: str) -> torch.Tensor | None:
    """An opaque call's result must have the sizes the compiled graph was traced for."""
    if t is not None and tuple(t.shape) != tuple(expected):
        raise RuntimeError(
            f"stoker-autograd: {what} returned a tensor of size {tuple(t.shape)}, but the "
            f"compiled backward was traced for {tuple(expected)}. Hooks and custom backwards "
            "must return gradients of the size eager autograd expects."
        )
    return t
