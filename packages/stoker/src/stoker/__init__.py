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
from ._internal.logs import TOPICS as LOG_TOPICS
from ._internal.logs import init_from_env as _init_logs
from ._internal.logs import set_logs

if TYPE_CHECKING:
    from ._internal.backend import StokerBackend
    from ._internal.compile_api import compile, last_report
    from ._internal.report import Report

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
        from ._internal.compile_api import compile

        return compile
    if name == "last_report":
        from ._internal.compile_api import last_report

        return last_report
    if name == "backend":
        if not _DEFAULT_BACKEND:
            from ._internal.backend import StokerBackend

            _DEFAULT_BACKEND.append(StokerBackend())
        return _DEFAULT_BACKEND[0]
    if name == "StokerBackend":
        from ._internal.backend import StokerBackend

        return StokerBackend
    if name == "Report":
        from ._internal.report import Report

        return Report
    if name == "export":
        try:
            import stoker_capture
        except ImportError as e:
            from ._internal.errors import missing_piece

            raise missing_piece("stoker_capture", "export", "stoker.export") from e
        fn = getattr(stoker_capture, "export", None)
        if fn is None:
            from ._internal.errors import missing_piece

            raise missing_piece("stoker_capture", "export", "stoker.export")
        return fn
    raise AttributeError(f"module 'stoker' has no attribute {name!r}")


@contextlib.contextmanager
def autograd_enabled(enabled: bool = True) -> Iterator[None]:
    """Scope the process-wide compiled-autograd switch on or off, restoring it afterwards.

    >>> with stoker.autograd_enabled(False):
    ...     eager_loss.backward()        # the plain autograd engine
    """
    from ._internal.backend import SWITCH

    with SWITCH.scoped(enabled):
        yield


def reset() -> None:
    """Forget every compiled graph and turn compiled autograd off (as after a fresh start)."""
    from ._internal.backend import SWITCH
    from ._internal.compile_api import _LAST, keep_reports_at_reset

    keep_reports_at_reset()
    SWITCH.turn_off()
    _LAST.clear()
    if _DEFAULT_BACKEND:
        # Keep the object: Dynamo's backend registry holds on to what the entry point loaded.
        _DEFAULT_BACKEND[0].forget()
    import sys

    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    ag = sys.modules.get("stoker_autograd")
    if ag is not None and hasattr(ag, "reset_stats"):
        ag.reset_stats()
