"""stoker: a PyTorch training compiler.

    compiled = stoker.compile(model)                 # Dynamo → stoker-capture → Triton / aten
    loss = loss_fn(compiled(x), y); loss.backward()  # backward through stoker-autograd
    torch.compile(model, backend="stoker")           # the same backend, by name

``import stoker`` is cheap: it imports neither triton nor torch._dynamo nor
the sibling packages; they load on first use (`compile`, `backend`, `export`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .__about__ import __version__
from ._internal.config import CompileOptions, StokerConfigError
from ._internal.errors import StokerMissingPieceError
from ._internal.report.logs import TOPICS as LOG_TOPICS
from ._internal.report.logs import init_from_env as _init_logs
from ._internal.report.logs import set_logs

if TYPE_CHECKING:
    from ._internal.api.backend import StokerBackend
    from ._internal.api.compile_api import compile, last_report
    from ._internal.report.report import Report

__all__ = [
    "LOG_TOPICS",
    "CompileOptions",
    "Report",
    "StokerBackend",
    "StokerConfigError",
    "StokerMissingPieceError",
    "__version__",
    "autograd_enabled",
    "backend",
    "compile",
    "export",
    "last_report",
    "reset",
    "set_logs",
]

_init_logs()

_DEFAULT_BACKEND: list[Any] = []


def __getattr__(name: str) -> Any:
    # Heavy pieces load on first use, so `import stoker` stays fast.
    if name == "compile":
        from ._internal.api.compile_api import compile

        return compile
    if name == "last_report":
        from ._internal.api.compile_api import last_report

        return last_report
    if name == "backend":
        if not _DEFAULT_BACKEND:
            from ._internal.api.backend import StokerBackend

            _DEFAULT_BACKEND.append(StokerBackend())
        return _DEFAULT_BACKEND[0]
    if name == "StokerBackend":
        from ._internal.api.backend import StokerBackend

        return StokerBackend
    if name == "Report":
        from ._internal.report.report import Report

        return Report
    if name == "export":
        from ._internal.errors import sibling

        return sibling("stoker_capture", "export", "stoker.export")
    raise AttributeError(f"module 'stoker' has no attribute {name!r}")


@contextlib.contextmanager
def autograd_enabled(enabled: bool = True) -> Iterator[None]:
    """Compile every backward inside the block (``True``), also of models stoker did not
    compile, or none (``False``: the plain autograd engine); afterwards the scope is what
    it was (by default, after `stoker.compile`: the backwards through a stoker-compiled
    forward only).  Blocks nest; captured graphs are kept either way.

    >>> with stoker.autograd_enabled(False):
    ...     loss.backward()              # the plain autograd engine
    >>> with stoker.autograd_enabled(True):
    ...     eager_loss.backward()        # captured and compiled by stoker-autograd
    """
    from ._internal.api.backend import SWITCH

    with SWITCH.scoped(enabled):
        yield


def reset() -> None:
    """Forget every compiled graph and turn compiled autograd off (as after a fresh start).

    Blocks of `autograd_enabled` (and of ``stoker_autograd``) still open stay open."""
    import sys

    from ._internal.api.backend import SWITCH
    from ._internal.api.compile_api import _LAST, keep_reports_at_reset

    keep_reports_at_reset()
    SWITCH.turn_off()
    _LAST.clear()
    ag = sys.modules.get("stoker_autograd")
    if ag is not None and hasattr(ag, "clear_cache"):
        ag.clear_cache()  # also what explicit stoker_autograd blocks captured
    if _DEFAULT_BACKEND:
        # Keep the object: Dynamo's backend registry holds on to what the entry point loaded.
        _DEFAULT_BACKEND[0].forget()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    if ag is not None and hasattr(ag, "reset_stats"):
        ag.reset_stats()
