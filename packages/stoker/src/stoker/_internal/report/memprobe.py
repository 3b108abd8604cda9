"""Peak CPU memory of a step, counted from allocation events: the CPU proxy of peak memory.

On a GPU the suite reads ``torch.cuda.max_memory_allocated``. A CPU has no such
counter, so `peak_live_bytes` runs the step under ``torch.profiler`` with
``profile_memory=True`` and replays the allocator's events in order: every
allocation and free of tensor memory on the CPU, with its size. The peak of
their running sum is the most bytes the step held at once above what was live
when it started. It counts allocations, not time, so it is deterministic for a
given program: a test can assert on it. Memory the Triton interpreter allocates
outside torch (NumPy arrays) is not counted. `held_bytes` sums the same events:
what the step allocated and still holds when it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _allocations(step: Callable[[], object]) -> list[int] | None:
    """The sizes of the CPU allocator's events during ``step()``, in order (a free is
    negative); None when this torch's profiler reported none."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .kineto import quiet_profile

    with quiet_profile(profile(activities=[ProfilerActivity.CPU], profile_memory=True)) as prof:
        step()
    alloc = torch._C._profiler._EventType.Allocation
    events: list[tuple[int, int]] = []
    todo: list[Any] = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == alloc and str(e.extra_fields.device).startswith("cpu"):
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        todo.extend(e.children)
    if not events:
        return None
    events.sort(key=lambda x: x[0])  # a stable sort: same-time events keep their order
    return [n for _, n in events]


def peak_live_bytes(step: Callable[[], object]) -> int | None:
    """Peak CPU tensor bytes allocated during ``step()`` beyond those live at its start
    (None: this torch's profiler reported no allocation events)."""
    sizes = _allocations(step)
    if sizes is None:
        return None
    live = peak = 0
    for n in sizes:
        live += n
        peak = max(peak, live)
    return peak


def held_bytes(step: Callable[[], object]) -> int | None:
    """CPU tensor bytes that ``step()`` allocated and that are still live when it returns
    (what its results, and anything else it left behind, hold)."""
    sizes = _allocations(step)
    return None if sizes is None else sum(sizes)
