"""Hand a compiler only pure core-aten graphs: split the retraced graph at Python calls.

The retraced backward interleaves aten ops with Python calls that must run as
they are (hooks, custom backwards, size checks of their results, the final
callbacks).  A compiler such as stoker-triton's ``compile_graph`` takes a
functional aten graph over tensors and SymInts, so each maximal run of aten
nodes between two Python calls becomes one sub-graph, compiled once; a small
runner calls the compiled runs and the Python calls in the graph's order, and
frees each value after its last use.

Accumulate-grad does not cut a run.  Its gradient becomes an output of the
segment, and the runner applies the run's accumulate-grads (``ops.accumulate_grad``,
eager's rules) in graph order right after the segment, so before the next Python
call: a hook, a custom backward or a final callback sees exactly the ``.grad``
eager shows at that point, and no aten op reads ``.grad``.  An accumulate-grad
whose result an aten op reads stays a Python call.
"""

from __future__ import annotations

import operator
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from stoker_capture._internal.runtime.boxed import BoxedGraph, call_boxed, mark_boxed

from . import ops
from .graph import check_sizes


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
    # items in graph order, not in ``n.users``' order: that is the order the uses were
    # made, which differs between a retraced graph and the same graph loaded from the
    # disk cache, and the segments' code (so stoker-triton's cache key) follows it
    pos = {n: i for i, n in enumerate(graph.nodes)}
    order: list[fx.Node] = []
    for n in graph.nodes:
        if _is_aten_item(n):
            continue  # placed right after its source
        order.append(n)
        if not is_python_node(n):
            order += sorted((u for u in n.users if _is_aten_item(u)), key=pos.__getitem__)
    return order


def is_deferred_accumulate(n: fx.Node) -> bool:
    """An accumulate-grad that a run of aten ops keeps: only Python calls read its result."""
    return (
        n.op == "call_function"
        and n.target is ops.accumulate_grad
        and all(is_python_node(u) for u in n.users)
    )


def _may_steal(acc: fx.Node, produced: set[fx.Node]) -> bool:
    """The graph's half of the stealing rule: this run computed the gradient with an aten
    op (or is an item of one's outputs, as the weight and bias gradients of
    ``native_layer_norm_backward``), and the accumulate-grad is its only reader (the
    runner checks the tensor)."""
    g = acc.args[2] if len(acc.args) == 4 else None
    if not isinstance(g, fx.Node) or g not in produced or len(g.users) != 1:
        return False
    op = g.args[0] if _is_aten_item(g) else g
    return isinstance(op, fx.Node) and isinstance(op.target, torch._ops.OpOverload)


@dataclass
class _Segment:
    fn: Callable[..., Any] | None  # None: the run has accumulate-grads only
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    gm: fx.GraphModule | None
    accumulates: list[tuple[fx.Node, bool]]  # applied after fn, in order; (node, may steal)
    # per accumulate: outputs read last by it, dropped right after (a copied gradient
    # is freed before the next one is copied, as when each accumulate had its segment)
    drops: list[list[fx.Node]] = field(default_factory=list)
    # per accumulate: a function reading its arguments from the env without fx.map_arg
    # (None: an argument of another kind, mapped by fx)
    readers: list[Callable[[dict[fx.Node, Any]], tuple[Any, ...]] | None] | None = None

    @property
    def steals(self) -> bool:
        """Some accumulate-grad may take its gradient without a copy."""
        return any(may for _, may in self.accumulates)


@dataclass
class _Call:
    node: fx.Node


class SegmentedBackward:
    """Runs compiled aten segments, their accumulate-grads and Python calls in graph order."""

    def __init__(self, gm: fx.GraphModule, compiler: Callable[..., Any]) -> None:
        graph = gm.graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in graph.nodes if n.op == "output")
        self.steps: list[_Segment | _Call] = []
        run: list[fx.Node] = []
        accs: list[fx.Node] = []
        for n in _items_beside_their_source(graph):
            if n.op in ("placeholder", "output"):
                continue
            if is_deferred_accumulate(n):
                accs.append(n)
            elif is_python_node(n):
                self._flush(gm, run, accs, compiler)
                run, accs = [], []
                self.steps.append(_Call(n))
            else:
                run.append(n)
        self._flush(gm, run, accs, compiler)
        self._plan_frees()
        # the graph's result: read from the env without fx.map_arg when it is a flat
        # list or tuple of nodes and Nones (compiled autograd's: one gradient per input)
        result = self.output.args[0]
        flat = isinstance(result, list | tuple) and all(
            x is None or isinstance(x, fx.Node) for x in result
        )
        self._result: tuple[fx.Node | None, ...] | None = tuple(result) if flat else None

    @property
    def segments(self) -> list[fx.GraphModule]:
        """The compiled sub-graphs, in order."""
        return [s.gm for s in self.steps if isinstance(s, _Segment) and s.gm is not None]

    def boxed_graphs(self) -> list[BoxedGraph]:
        """The segments run as is (the aten executor), in order: their code can be
        stored and loaded (`BoxedGraph.stored`)."""
        return [
            s.fn for s in self.steps if isinstance(s, _Segment) and isinstance(s.fn, BoxedGraph)
        ]

    def _flush(
        self,
        gm: fx.GraphModule,
        run: list[fx.Node],
        accs: list[fx.Node],
        compiler: Callable[..., Any],
    ) -> None:
        members = set(run)
        inputs: list[fx.Node] = []
        for n in run:
            for a in n.all_input_nodes:
                if a not in members and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in run if any(u not in members for u in n.users)]
        accumulates = [(a, _may_steal(a, members)) for a in accs]
        if not outputs:  # nothing outside reads the run
            if accumulates:
                self.steps.append(_Segment(None, [], [], None, accumulates))
            return
        g = fx.Graph()
        remap: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            p = g.placeholder(a.name)
            p.meta = dict(a.meta)
            remap[a] = p
        for n in run:
            remap[n] = g.node_copy(n, lambda x: remap[x])
        g.output(tuple(remap[o] for o in outputs))
        # its Python code is made at its first run or print: a compiler that loads the
        # segment from its cache never runs it (~0.04 s for gpt-m's 643-node backward)
        sub = _LazyGraphModule(gm, g, "StokerBackwardSegment")
        examples = [a.meta.get("val") for a in inputs]
        fn = compiler(sub, examples)
        if isinstance(fn, fx.GraphModule):  # run as is (the aten executor): boxed
            fn = mark_boxed(fn)
        self.steps.append(_Segment(fn, inputs, outputs, sub, accumulates))

    def _plan_frees(self) -> None:
        last: dict[fx.Node, int] = {}
        for i, s in enumerate(self.steps):
            if isinstance(s, _Segment):
                used = s.inputs + [a for acc, _ in s.accumulates for a in acc.all_input_nodes]
            else:
                used = s.node.all_input_nodes
            for a in used:
                last[a] = i
        keep = set(self.output.all_input_nodes)
        self.frees: list[list[fx.Node]] = [[] for _ in self.steps]
        for n, i in last.items():
            if n not in keep:
                self.frees[i].append(n)
        # a segment's inputs it reads last (and its accumulate-grads do not): dropped
        # before the call, so the segment holds the only reference and frees them
        self.early: list[list[fx.Node]] = [[] for _ in self.steps]
        for i, s in enumerate(self.steps):
            if isinstance(s, _Segment):
                s.drops = _drops(s, {n for n in self.frees[i] if n in set(s.outputs)})
                acc_in = {a for acc, _ in s.accumulates for a in acc.all_input_nodes}
                ins = set(s.inputs)
                self.early[i] = [n for n in self.frees[i] if n in ins and n not in acc_in]
                self.frees[i] = [n for n in self.frees[i] if n not in self.early[i]]

    def call_boxed(self, args: list[Any]) -> Any:
        """Run on a list it empties: each value is freed after its last reader (a
        segment's input it reads last is handed over boxed, so the segment frees it)."""
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, args))
        args.clear()
        for step, frees, early in zip(self.steps, self.frees, self.early):
            if isinstance(step, _Segment):
                # the inputs dropped here, still seen by the stealing rule while alive
                watch: list[weakref.ref[torch.Tensor]] = []
                if step.fn is not None:
                    seg_args = [env[x] for x in step.inputs]
                    if step.steals:
                        watch = [weakref.ref(env[x]) for x in early if _is_tensor(env[x])]
                    for x in early:
                        del env[x]
                    env.update(zip(step.outputs, call_boxed(step.fn, seg_args)))
                if step.accumulates:
                    _apply_accumulates(step, env, watch)
            else:
                n = step.node
                a, k = fx.map_arg((n.args, n.kwargs), lambda x: env[x])
                env[n] = n.target(*a, **k)  # type: ignore[operator]
            for f in frees:
                env.pop(f, None)
        if self._result is not None:  # a list (the engine takes a list; fx's would be copied)
            return [None if n is None else env[n] for n in self._result]
        return fx.map_arg(self.output.args[0], lambda x: env[x])

    def __call__(self, *args: Any) -> Any:
        return self.call_boxed(list(args))


def _drops(step: _Segment, freed: set[fx.Node]) -> list[list[fx.Node]]:
    """For each accumulate-grad of ``step``: the outputs in ``freed`` it reads last."""
    last: dict[fx.Node, int] = {}
    for j, (acc, _) in enumerate(step.accumulates):
        for a in acc.all_input_nodes:
            last[a] = j
    drops: list[list[fx.Node]] = [[] for _ in step.accumulates]
    for a, j in last.items():
        if a in freed:
            drops[j].append(a)
    return drops


def _apply_accumulates(
    step: _Segment, env: dict[fx.Node, Any], dropped: list[weakref.ref[torch.Tensor]]
) -> None:
    """Each accumulate-grad of a segment, in graph order, as eager applies it.

    A gradient may be stolen (become ``.grad`` itself, no copy) when the graph says
    nobody else reads it and the tensor the compiler returned is its own memory: it
    fills its storage exactly, and no other live input or output of the segment
    shares that storage (counted once, at the first candidate: values freed since
    only make it stricter, and a value stolen later was counted alone).
    ``dropped``: the segment's inputs handed over boxed; one still alive (someone
    else holds it, or an output is its view) is counted as a live input.  A
    tensor may be a view of a buffer internal to the compiled segment (a transposed
    matmul result); eager steals views too, so it is handed over detached.  A compiled
    function whose outputs are static buffers (``fn.static_outputs``: a CUDA graph's,
    overwritten by its next replay) never gives up a gradient: it is copied.
    """
    values: list[Any] | None = None  # the segment's live inputs and outputs
    ids: dict[int, int] | None = None  # how often each object is among them
    shared: dict[int, int] | None = None  # how many of them share each storage
    # e.g. CUDA graphs' static buffers; under create_graph (grad mode on) eager steals
    # nothing: .grad keeps the gradient's history
    static = getattr(step.fn, "static_outputs", False) or torch.is_grad_enabled()
    readers = step.readers
    if readers is None:
        readers = step.readers = [_reader(acc) for acc, _ in step.accumulates]
    for (acc, may_steal), drops, read in zip(step.accumulates, step.drops, readers):
        a: Any = read(env) if read is not None else fx.map_arg(acc.args, env.__getitem__)
        if may_steal and not static and a[0].grad is None and a[2].layout == torch.strided:
            variable, variable_grad, g, has_post_hooks = a
            if values is None:
                values = [env.get(n) for n in step.inputs] + [r() for r in dropped]
                values += [env.get(n) for n in step.outputs]
                ids = Counter(map(id, values))
            storage = g.untyped_storage()
            if _use_count(storage._cdata) == 2:
                # g's and `storage`'s own references: one tensor holds this storage, so
                # the values sharing it are g's occurrences (no storage read per value)
                assert ids is not None
                alone = ids.get(id(g), 0) == 1
            else:
                if shared is None:
                    shared = _storage_counts(values)
                alone = shared.get(storage.data_ptr(), 0) == 1
            fresh = alone and g.nbytes == storage.nbytes()  # fills its storage
            del storage
            if fresh and g._is_view():  # of a buffer nobody else holds: eager steals it too
                g = g.detach()
            env[acc] = ops.accumulate_grad(variable, variable_grad, g, has_post_hooks, fresh)
        else:
            env[acc] = ops.accumulate_grad(*a)
        del a
        for n in drops:
            env.pop(n, None)


def _reader(acc: fx.Node) -> Callable[[dict[fx.Node, Any]], tuple[Any, ...]] | None:
    """How to read an accumulate's arguments: one generated line that looks its nodes
    up in the env and puts its plain constants (None, bools) beside them."""
    scope: dict[str, Any] = {}
    items: list[str] = []
    for i, x in enumerate(acc.args):
        if isinstance(x, fx.Node):
            scope[f"n{i}"] = x
            items.append(f"env[n{i}]")
        elif x is None or isinstance(x, bool | int | float | str):
            scope[f"c{i}"] = x
            items.append(f"c{i}")
        else:
            return None
    if acc.kwargs:
        return None
    src = f"def read(env):\n    return ({', '.join(items)},)\n"
    exec(compile(src, "<stoker accumulate-grad arguments>", "exec"), scope)
    read: Callable[[dict[fx.Node, Any]], tuple[Any, ...]] = scope["read"]
    return read


_use_count: Callable[[int], int] = torch._C._storage_Use_Count


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _storage_counts(values: list[Any]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for v in values:
        if isinstance(v, torch.Tensor) and v.layout == torch.strided:  # sparse: no storage
            k = v.untyped_storage().data_ptr()
            counts[k] = counts.get(k, 0) + 1
    return counts
