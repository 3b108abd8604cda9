"""Boxed calls: a graph that takes its inputs in one list and empties it.

A backward called as ``fn(*saved, *grads)`` keeps every saved tensor alive until
it returns: the caller's argument tuple holds them. Eager's engine frees each
saved tensor once the node that reads it has run. A boxed callable takes a list
it may empty (``fn(args)``); once it has bound the inputs to its own names, each
one nobody else holds is freed after its last reader. stoker-triton's
``CompiledGraph.call_boxed`` does so in its generated wrapper; `mark_boxed`
does it for an FX graph run as is (the aten executor): FX's generated code
already drops each value after its last use.

`mark_boxed` neither copies the graph nor makes a second module: its `BoxedGraph`
generates the graph's Python code once, at its first call or print, with a prologue
that reads the inputs from the list and empties it (a warm start that loads a
backward from the disk cache pays for one code generation, not a copy and one).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import CodeGen
from torch.fx.graph_module import _forward_from_src


def boxed_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` called as ``new(args)``: it reads ``args[i]`` for its i-th
    placeholder, empties ``args``, then runs ``gm``'s nodes (for a graph `BoxedGraph`
    cannot take: a placeholder with a default, or a graph with its own code generator)."""
    g = fx.Graph()
    args = g.placeholder("args")
    remap: dict[fx.Node, fx.Node] = {}
    old = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, p in enumerate(old):
        # the placeholder's name again (deduplicated): the generated code stays readable
        item = g.create_node("call_function", operator.getitem, (args, i), name=p.name)
        item.meta = dict(p.meta)
        remap[p] = item
    g.call_method("clear", (args,))
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            remap[n] = g.node_copy(n, lambda x: remap[x])
    # its Python code is made at its first run, as for the graph it copies
    return _LazyGraphModule(gm, g, type(gm).__name__)


class _BoxedCodeGen(CodeGen):
    """FX's code generator with a boxed signature: ``def forward(self, args)``, then
    ``name = args[i]`` for each placeholder some node reads, then ``args.clear()``
    (an input nobody reads is not bound: the list held it last)."""

    def __init__(self, read: list[bool]) -> None:
        super().__init__()
        self.read = read  # per placeholder, in order: does a node read it

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **_: Any) -> str:
        names = [v.split(":")[0].split("#")[0].strip() for v in free_vars if v != "self"]
        assert len(names) == len(self.read), (names, self.read)
        lines = [f"def forward(self, args){maybe_return_annotation}:"]
        lines += [f"    {v} = args[{i}]" for i, (v, r) in enumerate(zip(names, self.read)) if r]
        return "\n".join([*lines, "    args.clear()"])


def _boxable(gm: fx.GraphModule) -> bool:
    """FX's default code generator, and placeholders that are plain names."""
    if type(gm.graph._codegen) is not CodeGen:
        return False
    return all(
        not n.args and not n.name.startswith("*") for n in gm.graph.find_nodes(op="placeholder")
    )


class BoxedGraph:
    """``gm`` called as ``fn(args)`` (`call_boxed`): binds ``args[i]`` to its i-th
    placeholder, empties ``args``, runs ``gm``'s nodes. Shares ``gm``'s graph (a change
    to it after the first call is not seen); ``fn(*args)`` works too."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self._forward: Callable[..., Any] | None = None

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def has_code(self) -> bool:
        """Its Python code has been generated (by a call or `code`)."""
        return self._forward is not None

    @property
    def code(self) -> str:
        """The generated Python code (generated now if not yet)."""
        fn = self._forward if self._forward is not None else self._generate()
        return str(fn.__stoker_src__)  # type: ignore[attr-defined]

    def _generate(self) -> Callable[..., Any]:
        graph = self.gm.graph
        prior = graph._codegen
        graph._codegen = _BoxedCodeGen([bool(p.users) for p in graph.find_nodes(op="placeholder")])
        try:
            code = graph.python_code(root_module="self")
        finally:
            graph._codegen = prior
        fn = _forward_from_src(code.src, code.globals)
        fn.__stoker_src__ = code.src  # type: ignore[attr-defined]
        self._forward = fn
        return fn

    def call_boxed(self, args: list[Any]) -> Any:
        fn = self._forward if self._forward is not None else self._generate()
        return fn(self.gm, args)

    def __call__(self, *args: Any) -> Any:
        return self.call_boxed(list(args))

    def __repr__(self) -> str:
        return f"BoxedGraph({type(self.gm).__name__})"


def call_boxed(fn: Callable[..., Any], args: list[Any]) -> Any:
    """Call ``fn`` with ``args``: boxed where it takes a list (``fn.call_boxed``, or a
    `boxed_module`, marked ``_stoker_boxed``), else unpacked (the list is emptied
    all the same, so it holds nothing during the call)."""
    # looked up on the callable itself, never through a wrapper's __getattr__ that
    # forwards to what it wraps (a CUDA-graph replayer would be bypassed)
    boxed = getattr(type(fn), "call_boxed", None)
    if boxed is not None:
        return boxed(fn, args)
    if getattr(fn, "__dict__", {}).get("_stoker_boxed", False):
        return fn(args)
    unpacked = tuple(args)
    args.clear()
    return fn(*unpacked)


def mark_boxed(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm`` called boxed by `call_boxed`: a `BoxedGraph` (no copy of the graph), or
    for a graph it cannot take a `boxed_module` marked ``_stoker_boxed``."""
    if _boxable(gm):
        return BoxedGraph(gm)
    new = boxed_module(gm)
    new._stoker_boxed = True  # type: ignore[assignment]
    return new
