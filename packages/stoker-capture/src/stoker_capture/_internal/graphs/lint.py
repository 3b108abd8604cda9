"""Debug checks between stages (``AOTConfig(debug_checks=True)`` or ``STOKER_CHECK=1``).

Invariants every graph between stages keeps: ``graph.lint()`` passes; every
call is a functional (non-mutating, no ``out=``) aten/prims op, a symbolic
size op, or ``operator.getitem``; other nodes are inputs, tensor constants
(``get_attr``) and the output; every node that returns something has a
``val`` in its meta.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..errors import GraphLintError

_PY_OPS = {
    operator.getitem,
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.truediv,
    operator.mod,
    operator.neg,
    operator.pow,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    math.ceil,
    math.floor,
    torch.sym_float,
    torch.sym_int,
    torch.sym_max,
    torch.sym_min,
    torch.sym_not,
    torch.sym_sum,
}


def lint_graph(gm: fx.GraphModule, where: str) -> None:
    """Raise `GraphLintError` naming the first node that breaks an invariant."""
    try:
        gm.graph.lint()
    except Exception as e:
        raise GraphLintError(f"{where}: graph.lint() failed: {e}") from e
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr" and isinstance(_attr(gm, str(n.target)), torch.Tensor):
            continue  # a tensor constant the trace lifted (e.g. torch.tensor(...) in fn)
        if n.op != "call_function":
            raise GraphLintError(
                f"{where}: node {n.name} is a {n.op}; only call_function "
                "nodes are allowed in a captured graph"
            )
        t = n.target
        if isinstance(t, torch._ops.OpOverload):
            if t.namespace not in ("aten", "prims"):
                raise GraphLintError(f"{where}: node {n.name} calls {t}, not an aten/prims op")
            schema = t._schema
            if schema.is_mutable or any(a.is_out for a in schema.arguments):
                raise GraphLintError(
                    f"{where}: node {n.name} calls {t}, which mutates its "
                    "inputs; captured graphs are functional"
                )
        elif t not in _PY_OPS:
            raise GraphLintError(
                f"{where}: node {n.name} calls {t!r}, which is neither an "
                "aten op nor a symbolic-size operation"
            )
        returns_nothing = isinstance(t, torch._ops.OpOverload) and not t._schema.returns
        if "val" not in n.meta and not returns_nothing:  # e.g. aten._linalg_check_errors
            raise GraphLintError(f"{where}: node {n.name} has no meta['val']")


def _attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj
