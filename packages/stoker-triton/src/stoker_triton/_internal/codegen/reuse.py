"""Which freed buffer a later allocation of the generated wrapper takes, so that a
graph call allocates less without raising its peak memory.

The wrapper's buffers live from their allocation to their last reader
(`Schedule.last_use`). A buffer freed there may instead be kept and handed to a
later allocation of the same size, stride and dtype: one allocation less, but it
stays live in between. It is handed over only when that cannot raise the call's
peak, the most bytes live at once without any reuse (inputs counted from their
free, as a boxed call frees them): with static sizes, when the live bytes
between its free and the reuse, plus its own, stay within that peak; with
symbolic sizes, when nothing is allocated in between. Each reuse is decided in
allocation order against the live bytes the earlier reuses left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy

from ..ir import Buffer, ExternNode, Program, ScatterNode
from ..scheduler import Kernel, Schedule

Key = tuple[Any, ...]


@dataclass
class Event:
    name: str
    alloc: bool  # an allocation (else a free)
    step: int


def events(program: Program, sched: Schedule, frees: Callable[[str], bool]) -> list[Event]:
    """The wrapper's allocations and frees in the order it makes them: each kernel's
    stored outputs before its launch, each extern result after its call, then the
    buffers the step read last (those `frees(name)` says the wrapper lets go)."""
    out: list[Event] = []
    for i, step in enumerate(sched.steps):
        if isinstance(step, Kernel):
            for node in step.nodes:
                if node.name in sched.internal or program.buffers[node.name].kind != "kernel":
                    continue
                if not isinstance(node, ScatterNode):  # it writes its init node's buffer
                    out.append(Event(node.name, True, i))
        elif isinstance(step, ExternNode):
            out += [Event(o, True, i) for o in step.outputs if o is not None]
        out += [Event(b, False, i) for b, last in sched.last_use.items() if last == i and frees(b)]
    return out


def nbytes(buf: Buffer) -> int | None:
    """The bytes of `buf`'s storage extent, or None when its sizes are symbolic."""
    try:
        size = [int(sympy.sympify(s)) for s in buf.size]
        stride = [int(sympy.sympify(s)) for s in buf.stride]
    except TypeError:  # a free symbol
        return None
    if not all(size):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(size, stride))) * buf.dtype.itemsize


def plan(
    program: Program,
    evs: list[Event],
    key: Callable[[Buffer], Key],
    may_take: Callable[[str], bool],
    may_give: Callable[[str], bool],
) -> dict[str, str]:
    """allocated buffer -> the freed buffer it takes (see the module docstring).
    `may_take(name)`: an allocation that may take a freed buffer; `may_give(name)`: a
    freed buffer that may be handed over (else it is deleted at its free)."""
    bufs = program.buffers
    sizes = [nbytes(bufs[e.name]) for e in evs]
    static = all(s is not None for s in sizes)
    # live bytes after each event: an input's free frees it in one (a boxed call whose
    # caller let it go), not in the other (the caller holds it); a reuse fits both
    curves: list[list[int]] = []
    for inputs_freed in (True, False):
        now, live = 0, []
        for e, n in zip(evs, sizes):
            if e.alloc:
                now += n or 0
            elif inputs_freed or bufs[e.name].kind != "input":
                now -= n or 0
            live.append(now)
        curves.append(live)
    peaks = [max([0, *live]) for live in curves]
    pool: dict[Key, list[int]] = {}  # key -> indices of free events, oldest first
    taken: dict[str, str] = {}
    for r, e in enumerate(evs):
        b = bufs[e.name]
        if not e.alloc:
            if may_give(e.name):
                pool.setdefault(key(b), []).append(r)
            continue
        frees = pool.get(key(b))
        if not frees or not may_take(e.name):
            continue
        for j in range(len(frees) - 1, -1, -1):  # the latest freed first: the shortest hold
            f = frees[j]
            n = sizes[f] or 0
            if static:
                ok = all(max(live[f:r]) + n <= pk for live, pk in zip(curves, peaks))
            else:
                ok = not any(x.alloc for x in evs[f + 1 : r])
            if ok:
                del frees[j]
                taken[e.name] = evs[f].name
                for live in curves if static else ():
                    for t in range(f, r):
                        live[t] += n
                break
    return taken
