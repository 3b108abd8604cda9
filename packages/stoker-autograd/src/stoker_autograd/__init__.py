"""stoker-autograd: compiled autograd for stoker.

Inside ``with stoker_autograd.enable():`` a ``loss.backward()`` (or
``torch.autograd.grad``) is captured through torch's compiled-autograd engine hook
into one FX graph the first time, retraced into core aten with real (symbolic)
shapes, compiled, and replayed from the engine's cache afterwards.  Hooks and
custom ``autograd.Function`` backwards stay Python calls, run in eager order.
``set_default(scope="compiled")`` (what ``stoker.compile`` turns on) does it for the
backwards that run through a stoker-compiled forward only; every other backward
keeps the eager engine.
"""

from typing import TYPE_CHECKING, Any

from .__about__ import __version__
from ._internal.engine import (
    cache_outcomes,
    clear_cache,
    clear_default,
    default_session,
    disabled,
    enable,
    is_enabled,
    off,
    on,
    recapture_reasons,
    recompile_reasons,
    reset_stats,
    set_default,
    stats,
)
from ._internal.final_callbacks import on_backward_start, skip_compile
from ._internal.ops import OPAQUE_TARGETS, BoundBackward, accumulate_grad, call_backward, call_hook
from ._internal.recapture import name_parameters
from ._internal.session import Session, Stats, aten_executor

if TYPE_CHECKING:
    from . import passes


def __getattr__(name: str) -> Any:
    """``stoker_autograd.passes``, imported at its first use: the reordering passes run
    on a captured graph's first compile, never on a warm start's disk-cache hit."""
    if name == "passes":
        import importlib

        return importlib.import_module(".passes", __name__)
    raise AttributeError(f"module 'stoker_autograd' has no attribute {name!r}")


__all__ = [
    "OPAQUE_TARGETS",
    "BoundBackward",
    "Session",
    "Stats",
    "__version__",
    "accumulate_grad",
    "aten_executor",
    "cache_outcomes",
    "call_backward",
    "call_hook",
    "clear_cache",
    "clear_default",
    "default_session",
    "disabled",
    "enable",
    "is_enabled",
    "name_parameters",
    "off",
    "on",
    "on_backward_start",
    "passes",
    "recapture_reasons",
    "recompile_reasons",
    "reset_stats",
    "set_default",
    "skip_compile",
    "stats",
]
