"""The warm-start cache: a new process loads a backward's retraced graph instead of
running the captured graph eagerly, retracing it and reading its guards again.

An entry (``$STOKER_CACHE_DIR/autograd/graphs/<key>``, a checked
`stoker_shapes.DiskCache` file, JSON, no pickles) holds the retraced core-aten
graph (each node's target by qualified name, its arguments, and the metadata of
its value: sizes, strides, offset, dtype, device), which list and index each
graph input is read from, the guards of the compile and the sizes it was made for,
and the code of each part the compiler runs as is (`BoxedGraph.stored`: a hit
loads it instead of generating and compiling it; the stored code is executed, so
the cache directory is as trusted as code).
The compiler then compiles the loaded graph as it would a retraced one, and
stoker-triton's compiled-graph cache finds its segments.

| what decides the key | how |
|---|---|
| the captured graph | as captured, before the reordering passes (pure functions of it, and of stoker-autograd's sources, which the key hashes; a hit never runs them), every node: op, target (a functional backward by the engine's name, functions by qualified name), arguments (nodes by position, so an inlined AOT backward is keyed by its content, not by its id), the output metadata a custom backward promised and its Function's qualified name |
| the inputs | each tensor's sizes, strides, offset, dtype, device, requires_grad, type; the sizes and scalars the engine lifted, by value and type |
| the shape state | the positions made symbolic (seen to change, or held symbolic by the forward) and which of them share a symbol (one per forward symbol), how capture symbols map to sizes and scalars |
| the session | dynamic or not, the compiler's qualified name, grad mode (``create_graph``) |
| the code | torch, stoker-autograd, stoker-capture and stoker-shapes versions, a hash of stoker-autograd's sources, the entry format and the stored code's (`boxed.CODE_FORMAT`) |

Python objects are never stored: hooks, custom Functions' ctx and packed data are
graph inputs read by position from the lists the engine passes at every call
(``hooks``, ``packed_data``), the same collection order that made the key.

| on a lookup | result |
|---|---|
| no entry | miss "new key" |
| broken entry (bytes, version) | `DiskCache` warns once naming the file; miss "corrupt entry"; the cold compile rewrites it |
| the stored guards fail on this call | miss "guards failed" |
| otherwise | hit: no eager run, no retrace |

Tensor constants (of an inlined AOT backward) are stored by value, up to
`MAX_CONSTANT_BYTES` each, and keyed by a hash of their values.  A graph the
format cannot hold (a saved-tensor unpack hook, whose result's sizes are known
only after a run; a larger constant; a size that depends on data; a call target
without a qualified name) is compiled every time: "uncacheable: why" in the log.
Symbolic sizes (a dynamic forward's backward, or a recompile after a size changed)
are stored as expressions over the retrace's input symbols, which are named after
their sources; a load makes the same input fakes (`retrace.fake_inputs`, for the
positions the entry stores as dynamic) and reads the expressions back over them.
Set ``STOKER_AUTOGRAD_CACHE=0`` to neither read nor write entries.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._sympy.functions as sympy_functions
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from stoker_capture._internal.graphs.serialize import (
    _arg_from_json,
    _arg_to_json,
    _target_from_json,
    _target_to_json,
    add_nodes,
)
from stoker_shapes import DiskCache, GuardSet, ShapeContext
from stoker_shapes._internal.cachekey import hints

from . import ops
from .graph import Position, Walk, WalkNode, check_sizes, fake_tensor, graph_module
from .retrace import fake_inputs

log = logging.getLogger("stoker.cache")

# bump when an entry's layout or meaning changes (2: "code", 3: symbolic, 4: "groups")
ENTRY_FORMAT = "4"
_ENV_OFF = "STOKER_AUTOGRAD_CACHE"  # "0": neither read nor write entries

# The Python calls a retraced graph may hold, by the name an entry stores.
OPAQUE_BY_NAME: dict[str, Any] = {
    "stoker_autograd.call_backward": ops.call_backward,
    "stoker_autograd.call_hook": ops.call_hook,
    "stoker_autograd.accumulate_grad": ops.accumulate_grad,
    "stoker_autograd.call_cpp_tensor_pre_hooks": ops.call_cpp_tensor_pre_hooks,
    "stoker_autograd.exec_final_callbacks_stub": ops.exec_final_callbacks_stub,
    "stoker_autograd.check_sizes": check_sizes,
}
_NAME_OF = {id(v): k for k, v in OPAQUE_BY_NAME.items()}

# process-wide counts: "hit", "miss (why)", "uncacheable (why)", "write"
outcomes: dict[str, int] = {}


class Uncacheable(Exception):
    """The graph cannot be stored exactly; the message says why."""


def enabled() -> bool:
    return os.environ.get(_ENV_OFF, "1") != "0"


def store() -> DiskCache:
    from stoker_shapes._internal.diskcache import cache_root

    return DiskCache(cache_root, "autograd/graphs", _version())


def count(what: str) -> None:
    outcomes[what] = outcomes.get(what, 0) + 1


@functools.cache
def _version() -> str:
    """Entry format (and the stored code's), versions and a hash of stoker-autograd's
    sources (no spaces)."""
    import stoker_capture
    import stoker_shapes

    from ..__about__ import __version__

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    from stoker_capture._internal.runtime.boxed import CODE_FORMAT

    parts = (
        f"{ENTRY_FORMAT}.{CODE_FORMAT}",
        f"torch{torch.__version__}",
        f"autograd{__version__}",
        f"capture{getattr(stoker_capture, '__version__', '?')}",
        f"shapes{getattr(stoker_shapes, '__version__', '?')}",
        h.hexdigest()[:16],
    )
    return "-".join(parts).replace(" ", "_")


# --------------------------------------------------------------------------
# the key


def _target_text(t: Any) -> str:
    if isinstance(t, ops.BoundBackward):
        if t.is_custom_function:
            # CppNode<name><n>: the C++ class name, numbered in the order this process
            # bound them; another process may give it to another extension's Function
            # of the same name, whose traced backward would then be loaded
            raise Uncacheable(
                f"{t.__name__} is a C++ autograd::Function, whose name does not identify "
                "its code in another process"
            )
        return f"bound:{t.__name__}"
    if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return f"op:{t}"
    if isinstance(t, str):
        return t
    mod = getattr(t, "__module__", None)
    name = getattr(t, "__qualname__", None)
    if mod is None or name is None or "<" in name:
        raise Uncacheable(f"the graph calls {t!r}, which has no stable qualified name")
    return f"{mod}.{name}"


def _arg_text(a: Any, index: dict[Any, int]) -> str:
    if isinstance(a, fx.Node | WalkNode):
        return f"%{index[a]}"
    if isinstance(a, list | tuple):
        inner = ",".join(_arg_text(x, index) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}:{_arg_text(v, index)}" for k, v in sorted(a.items())) + "}"
    if isinstance(a, torch.Tensor):
        raise Uncacheable("a tensor is an argument of the captured graph")
    if a is None or isinstance(a, bool | int | float | str | torch.dtype | torch.device):
        return f"{type(a).__name__}:{a!r}"
    if isinstance(a, torch.layout | torch.memory_format | sympy.Expr):
        return f"{type(a).__name__}:{a}"
    raise Uncacheable(f"a captured-graph argument of type {type(a).__qualname__}")


def graph_text(
    gm: fx.GraphModule | fx.Graph | Walk,
    sym_sources: dict[sympy.Symbol, tuple[str, int]],
    root: torch.nn.Module | None = None,
) -> str:
    """The captured graph as text that names no node and no object id (the key's part).
    ``gm``: a graph module, or a graph or the engine's walk (`graph.Walk`: the same
    text as the graph made of it) whose constants are attributes of ``root``."""
    graph: fx.Graph | Walk = gm.graph if isinstance(gm, fx.GraphModule) else gm
    owner = gm if root is None else root
    index: dict[Any, int] = {}
    lines: list[str] = []
    for i, n in enumerate(graph.nodes):
        index[n] = i
        if n.op == "get_attr":  # a constant of an inlined AOT backward: by its values
            lines.append(f"get_attr {_const_digest(getattr(owner, str(n.target)))}")
            continue
        if n.op == "call_function" and n.target is ops.call_hook:
            if n.kwargs.get("hook_type") == "unpack_hook":
                raise Uncacheable(
                    "a saved-tensor unpack hook (its result's sizes show only at run)"
                )
        target = n.target if n.op != "call_function" else _target_text(n.target)
        meta = n.meta.get("stoker_out_meta")
        fn = n.meta.get("stoker_fn_key")
        if fn is None and n.op == "call_function" and n.target is ops.call_backward:
            raise Uncacheable(
                f"{n.meta.get('stoker_fn', 'a custom Function')} has no stable identity "
                "(a torch.compile'd function without its backward graph)"
            )
        lines.append(
            f"{n.op} {target} {_arg_text(tuple(n.args), index)} {_arg_text(dict(n.kwargs), index)}"
            + (f" out_meta={_arg_text(meta, index)}" if meta is not None else "")
            + (f" fn={fn}" if fn is not None else "")
        )
    lines += sorted(f"sym {s}={w}[{i}]" for s, (w, i) in sym_sources.items())
    return "\n".join(lines)


MAX_CONSTANT_BYTES = 1 << 20  # larger tensor constants make a graph uncacheable


def _const_bytes(t: Any) -> bytes:
    if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor or t.layout != torch.strided:
        raise Uncacheable(f"a graph constant of type {type(t).__qualname__}")
    if t.numel() * t.element_size() > MAX_CONSTANT_BYTES:
        raise Uncacheable(f"a tensor constant over {MAX_CONSTANT_BYTES} bytes")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def _const_digest(t: Any) -> str:
    data = _const_bytes(t)
    return f"{_tensor_text(t)}={hashlib.sha256(data).hexdigest()}"


def _const_json(t: torch.Tensor) -> dict[str, Any]:
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "size": list(t.shape),
        "stride": list(t.stride()),
        "device": str(t.device),
        "data": base64.b64encode(_const_bytes(t)).decode(),
    }


def _const_back(d: dict[str, Any]) -> torch.Tensor:
    """The constant as stored: same values, sizes, strides, dtype, device."""
    dtype = getattr(torch, d["dtype"])
    raw = bytearray(base64.b64decode(d["data"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    values = flat.view(dtype).reshape(d["size"])
    out = torch.empty_strided(d["size"], d["stride"], dtype=dtype, device=d["device"])
    return out.copy_(values)


def _tensor_text(t: torch.Tensor) -> str:
    return (
        f"{type(t).__name__}({tuple(t.shape)},{t.stride()},{t.storage_offset()},"
        f"{t.dtype},{t.device},{t.requires_grad})"
    )


def _value_text(v: Any) -> str:
    if isinstance(v, torch.Tensor) and v.layout != torch.strided:
        raise Uncacheable(f"an input of layout {v.layout} (a sparse .grad or saved tensor)")
    if isinstance(v, torch.Tensor):
        return _tensor_text(v)
    if v is None or isinstance(v, bool | int | float):
        return f"{type(v).__name__}:{v!r}"
    raise Uncacheable(f"an input of type {type(v).__qualname__}")


def key(
    graph: str,
    inputs: Sequence[Any],
    sizes: Sequence[Any],
    scalars: Sequence[Any],
    dynamic: frozenset[Position],
    session: Any,
    free: frozenset[Position] = frozenset(),
    groups: dict[Position, Position] | None = None,
) -> str:
    h = hashlib.sha256()
    compiler = session.compiler
    name = f"{getattr(compiler, '__module__', '?')}.{getattr(compiler, '__qualname__', '?')}"
    for part in (
        _version(),
        graph,
        "inputs " + ";".join(_value_text(x) for x in inputs),
        "sizes " + ";".join(_value_text(x) for x in sizes),
        "scalars " + ";".join(_value_text(x) for x in scalars),
        f"dynamic {sorted(dynamic)} free {sorted(free)} groups {sorted((groups or {}).items())}",
        f"session dynamic={session.dynamic} compiler={name}",
        f"grad mode {torch.is_grad_enabled()}",  # create_graph=True backwards differ
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


# --------------------------------------------------------------------------
# the entry


def _target_json(t: Any) -> str:
    name = _NAME_OF.get(id(t))
    if name is not None:
        return f"autograd:{name}"
    try:
        return _target_to_json(t)
    except Exception as e:
        raise Uncacheable(f"the retraced graph calls {t!r}") from e


def _target_back(s: str) -> Any:
    if s.startswith("autograd:"):
        return OPAQUE_BY_NAME[s.removeprefix("autograd:")]
    return _target_from_json(s)


def _is_symbolic(x: Any) -> bool:
    if not isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        return False
    return not (x.node.is_constant() or x.node.expr.is_number)


# the names a stored size expression may call, besides sympy's own (`_parse`)
_SIZE_FUNCTIONS: dict[str, Any] = {
    name: getattr(sympy_functions, name)
    for name in (*sympy_functions.__all__, "Max", "Min")
    if hasattr(sympy_functions, name)
}


def _parse(text: str, symbols: dict[str, sympy.Symbol]) -> Any:
    """A size expression written by `_size_json` (``sympy.srepr``: torch's own functions
    such as ``FloorDiv`` by name), over ``symbols`` (by name, with their assumptions).
    Like stored code, it is evaluated: the cache directory is trusted as code is."""
    expr = sympy.sympify(text, locals=_SIZE_FUNCTIONS)
    unknown = {s for s in expr.free_symbols if symbols.get(str(s)) != s}
    if unknown:
        raise ValueError(f"a stored size reads unknown symbols {sorted(map(str, unknown))}")
    return expr


def _size_json(x: Any) -> int | str:
    """A size: an int, or a symbolic one's expression over the retrace's input symbols
    (named after their sources: `retrace.fake_inputs` makes the same names again)."""
    if not _is_symbolic(x):
        return int(x)
    if free_unbacked_symbols(x):
        raise Uncacheable("a size that depends on data (an unbacked symbol)")
    return _size_text(x.node.expr)


@functools.lru_cache(maxsize=4096)
def _size_text(expr: sympy.Expr) -> str:
    """`sympy.srepr` of a size expression, checked to read back (`_parse`).  A graph has
    a few distinct sizes, each met on many nodes: the check (a `sympify`, about 2 ms) runs
    once per expression.  A sympy expression compares with its symbols' assumptions."""
    text: str = sympy.srepr(expr)
    if _parse(text, {str(s): s for s in expr.free_symbols}) != expr:
        raise Uncacheable(f"the size {text} does not read back")
    return text


def _val_json(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {
            "t": [
                [_size_json(s) for s in v.shape],
                [_size_json(s) for s in v.stride()],
                _size_json(v.storage_offset()),
                str(v.dtype).removeprefix("torch."),
                str(v.device),
            ]
        }
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        if _is_symbolic(v):
            return {"s": [type(v).__name__, _size_json(v)]}
        return _val_json(v.node.pytype(v.node.expr))
    if v is None or isinstance(v, bool | int | float):
        return _arg_to_json(v)
    if isinstance(v, list | tuple):
        return {"list" if isinstance(v, list) else "tuple": [_val_json(x) for x in v]}
    raise Uncacheable(f"a graph value of type {type(v).__qualname__}")


def _is_symbolic_json(d: Any) -> bool:
    if isinstance(d, dict):
        if "s" in d:
            return True
        if "t" in d:
            size, stride, offset = d["t"][:3]
            return any(isinstance(x, str) for x in (*size, *stride, offset))
        return any(_is_symbolic_json(x) for x in d.get("list") or d.get("tuple") or [])
    return False


class _Reader:
    """Node values of an entry as fakes of ``ctx`` (symbolic sizes over its symbols)."""

    def __init__(self, ctx: ShapeContext, symbolic: bool) -> None:
        from stoker_capture._internal.capcache.graphs import _Decoder

        self.ctx = ctx
        self.dec = _Decoder(ctx) if symbolic else None
        self.symbols = {str(s): s for s in hints(ctx.shape_env)} if symbolic else {}

    def size(self, x: int | str) -> Any:
        return x if isinstance(x, int) else _parse(x, self.symbols)

    def val(self, d: Any, shared: bool) -> Any:
        if isinstance(d, dict) and "t" in d:
            size, stride, offset, dtype, device = d["t"]
            if self.dec is None:
                return fake_tensor(
                    self.ctx.fake_mode, size, stride, offset, getattr(torch, dtype), device
                )
            sizes = tuple(self.size(x) for x in size)
            strides = tuple(self.size(x) for x in stride)
            t = ("T", getattr(torch, dtype), device, sizes, strides, self.size(offset), False)
            return self.dec.val(t, shared)
        if isinstance(d, dict) and "s" in d:
            assert self.dec is not None
            kind, text = d["s"]
            return self.dec.size(self.size(text), kind)
        if isinstance(d, dict) and ("list" in d or "tuple" in d):
            items = [self.val(x, shared) for x in d.get("list") or d.get("tuple") or []]
            return items if "list" in d else tuple(items)
        return _arg_from_json(d, {})


def graph_json(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """A retraced graph's nodes as JSON values (raises `Uncacheable`)."""
    nodes: list[dict[str, Any]] = []
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "call_function", "get_attr", "output"):
            raise Uncacheable(f"a {n.op} node in the retraced graph")
        d: dict[str, Any] = {"op": n.op, "name": n.name}
        if n.op == "call_function":
            d["target"] = _target_json(n.target)
        elif n.op == "get_attr":
            d["target"] = str(n.target)
            d["const"] = _const_json(getattr(gm, str(n.target)))
        try:
            d["args"] = _arg_to_json(tuple(n.args))
            d["kwargs"] = {k: _arg_to_json(v) for k, v in n.kwargs.items()}
        except Exception as e:
            raise Uncacheable(f"an argument of {n.name}: {e}") from e
        if "val" in n.meta:
            d["val"] = _val_json(n.meta["val"])
        d["meta"] = {
            k: v
            for k, v in n.meta.items()
            if k.startswith(("autograd", "stoker")) and isinstance(v, str)
        }
        nodes.append(d)
    return nodes


def entry(
    nodes: list[dict[str, Any]],
    arg_spec: Sequence[tuple[int, int]],
    guards: GuardSet,
    values: dict[Position, int],
    code: Sequence[dict[str, Any] | None] = (),
    dynamic: frozenset[Position] = frozenset(),
    free: frozenset[Position] = frozenset(),
    groups: dict[Position, Position] | None = None,
) -> bytes:
    """The body of an entry: the graph (`graph_json`), where each input is read from,
    the guards (after the compiler ran: it may add some), the sizes compiled for, and
    the Python code of each part the compiler runs as is (`BoxedGraph.stored`; None:
    not storable), so that a load generates none.  A graph with symbolic sizes keeps
    them as expressions over the symbols `retrace.fake_inputs` makes for ``dynamic``,
    ``free`` and ``groups``."""
    body = {
        "graph": nodes,
        "dynamic": [list(p) for p in sorted(dynamic)],
        "free": [list(p) for p in sorted(free)],
        "groups": [[*p, *g] for p, g in sorted((groups or {}).items())],
        "arg_spec": [list(x) for x in arg_spec],
        "guards": guards.to_json(),
        "values": [[*p, v] for p, v in values.items()],
        "code": list(code),
    }
    return json.dumps(body).encode()


def from_json(
    data: bytes,
    inputs: Sequence[Any] = (),
    sizes: Sequence[Any] = (),
    scalars: Sequence[Any] = (),
) -> tuple[fx.GraphModule, list[tuple[int, int]], GuardSet, dict[Position, int], list[Any]]:
    """(graph with fake values, arg_spec, guards, values, code) of an entry, for a call
    with these arguments (a symbolic graph's sizes are read back over the symbols of
    their fakes); raises on a bad one."""
    body = json.loads(data)
    symbolic = any(_is_symbolic_json(d.get("val")) for d in body["graph"])
    ctx = ShapeContext(policy="auto" if symbolic else "static")
    if symbolic:
        dynamic, free = (
            frozenset((int(w), int(i), int(d)) for w, i, d in body[k]) for k in ("dynamic", "free")
        )
        groups = {
            (int(w), int(i), int(d)): (int(gw), int(gi), int(gd))
            for w, i, d, gw, gi, gd in body["groups"]
        }
        # the retrace's symbols
        fake_inputs(ctx, inputs, sizes, scalars, dynamic, free, groups=groups)
    reader = _Reader(ctx, symbolic)
    g = fx.Graph()
    root = torch.nn.Module()

    def get_attr(d: dict[str, Any]) -> str:
        target = str(d["target"])
        if not target.isidentifier():
            raise ValueError(f"a constant named {target!r}")
        setattr(root, target, _const_back(d["const"]))
        return target

    env = add_nodes(g, body["graph"], _target_back, get_attr)
    for d in body["graph"]:
        if "val" in d:
            node = env[d["name"]]
            node.meta["val"] = reader.val(d["val"], shared=node.op != "placeholder")
    g.lint()
    gm = graph_module(root, g, "StokerBackwardAten")
    arg_spec = [(int(w), int(i)) for w, i in body["arg_spec"]]
    values = {(int(w), int(i), int(dim)): int(v) for w, i, dim, v in body["values"]}
    code = body["code"]
    if not isinstance(code, list):
        raise ValueError("the entry's code is not a list")
    return gm, arg_spec, GuardSet.from_json(body["guards"]), values, code
