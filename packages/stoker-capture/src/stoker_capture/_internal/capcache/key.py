"""The key of a capture: everything that decides its result, as text, hashed;
`Uncacheable` for what no key can stand for (see the package docstring)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from stoker_shapes import ShapeContext
from stoker_shapes._internal.cachekey import (
    graph_text,
    shape_env_text,
    source_hash,
    target_text,
    val_text,
)

from ..autocast import autocast_state
from ..config import AOTConfig

# Bump when an entry's layout or meaning changes: older entries become misses.
ENTRY_FORMAT = "1"


class Uncacheable(Exception):
    """What the key or the entry cannot describe: captured every time."""


_TORCH_MODULES = ("torch", "operator", "_operator", "math", "builtins")
# torch's modules whose functions call back into the user's code (hooks, Functions,
# checkpointed regions, Dynamo's helpers around them): their code is not all torch's
_OPAQUE_MODULES = (
    "torch._dynamo",
    "torch._higher_order_ops",
    "torch._functorch",
    "torch.autograd.function",
    "torch.utils.checkpoint",
    "torch.utils.hooks",
)
_PLAIN: tuple[type, ...] = (type(None), bool, int, float, str, complex, torch.dtype)
_PLAIN += (torch.device, torch.layout, torch.memory_format, slice, type(Ellipsis), fx.Node)


def _code_version() -> str:
    import stoker_shapes

    from ...__about__ import __version__

    here = Path(__file__).resolve().parents[2]
    shapes = Path(stoker_shapes.__file__).resolve().parent
    return (
        f"torch {torch.__version__} stoker-capture {__version__} {source_hash(here)} "
        f"stoker-shapes {stoker_shapes.__version__} {source_hash(shapes)}"
    )


def _config_text(cfg: AOTConfig) -> str:
    part = cfg.partition
    if part is not None and not getattr(part, "__module__", "").startswith("stoker_capture"):
        raise Uncacheable(f"a partitioner of the user's ({target_text(part)})")
    if cfg.decompositions is not None:
        raise Uncacheable("a decomposition table of the user's")
    for graph_pass in cfg.graph_passes:  # a stoker package's (its source is in the key)
        if not getattr(graph_pass, "__module__", "").startswith("stoker_"):
            raise Uncacheable(f"a graph pass of the user's ({target_text(graph_pass)})")
    passes = " ".join(_pass_text(p) for p in cfg.graph_passes) or "none"
    return (
        f"mode {cfg.mode} dynamic {cfg.dynamic} guard_params {cfg.guard_params} "
        f"partition {target_text(part) if part else 'default'} budget {cfg.memory_budget!r} "
        f"graph passes {passes} "
        f"grad {torch.is_grad_enabled()} autocast {autocast_state()!r} "
        f"mkldnn {torch._C._get_mkldnn_enabled()} "
        # what ops that name no dtype or device create, and which kernels decompositions pick
        f"default {torch.get_default_dtype()} {torch.get_default_device()} "
        f"deterministic {torch.are_deterministic_algorithms_enabled()}"
    )


@functools.cache
def _pass_text(graph_pass: Any) -> str:
    """A graph pass by name and by the source of its module (a pass keeps to one module),
    read once a process."""
    import inspect

    source = inspect.getsourcefile(graph_pass)
    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16] if source else "?"
    return f"{target_text(graph_pass)} {digest}"


def _check_arg(a: Any, where: str) -> None:
    if isinstance(a, list | tuple):
        for x in a:
            _check_arg(x, where)
    elif isinstance(a, dict):
        for x in a.values():
            _check_arg(x, where)
    elif isinstance(a, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return
    elif isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool | torch.Tensor):
        return  # by metadata (Dynamo's example values), a real tensor by its values too
    elif callable(a) and not isinstance(a, type):
        _check_target(a, where)
    elif not isinstance(a, _PLAIN) and not (isinstance(a, type) and a.__module__ == "builtins"):
        raise Uncacheable(f"{where}: an argument of type {type(a).__qualname__}")


def _check_target(t: Any, where: str) -> None:
    if isinstance(t, torch._ops.HigherOrderOperator):
        raise Uncacheable(f"{where}: the higher-order op {t.name()}")  # type: ignore[no-untyped-call]
    if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return
    mod = getattr(t, "__module__", None) or type(t).__module__
    if mod.split(".")[0] not in _TORCH_MODULES or mod.startswith(_OPAQUE_MODULES):
        raise Uncacheable(f"{where}: a call of {target_text(t)}, whose code the key cannot see")


def check_graph(gm: fx.GraphModule) -> None:
    """Raise `Uncacheable` for what a key of the graph's text cannot stand for."""
    lifted = {*dict(gm.named_parameters()), *dict(gm.named_buffers())}
    for n in gm.graph.nodes:
        where = f"node {n.name}"
        if n.op == "call_function":
            _check_target(n.target, where)
        elif n.op == "call_module":
            raise Uncacheable(f"{where}: the module {n.target} is called, not traced")
        elif n.op == "get_attr":
            sub = getattr(gm, str(n.target), None)
            if isinstance(sub, fx.GraphModule):
                raise Uncacheable(f"{where}: a subgraph ({n.target})")
            if isinstance(sub, torch.Tensor) and str(n.target) not in lifted:
                raise Uncacheable(f"{where}: the tensor constant {n.target}")
        _check_arg((n.args, n.kwargs), where)


def _inputs_text(example_inputs: Sequence[Any], fakes: Sequence[Any]) -> list[str]:
    from torch.multiprocessing.reductions import StorageWeakRef

    lines: list[str] = []
    storages: dict[Any, int] = {}
    for i, (x, f) in enumerate(zip(example_inputs, fakes)):
        if isinstance(x, torch.Tensor):
            if type(x) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
                raise Uncacheable(f"input {i}: a tensor subclass ({type(x).__qualname__})")
            storage = StorageWeakRef(x.untyped_storage())  # type: ignore[no-untyped-call]
            first = storages.setdefault(storage, i)
            lines.append(f"input {i} {val_text(f)} view {int(x._is_view())} storage {first}")
        elif isinstance(x, torch.SymInt | torch.SymFloat | int | float | bool):
            lines.append(f"input {i} {val_text(f)}")
        else:  # e.g. the state Dynamo hands to hooks that run in the backward
            raise Uncacheable(f"input {i}: a {type(x).__qualname__}")
    return lines


def capture_key(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    fakes: Sequence[Any],
    ctx: ShapeContext,
    cfg: AOTConfig,
) -> tuple[str, dict[str, str]]:
    """The key of capturing ``gm``, and a hash per part of it (what changed, on a miss,
    is the parts whose hashes differ from the last entry stored for the same code
    site). Raises `Uncacheable`."""
    check_graph(gm)
    params = [*gm.named_parameters(), *gm.named_buffers()]
    parts = {
        "code": [f"entry {ENTRY_FORMAT}", _code_version()],
        "config": [_config_text(cfg)],
        "inputs": [
            *_inputs_text(example_inputs, fakes),
            *(f"param {name} {val_text(p)}" for name, p in params),
        ],
        "shape env": shape_env_text(ctx.shape_env, list(fakes)),
        "graph": graph_text(gm),
    }
    texts = {k: "\n".join(v) for k, v in parts.items()}
    key = hashlib.sha256("\n".join(texts.values()).encode()).hexdigest()[:32]
    return key, {k: hashlib.sha256(t.encode()).hexdigest()[:16] for k, t in texts.items()}


def code_site(gm: fx.GraphModule) -> str:
    """Where the graph comes from: the outermost user frame (file, function) of its first
    node with a stack trace; misses at one site say which part of the key changed."""
    import re

    for n in gm.graph.nodes:
        m = re.search(r'File "([^"]+)", line \d+, in (\S+)', n.meta.get("stack_trace") or "")
        if m:
            return hashlib.sha256(f"{m[1]}:{m[2]}".encode()).hexdigest()[:32]
    return "unknown"
