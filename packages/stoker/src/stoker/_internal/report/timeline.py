"""Where the first compiled step's time goes: stage marks collected into a timeline.

Every stoker package marks its stages through `stoker_shapes.timing`; this
module listens (`install`) and keeps the marks as `Span`s in one process-wide
`Recorder`. Besides the packages' own marks it records

* Dynamo's compile of each frame, from its compile-start to its compile-end
  callback (``torch._dynamo.callback``): everything in it that is not a
  stoker stage is Dynamo's own work (the bytecode trace, building guards);
* the first run of each compiled forward (`TimedRun`, the callable Dynamo
  gets) and of the backward after a compile (stoker-autograd's runtime
  wrapper);
* Python's garbage collections while a first step is being recorded.

`account` turns the spans of a window (the first compiled step) into
exclusive time per graph and stage: a span inside another is a part of it,
time inside no span is "other". So the rows add up to the window's wall
time exactly, and "other" is what no stage claims.
"""

from __future__ import annotations

import collections
import gc
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from stoker_shapes import timing

STAGE_LABELS: dict[str, str] = {
    **timing.STAGES,
    "backend": "stoker backend (bookkeeping)",
    "other": "other (in no stage: gaps, unmarked code)",
}
"""Stage key -> what the report calls it (`stoker_shapes.timing.STAGES`, plus "other")."""

MAX_SPANS = 50_000  # a bound for a process that compiles for days


@dataclass
class Span:
    stage: str  # a key of STAGE_LABELS
    name: str  # what the timeline shows
    start_ns: int  # time.perf_counter_ns()
    end_ns: int
    graph: str = ""  # "graph 0", "backward graph 0", "" (resolved from the enclosing span)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass
class StageTime:
    graph: str  # "" for time that belongs to no graph (other, GC outside one)
    stage: str
    ms: float


def account(spans: Iterable[Span], start_ns: int, end_ns: int) -> list[StageTime]:
    """Exclusive milliseconds per (graph, stage) of ``[start_ns, end_ns]``.

    Each instant goes to the innermost span covering it (the latest started),
    an instant no span covers to ``("", "other")``; a span with no graph takes
    its enclosing span's. The rows sum to the window's length."""
    clipped = sorted(
        (
            (max(s.start_ns, start_ns), min(s.end_ns, end_ns), i, s)
            for i, s in enumerate(spans)
            if s.end_ns > start_ns and s.start_ns < end_ns and s.end_ns > s.start_ns
        ),
        key=lambda x: (x[0], -x[1], x[2]),
    )
    events: list[tuple[int, int, int]] = []  # (time, 0 end / 1 start, index into clipped)
    for k, (a, b, _, _) in enumerate(clipped):
        events.append((a, 1, k))
        events.append((b, 0, k))
    events.sort(key=lambda e: (e[0], e[1], -e[2] if e[1] == 0 else e[2]))
    totals: dict[tuple[str, str], int] = collections.defaultdict(int)
    stack: list[tuple[int, str]] = []  # (index into clipped, resolved graph)
    now = start_ns
    for t, kind, k in events:
        if t > now:
            if stack:
                top, graph = stack[-1]
                totals[(graph, clipped[top][3].stage)] += t - now
            else:
                totals[("", "other")] += t - now
            now = t
        if kind == 1:
            span = clipped[k][3]
            graph = span.graph or (stack[-1][1] if stack else "")
            stack.append((k, graph))
        else:
            for j in range(len(stack) - 1, -1, -1):
                if stack[j][0] == k:
                    del stack[j]
                    break
    if end_ns > now:
        totals[("", "other")] += end_ns - now
    return [StageTime(g, st, ns / 1e6) for (g, st), ns in totals.items()]


class Recorder:
    """The process's spans, and what decides which runs are recorded.

    Compile stages are always kept (they are rare). Runs are kept while a first
    step is open (from a compile to the end of the backward after it), while
    `trace_runs` is on (a memory trace, the Chrome trace's steady step), and a
    compiled forward's first call."""

    def __init__(self) -> None:
        self.spans: collections.deque[Span] = collections.deque(maxlen=MAX_SPANS)
        self.graph = ""  # the graph the backend compiles now
        self.report: Any = None  # the report the next first step belongs to
        self.armed = False  # a compile happened and its backward has not run yet
        self.trace_runs = False  # keep every run (forward and backward)
        # a compiled forward's next call has something to do (`TimedRun`): trace_runs, or
        # the garbage collections of a first step to stop recording (after its backward:
        # the caller's optimizer step is part of the step it may mark)
        self.watch = False
        self.gc_closing = False
        self.dynamo_ended: tuple[int, str] | None = None  # (when, graph) of the last compile
        self.on_span: list[Callable[[Span], None]] = []  # e.g. TORCH_TRACE's events
        self.on_backward: list[Callable[[Span], None]] = []  # a kept backward run ended
        self.dynamo_start = 0  # Dynamo's compile in progress began here (0: none)
        self.dynamo_graph = ""  # ... and handed this graph to stoker ("" none)

    def add(self, stage: str, name: str, t0: int, t1: int, graph: str = "") -> None:
        """`stoker_shapes.timing`'s listener."""
        if stage == "run backward" and not (self.armed or self.trace_runs):
            return
        span = Span(stage, name, t0, t1, graph or self.graph)
        self.spans.append(span)
        for fn in self.on_span:
            fn(span)
        if stage == "run backward":
            if self.armed:
                self.armed, self.gc_closing = False, True
                self.update()
            for fn in list(self.on_backward):
                fn(span)

    def arm(self) -> None:
        """A graph was compiled: record the runs until the next backward has run."""
        self.armed, self.gc_closing = True, False
        _gc_on()
        self.update()

    def set_trace_runs(self, on: bool) -> bool:
        """Keep every run from now on (or not); returns the previous setting."""
        prior, self.trace_runs = self.trace_runs, on
        self.update()
        return prior

    def update(self) -> None:
        self.watch = self.trace_runs or self.gc_closing

    def next_run(self) -> None:
        """A compiled forward is called while `watch`: a new step began."""
        if self.gc_closing and not self.armed:
            _gc_off()
            self.gc_closing = False
            self.update()

    def between(self, start_ns: int, end_ns: int) -> list[Span]:
        return [s for s in self.spans if s.end_ns > start_ns and s.start_ns < end_ns]


RECORDER = Recorder()


@dataclass
class StepRecord:
    """The first compiled step: its window and the stage spans in it."""

    start_ns: int  # time.perf_counter_ns()
    end_ns: int
    how: str  # how the window was chosen
    spans: list[Span] = field(default_factory=list)  # clipped to the window

    @property
    def wall_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    def breakdown(self) -> list[StageTime]:
        """Exclusive ms per (graph, stage); they sum to `wall_ms` ("other": no stage's)."""
        return account(self.spans, self.start_ns, self.end_ns)

    def by_stage(self) -> dict[str, float]:
        """Exclusive ms per stage, in `STAGE_LABELS`' order, "other" last."""
        out: dict[str, float] = {}
        for row in self.breakdown():
            out[row.stage] = out.get(row.stage, 0.0) + row.ms
        order = list(STAGE_LABELS)
        return dict(sorted(out.items(), key=lambda kv: order.index(kv[0])))

    @classmethod
    def of(cls, start_ns: int, end_ns: int, how: str) -> StepRecord:
        spans = [
            Span(sp.stage, sp.name, max(sp.start_ns, start_ns), min(sp.end_ns, end_ns), sp.graph)
            for sp in RECORDER.between(start_ns, end_ns)
        ]
        return cls(start_ns, end_ns, how, spans)


class TimedRun:
    """The callable Dynamo gets for a compiled graph: the compiled function, with its
    first call (and every call while `Recorder.trace_runs`) marked "run forward"."""

    __slots__ = ("_first", "fn", "label")

    def __init__(self, fn: Callable[..., Any], label: str) -> None:
        self.fn, self.label, self._first = fn, label, True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._first or RECORDER.watch:
            return self._marked(args, kwargs)
        return self.fn(*args, **kwargs)

    def _marked(self, args: Any, kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        ended, first = RECORDER.dynamo_ended, self._first
        if first and ended is not None and ended[1] == self.label:
            # from Dynamo's compile-end callback to this first call: Dynamo's own work
            # after the compile (its GC pass, metrics, the cache entry, the new bytecode)
            RECORDER.add("dynamo", "Dynamo: after compile", ended[0], t0, self.label)
            RECORDER.dynamo_ended = None
        self._first = False
        if not first:
            RECORDER.next_run()
            if not RECORDER.trace_runs:
                return self.fn(*args, **kwargs)
        out = self.fn(*args, **kwargs)
        RECORDER.add("run forward", "forward", t0, time.perf_counter_ns(), self.label)
        return out

    def __getattr__(self, name: str) -> Any:
        if name in TimedRun.__slots__:  # not set yet (a copy made without __init__)
            raise AttributeError(name)
        return getattr(self.fn, name)


# ---------------------------------------------------------------------- Dynamo's compiles


def _dynamo_start(*_: Any) -> None:
    RECORDER.dynamo_start = time.perf_counter_ns()
    RECORDER.dynamo_graph = ""
    _gc_on()  # a collection in the compile is part of the step (off after its backward)


def _dynamo_end(*_: Any) -> None:
    t0, graph = RECORDER.dynamo_start, RECORDER.dynamo_graph
    RECORDER.dynamo_start, RECORDER.dynamo_graph = 0, ""
    # a frame that gave stoker a graph, or any frame Dynamo compiled in a first step
    # (a resume function after a graph break, a frame it skipped): time of the step
    if t0 and (graph or RECORDER.armed):
        t1 = time.perf_counter_ns()
        RECORDER.add("dynamo", "Dynamo: compile frame", t0, t1, graph)
        RECORDER.dynamo_ended = (t1, graph) if graph else None
    elif not (RECORDER.armed or RECORDER.gc_closing):
        _gc_off()  # a compile that gave stoker nothing, outside a first step


def install() -> None:
    """Listen to the stage marks and to Dynamo's compile callbacks (again after a
    ``torch._dynamo.reset()``, which drops them). Cheap when done already."""
    if not timing.listening():
        timing.listen(RECORDER.add)
    dynamo = sys.modules.get("torch._dynamo")
    handler = getattr(getattr(dynamo, "callback", None), "callback_handler", None)
    if handler is None:  # torch._dynamo not imported yet, or a torch without the callbacks
        return
    try:
        if _dynamo_start not in handler.start_callbacks:
            handler.register_start_callback(_dynamo_start)
        if _dynamo_end not in handler.end_callbacks:
            handler.register_end_callback(_dynamo_end)
    except AttributeError:  # pragma: no cover - a torch whose handler differs
        pass


def compile_start_ns() -> int:
    """When the Dynamo compile now in progress began (now, when that is unknown)."""
    return RECORDER.dynamo_start or time.perf_counter_ns()


# ---------------------------------------------------------------------- garbage collection

_gc_t0 = [0]


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_t0[0] = time.perf_counter_ns()
        return
    t0, t1 = _gc_t0[0], time.perf_counter_ns()
    if t0 and t1 - t0 >= 50_000:  # 50 µs: shorter ones stay part of what they interrupted
        RECORDER.add("gc", f"Python GC (generation {info.get('generation', '?')})", t0, t1)


def _gc_on() -> None:
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def _gc_off() -> None:
    if _on_gc in gc.callbacks:
        gc.callbacks.remove(_on_gc)
