"""Stage timing: where a compile's time goes, for whoever listens.

Each stoker package marks its stages (capture, partition, lowering, compiled
autograd's capture and retrace, cache loads, ...) with `timed` or with
`start` / `done` around the work. Nobody listens by default, and then a mark
costs one global check. The umbrella package `stoker` listens (`listen`) and
builds its report's timeline and its Chrome trace from the marks.

A mark reaches the listener when its stage ends, as ``(stage, name, start_ns,
end_ns, graph)``: times from `time.perf_counter_ns`; ``stage`` one of
`STAGES`; ``name`` what the timeline shows; ``graph`` the graph it belongs to
("" for the one being compiled now). Marks nest by time: a mark inside
another is a part of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STAGES: dict[str, str] = {
    "dynamo": "Dynamo trace",
    "backend": "stoker backend",
    "capture": "capture",
    "partition": "partition",
    "codegen": "lowering and codegen",
    "kernel compile": "kernel compile",
    "autograd capture": "compiled autograd: capture",
    "autograd retrace": "compiled autograd: retrace",
    "autograd compile": "compiled autograd: compile",
    "cache load": "cache loads",
    "cache write": "cache writes",
    "run forward": "first run: forward",
    "run backward": "first run: backward",
    "report": "report and logs",
    "gc": "Python GC",
    "user": "user code (loss, optimizer step)",
}
"""Every stage a mark may name, with what a report calls it."""

Listener = Callable[[str, str, int, int, str], None]

_listener: Listener | None = None


def listen(fn: Listener | None) -> Listener | None:
    """Send every mark to ``fn`` from now on (None: to nobody); returns the previous one."""
    global _listener
    prior, _listener = _listener, fn
    return prior


def listening() -> bool:
    return _listener is not None


def start() -> int:
    """The start of a mark, for `done` (0 when nobody listens: `done` then does nothing)."""
    return time.perf_counter_ns() if _listener is not None else 0


def done(stage: str, t0: int, name: str = "", graph: str = "") -> None:
    """End the mark that `start` began: ``stage`` from ``t0`` until now."""
    fn = _listener
    if fn is not None and t0:
        fn(stage, name or stage, t0, time.perf_counter_ns(), graph)


@contextmanager
def timed(stage: str, name: str = "", graph: str = "") -> Iterator[None]:
    """Mark the block as ``stage`` (ended by an exception too)."""
    t0 = start()
    try:
        yield
    finally:
        done(stage, t0, name, graph)
