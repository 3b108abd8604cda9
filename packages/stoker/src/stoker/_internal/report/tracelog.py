"""stoker in torch's own tools: ``TORCH_TRACE`` events and artifacts, and ``STOKER_TRACE``.

Under ``TORCH_TRACE`` (torch's structured trace, read by tlparse), stoker logs
what Inductor and AOTAutograd log for a compile, through the same
``torch._logging.trace_structured``:

* each stage span as a ``chromium_event`` (category ``stoker``), so tlparse's
  Perfetto timeline (``chromium_events.json``) shows stoker's stages inside
  Dynamo's ``backend_compile``, and compiled autograd's after them;
* per Dynamo graph, in that compile's tlparse page: ``aot_joint_graph``,
  ``aot_forward_graph``, ``aot_backward_graph`` (or ``aot_inference_graph``),
  the artifacts ``stoker_guards`` (every guard with the op and line that
  made it), ``stoker_output_code`` (the Triton wrapper and kernel sources) and
  ``stoker_compile_stages`` (milliseconds per stage);
* per compiled-autograd graph, ``compiled_autograd_graph`` under compile id
  ``!N`` (N: the backward graph's number), as torch's compiled autograd does.

Nothing is formatted unless a trace handler is installed (``TORCH_TRACE`` set).

``STOKER_TRACE=path`` writes a Chrome-trace JSON (``{"traceEvents": [...]}``,
opens in Perfetto or chrome://tracing): every stage span of the compile and
the first step, then the spans of the next (steady) step, a counter track of
live bytes where a step's memory was traced. It is written when that step
ends and again at exit.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .timeline import RECORDER, STAGE_LABELS, Span

if TYPE_CHECKING:
    from .report import Report

# perf_counter_ns + this = time_ns: stoker's spans on the clock of Dynamo's chromium events
_EPOCH_NS = time.time_ns() - time.perf_counter_ns()


def enabled() -> bool:
    """Whether torch's structured trace log writes somewhere (``TORCH_TRACE`` is set, or a
    handler of the user's): torch keeps an idle handler without a directory otherwise."""
    mod = sys.modules.get("torch._logging._internal")
    log = getattr(mod, "trace_log", None)
    if log is None:
        return False
    return any(
        not (type(h).__name__ == "LazyTraceHandler" and getattr(h, "root_dir", None) is None)
        for h in log.handlers
    )


def _trace(name: str, payload: Callable[[], Any], metadata: Any = dict, **kw: Any) -> None:
    from torch._logging._internal import trace_structured

    trace_structured(name, metadata, payload_fn=payload, **kw)


def _event(span: Span) -> dict[str, Any]:
    return {
        "name": span.name,
        "cat": "stoker",
        "ph": "X",
        "ts": (span.start_ns + _EPOCH_NS) / 1e3,
        "dur": (span.end_ns - span.start_ns) / 1e3,
        "pid": 0,
        "tid": 0,
        "args": {"stage": STAGE_LABELS.get(span.stage, span.stage), "graph": span.graph},
    }


def on_span(span: Span) -> None:
    """`timeline.Recorder.on_span`: the span as a chromium event of the trace."""
    if enabled():
        event = _event(span)
        _trace("chromium_event", lambda: event, suppress_context=False, expect_trace_id=False)


def _readable(gm: Any) -> str:
    try:
        return str(gm.print_readable(print_output=False, include_stride=True, include_device=True))
    except Exception:  # a graph module of another kind
        return str(getattr(gm, "graph", gm))


def compile_artifacts(compiled: Any, rec: Any) -> None:
    """A Dynamo graph's AOT graphs, guards and stage times (in its compile's context)."""
    if not enabled():
        return
    import torch

    graph = getattr(compiled, "graph", None)
    part = getattr(compiled, "partition", None)
    gm = getattr(graph, "gm", None)
    if isinstance(gm, torch.fx.GraphModule):
        kind = "aot_joint_graph" if getattr(graph, "joint", False) else "aot_inference_graph"
        _trace(kind, lambda: _readable(gm))
    for kind, attr in (("aot_forward_graph", "fw"), ("aot_backward_graph", "bw")):
        sub = getattr(part, attr, None)
        if isinstance(sub, torch.fx.GraphModule):
            _trace(kind, functools.partial(_readable, sub))
    artifact("stoker_compile_stages", lambda: rec.timings_ms, "json")


def guards(rec: Any) -> None:
    if enabled():
        artifact(
            "stoker_guards",
            lambda: [{"guard": g.text, "kind": g.kind, "made by": g.origin} for g in rec.guards],
            "json",
        )


def output_code(fn: Any, what: str) -> None:
    """stoker-triton's wrapper and kernel sources of one compiled graph."""
    if not enabled() or not hasattr(fn, "wrapper_source"):  # the aten executor: no code
        return
    rep = getattr(fn, "report", None)

    def text() -> str:
        parts = [f"# {what}: wrapper\n{getattr(fn, 'wrapper_source', '')}"]
        for k in getattr(rep, "kernels", None) or []:
            parts.append(f"# kernel {k.name} ({k.kind}): {k.path}\n{k.source}")
        return "\n\n".join(parts)

    artifact("stoker_output_code", text)


def autograd_graph(number: int | None, gm: Any) -> None:
    """A compiled-autograd graph, under compile id ``!number`` as torch's own are."""
    if not enabled():
        return
    kw: dict[str, Any] = {}
    if number is not None:
        try:
            from torch._guards import CompileId

            kw["compile_id"] = CompileId(
                frame_id=None, frame_compile_id=None, compiled_autograd_id=number
            )
        except Exception:  # a torch whose CompileId differs: logged without an id
            kw = {}
    try:
        _trace("compiled_autograd_graph", lambda: _readable(gm), expect_trace_id=False, **kw)
    except TypeError:  # a trace_structured without compile_id=
        _trace("compiled_autograd_graph", lambda: _readable(gm), expect_trace_id=False)


def artifact(name: str, payload: Callable[[], Any], encoding: str = "string") -> None:
    if not enabled():
        return

    def text() -> Any:
        got = payload()
        return json.dumps(got, default=str) if encoding == "json" else got

    _trace("artifact", text, lambda: {"name": name, "encoding": encoding})


# ---------------------------------------------------------------------- STOKER_TRACE


class ChromeTrace:
    """``STOKER_TRACE``: the compile, the first step and one steady step, as a Chrome trace."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.steps: list[tuple[str, int, int]] = []  # (name, start, end) perf_counter_ns
        self.steady_from = 0  # recording the steady step since (0: not yet / done)
        self.reports: list[Report] = []

    def first_step_closed(self, end_ns: int) -> None:
        """The first step ended: record every run of the next step."""
        if not any(name == "steady step" for name, _, _ in self.steps):
            self.steady_from = end_ns
            RECORDER.set_trace_runs(True)

    def on_backward(self, span: Span) -> None:
        if self.steady_from and span.start_ns >= self.steady_from:
            runs = [
                s
                for s in RECORDER.between(self.steady_from, span.end_ns)
                if s.stage == "run forward"
            ]
            start = min((s.start_ns for s in runs), default=span.start_ns)
            self.steps.append(("steady step", start, span.end_ns))
            self.steady_from = 0
            RECORDER.set_trace_runs(False)
            self.write()

    def events(self) -> list[dict[str, Any]]:
        pid = os.getpid()
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": "stoker"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "stages"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "steps"}},
        ]
        for s in list(RECORDER.spans):
            ev = _event(s)
            ev["pid"] = pid
            out.append(ev)
        steps = [
            ("first compiled step", r.first_step.start_ns, r.first_step.end_ns)
            for r in self.reports
            if r.first_step is not None
        ]
        for name, a, b in dict.fromkeys(steps + self.steps):
            out.append(
                {
                    "name": name,
                    "cat": "stoker",
                    "ph": "X",
                    "ts": (a + _EPOCH_NS) / 1e3,
                    "dur": (b - a) / 1e3,
                    "pid": pid,
                    "tid": 1,
                }
            )
        for r in self.reports:
            m = r.memory
            if m is None or not m.start_ns:
                continue
            for t, v in zip(m.t_ms, m.live):
                out.append(
                    {
                        "name": f"live bytes ({m.device})",
                        "ph": "C",
                        "ts": (m.start_ns + _EPOCH_NS) / 1e3 + t * 1e3,
                        "pid": pid,
                        "args": {"bytes": v},
                    }
                )
        return out

    def write(self) -> str:
        from stoker_shapes import atomic_write

        body = json.dumps({"traceEvents": self.events(), "displayTimeUnit": "ms"})
        atomic_write(self.path, body.encode())
        return self.path


_CHROME: list[ChromeTrace] = []


def chrome_trace() -> ChromeTrace | None:
    """The ``STOKER_TRACE`` writer (None when the variable is unset), made at the first use."""
    if not _CHROME:
        path = os.environ.get("STOKER_TRACE")
        if not path:
            return None
        _CHROME.append(ChromeTrace(path))
        RECORDER.on_backward.append(_CHROME[0].on_backward)
        atexit.register(_write_at_exit)
    return _CHROME[0]


def _write_at_exit() -> None:
    try:
        if _CHROME:
            _CHROME[0].write()
    except Exception:  # a trace must not fail the program at exit
        pass
