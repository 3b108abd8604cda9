"""The process-wide switch that routes ``loss.backward()`` through stoker-autograd.

The autograd engine has one compiled-autograd hook per process, and
``backward()`` is called by user code, outside anything stoker compiled.  So
`stoker.compile` (with ``compiled_autograd=True``, the default) turns the
switch on for the whole process, once: from then on every ``backward()``,
also of models stoker did not compile, runs through stoker-autograd's
compiled backward (same numbers, compiled).  Scope it with
``with stoker.autograd_enabled(False): ...`` (or ``True``); `stoker.reset()`
turns it off and forgets every compiled graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from .errors import missing_piece


class AutogradSwitch:
    """Holds the entered ``stoker_autograd.enable(...)`` context, if on."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._compiler: Callable[..., Any] | None = None
        self._dynamic = True
        self.session: Any = None  # the stoker_autograd.Session while on (its captured graphs)

    @property
    def on(self) -> bool:
        return self._stack is not None

    def turn_on(self, compiler: Callable[..., Any] | None = None, dynamic: bool = True) -> None:
        """Enter ``stoker_autograd.enable(compiler, dynamic)`` for the process (idempotent)."""
        if self._stack is not None:
            return
        enable = _enable_fn()
        stack = contextlib.ExitStack()
        self.session = stack.enter_context(enable(compiler=compiler, dynamic=dynamic))
        self._stack, self._compiler, self._dynamic = stack, compiler, dynamic

    def turn_off(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    @contextlib.contextmanager
    def scoped(self, enabled: bool) -> Iterator[None]:
        """Temporarily on or off; restores the previous state afterwards.

        Off is a pause: the engine hook is unset and put back, but stoker-autograd's
        session and the engine's cache of captured backwards survive, so switching back
        and forth every step (eager beside compiled, as the demo does) costs nothing.
        """
        if enabled and not self.on:
            self.turn_on(self._compiler, self._dynamic)
            try:
                yield
            finally:
                self.turn_off()
        elif not enabled and self.on:
            from stoker_capture import eager_autograd_engine  # lazily: `import stoker` stays light

            with eager_autograd_engine():
                yield
        else:
            yield


def _enable_fn() -> Callable[..., Any]:
    try:
        import stoker_autograd
    except ImportError as e:
        raise missing_piece("stoker_autograd", "enable", "compiled_autograd=True") from e
    enable = getattr(stoker_autograd, "enable", None)
    if enable is None:
        raise missing_piece("stoker_autograd", "enable", "compiled_autograd=True")
    return enable  # type: ignore[no-any-return]


def autograd_stats() -> dict[str, Any]:
    """``stoker_autograd.stats()`` as a dict (with its warm-start cache's outcomes), or
    ``{}`` when stoker-autograd has no stats."""
    try:
        import stoker_autograd
    except ImportError:
        return {}
    stats = getattr(stoker_autograd, "stats", None)
    if stats is None:
        return {}
    value = stats()
    if isinstance(value, dict):
        # the warm-start cache's outcomes by reason ("miss (new key)": 1), for the report
        outcomes: dict[str, int] = getattr(stoker_autograd, "cache_outcomes", dict)()
        # why each backward was compiled again (the report's Recompiles section lists them)
        reasons: list[str] = getattr(stoker_autograd, "recompile_reasons", list)()
        # why a backward was captured again (its autograd nodes differ from an earlier one)
        again: list[str] = getattr(stoker_autograd, "recapture_reasons", list)()
        return (
            dict(value)
            | {f"disk cache {k}": n for k, n in sorted(outcomes.items())}
            | ({"recompile reasons": reasons} if reasons else {})
            | ({"recapture reasons": again} if again else {})
        )
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(value)
    return {k: v for k, v in vars(value).items() if not k.startswith("_")}
