"""What a persistent cache keys a compiled graph by, as text, and its guards' replay.

Shared by the on-disk caches of later stages (stoker-capture's captured
graphs, stoker-triton's compiled graphs): each hashes the lines these give,
with its own config and code version, and replays the guards a cold compile
added into the shape env of a warm one.

| text of | what it holds |
|---|---|
| `graph_text` | every node: op, name, target (qualified), args, kwargs, ``meta["val"]`` (or Dynamo's ``example_value``); subgraphs inline; modules by repr |
| `val_text` | a tensor's dtype, device, sizes, strides, offset, requires_grad, layout (symbolic sizes as expressions); with ``data`` a real tensor's values by hash |
| `shape_env_text` | each input symbol's replacement and range, and the guards already held |
| `source_hash` | a hash of a package's sources (a changed generator never reads an older entry) |
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.fx


def target_text(t: Any) -> str:
    """A call target by qualified name (ops as ``op:<name>``)."""
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return f"op:{t}"
    mod = getattr(t, "__module__", None) or type(t).__module__
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)
    return f"{mod}.{name}"


def val_text(v: Any, data: bool = False) -> str:
    """A value's metadata as text: tensors by metadata, and with ``data`` (a real
    tensor written into the graph's arguments) by a hash of their values too."""
    if isinstance(v, torch.Tensor) and data and not is_fake(v):
        values = hashlib.sha256(
            v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        )
        return val_text(v) + "=" + values.hexdigest()[:16]
    if isinstance(v, torch.Tensor):
        try:
            stride = tuple(str(s) for s in v.stride())
            offset = str(v.storage_offset())
        except (RuntimeError, NotImplementedError):  # sparse, nested: no strides
            stride, offset = (), "-"
        shape = tuple(str(s) for s in v.shape)
        return (
            f"T[{v.dtype},{v.device},{shape},{stride},{offset},{int(v.requires_grad)},{v.layout}]"
        )
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return f"S[{type(v).__name__},{v.node.expr}]"
    if isinstance(v, list | tuple):
        return type(v).__name__ + "(" + ",".join(val_text(x, data) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k!r}:{val_text(x, data)}" for k, x in v.items()) + "}"
    if isinstance(v, torch.fx.Node):
        return f"%{v.name}"
    if callable(v) and not isinstance(v, type):
        return target_text(v)
    return repr(v)


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def graph_text(gm: torch.fx.GraphModule) -> list[str]:
    """One line per node (subgraphs inline): what a compile of ``gm`` reads of it."""
    lines = []
    for n in gm.graph.nodes:
        val = n.meta.get("val", n.meta.get("example_value"))
        args = f"{val_text(n.args, data=True)} {val_text(n.kwargs, data=True)}"
        line = f"{n.op} {n.name} {target_text(n.target)} {args} :: {val_text(val)}"
        if n.op in ("get_attr", "call_module"):
            sub = getattr(gm, str(n.target), None)
            if isinstance(sub, torch.fx.GraphModule):  # a subgraph (higher-order op): its code
                lines += [f"subgraph {n.target}:", *graph_text(sub)]
            elif isinstance(sub, torch.nn.Module):
                line += " = " + repr(sub)
            else:
                line += " = " + val_text(sub)
        lines.append(line)
    return lines


def shape_env_text(shape_env: Any, inputs: list[Any]) -> list[str]:
    """What of the shape env a compile reads: each input symbol's replacement and
    range, and the guards already held (a compile guards only what they do not imply)."""
    if shape_env is None:
        return ["static"]
    syms: set[Any] = set()
    for t in inputs:
        vals = [t] if not isinstance(t, torch.Tensor) else [*t.shape, *_strides(t)]
        for s in vals:
            if isinstance(s, torch.SymInt | torch.SymFloat | torch.SymBool):
                syms |= s.node.expr.free_symbols
    lines = [
        f"sym {s} -> {shape_env.replace(s)} in {shape_env.var_to_range.get(s)}"
        for s in sorted(syms, key=str)
    ]
    lines += [f"guard {g.expr}" for g in shape_env.guards]
    return lines


def _strides(t: torch.Tensor) -> tuple[Any, ...]:
    try:
        return (*t.stride(), t.storage_offset())
    except (RuntimeError, NotImplementedError):
        return ()


@functools.cache
def source_hash(root: Path) -> str:
    """A hash of every ``*.py`` under ``root`` (names and contents)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def hints(shape_env: Any) -> dict[Any, Any]:
    """The sizes at hand (`backed_var_to_val` from torch 2.13, `var_to_val` before)."""
    backed = getattr(shape_env, "backed_var_to_val", None)
    return dict(shape_env.var_to_val if backed is None else backed)


def guards_hold(guards: list[Any], shape_env: Any) -> bool:
    """Whether every guard a cold compile added holds at ``shape_env``'s current sizes
    (then a compile now would decide as it did, and add the same guards)."""
    if not guards:
        return True
    if shape_env is None:
        return False
    import sympy

    at = hints(shape_env)
    try:
        return all(g.expr.xreplace(at) == sympy.true for g in guards)
    except Exception:  # a symbol this shape env does not know
        return False


def replay(guards: list[Any], shape_env: Any) -> list[int | None]:
    """Add ``guards`` (each true at the hints: `guards_hold`) to ``shape_env`` as the
    cold compile did; each keeps the source line that made it, for the report.
    Returns where each landed in ``shape_env.guards`` (None: implied, not added)."""
    where: list[int | None] = []
    for g in guards:
        n = len(shape_env.guards)
        shape_env.evaluate_expr(g.expr)
        if len(shape_env.guards) == n + 1:
            shape_env.guards[n] = g
        where.append(n if len(shape_env.guards) == n + 1 else None)
    return where
