"""``queue_callback`` inside a compiled backward: run the callbacks at the graph's end.

The eager engine runs the callbacks a backward queued with
``Variable._execution_engine.queue_callback`` after its last node.  When the
compiled-autograd hook runs a backward, the engine hands the whole graph to the
hook and never runs them: FSDP2's root post-backward (reshard, reduce-scatter of
the modules whose inputs need no gradient) and DDP's finalisation would be lost.

`collecting()` (entered by the runtime wrapper around one compiled backward)
swaps ``Variable._execution_engine`` for a proxy whose ``queue_callback`` keeps,
for that backward's graph task only, the callbacks in a list; the graph's last
node (`ops.exec_final_callbacks_stub`) runs them, in order, including those that
callbacks queue.  A nested eager backward that a hook runs has its own graph
task: its callbacks go to the real engine, which runs them itself.

`on_backward_start` is the other end: callables the runtime wrapper runs at the
start of every compiled backward, inside `collecting()`.  `skip_compile` lets such
a caller say that the graph now running will not be replayed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.variable import Variable


class _Collecting:
    """One compiled backward's queued callbacks (its graph task's id and the list)."""

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self.callbacks: list[Callable[[], None]] = []


_ACTIVE: list[_Collecting] = []  # innermost compiled backward last
# `on_backward_start` callables by handle id (an OrderedDict: the handle holds a weakref)
_ON_START: OrderedDict[int, Callable[[], None]] = OrderedDict()


def on_backward_start(fn: Callable[[], None]) -> torch.utils.hooks.RemovableHandle:
    """Call ``fn()`` at the start of every compiled backward, before its graph runs.

    It runs in the backward's graph task (``torch._C._current_graph_task_id()``
    names that backward) and a callback it queues with ``queue_callback`` runs at
    the graph's end.  Being no node of the graph, it cuts no segment (stoker's DDP
    reducer takes its picture of ``.grad`` before the backward here).  Returns a
    handle whose ``remove()`` stops it.
    """
    handle = torch.utils.hooks.RemovableHandle(_ON_START)
    _ON_START[handle.id] = fn
    return handle


def run_start_callbacks() -> None:
    for fn in list(_ON_START.values()):
        fn()


_SKIP_COMPILE: list[int] = [-1]  # the graph task whose captured graph is not to be compiled


def skip_compile() -> None:
    """Within a compiled backward: do not compile its captured graph after this run.

    For a caller that, during the backward, changed what the engine will capture
    next time (stoker's DDP reducer removes hooks after its first backward): the
    compile of a graph that will not be replayed is wasted.  Only the first,
    uncompiled run of a captured graph compiles, so elsewhere this does nothing; a
    graph that is replayed after all is compiled after that run.
    """
    _SKIP_COMPILE[0] = int(torch._C._current_graph_task_id())


def take_skip_compile() -> bool:
    """Whether the current backward asked `skip_compile` (and forget that it did)."""
    task = int(torch._C._current_graph_task_id())
    if task != -1 and _SKIP_COMPILE[0] == task:
        _SKIP_COMPILE[0] = -1
        return True
    return False


class _EngineProxy:
    """The real engine, except ``queue_callback`` within a collecting graph task."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def queue_callback(self, callback: Callable[[], None]) -> None:
        task = torch._C._current_graph_task_id()
        for c in reversed(_ACTIVE):
            if c.task_id == task:
                c.callbacks.append(callback)
                return
        self._real.queue_callback(callback)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class collecting:  # a class used like a function: ``with collecting():``
    """Collect the callbacks the current graph task queues until `run_queued()`.
    (Entered once per compiled backward: a slotted class, not a generator context manager.)"""

    __slots__ = ("_entry", "_real")

    def __enter__(self) -> None:
        self._entry = _Collecting(torch._C._current_graph_task_id())
        real = Variable._execution_engine
        self._real = None if isinstance(real, _EngineProxy) else real
        if self._real is not None:
            Variable._execution_engine = _EngineProxy(real)  # type: ignore[assignment]
        _ACTIVE.append(self._entry)

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self._entry)
        if self._real is not None:
            Variable._execution_engine = self._real


def run_queued() -> None:
    """Run (and forget) the innermost compiled backward's callbacks, also those they queue."""
    if not _ACTIVE:
        return
    callbacks = _ACTIVE[-1].callbacks
    i = 0
    while i < len(callbacks):
        callbacks[i]()
        i += 1
    callbacks.clear()
