"""FX graphs to and from JSON (no pickles, no exec): aten ops by qualified name.

Values an argument may hold: nodes, ints, floats (inf/nan too), bools, None,
strings, dtypes, devices, layouts, memory formats, and lists/tuples of them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..errors import ExportFormatError, UnsupportedError

_PY_FUNCS: dict[str, Any] = {
    **{
        f"operator.{n}": getattr(operator, n)
        for n in (
            "getitem",
            "add",
            "sub",
            "mul",
            "floordiv",
            "truediv",
            "mod",
            "neg",
            "pow",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
        )
    },
    "math.ceil": math.ceil,
    "math.floor": math.floor,
    **{
        f"torch.{n}": getattr(torch, n)
        for n in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_sum")
    },
}
_PY_NAMES = {id(v): k for k, v in _PY_FUNCS.items()}
_META_KEYS = ("stack_trace", "stoker_phase", "stoker_module_path", "stoker_recomputed")


def _target_to_json(t: Any) -> str:
    if isinstance(t, torch._ops.OpOverload):
        return f"op:{t.namespace}.{t._opname}.{t._overloadname}"
    name = _PY_NAMES.get(id(t))
    if name is None:
        raise UnsupportedError(
            f"cannot save a graph calling {t!r}: only aten ops and "
            "symbolic-size operations are serializable"
        )
    return f"py:{name}"


def _target_from_json(s: str) -> Any:
    kind, _, name = s.partition(":")
    if kind == "py" and name in _PY_FUNCS:
        return _PY_FUNCS[name]
    if kind == "op":
        ns, op, overload = name.split(".")
        try:
            return getattr(getattr(getattr(torch.ops, ns), op), overload)
        except AttributeError as e:
            raise ExportFormatError(f"unknown operator {name} (saved by another torch?)") from e
    raise ExportFormatError(f"unknown call target {s!r}")


def _arg_to_json(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if a is None or isinstance(a, bool | str):
        return a
    if isinstance(a, int):
        return a
    if isinstance(a, float):
        return a if math.isfinite(a) else {"float": str(a)}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout):
        return {"layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).removeprefix("torch.")}
    if isinstance(a, list | tuple):
        return {"list" if isinstance(a, list) else "tuple": [_arg_to_json(x) for x in a]}
    raise UnsupportedError(f"cannot save a graph argument of type {type(a).__qualname__}: {a!r}")


def _arg_from_json(a: Any, env: dict[str, fx.Node]) -> Any:
    if not isinstance(a, dict):
        return a
    ((k, v),) = a.items()
    if k == "node":
        return env[v]
    if k == "float":
        return float(v)
    if k in ("dtype", "layout", "memory_format"):
        return getattr(torch, v)
    if k == "device":
        return torch.device(v)
    if k in ("list", "tuple"):
        items = [_arg_from_json(x, env) for x in v]
        return items if k == "list" else tuple(items)
    raise ExportFormatError(f"unknown argument encoding {k!r}")


def graph_to_json(gm: fx.GraphModule) -> list[dict[str, Any]]:
    nodes = []
    for n in gm.graph.nodes:
        d: dict[str, Any] = {"op": n.op, "name": n.name}
        if n.op == "call_function":
            d["target"] = _target_to_json(n.target)
        elif n.op not in ("placeholder", "output"):
            raise UnsupportedError(f"cannot save node {n.name} ({n.op})")
        d["args"] = _arg_to_json(tuple(n.args))
        d["kwargs"] = {k: _arg_to_json(v) for k, v in n.kwargs.items()}
        d["meta"] = {k: n.meta[k] for k in _META_KEYS if isinstance(n.meta.get(k), str | bool)}
        nodes.append(d)
    return nodes


def graph_from_json(nodes: list[dict[str, Any]], class_name: str | None = None) -> fx.GraphModule:
    """The graph module of `graph_to_json`'s nodes; with ``class_name``, a lazy one
    of that class name (its Python code generated when first run or printed)."""
    g = fx.Graph()
    add_nodes(g, nodes)
    g.lint()
    if class_name is not None:
        from torch.fx._lazy_graph_module import _LazyGraphModule

        return _LazyGraphModule(torch.nn.Module(), g, class_name=class_name)
    return fx.GraphModule(torch.nn.Module(), g)


def add_nodes(
    g: fx.Graph,
    nodes: list[dict[str, Any]],
    target: Callable[[str], Any] | None = None,
    get_attr: Callable[[dict[str, Any]], str] | None = None,
) -> dict[str, fx.Node]:
    """Append `graph_to_json`'s nodes to `g`; returns them by name. `target` reads a
    call's target (default: aten ops and Python operators by qualified name);
    `get_attr(d)` sets up a constant node's attribute and returns its name
    (default: constants are refused)."""
    env: dict[str, fx.Node] = {}
    for d in nodes:
        args = _arg_from_json(d["args"], env)
        kwargs = {k: _arg_from_json(v, env) for k, v in d["kwargs"].items()}
        if d["op"] == "placeholder":
            node = g.placeholder(d["name"])
        elif d["op"] == "output":
            node = g.output(args[0])
        elif d["op"] == "call_function":
            fn = (target or _target_from_json)(d["target"])
            node = g.create_node("call_function", fn, args, kwargs, name=d["name"])
        elif d["op"] == "get_attr" and get_attr is not None:
            node = g.create_node("get_attr", get_attr(d), name=d["name"])
        else:
            raise ExportFormatError(f"unknown node kind {d['op']!r}")
        node.meta.update(d.get("meta", {}))
        env[d["name"]] = node
    return env
