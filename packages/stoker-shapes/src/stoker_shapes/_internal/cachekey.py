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

One key holds a few entries (variants), newest first, one per set of guards the
cold compile added: `read_variants` and `add_variant` read and write them,
`guards_hold` picks the one that fits the sizes at hand, `replay` adds its guards.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.fx

from .diskcache import warn_once
from .plain import PLAIN_TYPES

if TYPE_CHECKING:
    from .diskcache import DiskCache


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
    """One line per node (subgraphs inline): what a compile of ``gm`` reads of it.

    The lines are `val_text`'s (a test holds them equal to it), made faster: a value
    object's text is made once per call (a loaded graph's nodes share their fake
    values, a layer's ops share their argument lists), the common argument types
    are spelt without `val_text`'s chain of type tests."""
    return _GraphText().lines(gm)


class _GraphText:
    """`graph_text` of one call: texts of the values seen, by object (kept alive here,
    so an id is never reused within the call)."""

    def __init__(self) -> None:
        self.memo: dict[int, tuple[Any, str]] = {}

    def lines(self, gm: torch.fx.GraphModule) -> list[str]:
        lines = []
        for n in gm.graph.nodes:
            meta = n.meta
            val = meta["val"] if "val" in meta else meta.get("example_value")
            args = f"{self.arg(n.args)} {self.arg(n.kwargs)}"
            line = f"{n.op} {n.name} {target_text(n.target)} {args} :: {self.val(val)}"
            if n.op in ("get_attr", "call_module"):
                sub = getattr(gm, str(n.target), None)
                if isinstance(sub, torch.fx.GraphModule):  # a subgraph (higher-order op)
                    lines += [f"subgraph {n.target}:", *self.lines(sub)]
                elif isinstance(sub, torch.nn.Module):
                    line += " = " + repr(sub)
                else:
                    line += " = " + val_text(sub)
            lines.append(line)
        return lines

    def arg(self, a: Any) -> str:
        """``val_text(a, data=True)``."""
        t = type(a)
        if t is torch.fx.Node:
            return f"%{a.name}"
        if t in PLAIN_TYPES:
            return repr(a)
        if t is tuple or t is list:
            return t.__name__ + "(" + ",".join([self.arg(x) for x in a]) + ")"
        if isinstance(a, dict):
            return "{" + ",".join([f"{k!r}:{self.arg(x)}" for k, x in a.items()]) + "}"
        if isinstance(a, list | tuple):  # immutable_list and other subclasses: by name
            return type(a).__name__ + "(" + ",".join([self.arg(x) for x in a]) + ")"
        return val_text(a, data=True)

    def val(self, v: Any) -> str:
        """``val_text(v)``; a tensor's once per object."""
        if isinstance(v, torch.Tensor):
            got = self.memo.get(id(v))
            if got is None:
                got = self.memo[id(v)] = (v, val_text(v))
            return got[1]
        if type(v) is tuple or type(v) is list:
            return type(v).__name__ + "(" + ",".join([self.val(x) for x in v]) + ")"
        return val_text(v)


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


class _Guarded(Protocol):
    guards: list[Any]  # the ShapeGuards the cold compile added


E = TypeVar("E", bound=_Guarded)


def read_variants(
    store: DiskCache, key: str, entry_type: type[E], redo: str
) -> tuple[list[E], str]:
    """The entries stored under ``key`` (a pickled list of ``entry_type``), or ([], why
    none): "new key" (no file) or "corrupt entry" (a file `DiskCache` rejects, or one
    another version of the package wrote: warned once, naming it, saying that the
    caller will ``redo``, e.g. "compiling again")."""
    existed = store.path(key).exists()
    body = store.get(key)
    if body is None:
        return [], ("corrupt entry" if existed else "new key")
    try:
        variants = pickle.loads(body)
        if not isinstance(variants, list) or not all(isinstance(e, entry_type) for e in variants):
            raise TypeError(f"not a list of entries but {type(variants).__name__}")
    except Exception as e:  # written by another version of the package
        path = store.path(key)
        warn_once(str(path), "stoker cache: ignoring %s (%s); %s", path, e, redo)
        return [], "corrupt entry"
    return variants, ""


def add_variant(
    store: DiskCache,
    key: str,
    entry: E,
    redo: str,
    limit: int,
    unstorable: Callable[[str], Exception],
) -> None:
    """Store ``entry`` first under ``key``, then the variants already there whose guards
    differ (sizes that made the compile add other guards), ``limit`` in all.  Raises
    ``unstorable(why)`` when the entries cannot be pickled (an output structure of an
    unregistered type); nothing is written then."""
    exprs = [g.expr for g in entry.guards]
    old, _ = read_variants(store, key, type(entry), redo)
    kept = [e for e in old if [g.expr for g in e.guards] != exprs]
    try:
        body = pickle.dumps([entry, *kept][:limit])
    except Exception as e:
        raise unstorable(f"the entry cannot be stored ({type(e).__name__}: {e})") from e
    store.put(key, body)
