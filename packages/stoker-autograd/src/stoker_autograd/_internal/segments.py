"""Hand a compiler only pure core-aten graphs: split the retraced graph at opaque calls.

The retraced backward interleaves aten ops with Python calls that must run as
they are (hooks, custom backwards, accumulate-grad, size checks).  A compiler
such as stoker-triton's ``compile_graph`` takes a functional aten graph over
tensors and SymInts, so each maximal run of aten nodes becomes one sub-graph,
compiled once; a small runner calls the compiled runs and the Python calls in
the graph's order, and frees each value after its last use.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from . import ops
from .retrace import check_sizes


def is_python_node(n: fx.Node) -> bool:
    """Calls that run in Python: opaque calls, size checks and items of their results."""
    if n.op != "call_function":
        return False
    if ops.is_opaque(n.target) or n.target is check_sizes:
        return True
    src = n.args[0] if n.args else None
    return n.target is operator.getitem and isinstance(src, fx.Node) and is_python_node(src)


def _is_aten_item(n: fx.Node) -> bool:
    src = n.args[0] if n.args else None
    return (
        n.op == "call_function"
        and n.target is operator.getitem
        and isinstance(src, fx.Node)
        and not is_python_node(src)
    )


def _items_beside_their_source(graph: fx.Graph) -> list[fx.Node]:
    """Graph order, except that the items of a multi-output aten op follow it at once.

    A segment takes and returns tensors and SymInts, never a tuple; keeping each
    ``getitem`` beside its source puts both in the same segment (retracing may
    have scheduled an item after an opaque call that cuts the run).
    """
    order: list[fx.Node] = []
    for n in graph.nodes:
        if _is_aten_item(n):
            continue  # placed right after its source
        order.append(n)
        if not is_python_node(n):
            order += [u for u in n.users if _is_aten_item(u)]
    return order


@dataclass
class _Segment:
    fn: Callable[..., Any]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    gm: fx.GraphModule


@dataclass
class _Call:
    node: fx.Node


class SegmentedBackward:
    """Runs compiled aten segments and Python calls in graph order."""

    def __init__(self, gm: fx.GraphModule, compiler: Callable[..., Any]) -> None:
        graph = gm.graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in graph.nodes if n.op == "output")
        self.steps: list[_Segment | _Call] = []
        run: list[fx.Node] = []
        for n in _items_beside_their_source(graph):
            if n.op in ("placeholder", "output"):
                continue
            if is_python_node(n):
                self._flush(gm, run, compiler)
                run = []
                self.steps.append(_Call(n))
            else:
                run.append(n)
        self._flush(gm, run, compiler)
        self._plan_frees()

    @property
    def segments(self) -> list[fx.GraphModule]:
        return [s.gm for s in self.steps if isinstance(s, _Segment)]

    def _flush(self, gm: fx.GraphModule, run: list[fx.Node], compiler: Callable[..., Any]) -> None:
        if not run:
            return
        members = set(run)
        inputs: list[fx.Node] = []
        for n in run:
            for a in n.all_input_nodes:
                if a not in members and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in run if any(u not in members for u in n.users)]
        if not outputs:
            return  # nothing outside reads it
        g = fx.Graph()
        remap: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            p = g.placeholder(a.name)
            p.meta = dict(a.meta)
            remap[a] = p
        for n in run:
            remap[n] = g.node_copy(n, lambda x: remap[x])
        g.output(tuple(remap[o] for o in outputs))
        sub = fx.GraphModule(gm, g, "StokerBackwardSegment")
        examples = [a.meta.get("val") for a in inputs]
        self.steps.append(_Segment(compiler(sub, examples), inputs, outputs, sub))

    def _plan_frees(self) -> None:
        last: dict[fx.Node, int] = {}
        for i, s in enumerate(self.steps):
            used = s.inputs if isinstance(s, _Segment) else s.node.all_input_nodes
            for a in used:
                last[a] = i
        keep = set(self.output.all_input_nodes)
        self.frees: list[list[fx.Node]] = [[] for _ in self.steps]
        for n, i in last.items():
            if n not in keep:
                self.frees[i].append(n)

    def __call__(self, *args: Any) -> Any:
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, args))
        for step, frees in zip(self.steps, self.frees):
            if isinstance(step, _Segment):
                outs = step.fn(*[env[a] for a in step.inputs])
                for o, v in zip(step.outputs, outs):
                    env[o] = v
            else:
                n = step.node
                a, k = fx.map_arg((n.args, n.kwargs), lambda x: env[x])
                env[n] = n.target(*a, **k)  # type: ignore[operator]
            for f in frees:
                env.pop(f, None)
        return fx.map_arg(self.output.args[0], lambda x: env[x])
