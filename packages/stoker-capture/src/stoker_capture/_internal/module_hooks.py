"""Module backward hooks around a compiled module (`aot_module`).

A training graph holds the backward as traced ops, so a Python hook inside it
would run once, while the graph is traced, and never again. Backward hooks of
the module handed to `aot_module` (``register_full_backward_hook`` and
``register_full_backward_pre_hook``) run where eager runs them, around the
compiled call: `ModuleBackwardHooks` hides them while the graph is traced and
wraps each call's inputs and outputs as ``nn.Module.__call__`` does. Hooks on a
submodule, global module backward hooks that reach a submodule, and the
deprecated non-full hooks (``register_backward_hook``) raise `UnsupportedError`
saying where they are, instead of running at trace time only.

This room imports torch and the package's errors only.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.hooks import BackwardHook

from .errors import UnsupportedError

_mod = torch.nn.modules.module


def _global_backward_hooks() -> tuple[dict[int, Any], dict[int, Any]]:
    return _mod._global_backward_hooks, _mod._global_backward_pre_hooks


def _has_backward_hooks(m: torch.nn.Module) -> bool:
    return bool(m._backward_hooks or m._backward_pre_hooks)


def _where(name: str, m: torch.nn.Module) -> str:
    return (
        f"submodule '{name}' ({type(m).__name__})" if name else f"the module ({type(m).__name__})"
    )


class ModuleBackwardHooks:
    """The backward hooks of ``module`` for a compiled call of it, checked at compile time."""

    def __init__(self, module: torch.nn.Module, caller: str) -> None:
        self.module = module
        self.caller = caller

    def check(self) -> None:
        """Raise `UnsupportedError` for a backward hook the compiled call cannot run
        at every backward (see the module docstring)."""
        g_hooks, g_pre = _global_backward_hooks()
        if (g_hooks or g_pre) and any(True for _ in self.module.children()):
            raise UnsupportedError(
                f"{self.caller}: a global module backward hook "
                "(torch.nn.modules.module.register_module_full_backward_hook or "
                "register_module_full_backward_pre_hook) is registered, and it would run for "
                "every submodule inside the compiled backward graph, once at trace time and "
                "never at a backward. Remove it while this module runs compiled, or compile "
                "with stoker.compile (torch.compile(backend='stoker')), which runs module "
                "hooks at every backward."
            )
        if g_hooks and _mod._global_is_full_backward_hook is False:
            raise UnsupportedError(
                f"{self.caller}: a global non-full module backward hook "
                "(register_module_backward_hook, deprecated by torch) is registered; use "
                "register_module_full_backward_hook instead."
            )
        for name, m in self.module.named_modules():
            if not _has_backward_hooks(m):
                continue
            if m._backward_hooks and m._is_full_backward_hook is False:
                raise UnsupportedError(
                    f"{self.caller}: {_where(name, m)} has a non-full backward hook "
                    "(register_backward_hook, deprecated by torch); register it with "
                    "register_full_backward_hook instead."
                )
            if name:
                raise UnsupportedError(
                    f"{self.caller}: {_where(name, m)} has a backward hook "
                    "(register_full_backward_hook or register_full_backward_pre_hook). "
                    "Its backward is traced into the compiled graph, where the hook would "
                    "run once, at trace time, and never at a backward. Register the hook on "
                    "the module passed to aot_module (its hooks run at every backward), or "
                    "compile with stoker.compile (torch.compile(backend='stoker')), which "
                    "runs every module's hooks."
                )
            if m._forward_pre_hooks:
                raise UnsupportedError(
                    f"{self.caller}: {_where(name, m)} has both forward pre-hooks and "
                    "backward hooks; its backward hooks run around the compiled call, on "
                    "the inputs before the forward pre-hooks (which are compiled), where "
                    "eager gives them the inputs after. Move the forward pre-hooks' work "
                    "before the call, or compile with stoker.compile."
                )

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """The module's own backward hooks (and global ones, which `check` allows on a
        module without submodules only) out of sight while its graph is traced: they
        run around the compiled call instead. The same dicts come back, so the hooks'
        handles still remove them."""
        m = self.module
        own = m._backward_hooks, m._backward_pre_hooks
        g_hooks, g_pre = _global_backward_hooks()
        m._backward_hooks, m._backward_pre_hooks = OrderedDict(), OrderedDict()
        _mod._global_backward_hooks, _mod._global_backward_pre_hooks = OrderedDict(), OrderedDict()
        try:
            yield
        finally:
            m._backward_hooks, m._backward_pre_hooks = own
            _mod._global_backward_hooks, _mod._global_backward_pre_hooks = g_hooks, g_pre

    def around(self) -> BackwardHook | None:
        """A `BackwardHook` for one grad-mode call, as ``nn.Module.__call__`` makes
        one (None when the module has no backward hook): ``setup_input_hook`` on the
        call's positional inputs, ``setup_output_hook`` on its result."""
        m = self.module
        g_hooks, g_pre = _global_backward_hooks()
        if not (_has_backward_hooks(m) or g_hooks or g_pre):
            return None
        full, _ = m._get_backward_hooks()  # type: ignore[no-untyped-call]
        pre = m._get_backward_pre_hooks()  # type: ignore[no-untyped-call]
        return BackwardHook(m, full, pre) if full or pre else None
