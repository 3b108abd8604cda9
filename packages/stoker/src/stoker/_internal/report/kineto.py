"""``torch.profiler`` without Kineto's start and stop lines on stderr.

Kineto, the profiler's C++ side, writes one line to file descriptor 2 when a
profiler starts and one when it stops, whatever ``KINETO_LOG_LEVEL`` says::

    USDT:2026-12-07 15:05:15 9438:9438 SyncActivityProfilerHandler.cpp:52] profiler_start
    USDT:2026-12-07 15:05:15 9438:9438 SyncActivityProfilerHandler.cpp:59] profiler_stop

stoker starts a profiler of its own to trace memory (the report's plot, ``stoker
demo``) and to count allocations and GPU kernels, so those lines landed in the
user's output.  `quiet_profile` runs the profiler's start and stop, and only those,
with descriptor 2 sent to a temporary file, then writes back every line that is not
one of the two: nothing else is hidden, and the profiled block's own output is left
alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

# Kineto's "USDT" log lines of a profiler start or stop (glog-style prefix, then the text)
KINETO_LINE = re.compile(rb"^USDT:[^\n]*\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def quiet_profile(prof: Any) -> Iterator[Any]:
    """``with quiet_profile(torch.profiler.profile(...)) as prof:``, like ``with
    profile(...) as prof:`` without Kineto's start and stop lines on stderr."""
    with _without_kineto_lines():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _without_kineto_lines():
            prof.__exit__(None, None, None)


@contextlib.contextmanager
def _without_kineto_lines() -> Iterator[None]:
    """Descriptor 2 into a temporary file over the block, then every line written there
    that is not Kineto's start or stop line back to descriptor 2."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no descriptor 2 (a closed or replaced stream)
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        try:
            os.dup2(tmp.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().splitlines(keepends=True) if not KINETO_LINE.match(ln)]
            rest = b"".join(kept)
            while rest:
                rest = rest[os.write(2, rest) :]
