"""One measurement on the GPU at a time: `GpuLock`, which the GPU lap
(tools/gpu_lap.py) and the kernel benchmark (`benchmarks.kernels --gpu-lock`) share, and
`pin`, which moves the calling thread to the cores kept for measurements."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator


class GpuLock:
    """An exclusive lock on a file: one measurement on the GPU at a time. Entering it
    also moves the calling thread to the cores kept for measurements
    (``STOKER_LAP_TIMED_CPUS``), away from the processes compiling beside it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.waited_s = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        t0 = time.perf_counter()
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            self.waited_s += time.perf_counter() - t0
            before = pin(os.environ.get("STOKER_LAP_TIMED_CPUS", ""))
            try:
                yield
            finally:
                if before is not None:
                    os.sched_setaffinity(0, before)
                fcntl.flock(f, fcntl.LOCK_UN)


def _cpus(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            out |= set(range(int(a), int(b) + 1))
        elif part.strip():
            out.add(int(part))
    return out


def pin(spec: str) -> set[int] | None:
    """Pin the calling thread to the cores of `spec` (which may lie outside its present
    mask: a compiling process moves to the measuring cores); the mask before, or None
    where the cores are not ours to take."""
    cpus = _cpus(spec) if spec else set()
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return None
    return before
