"""Node metadata while tracing: the user's source line and the module path of every node.

make_fx copies `torch.fx.traceback`'s "current meta" onto each node it creates
when node meta is preserved.  `recording_node_meta` keeps that meta up to date:
a torch-function mode sets ``stack_trace`` to the user's frames at each torch
call, and global module hooks keep ``nn_module_stack`` (and stoker's own
``stoker_module_path``) naming the module being run.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.overrides import TorchFunctionMode

from stoker_shapes._internal.provenance import is_internal_file

_INTERNAL: dict[str, bool] = {}  # filename -> is it torch's/stoker's/the stdlib's (memo)
# (code, line) of the user frames -> their formatted trace: a model's layers repeat the
# same lines, and formatting (source lookup) costs far more than walking the frames
_FORMATTED: dict[tuple[tuple[types.CodeType, int], ...], str] = {}
_FORMATTED_MAX = 4096


def user_stack_trace(limit: int = 6) -> str:
    """The innermost user frames (outside torch, stoker and the standard library)."""
    frames: list[types.FrameType] = []
    f: types.FrameType | None = sys._getframe(2)
    while f is not None and len(frames) < limit:
        name = f.f_code.co_filename
        internal = _INTERNAL.get(name)
        if internal is None:
            internal = _INTERNAL[name] = is_internal_file(name)
        if not internal:
            frames.append(f)
        f = f.f_back
    key = tuple((fr.f_code, fr.f_lineno) for fr in frames)
    text = _FORMATTED.get(key)
    if text is None:
        summary = traceback.StackSummary.extract(
            ((fr, fr.f_lineno) for fr in reversed(frames)), lookup_lines=True
        )
        text = "".join(summary.format()).strip()
        if len(_FORMATTED) >= _FORMATTED_MAX:
            _FORMATTED.clear()
        _FORMATTED[key] = text
    return text


class _StackTraceMode(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Any = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        meta = fx_traceback.get_current_meta()
        if not meta.get("stoker_backward"):
            trace = user_stack_trace()
            if trace:
                meta["stack_trace"] = trace
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording_node_meta(root: torch.nn.Module | None) -> Iterator[None]:
    """Record ``stack_trace`` and module paths on every node traced inside."""
    names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
    stack: list[tuple[str, str]] = []

    def pre(mod: torch.nn.Module, args: Any) -> None:
        name = names.get(id(mod))
        if name is None or name == "":
            return
        stack.append((name, f"{type(mod).__module__}.{type(mod).__qualname__}"))
        _publish()

    def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
        name = names.get(id(mod))
        if name is None or name == "" or not stack:
            return
        stack.pop()
        _publish()

    def _publish() -> None:
        meta = fx_traceback.get_current_meta()
        meta["nn_module_stack"] = {p: (p, t) for p, t in stack}
        if stack:
            meta["custom"] = {"stoker_module_path": stack[-1][0]}
        else:
            meta.pop("custom", None)

    with contextlib.ExitStack() as es:
        es.enter_context(fx_traceback.preserve_node_meta())
        fx_traceback.get_current_meta().pop("stack_trace", None)
        if names:
            es.callback(torch.nn.modules.module.register_module_forward_pre_hook(pre).remove)
            es.callback(torch.nn.modules.module.register_module_forward_hook(post).remove)
        es.enter_context(_StackTraceMode())
        yield


@contextlib.contextmanager
def backward_meta() -> Iterator[None]:
    """Nodes traced inside belong to the backward: no forward stack trace on them."""
    meta = fx_traceback.get_current_meta()
    saved = dict(meta)
    meta.pop("stack_trace", None)
    meta.pop("nn_module_stack", None)
    meta.pop("custom", None)
    meta["stoker_backward"] = True
    try:
        yield
    finally:
        meta.clear()
        meta.update(saved)


def module_path(node: torch.fx.Node) -> str | None:
    """The module path a node was traced in (``layers.0.linear1``), if any."""
    custom = node.meta.get("custom")
    if isinstance(custom, dict):
        p = custom.get("stoker_module_path")
        return p if isinstance(p, str) else None
    return None
