"""The ``stoker`` torch.compile backend: Dynamo's graph → stoker-capture → an executor.

`StokerBackend(options)` is the callable Dynamo calls with each graph it
captured.  Per graph, it

1. picks the executor (`config.resolve_backend`: Triton on CUDA, the aten
   executor on CPU, or the Triton interpreter),
2. turns compiled autograd on for the backwards of stoker-compiled forwards (once, for
   the process; `autograd_switch`),
3. hands the graph to ``stoker_capture.dynamo_backend(compiler=...)``, which
   adopts Dynamo's fake mode (so every stage's guards become Dynamo's) and
   calls ``compiler`` on the partitioned forward and backward graphs,
4. records what happened (graphs, guards, partition, kernels, timings) into
   the `Report` and the ``stoker.<topic>`` loggers.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import fx

from stoker_shapes._internal.gcfreeze import frozen_heap

from ..config import CompileOptions, StokerConfigError, resolve_backend
from ..errors import missing_piece, sibling
from ..report import logs, timeline, tracelog
from ..report.report import (
    CompileRecord,
    GraphBreakRecord,
    GraphRecord,
    GuardRecord,
    KernelRecord,
    PartitionRecord,
    ReadableCode,
    RecompileRecord,
    Report,
    SavedValue,
    autograd_stats,
)
from ..report.timeline import RECORDER, Span, StepRecord, TimedRun
from .autograd_switch import AutogradSwitch

CompiledCallable = Callable[..., Any]

# One switch per process: the scope in which stoker-autograd compiles backwards.
SWITCH = AutogradSwitch()
# The report of the graph compiled last: backward graphs captured by compiled autograd
# belong to it (the switch and its compiler outlive any one stoker.compile).
_CURRENT_REPORT: list[Report] = []


class StokerBackend:
    """A torch.compile backend configured by `CompileOptions`; see the module docstring.

    >>> torch.compile(model, backend=StokerBackend(CompileOptions(dynamic=True)))
    >>> torch.compile(model, backend=stoker.backend.with_options(backend="interpret"))
    """

    # How Dynamo names the backend in its messages ("backend='stoker' raised: ..."):
    # instances have no __name__ of their own, and Dynamo's debug wrapper reads compiler_name.
    __name__ = "stoker"
    compiler_name = "stoker"

    def __init__(self, options: CompileOptions | None = None, report: Report | None = None) -> None:
        self.options = options or CompileOptions.from_kwargs()
        self.report = report if report is not None else Report(path=self.options.report, live=True)
        self.report.options = _public_options(self.options)
        # Dynamo's guard-failure table is process-wide: count only what happens from now on.
        self._seen_failures: dict[Any, int] = (
            _failure_counts() if "torch._dynamo" in sys.modules else {}
        )
        self._input_desc: dict[str, str] = {}
        self.exports_guards = False  # True when Dynamo calls on_guards (stoker.compile sets it)
        self.name_hint: str | None = None  # what stoker.compile was given, for graph labels
        install_timeline()

    def forget(self) -> None:
        """Start a fresh report (`stoker.reset()` calls this on the default backend).

        The backends made for torch.compile's ``mode=`` / ``options=`` write into the report
        they were made with: they are dropped too, so later ones share the fresh report."""
        self.report.refresh()  # the counters as they were: `stoker.reset()` clears them next
        self.report.live = False
        self.report = Report(
            path=self.options.report, options=_public_options(self.options), live=True
        )
        self.__dict__.pop("_derived_backends", None)
        self._seen_failures = _failure_counts() if "torch._dynamo" in sys.modules else {}

    def with_options(self, **kwargs: Any) -> StokerBackend:
        """A new backend with these options changed (a fresh report)."""
        return StokerBackend(replace(self.options, **kwargs))

    def __repr__(self) -> str:
        return f"StokerBackend({self.options!r})"

    def _derived(self, mode: str | None, options: dict[str, Any]) -> StokerBackend:
        """The backend for torch.compile's ``mode=`` / ``options=`` (one per combination)."""
        changes = dict(options) | ({"mode": mode} if mode is not None else {})
        key = repr(sorted(changes.items()))
        derived: dict[str, StokerBackend] = self.__dict__.setdefault("_derived_backends", {})
        if key not in derived:
            try:
                opts = replace(self.options, **changes)
            except TypeError as e:
                known = ", ".join(sorted(set(self.options.__dataclass_fields__) - {"extra"}))
                raise StokerConfigError(
                    f"torch.compile(backend='stoker', options={options!r}): {e}; known: {known}"
                ) from e
            derived[key] = StokerBackend(opts, self.report)
        return derived[key]

    # ------------------------------------------------------------------ Dynamo calls this
    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> CompiledCallable:
        if mode is not None or options:
            # torch.compile(model, backend="stoker", mode=..., options={...}) passes them here
            return self._derived(mode, options or {})(gm, example_inputs)
        opts = self.options
        if torch.distributed.is_available():  # a DDP forward: take it over or split the graph
            from ..distributed.distributed import on_graph

            pieces = on_graph(self, gm, example_inputs, opts.compiled_autograd)
            if pieces is not None:
                return pieces  # type: ignore[no-any-return]
        install_timeline()
        t_call = time.perf_counter_ns()
        if not self.report.first_start_ns:  # the first step starts with Dynamo's first compile
            self.report.first_start_ns = timeline.compile_start_ns()
        devices = _devices(gm, example_inputs)
        executor = resolve_backend(opts.backend, devices)
        if executor == "triton":  # on a GPU: compile workers start while capture runs
            from stoker_triton import start_compile_workers

            for d in {d for d in devices if d.type == "cuda"}:
                start_compile_workers(d)
        rec = self.report.new_compile(_frame_name(gm, self.name_hint), executor)
        _CURRENT_REPORT[:] = [self.report]
        label = _label(rec)
        RECORDER.report, RECORDER.graph, RECORDER.dynamo_graph = self.report, label, label
        try:
            with frozen_heap():  # full GC walks skip the heap that was there before
                compiled = self._compile(gm, example_inputs, rec)
        finally:
            RECORDER.add("backend", "stoker backend", t_call, time.perf_counter_ns(), label)
            RECORDER.graph = ""
        RECORDER.arm()  # the first runs of what was compiled are part of the step
        return TimedRun(compiled, label)

    def _compile(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], rec: CompileRecord
    ) -> CompiledCallable:
        opts = self.options
        self._note_graph_break(rec, gm)
        if not self.exports_guards:  # stoker.compile gets reasons from guard_fail_fn instead
            self._note_recompiles_from_dynamo()
        self._input_desc = _describe_inputs(gm)
        if opts.compiled_autograd:
            _name_parameters(gm, example_inputs)
        if opts.mode == "reduce-overhead":
            _mark_buffers_static(gm, example_inputs)
        self._log_graph(rec, "dynamo", gm)
        if opts.compiled_autograd:
            SWITCH.turn_on(
                compiler=autograd_compiler(opts, self.report), dynamic=opts.dynamic is not False
            )
        compiler = _RecordingCompiler(rec.executor, rec, self)
        t0 = time.perf_counter()
        try:
            # With compiled autograd on, the backward's first run inlines the AOT backward
            # graph into its own captured graph, so the AOT backward is compiled only if
            # something calls it (a backward outside compiled autograd). With symbolic
            # sizes, that late compile may need a guard the forward can no longer check:
            # the graph then runs uncompiled, with a warning (stoker-capture's fallback)
            lazy_bw = opts.compiled_autograd
            inner = _capture_backend(compiler, opts, lazy_bw)
            compiled: CompiledCallable = inner(gm, example_inputs)
        except Exception as e:
            rec.error = f"{type(e).__name__}: {e}"
            self.report.flush()
            raise
        rec.time("total", (time.perf_counter() - t0) * 1e3)
        _record_capture_result(rec, compiled, opts)
        self.report.count_capture_cache(getattr(compiled, "cache_outcome", ""))
        self._record_shape_guards(rec)
        tracelog.compile_artifacts(compiled, rec)
        tracelog.guards(rec)
        if not self.exports_guards:
            # No guard_export_fn (torch.compile(backend="stoker")): Dynamo's guards so far
            # are in the tracing context; its shape guards are the ones recorded above.
            tc = torch._guards.TracingContext.try_get()
            gctx = getattr(tc, "guards_context", None)
            if gctx is not None:
                self._add_dynamo_guards(
                    rec, [g for g in gctx.dynamo_guards if g.create_fn_name() != "SHAPE_ENV"]
                )
            _log_guards(rec)
        _log_partition(rec)
        logs.logger("timings").info(
            "%s: %s", _label(rec), ", ".join(f"{k} {v:.1f} ms" for k, v in rec.timings_ms.items())
        )
        self.report.autograd = _autograd_stats()
        self.report.flush()
        return compiled

    def _note_graph_break(self, rec: CompileRecord, gm: fx.GraphModule) -> None:
        """A graph that ends at a graph break (Dynamo's reason and the user's line), or
        one that resumes after a break (a ``torch_dynamo_resume_in_<fn>_at_<line>`` frame)."""
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            self.report.graph_breaks.append(
                GraphBreakRecord(
                    _label(rec),
                    _short_reason(str(getattr(reason, "reason", reason))),
                    _user_where(getattr(reason, "user_stack", None) or []),
                )
            )
        m = _RESUME_RE.search(rec.frame)
        if m is None:
            return
        fn, line = m["fn"], int(m["line"])
        for b in self.report.graph_breaks:
            if not b.resumed_by and _breaks_at(b, fn, line):
                b.resumed_by = _label(rec)
                return
        # no graph ended at this break (it came first in its frame): Dynamo's own record
        why = _dynamo_break_reason(fn, line)
        self.report.graph_breaks.append(
            GraphBreakRecord(
                "(none: the break came before any op of the frame)",
                _short_reason(str(why.reason)) if why is not None else "(Dynamo kept no reason)",
                _user_where(why.user_stack) if why is not None else f"{fn}, line {line}",
                _label(rec),
            )
        )

    # ------------------------------------------------------------------ hooks for Dynamo
    def on_guards(self, guards: Any) -> None:
        """``guard_export_fn``: Dynamo's final guards for the graph just compiled."""
        if not self.report.compiles:
            return
        rec = self.report.compiles[-1]
        self._add_dynamo_guards(rec, guards)
        _log_guards(rec)
        self.report.flush()

    def _add_dynamo_guards(self, rec: CompileRecord, guards: Any) -> None:
        other: dict[str, int] = {}
        for g in list(guards):
            kind = str(g.create_fn_name())
            name = str(g.name)
            if kind == "TENSOR_MATCH":
                desc = self._input_desc.get(name, "")
                rec.guards.append(
                    GuardRecord(
                        f"{name} matches {desc}".strip()
                        if desc
                        else f"{name}: dtype, device, sizes, strides, requires_grad",
                        _user_frame(g) or "input of the captured frame",
                        "tensor",
                    )
                )
            elif kind == "SHAPE_ENV":
                for part in g.code_list or []:
                    rec.guards.append(
                        GuardRecord(
                            str(part), "relations of dynamic sizes (Dynamo)", "shape (Dynamo)"
                        )
                    )
            else:
                other[kind] = other.get(kind, 0) + 1
        if other:
            summary = ", ".join(f"{k}×{v}" for k, v in sorted(other.items()))
            rec.guards.append(
                GuardRecord(
                    f"{sum(other.values())} identity/state guards: {summary}",
                    "Python objects the frame read",
                    "dynamo",
                )
            )

    def on_guard_fail(self, failure: Any) -> None:
        """``guard_fail_fn``: a call missed every cached graph; Dynamo recompiles next."""
        code = getattr(failure, "orig_code", None)
        frame = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})" if code else "?"
        reason = str(getattr(failure, "reason", failure))
        self.report.recompiles.append(RecompileRecord(frame, reason))
        logs.logger("recompiles").info("recompiling %s: %s", frame, reason)

    # ------------------------------------------------------------------ internals
    def _note_recompiles_from_dynamo(self) -> None:
        """Without guard_fail_fn (``backend="stoker"``), read Dynamo's guard-failure table."""
        now = _failure_counts()
        for code, n in now.items():
            before = self._seen_failures.get(code, 0)
            if n > before:
                reasons = _failure_reasons(code)[before:n]
                frame = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
                for r in reasons:
                    self.report.recompiles.append(RecompileRecord(frame, str(r)))
                    logs.logger("recompiles").info("recompiling %s: %s", frame, r)
        self._seen_failures = now

    def _log_graph(self, rec: CompileRecord, stage: str, gm: fx.GraphModule) -> None:
        code = ReadableCode(gm)  # printed when a report or the log shows it
        nodes = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr"))
        rec.graphs.append(GraphRecord(stage, code, nodes))
        logs.logger("graphs").info("%s, %s graph (%d nodes):\n%s", _label(rec), stage, nodes, code)

    def _record_shape_guards(self, rec: CompileRecord) -> None:
        """The shape env's guards with the op and line that made each (stoker-shapes' origins)."""
        tc = torch._guards.TracingContext.try_get()
        env = getattr(getattr(tc, "fake_mode", None), "shape_env", None)
        if env is None:
            return
        names = _symbol_names(env)
        origins: dict[int, Any] = getattr(env.guards, "_origins", {})
        for i, g in enumerate(env.guards):
            text = _sym_text(g.expr, names)
            origin = origins.get(i)
            where = (
                origin.describe() if origin is not None and hasattr(origin, "describe") else None
            )
            if where is None and getattr(g, "sloc", None) is not None:
                where = str(g.sloc)
            rec.guards.append(GuardRecord(text, where, "shape"))


class _RecordingCompiler:
    """The ``compiler`` given to stoker-capture: runs the executor and records each graph."""

    def __init__(self, executor: str, rec: CompileRecord, owner: StokerBackend) -> None:
        self.executor, self.rec, self.owner = executor, rec, owner

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledCallable:
        stage = _stage_of(gm)
        self.owner._log_graph(self.rec, stage, gm)
        if stage == "backward":
            self.rec.partition = _partition_from_backward(gm, self.owner.options)
        t0 = time.perf_counter()
        fn = compile_with_executor(
            self.executor, gm, example_inputs, self.rec, self.owner.options, self.owner.report
        )
        self.rec.time(f"codegen {stage}", (time.perf_counter() - t0) * 1e3)
        tracelog.output_code(fn, f"{_label(self.rec)} {stage}")
        self.owner.report.flush()
        return fn


def compile_with_executor(
    executor: str,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    rec: CompileRecord | None,
    opts: CompileOptions | None = None,
    report: Report | None = None,
    segment: CompileRecord | None = None,
) -> CompiledCallable:
    """The aten executor (the graph module itself) or stoker-triton's compiled callable;
    under ``mode="reduce-overhead"``, wrapped to replay CUDA graphs (`cudagraphs`).
    ``segment``: where a compiled-autograd segment's kernels are recorded."""
    fn = _compile_with_executor(
        executor, gm, example_inputs, rec or segment, opts, report, segment is not None
    )
    if opts is None or opts.mode != "reduce-overhead":
        return fn
    from ..cudagraphs.cudagraphs import CudaGraphStats, graphed

    if rec is not None:
        label = f"{_label(rec)} {_stage_of(gm)}"
    else:
        n = (
            sum(1 for s in report.cudagraphs if s.label.startswith("compiled autograd"))
            if report
            else 0
        )
        label = f"compiled autograd segment {n}"
    stats = CudaGraphStats(label)
    if report is not None:
        report.cudagraphs.append(stats)
    return graphed(fn, gm, example_inputs, stats, opts.cudagraph_limit)


def _compile_with_executor(
    executor: str,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    rec: CompileRecord | None,
    opts: CompileOptions | None,
    report: Report | None,
    backward_segment: bool = False,
) -> CompiledCallable:
    if executor == "aten":
        return gm
    compile_graph = sibling("stoker_triton", "compile_graph", f"backend={executor!r}")
    autotune = opts is not None and opts.mode == "max-autotune"
    options: dict[str, Any] | None = {"max_autotune": True} if autotune else None
    if executor == "c":  # C kernels for the CPU (the Triton path follows the inputs' device)
        options = {**(options or {}), "target": "c"}
    fn = compile_graph(gm, list(example_inputs), options=options)
    if rec is not None:
        stage = "backward" if backward_segment else _stage_of(gm)
        _record_kernels(rec, getattr(fn, "report", None), stage)
    if report is not None:
        rep = getattr(fn, "report", None)
        outcome = getattr(rep, "cache", "")
        if outcome == "hit" and getattr(rep, "cache_local", False):
            outcome = "hit (compiled earlier in this process)"  # not a warm start's hit
        report.count_cache(outcome)
    return fn  # type: ignore[no-any-return]


def autograd_compiler(opts: CompileOptions, first_report: Report) -> Callable[..., Any] | None:
    """The compiler stoker-autograd uses for captured backward graphs (None: its default)."""

    def compile_backward(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledCallable:
        executor = resolve_backend(opts.backend, _devices(gm, example_inputs))
        report = _CURRENT_REPORT[0] if _CURRENT_REPORT else first_report
        nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        code = ReadableCode(gm)  # printed when a report or the log shows it
        stage = f"compiled autograd graph {len(report.autograd_graphs)} [{executor}]"
        report.autograd_graphs.append(GraphRecord(stage, code, nodes))
        tracelog.autograd_graph(len(report.autograd_graphs) - 1, gm)
        logs.logger("graphs").info("%s (%d ops):\n%s", stage, nodes, code)
        logs.logger("autograd").info(
            "compiled autograd graph (%d ops) → %s executor", nodes, executor
        )
        report.autograd = _autograd_stats()
        # the segment's kernels, for the report (not a Dynamo graph: not in `compiles`)
        segment = CompileRecord(len(report.autograd_kernels), stage.split(" [")[0], executor)
        if executor != "aten":
            report.autograd_kernels.append(segment)
        report.flush()
        fn = compile_with_executor(executor, gm, example_inputs, None, opts, report, segment)
        tracelog.output_code(fn, stage)
        return fn

    return compile_backward


# ---------------------------------------------------------------------- timeline


def install_timeline() -> None:
    """Listen to the stage marks, Dynamo's compiles and the first backward (idempotent)."""
    timeline.install()
    if _close_first_step not in RECORDER.on_backward:
        RECORDER.on_backward.insert(0, _close_first_step)
    if tracelog.on_span not in RECORDER.on_span:
        RECORDER.on_span.append(tracelog.on_span)
    tracelog.chrome_trace()


def _close_first_step(span: Span) -> None:
    """The backward after the first compile ended: the report's first step ends with it."""
    rep = RECORDER.report
    if rep is None or rep.first_step is not None or not rep.first_start_ns:
        return
    rep.first_step = StepRecord.of(
        rep.first_start_ns, span.end_ns, "from the first compile to the end of its backward"
    )
    chrome = tracelog.chrome_trace()
    if chrome is not None:
        if rep not in chrome.reports:
            chrome.reports.append(rep)
        chrome.first_step_closed(span.end_ns)


_RESUME_RE = re.compile(r"torch_dynamo_resume_in_(?P<fn>\w+?)_at_(?P<line>\d+)")


def _short_reason(text: str, lines: int = 4) -> str:
    """Dynamo's reason without its long hints and tracebacks."""
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][:lines]
    return "\n".join(kept)


def _user_where(stack: Sequence[Any]) -> str:
    """``model.py:9 in forward: x = x.sin()``: the innermost frame of the user's code."""
    import os

    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in stack if not str(getattr(f, "filename", "")).startswith(torch_dir)]
    if not frames:
        return "?"
    f = frames[-1]
    code = (getattr(f, "line", "") or "").strip()
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": {code}" if code else "")


def _breaks_at(b: GraphBreakRecord, fn: str, line: int) -> bool:
    return f":{line} in {fn}" in b.where


def _dynamo_break_reason(fn: str, line: int) -> Any:
    """Dynamo's record of the break at ``fn``'s ``line`` (its graph_break_reasons), or None."""
    try:
        import torch._dynamo.output_graph as og
    except ImportError:  # pragma: no cover
        return None
    for r in reversed(getattr(og, "graph_break_reasons", [])):
        if any(
            getattr(f, "name", "") == fn and getattr(f, "lineno", -1) == line for f in r.user_stack
        ):
            return r
    return None


# ---------------------------------------------------------------------- capture adapter


def _capture_backend(
    compiler: Callable[..., Any], opts: CompileOptions, lazy_backward: bool = False
) -> Callable[..., Any]:
    """``stoker_capture.dynamo_backend(compiler=..., <options it accepts>)``."""
    make = sibling("stoker_capture", "dynamo_backend", "the stoker backend")
    import inspect

    params = inspect.signature(make).parameters
    # not `sibling`: a partitioner stoker-capture exports is loaded on first use, and a
    # lookup here would import it (a warm start never partitions)
    import stoker_capture

    partition = _partitioner(stoker_capture, f"{opts.partitioner}_partition")
    if partition is None:
        raise missing_piece(
            "stoker_capture", f"{opts.partitioner}_partition", f"partitioner={opts.partitioner!r}"
        )
    wanted: dict[str, Any] = {
        "compiler": compiler,
        "partition": partition,
        "memory_budget": opts.memory_budget,
        "graph_passes": _graph_passes(getattr(compiler, "executor", "aten")),
        **({"lazy_backward": True, "lazy_backward_fallback": True} if lazy_backward else {}),
        **opts.extra,
    }
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in opts.extra if not takes_any and k not in params]
    if unknown:
        raise StokerConfigError(
            f"extra={{{', '.join(map(repr, unknown))}: ...}}: stoker_capture.dynamo_backend takes "
            f"no such option; it takes {', '.join(params)}"
        )
    kwargs = {k: v for k, v in wanted.items() if takes_any or k in params}
    return make(**kwargs)  # type: ignore[no-any-return]


def _graph_passes(executor: str) -> tuple[Callable[..., Any], ...]:
    """stoker-triton's whole-graph layout choices for its ``executor`` kernels (none for
    the aten executor, which runs the graph as captured)."""
    if executor == "aten":
        return ()
    return sibling("stoker_triton", "graph_passes", f"backend={executor!r}")(executor)  # type: ignore[no-any-return]


def _partitioner(module: Any, name: str) -> Callable[..., Any] | None:
    """``module.<name>``; a partitioner stoker-capture exports imported at its first call:
    a warm start loads its partitioned graphs from the capture cache and never runs it."""
    if name not in getattr(module, "__all__", ()):
        return getattr(module, name, None)

    def partition(*args: Any, **kwargs: Any) -> Any:
        return getattr(module, name)(*args, **kwargs)

    # its name in the capture cache's key: stoker_capture.<name>
    partition.__module__, partition.__name__, partition.__qualname__ = module.__name__, name, name
    return partition


def _record_capture_result(rec: CompileRecord, compiled: Any, opts: CompileOptions) -> None:
    """Fill in what stoker-capture exposes on its `CompiledFn` (the partition's decisions)."""
    partition = getattr(compiled, "partition", None)
    bw = getattr(partition, "bw", None)
    if rec.partition is None and isinstance(bw, fx.GraphModule):
        # a lazy backward (compiled autograd, static sizes) is never compiled, so the
        # saved values are read from the partition's backward graph itself
        rec.partition = _partition_from_backward(bw, opts)
    if partition is not None and rec.partition is not None:
        rec.partition.recomputed = [str(x) for x in getattr(partition, "recomputed", [])]
    codegen = sum(v for k, v in rec.timings_ms.items() if k.startswith("codegen"))
    if "total" in rec.timings_ms:
        rec.timings_ms["capture + partition"] = max(0.0, rec.timings_ms["total"] - codegen)


def _record_kernels(rec: CompileRecord, report: Any, stage: str) -> None:
    """stoker-triton's `CompileReport`: kernels, fallbacks to aten, its own stage timings."""
    if report is None:
        return
    for k in getattr(report, "kernels", None) or []:
        nodes = getattr(k, "nodes", None) or []
        size = (
            f" [{getattr(k, 'xnumel', '?')} x {getattr(k, 'rnumel', '?')}]"
            if hasattr(k, "xnumel")
            else ""
        )
        detail = ", ".join(map(str, nodes)) + size
        name = f"{stage}/{getattr(k, 'name', k)}"
        rec.kernels.append(KernelRecord(name, str(getattr(k, "kind", "")), detail))
    reasons = getattr(report, "fallback_reasons", None) or {}
    for op, count in (getattr(report, "fallback_ops", None) or {}).items():
        why = reasons.get(op, "no lowering")
        rec.fallbacks.append(f"{op} ×{count}: {why}")
    rec.externs += [f"{stage}: {x}" for x in getattr(report, "extern_calls", None) or []]
    emitter = "c" if getattr(report, "target", "") == "c" else "triton"
    for name, ms in (getattr(report, "timings_ms", None) or {}).items():
        # ("c compile": building the C kernels; the C backend's other stages are codegen's)
        rec.time(name if name.startswith(emitter) else f"{emitter} {name}", float(ms))
    log = logs.logger("kernels")
    log.info("%s: %d kernels, %d fallbacks", _label(rec), len(rec.kernels), len(rec.fallbacks))
    for kr in rec.kernels:
        log.info("  %s [%s] %s", kr.name, kr.kind, kr.detail)
    for f in rec.fallbacks:
        log.info("  fallback: %s", f)


# ---------------------------------------------------------------------- helpers


def _public_options(o: CompileOptions) -> dict[str, Any]:
    return {k: getattr(o, k) for k in o.__dataclass_fields__ if k != "extra"} | (
        {"extra": o.extra} if o.extra else {}
    )


def _devices(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[torch.device]:
    devs = [x.device for x in example_inputs if isinstance(x, torch.Tensor)]
    devs += [p.device for p in gm.parameters()] + [b.device for b in gm.buffers()]
    return devs


_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


def _frame_name(gm: fx.GraphModule, hint: str | None = None) -> str:
    """``forward (model.py:12) #0/1``: the outermost user frame of the graph and its compile id."""
    cid = torch._guards.CompileContext.current_compile_id()
    where = hint or "graph"
    for n in gm.graph.nodes:
        st = n.meta.get("stack_trace")
        if st:
            m = _FRAME_RE.search(st)
            if m:
                where = f"{m['fn']} ({m['file'].rsplit('/', 1)[-1]}:{m['line']})"
                break
    return f"{where} #{cid}" if cid is not None else where


def _label(rec: CompileRecord) -> str:
    return f"graph {rec.index} {rec.frame}"


def _stage_of(gm: fx.GraphModule) -> str:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if any(n.startswith("tangents") for n in names):
        return "backward"
    return "forward"


def _partition_from_backward(gm: fx.GraphModule, opts: CompileOptions) -> PartitionRecord:
    """What the backward receives from the forward: every non-tangent input."""
    saved: list[SavedValue] = []
    for n in gm.graph.nodes:
        if n.op != "placeholder" or n.name.startswith("tangents"):
            continue
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = "×".join(str(s) for s in val.shape) or "scalar"
            nbytes: int | None = None
            if all(isinstance(s, int) for s in val.shape):
                nbytes = val.numel() * val.element_size()
            saved.append(SavedValue(n.name, shape, str(val.dtype).removeprefix("torch."), nbytes))
        else:
            saved.append(SavedValue(n.name, "symint", type(val).__name__, 0))
    return PartitionRecord(
        saved=saved, partitioner=opts.partitioner, memory_budget=opts.memory_budget
    )


def _mark_buffers_static(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Module buffers among the frame's inputs: CUDA graphs read them in place."""
    from ..cudagraphs.cudagraphs import mark_static

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, x in zip(placeholders, example_inputs):
        src: Any = getattr(n.meta.get("grapharg"), "source", None)
        name = getattr(src, "name", "")
        name = name() if callable(name) else name
        if isinstance(x, torch.Tensor) and "._buffers[" in str(name):
            mark_static(x)


_PARAM_PATH = re.compile(r"_(?:modules|parameters)\[['\"]([^'\"]+)['\"]\]")


def _name_parameters(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """The frame's parameters by their module path (``fc1.weight``, from Dynamo's
    sources), so compiled autograd's messages name them."""
    try:
        from stoker_autograd import name_parameters
    except ImportError:  # pragma: no cover - the umbrella installs it
        return
    named: list[tuple[str, torch.Tensor]] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, x in zip(placeholders, example_inputs):
        src: Any = getattr(n.meta.get("grapharg"), "source", None)
        name = getattr(src, "name", "")
        name = str(name() if callable(name) else name)
        if isinstance(x, torch.nn.Parameter) and "_parameters[" in name:
            named.append((".".join(_PARAM_PATH.findall(name)), x))
    name_parameters(named)


def _describe_inputs(gm: fx.GraphModule) -> dict[str, str]:
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        ga = n.meta.get("grapharg")
        src = getattr(ga, "source", None)
        if src is None:
            continue
        name = src.name() if callable(src.name) else src.name
        val = n.meta.get("example_value")
        if isinstance(val, torch.Tensor):
            dims = ", ".join(str(s) for s in val.shape)
            out[str(name)] = f"{str(val.dtype).removeprefix('torch.')}[{dims}] on {val.device}"
    return out


def _user_frame(g: Any) -> str | None:
    import os

    torch_dir = os.path.dirname(torch.__file__)
    for fs in reversed(getattr(g, "user_stack", None) or []):
        if not fs.filename.startswith(torch_dir):
            return f"{fs.filename.rsplit('/', 1)[-1]}:{fs.lineno} ({(fs.line or '').strip()})"
    return None


def _symbol_names(env: Any) -> dict[Any, str]:
    names: dict[Any, str] = {}
    for sym, sources in getattr(env, "var_to_sources", {}).items():
        if sources:
            s = sources[0]
            names[sym] = str(s.name() if callable(s.name) else s.name)
    return names


def _sym_text(expr: Any, names: dict[Any, str]) -> str:
    text = str(expr)
    # Longest symbol names first, so s10 is not rewritten through s1.
    for sym in sorted(getattr(expr, "free_symbols", ()), key=lambda s: -len(str(s))):
        if sym in names:
            text = re.sub(rf"\b{re.escape(str(sym))}\b", names[sym], text)
    return text


def _failure_table() -> Any:
    import torch._dynamo.utils as dynamo_utils

    return getattr(dynamo_utils, "guard_failures", {})


def _failure_counts() -> dict[Any, int]:
    return {code: len(reasons) for code, reasons in _failure_table().items()}


def _failure_reasons(code: Any) -> list[Any]:
    return list(_failure_table().get(code, []))


def _autograd_stats() -> dict[str, Any]:
    try:
        return autograd_stats()
    except Exception as e:  # stats are for the report: never fail a compile over them
        return {"error": f"{type(e).__name__}: {e}"}


def _log_guards(rec: CompileRecord) -> None:
    log = logs.logger("guards")
    if not log.isEnabledFor(20):
        return
    lines = [f"  {g.text}" + (f"  # {g.origin}" if g.origin else "") for g in rec.guards]
    log.info("%s: %d guards\n%s", _label(rec), len(rec.guards), "\n".join(lines))


def _log_partition(rec: CompileRecord) -> None:
    p = rec.partition
    if p is None:
        return
    logs.logger("partition").info(
        "%s: saved %d values (%d bytes) for backward; recomputed %d ops%s",
        _label(rec),
        len(p.saved),
        p.saved_bytes,
        len(p.recomputed),
        (": " + ", ".join(p.recomputed)) if p.recomputed else "",
    )
