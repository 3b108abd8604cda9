"""Autocast and compiled graphs: traced under the caller's autocast, run with it off.

A graph captured while autocast is on already holds autocast's casts (and the
regions the function ran with autocast disabled hold none).  Running that
graph under autocast again would cast a second time (an ``mm`` of two float32
values inside an ``autocast(enabled=False)`` region would become bfloat16), so
every compiled forward, backward and compiled-autograd graph runs inside
`autocast_off`.  Backward graphs are also *traced* inside it: eager runs a
backward called outside autocast (what torch recommends) without autocast.

`autocast_state` is the part of the autocast state that changes a captured
graph: stoker keys the caches it owns on it (Dynamo guards it itself).
"""

from __future__ import annotations

import functools
from types import TracebackType

import torch

_any_enabled = torch._C._is_any_autocast_enabled

# torch's own list of the device types autocast knows (privateuse1 included); the
# fallback is for a torch without the query.
_FALLBACK_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu", "maia")

AutocastState = tuple[tuple[str, torch.dtype], ...]


@functools.cache
def autocast_devices() -> tuple[str, ...]:
    """Device types whose autocast state can be read and set on this torch build."""
    query = getattr(torch._C, "_autocast_supported_devices", None)
    names = tuple(query()) if query is not None else _FALLBACK_DEVICES
    usable: list[str] = []
    for d in names:
        try:
            torch.is_autocast_enabled(d)
        except RuntimeError:  # a device type this build cannot name (e.g. no privateuse1)
            continue
        usable.append(d)
    return tuple(usable)


def autocast_state() -> AutocastState:
    """``((device type, dtype), ...)`` for each device type with autocast on; ``()`` if none.

    One C call when autocast is off (the common case).
    """
    if not _any_enabled():
        return ()
    return tuple(
        (d, torch.get_autocast_dtype(d)) for d in autocast_devices() if torch.is_autocast_enabled(d)
    )


class autocast_off:  # a class used like a function: ``with autocast_off():``
    """Turn autocast off on every device type for a block; restore it after.

    Sets the per-device flags (not only the dispatch keys), so code inside that
    enters ``torch.autocast`` again (a ``custom_bwd`` backward, a checkpoint's
    recomputation) gets autocast as in eager.  With autocast off (the common case)
    it costs one C call on entry and nothing on exit.
    """

    __slots__ = ("_was_on",)

    def __enter__(self) -> None:
        if not _any_enabled():
            self._was_on: tuple[str, ...] = ()
            return
        on = tuple(d for d in autocast_devices() if torch.is_autocast_enabled(d))
        for d in on:
            torch.set_autocast_enabled(d, False)
        self._was_on = on

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for d in self._was_on:
            torch.set_autocast_enabled(d, True)
