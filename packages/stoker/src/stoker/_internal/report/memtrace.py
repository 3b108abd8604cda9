"""Live tensor bytes over one step, for the report's memory plot (`Report.trace_memory`).

On the CPU the step runs under ``torch.profiler`` with ``profile_memory=True``:
every allocation and free of CPU tensor memory, with its size and time (as
`memprobe` counts a peak). On a GPU the CUDA caching allocator records its
history (``torch.cuda.memory._record_memory_history``): every block allocated
and freed, with its size and time. The running sum of either is the bytes
live above what was live when the step began; the forward and backward runs
in the step (`timeline.Recorder.trace_runs`) are marked as phases.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .timeline import RECORDER

_BEGIN, _END = "stoker.memory.begin", "stoker.memory.end"


@dataclass
class MemoryRecord:
    """Live tensor bytes over one traced step (`trace`), above what was live before it."""

    device: str  # "cpu", "cuda:0"
    source: str  # where the figures come from
    t_ms: list[float] = field(default_factory=list)  # time of each change since the start
    live: list[int] = field(default_factory=list)  # bytes live after it
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # (name, start, end) ms
    duration_ms: float = 0.0
    baseline: int = 0  # bytes live when the step began (CUDA: allocated; CPU: not known, 0)
    start_ns: int = 0  # time.perf_counter_ns() at the start (for the Chrome trace)

    @property
    def peak(self) -> int:
        return max(self.live, default=0)

    @property
    def peak_ms(self) -> float:
        return self.t_ms[self.live.index(self.peak)] if self.live else 0.0


@contextlib.contextmanager
def trace(device: Any = None) -> Iterator[list[MemoryRecord]]:
    """Trace the block; the list it yields holds the `MemoryRecord` afterwards."""
    import torch

    dev = torch.device(device) if device is not None else _default_device()
    got: list[MemoryRecord] = []
    prior = RECORDER.set_trace_runs(True)
    try:
        if dev.type == "cuda":
            with _trace_cuda(dev, got):
                yield got
        else:
            with _trace_cpu(got):
                yield got
    finally:
        RECORDER.set_trace_runs(prior)


def _default_device() -> Any:
    import torch

    return (
        torch.device("cuda", torch.cuda.current_device()) if _cuda_used() else torch.device("cpu")
    )


def _cuda_used() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def _phases(start_ns: int, end_ns: int) -> list[tuple[str, float, float]]:
    """The forward and backward runs recorded in ``[start_ns, end_ns]``, in ms from the start."""
    out = []
    for s in RECORDER.between(start_ns, end_ns):
        if s.stage in ("run forward", "run backward"):
            a, b = max(s.start_ns, start_ns), min(s.end_ns, end_ns)
            out.append((s.stage.removeprefix("run "), (a - start_ns) / 1e6, (b - start_ns) / 1e6))
    return sorted(out, key=lambda p: p[1])


def curve(events: Iterable[tuple[float, int]]) -> tuple[list[float], list[int]]:
    """``(t_ms, size)`` allocator events (a free negative), in time order → the times
    and the bytes live after each (above the start)."""
    ts, live, now = [], [], 0
    for t, n in sorted(events, key=lambda e: e[0]):  # stable: same-time events keep order
        now += n
        ts.append(t)
        live.append(now)
    return ts, live


@contextlib.contextmanager
def _trace_cpu(got: list[MemoryRecord]) -> Iterator[None]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from .kineto import quiet_profile

    with quiet_profile(profile(activities=[ProfilerActivity.CPU], profile_memory=True)) as prof:
        with record_function(_BEGIN):
            pass
        p0 = time.perf_counter_ns()  # inside the marks: the phases fall within the record
        yield
        p1 = time.perf_counter_ns()
        with record_function(_END):
            pass
    alloc = torch._C._profiler._EventType.Allocation
    marks: dict[str, int] = {}
    raw: list[tuple[int, int]] = []
    todo: list[Any] = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == alloc:
            if str(e.extra_fields.device).startswith("cpu"):
                raw.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
        elif e.name in (_BEGIN, _END):
            marks[e.name] = e.start_time_ns
        todo.extend(e.children)
    t0 = marks.get(_BEGIN, min((t for t, _ in raw), default=0))
    t1 = marks.get(_END, max((t for t, _ in raw), default=t0))
    ts, live = curve(((t - t0) / 1e6, n) for t, n in raw if t0 <= t <= t1)
    duration = (t1 - t0) / 1e6
    # the phases are timed on this process's clock, the record on the profiler's: a
    # phase that ends with the step may end a few microseconds past the last mark
    phases = [(n, min(a, duration), min(b, duration)) for n, a, b in _phases(p0, p1)]
    got.append(
        MemoryRecord(
            device="cpu",
            source="CPU allocator events, torch.profiler(profile_memory=True)",
            t_ms=ts,
            live=live,
            phases=phases,
            duration_ms=duration,
            start_ns=p0,
        )
    )


@contextlib.contextmanager
def _trace_cuda(dev: Any, got: list[MemoryRecord]) -> Iterator[None]:
    import torch

    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    # every alloc and free ("all"), without their tracebacks (context=None: cheaper)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=200_000)
    try:
        t0_us, p0 = time.time_ns() / 1e3, time.perf_counter_ns()
        yield
        torch.cuda.synchronize(dev)
        t1_us, p1 = time.time_ns() / 1e3, time.perf_counter_ns()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap.get("device_traces", [])
    entries = traces[dev.index or 0] if len(traces) > (dev.index or 0) else []
    got.append(cuda_record(entries, t0_us, t1_us, str(dev), base, _phases(p0, p1), p0))


def cuda_record(
    entries: list[dict[str, Any]],
    t0_us: float,
    t1_us: float,
    device: str,
    baseline: int,
    phases: list[tuple[str, float, float]],
    start_ns: int = 0,
) -> MemoryRecord:
    """A `MemoryRecord` from the CUDA caching allocator's trace entries (the snapshot's
    ``device_traces``): ``alloc`` adds a block's size, ``free_completed`` takes it away.
    Entries are placed by their ``time_us`` (wall-clock microseconds) from ``t0_us``;
    where none falls in ``[t0_us, t1_us]`` (another clock), from the first entry."""
    moves = [
        (float(e.get("time_us", 0)), int(e["size"]) * (1 if e["action"] == "alloc" else -1))
        for e in entries
        if e.get("action") in ("alloc", "free_completed") and "size" in e
    ]
    inside = [(t, n) for t, n in moves if t0_us <= t <= t1_us]
    if inside:
        start, end, moves = t0_us, t1_us, inside
    else:
        start = min((t for t, _ in moves), default=0.0)
        end = max((t for t, _ in moves), default=start)
    ts, live = curve(((t - start) / 1e3, n) for t, n in moves)
    return MemoryRecord(
        device=device,
        source="CUDA caching allocator history (torch.cuda.memory._record_memory_history)",
        t_ms=ts,
        live=live,
        phases=phases,
        duration_ms=(end - start) / 1e3,
        baseline=baseline,
        start_ns=start_ns,
    )
