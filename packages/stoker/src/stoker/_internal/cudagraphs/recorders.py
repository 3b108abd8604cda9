"""The recorders behind ``mode="reduce-overhead"`` (`cudagraphs`): what makes and
replays a graph. `CudaRecorder` uses torch's CUDA graphs; `HostRecorder` stands in
for them in CPU tests (recording runs the function, a replay runs it again and
writes the results into the recorded outputs, as a graph writes its static
buffers). Also which inputs are read in place as module buffers (`mark_static`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import torch


class Recorder(Protocol):
    """Makes and replays graphs for one kind of device."""

    record_executes: bool  # record() also computed the outputs (else: replay once after)

    def unsupported(self, example_inputs: Sequence[Any]) -> str | None: ...
    def pool_id(self, example_inputs: Sequence[Any]) -> Any: ...
    def record(self, fn: Callable[..., Any], args: list[Any], pool_id: Any) -> tuple[Any, Any]: ...
    def replay(self, graph: Any, args: list[Any] | None) -> None: ...


class CudaRecorder:
    """torch's CUDA graphs: one private memory pool per device, capture on a side stream."""

    record_executes = False
    _pools: ClassVar[dict[int, Any]] = {}

    def unsupported(self, example_inputs: Sequence[Any]) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        if not any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs):
            return "no CUDA device (the graph's inputs are on the CPU)"
        return None

    def pool_id(self, example_inputs: Sequence[Any]) -> Any:
        dev = next(x.device for x in example_inputs if isinstance(x, torch.Tensor))
        return ("cuda", dev.index if dev.index is not None else torch.cuda.current_device())

    def record(self, fn: Callable[..., Any], args: list[Any], pool_id: Any) -> tuple[Any, Any]:
        index = pool_id[1]
        pool = self._pools.get(index)
        if pool is None:
            with torch.cuda.device(index):
                pool = self._pools[index] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(index):
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = fn(*args)
        return graph, out

    def replay(self, graph: Any, args: list[Any] | None) -> None:
        graph.replay()


class HostRecorder:
    """A stand-in for CPU tests: "recording" runs the function, "replaying" runs it again
    and writes its results into the recorded outputs, as a graph writes its static buffers.
    ``events`` lists what happened ("record", "replay")."""

    record_executes = True

    def __init__(self) -> None:
        self.events: list[str] = []

    def unsupported(self, example_inputs: Sequence[Any]) -> str | None:
        return None

    def pool_id(self, example_inputs: Sequence[Any]) -> Any:
        return ("host", id(self))

    def record(self, fn: Callable[..., Any], args: list[Any], pool_id: Any) -> tuple[Any, Any]:
        self.events.append("record")
        out = fn(*args)
        # the outputs it writes at a replay: not those of an input's memory (a graph has
        # no such buffers of its own; holding them would pin the caller's tensors)
        inputs = {_cdata(a) for a in args if isinstance(a, torch.Tensor)}
        static = [
            t if isinstance(t, torch.Tensor) and _cdata(t) not in inputs else None
            for t in _flatten(out)[0]
        ]
        return (fn, static), out

    def replay(self, graph: Any, args: list[Any] | None) -> None:
        self.events.append("replay")
        fn, static = graph
        for s, new in zip(static, _flatten(fn(*(args or [])))[0], strict=True):
            if s is not None and s.untyped_storage().data_ptr() != (
                new.untyped_storage().data_ptr()
            ):
                s.copy_(new)


_RECORDER: list[Recorder] = []
# Module buffers the frontend saw (`mark_static`): read in place, as parameters are.
_STATIC: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def mark_static(t: torch.Tensor) -> None:
    """Graphs read ``t`` where it is (a module buffer) instead of copying it per replay."""
    _STATIC[id(t)] = t


def _is_static(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or _STATIC.get(id(t)) is t


def current_recorder() -> Recorder:
    return _RECORDER[-1] if _RECORDER else CudaRecorder()


@contextlib.contextmanager
def use_recorder(recorder: Recorder) -> Iterator[Recorder]:
    """Graphs wrapped inside this block use ``recorder`` (tests: a `HostRecorder`)."""
    _RECORDER.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.remove(recorder)


# ---------------------------------------------------------------------- helpers


def _cdata(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _flatten(out: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The leaves of a graph's result and how to rebuild it (fast for a tuple or list)."""
    if isinstance(out, tuple) and type(out) is tuple:
        return list(out), tuple
    if type(out) is list:
        return list(out), list
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    return leaves, lambda xs: torch.utils._pytree.tree_unflatten(xs, spec)
