"""No-op copies: a same-layout `clone` reads its input's buffer.

The one rule (Inductor's post-grad `remove_noop_ops`, for copies): a
`clone` / `_to_copy` / `contiguous` whose result has exactly its input's
layout (`meta["val"]`: sizes, strides, storage offset, dtype, device, layout)
is the same tensor as its input, so its consumers may read the input's value
(and buffer) instead of a second copy. It applies only where the aliasing
cannot be observed:

- neither the copy nor its input (nor anything sharing their storage through
  views) is written in place by any node of the graph (non-functional graphs,
  `copy_` epilogues of input mutations; a higher-order op counts as writing
  every tensor it takes): a copy taken before a write must keep
  the old values; a clone of a graph input is never a no-op when the graph
  writes any input (inputs may share storage);
- the copy (or a view of it) is not a graph output: an output must not alias
  an input or another output.

`lower_graph` binds such a copy to its input's value; when the input is itself
a graph output (stored anyway), it is stored right there in its output layout,
so the copy's consumers (an extern `bmm` through `expand`/`view`) read that one
buffer instead of a second store of the same values.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .core import LOWERINGS

aten = torch.ops.aten

COPY_OPS = frozenset({aten.clone.default, aten._to_copy.default, aten.contiguous.default})


def noop_copies(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The copy nodes of `gm` the rule above applies to."""
    nodes = list(gm.graph.nodes)
    written = {_root(a) for n in nodes for a in _written_args(n)}
    if any(w.op == "placeholder" for w in written):
        written |= {n for n in nodes if n.op == "placeholder"}
    out = next((n for n in reversed(nodes) if n.op == "output"), None)
    out_leaves = torch.utils._pytree.tree_leaves(out.args[0]) if out is not None else []
    out_roots = {_root(o) for o in out_leaves if isinstance(o, torch.fx.Node)}
    found: set[torch.fx.Node] = set()
    for n in nodes:
        if n.op != "call_function" or n.target not in COPY_OPS or not n.args:
            continue
        src = n.args[0]
        if not isinstance(src, torch.fx.Node) or not _same_layout(n, src):
            continue
        if n in out_roots or n in written or _root(src) in written:
            continue
        found.add(n)
    return found


def _same_layout(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    if (va.dtype, va.device, va.layout) != (vb.dtype, vb.device, vb.layout):
        return False
    if va.layout != torch.strided or va.ndim != vb.ndim:
        return False
    pairs = [
        *zip(va.shape, vb.shape),
        *zip(va.stride(), vb.stride()),
        (va.storage_offset(), vb.storage_offset()),
    ]
    return all(_same_int(x, y) for x, y in pairs)


def _same_int(x: Any, y: Any) -> bool:
    """Equal without adding a guard: ints by value, SymInts by expression."""
    if isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
        ex = x.node.expr if isinstance(x, torch.SymInt) else x
        ey = y.node.expr if isinstance(y, torch.SymInt) else y
        return bool(ex == ey)
    return bool(x == y)


def _aliases_input(n: torch.fx.Node) -> bool:
    """`n`'s value may share storage with its first argument (conservative:
    every op lowered as a view, and every op whose schema returns an alias)."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], torch.fx.Node):
        return False
    if n.target is operator.getitem:
        return True
    rule = LOWERINGS.get(n.target)
    if rule is not None and rule.kind == "view":
        return True
    schema = getattr(n.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _root(n: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage `n` views (itself when `n` is not a view)."""
    while _aliases_input(n):
        arg = n.args[0]
        assert isinstance(arg, torch.fx.Node)
        n = arg
    return n


def _written_args(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes `n` writes in place (schema arguments marked `(a!)`; every
    tensor argument of a higher-order op, whose writes no schema states)."""
    if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
        leaves = torch.utils._pytree.tree_leaves((n.args, n.kwargs))
        return [x for x in leaves if isinstance(x, torch.fx.Node)]
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None:
        return []
    out: list[torch.fx.Node] = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
        out += [
            x for x in (v if isinstance(v, list | tuple) else [v]) if isinstance(x, torch.fx.Node)
        ]
    return out
