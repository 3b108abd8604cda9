"""The scope in which stoker-autograd compiles ``loss.backward()``.

The autograd engine has one compiled-autograd hook per process, and ``backward()``
is called by user code, outside anything stoker compiled.  stoker-autograd decides
per backward call whether to set that hook (`stoker_autograd.set_default`): with
``compiled_autograd=True`` (the default), `stoker.compile` and the backend make the
backwards whose graph runs through a stoker-compiled forward compiled ones; every
other backward in the process (an eager reference model, a model another backend
compiled) runs on the plain eager engine, as without stoker.  Scope it further
with ``with stoker.autograd_enabled(True): ...`` (every backward in the block
compiled, also of eager models) or ``(False)`` (none); `stoker.reset()` turns it
off and forgets every captured graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import sibling


class AutogradSwitch:
    """Holds the process-wide scope's compiler while on."""

    def __init__(self) -> None:
        self._on = False
        self._compiler: Callable[..., Any] | None = None
        self._dynamic = True
        self.session: Any = None  # the default stoker_autograd.Session while on

    @property
    def on(self) -> bool:
        return self._on

    def turn_on(self, compiler: Callable[..., Any] | None = None, dynamic: bool = True) -> None:
        """Compile the backwards of stoker-compiled forwards, process-wide (idempotent: the
        first call's compiler stays until `turn_off`)."""
        if self._on:
            return
        ag = _autograd()
        self.session = ag.set_default(compiler=compiler, dynamic=dynamic, scope="compiled")
        self._on, self._compiler, self._dynamic = True, compiler, dynamic

    def turn_off(self) -> None:
        """Remove the process-wide scope and forget the captured backwards (the blocks of
        `scoped` still open stay open)."""
        if self._on:
            self._on = False
            self.session = None
            ag = _autograd()
            ag.clear_default()
            ag.clear_cache()

    @contextlib.contextmanager
    def scoped(self, enabled: bool) -> Iterator[None]:
        """A block where every backward is compiled (``True``, with the compiler and
        ``dynamic`` of the process-wide scope, so its captured graphs are shared) or none
        is (``False``: the eager engine).  The captured graphs survive either way, so
        switching every step costs nothing."""
        if not enabled and not _installed():
            yield  # without stoker-autograd every backward is eager anyway
            return
        ag = _autograd()
        if enabled and self.session is not None:  # the default's session: its graphs too
            with ag.enable(session=self.session, scope="all"):
                yield
        elif enabled:
            with ag.enable(compiler=self._compiler, dynamic=self._dynamic, scope="all"):
                yield
        else:
            with ag.disabled():
                yield


def _installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("stoker_autograd") is not None


def _autograd() -> Any:
    for name in ("enable", "set_default", "disabled", "clear_default", "clear_cache"):
        sibling("stoker_autograd", name, "compiled_autograd=True")
    import stoker_autograd

    return stoker_autograd
