"""Boxed calls: a graph that takes its inputs in one list and empties it.

A backward called as ``fn(*saved, *grads)`` keeps every saved tensor alive until
it returns: the caller's argument tuple holds them. Eager's engine frees each
saved tensor once the node that reads it has run. A boxed callable takes a list
it may empty (``fn(args)``); once it has bound the inputs to its own names, each
one nobody else holds is freed after its last reader. stoker-triton's
``CompiledGraph.call_boxed`` does so in its generated wrapper; `boxed_module`
does it for an FX graph run as is (the aten executor): FX's generated code
already drops each value after its last use.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule


def boxed_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` called as ``new(args)``: it reads ``args[i]`` for its i-th
    placeholder, empties ``args``, then runs ``gm``'s nodes."""
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


def mark_boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a `boxed_module`, marked so that `call_boxed` hands it the list."""
    new = boxed_module(gm)
    new._stoker_boxed = True  # type: ignore[assignment]
    return new
