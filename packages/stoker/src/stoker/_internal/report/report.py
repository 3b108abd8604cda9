"""The compile report: what stoker did for one run, as one self-contained HTML file.

A `Report` collects one `CompileRecord` per graph that Dynamo handed the
backend (its stage graphs, guards with their origins, the partition, kernels
and fallbacks, per-stage timings), the recompile reasons, and compiled
autograd's counters.  `Report.to_html()` renders it with inline CSS and no
scripts and no external resources, so it opens anywhere; `Report.write(path)`
writes it (the backend rewrites the file after every compilation, so a run
that crashes still leaves a report behind).
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from .memtrace import MemoryRecord
from .timeline import RECORDER, STAGE_LABELS, StepRecord

SECTIONS: tuple[tuple[str, str], ...] = (
    ("summary", "Summary"),
    ("step", "First compiled step"),
    ("memory", "Memory over a step"),
    ("breaks", "Graph breaks"),
    ("graphs", "Graphs by stage"),
    ("guards", "Guards"),
    ("recompiles", "Recompiles"),
    ("partition", "Partition"),
    ("kernels", "Kernels and fallbacks"),
    ("autograd", "Compiled autograd"),
    ("cudagraphs", "CUDA graphs"),
    ("distributed", "Distributed"),
    ("timings", "Timings per stage"),
)


class ReadableCode:
    """A graph module's readable code, made when first read (`str`; the graph as it is
    then, or at once where `STOKER_LOGS=graphs` logs it): printing every
    compiled graph cost 0.5 s of a warm gpt-m start, and most reports never show it.
    A copy (`dataclasses.asdict`, hence `Report.to_json`) is the text."""

    __slots__ = ("_gm", "_text")

    def __init__(self, gm: Any) -> None:
        self._gm: Any = gm
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:
            gm, self._gm = self._gm, None
            self._text = (
                gm.print_readable(print_output=False)
                if hasattr(gm, "print_readable")
                else str(gm.graph)
            )
        return self._text

    def __deepcopy__(self, memo: dict[int, Any]) -> str:
        return str(self)


@dataclass
class GraphRecord:
    stage: str  # e.g. "dynamo", "forward", "backward"
    code: str | ReadableCode  # readable FX code (`str(code)`)
    nodes: int  # number of call nodes


@dataclass
class GuardRecord:
    text: str  # the guard expression, in source terms
    origin: str | None  # the op and user line that made it, when known
    kind: str  # "shape" (a shape-env guard) or the Dynamo guard's kind (TENSOR_MATCH, ...)


@dataclass
class SavedValue:
    name: str
    shape: str
    dtype: str
    nbytes: int | None  # None when the size is symbolic


@dataclass
class PartitionRecord:
    saved: list[SavedValue] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)  # backward nodes that redo forward ops
    partitioner: str = ""
    memory_budget: float | None = None

    @property
    def saved_bytes(self) -> int:
        return sum(v.nbytes or 0 for v in self.saved)


@dataclass
class KernelRecord:
    name: str
    kind: str  # pointwise, reduction, extern, ...
    detail: str  # ops fused, or the source


@dataclass
class CompileRecord:
    """One graph Dynamo handed the backend, and what became of it."""

    index: int
    frame: str  # the Python function Dynamo captured
    executor: str  # aten, triton or interpret
    graphs: list[GraphRecord] = field(default_factory=list)
    guards: list[GuardRecord] = field(default_factory=list)
    partition: PartitionRecord | None = None
    kernels: list[KernelRecord] = field(default_factory=list)
    fallbacks: list[str] = field(
        default_factory=list
    )  # ops with no lowering (ran through aten), and why
    externs: list[str] = field(default_factory=list)  # aten calls by design (matmul, convolution)
    timings_ms: dict[str, float] = field(default_factory=dict)  # stage -> milliseconds
    error: str | None = None

    def time(self, stage: str, ms: float) -> None:
        self.timings_ms[stage] = self.timings_ms.get(stage, 0.0) + ms


@dataclass
class RecompileRecord:
    frame: str
    reason: str


@dataclass
class GraphBreakRecord:
    """A graph break: the graph Dynamo compiled up to it, why, and where in user code."""

    graph: str  # the graph that ends at the break ("graph 0: forward (model.py:9) #0/0")
    reason: str  # Dynamo's reason
    where: str  # the user's file:line (and the line's code)
    resumed_by: str = ""  # the graph of the code after the break, once compiled


@dataclass
class Report:
    """Everything one run compiled.  Render with `to_html`, save with `write`."""

    title: str = "stoker compile report"
    path: str | None = None  # where `flush` writes; None: nowhere
    compiles: list[CompileRecord] = field(default_factory=list)
    recompiles: list[RecompileRecord] = field(default_factory=list)
    autograd: dict[str, Any] = field(default_factory=dict)
    autograd_graphs: list[GraphRecord] = field(default_factory=list)  # captured backwards
    distributed: dict[str, Any] = field(default_factory=dict)  # distributed.summary()
    options: dict[str, Any] = field(default_factory=dict)
    # mode="reduce-overhead": one `cudagraphs.CudaGraphStats` per compiled graph (live
    # counters: records, replays, plain launches and why)
    cudagraphs: list[Any] = field(default_factory=list)
    # the compiled-autograd backward's segments compiled by stoker-triton: their kernels
    # (they are no Dynamo graph, so not in `compiles`)
    autograd_kernels: list[CompileRecord] = field(default_factory=list)
    # stoker-triton's compiled-graph cache: outcome ("hit", "miss (new key)", ...) -> graphs
    graph_cache: dict[str, int] = field(default_factory=dict)
    # stoker-capture's captured-graph cache: outcome ("hit", "miss (new key)", ...) -> graphs
    capture_cache: dict[str, int] = field(default_factory=dict)
    created: str = field(
        default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    )
    # the first compiled step, by stage (closed at the end of the backward after the first
    # compile, or marked by the caller: `mark_first_step`)
    first_step: StepRecord | None = None
    first_start_ns: int = 0  # when the first compile began (0: none yet)
    memory: MemoryRecord | None = None  # live bytes over a traced step (`trace_memory`)
    graph_breaks: list[GraphBreakRecord] = field(default_factory=list)
    # the report of a backend in this process: `summary` and `to_html` read compiled
    # autograd's counters as they are now (its backwards run after the compiles that
    # wrote the report); False keeps `autograd` as it was set (a report kept or loaded)
    live: bool = False

    def refresh(self) -> None:
        """Read compiled autograd's counters again, if this report is live."""
        if self.live:
            try:
                self.autograd = autograd_stats()
            except Exception as e:  # counters are for reading: never fail over them
                self.autograd = {"error": f"{type(e).__name__}: {e}"}

    # ------------------------------------------------------------------ the first step
    def mark_first_step(self, start: float, end: float) -> StepRecord:
        """The first compiled step is ``[start, end]`` (``time.perf_counter()`` seconds):
        what a caller timed as its first step (`stoker demo` does)."""
        self.first_step = StepRecord.of(
            int(start * 1e9), int(end * 1e9), "the step the caller timed"
        )
        return self.first_step

    def step_record(self) -> StepRecord | None:
        """The first step: closed, or (no backward yet) from the first compile to the
        newest span recorded."""
        if self.first_step is not None or not self.first_start_ns:
            return self.first_step
        spans = RECORDER.between(self.first_start_ns, 2**63)
        if not spans:
            return None
        end = max(s.end_ns for s in spans)
        return StepRecord.of(self.first_start_ns, end, "from the first compile to the last stage")

    @contextmanager
    def trace_memory(self, device: Any = None) -> Iterator[None]:
        """Record live tensor bytes over the block (one training step) into `memory`:
        CPU allocator events (``torch.profiler``), or on a GPU the CUDA caching
        allocator's history. The forward and backward runs in it are marked."""
        from .memtrace import trace

        with trace(device) as got:
            yield
        self.memory = got[0] if got else None

    # ------------------------------------------------------------------ caches
    def cache_counts(self) -> dict[str, tuple[int, int]]:
        """Per on-disk cache: (hits, misses) of its lookups in this run."""

        def split(counts: dict[str, int]) -> tuple[int, int]:
            miss = sum(n for k, n in counts.items() if k.startswith("miss"))
            return counts.get("hit", 0), miss

        return {
            "captured graphs (capture and partition)": split(self.capture_cache),
            "compiled graphs (lowering and codegen)": split(self.graph_cache),
            "compiled-autograd graphs (eager run and retrace)": (
                int(self.autograd.get("disk_hits", 0) or 0),
                int(self.autograd.get("disk_misses", 0) or 0),
            ),
        }

    def cache_state(self) -> str:
        """ "warm" (every lookup hit), "cold" (none did), "partly warm", or "off"."""
        hits = sum(h for h, _ in self.cache_counts().values())
        misses = sum(m for _, m in self.cache_counts().values())
        if not hits and not misses:
            return "off"
        return "warm" if not misses else "cold" if not hits else "partly warm"

    def cache_line(self) -> str:
        """``warm (hits 3, misses 0)``: the caches' state in one line."""
        hits = sum(h for h, _ in self.cache_counts().values())
        misses = sum(m for _, m in self.cache_counts().values())
        state = self.cache_state()
        if state == "off":
            return "off (no cache lookup)"
        return f"{state} (hits {hits}, misses {misses})"

    def new_compile(self, frame: str, executor: str) -> CompileRecord:
        rec = CompileRecord(index=len(self.compiles), frame=frame, executor=executor)
        self.compiles.append(rec)
        return rec

    def count_cache(self, outcome: str) -> None:
        """Count one graph's compiled-graph cache outcome ("" when the cache was off)."""
        if outcome:
            self.graph_cache[outcome] = self.graph_cache.get(outcome, 0) + 1

    def count_capture_cache(self, outcome: str) -> None:
        """Count one Dynamo graph's captured-graph cache outcome ("" when the cache was off)."""
        if outcome:
            self.capture_cache[outcome] = self.capture_cache.get(outcome, 0) + 1

    # ------------------------------------------------------------------ counts
    @property
    def n_graphs(self) -> int:
        return len(self.compiles)

    @property
    def n_guards(self) -> int:
        return sum(len(c.guards) for c in self.compiles)

    @property
    def n_kernels(self) -> int:
        return sum(len(c.kernels) for c in self.compiles)

    def summary(self) -> dict[str, Any]:
        self.refresh()
        counts = list(self.cache_counts().values())
        step = self.step_record()
        return {
            "graphs": self.n_graphs,
            "guards": self.n_guards,
            "kernels": self.n_kernels,
            # kernels of the compiled-autograd backward's segments (Triton executor)
            "backward_kernels": sum(len(c.kernels) for c in self.autograd_kernels),
            "fallbacks": sum(len(c.fallbacks) for c in self.compiles),
            "recompiles": len(self.recompiles),
            "graph_breaks": len(self.graph_breaks),
            # every on-disk cache's lookups, each counted once: warm, cold, partly warm, off
            "cache": self.cache_state(),
            "cache_hits": sum(h for h, _ in counts),
            "cache_misses": sum(m for _, m in counts),
            # Dynamo graphs whose capture and partition were loaded / run (and why)
            "capture_cache_hits": counts[0][0],
            "capture_cache_misses": counts[0][1],
            # graphs whose lowering and codegen (stoker-triton) were loaded / run
            "graph_cache_hits": counts[1][0],
            "graph_cache_misses": counts[1][1],
            # compiled-autograd backwards loaded / run eagerly and retraced
            "autograd_cache_hits": counts[2][0],
            "autograd_cache_misses": counts[2][1],
            # "total" covers the nested stages; records without one sum what they have
            "compile_ms": round(
                sum(c.timings_ms.get("total", sum(c.timings_ms.values())) for c in self.compiles), 3
            ),
            # the first compiled step's wall time, and the part of it no stage claims
            "first_step_ms": round(step.wall_ms, 3) if step else None,
            "first_step_other_ms": round(step.by_stage().get("other", 0.0), 3) if step else None,
        }

    # ------------------------------------------------------------------ output
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=str)

    def to_html(self) -> str:
        self.refresh()
        return _render(self)

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write the HTML report to ``path`` (atomically); returns the absolute path."""
        path = os.path.abspath(os.fspath(path))
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_html())
        os.replace(tmp, path)
        return path

    def flush(self) -> None:
        """Rewrite the report file, if this report has a path."""
        if self.path:
            t0 = time.perf_counter_ns()
            self.write(self.path)
            RECORDER.add("report", "report written", t0, time.perf_counter_ns())


# ---------------------------------------------------------------------- rendering

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#23262e;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#c9ced8;font-size:12px}
nav{padding:8px 24px;background:#e9ecf1;font-size:13px}nav a{margin-right:14px;color:#2a4d8f}
main{padding:8px 24px 40px;max-width:1200px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;margin:16px 0;padding:4px 16px 12px}
h2{font-size:17px;border-bottom:1px solid #eef0f3;padding-bottom:6px}h3{font-size:14px;margin:14px 0 6px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{border-bottom:1px solid #eef0f3;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f5f8;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
pre,code{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{background:#f7f8fa;border:1px solid #eceff3;padding:8px;overflow:auto;max-height:480px}
details{margin:6px 0}summary{cursor:pointer;font-weight:600}
.legend{font-size:12px}.lg{margin-right:12px;white-space:nowrap}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
.figure{overflow-x:auto}caption{text-align:left;font-weight:600;padding:4px 0}
.muted{color:#6b7380}.bad{color:#a12b2b}.tag{display:inline-block;padding:0 6px;border-radius:3px;background:#e7ecf6;font-size:12px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _table(
    headers: list[str], rows: list[list[Any]], num: frozenset[int] = frozenset(), caption: str = ""
) -> str:
    if not rows:
        return '<p class="muted">none recorded</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_e(c)}</td>' if i in num else f"<td>{_e(c)}</td>"
            for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    cap = f"<caption>{_e(caption)}</caption>" if caption else ""
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "symbolic"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return str(n)


def _label(c: CompileRecord) -> str:
    return f"graph {c.index}: {c.frame} [{c.executor}]"


def _render(r: Report) -> str:
    parts: list[str] = []
    s = r.summary()
    opts = ", ".join(f"{k}={v!r}" for k, v in r.options.items()) or "defaults"
    parts.append(
        _table(
            [
                "graphs",
                "guards",
                "kernels",
                "fallbacks",
                "recompiles",
                "graph breaks",
                "caches",
                "first compiled step",
            ],
            [
                [
                    s["graphs"],
                    s["guards"],
                    s["kernels"],
                    s["fallbacks"],
                    s["recompiles"],
                    s["graph_breaks"],
                    r.cache_line(),
                    f"{s['first_step_ms'] / 1e3:.2f} s" if s["first_step_ms"] is not None else "—",
                ]
            ],
            frozenset(range(6)),
        )
        + f"<p>options: <code>{_e(opts)}</code></p>"
        + _render_caches(r)
    )
    parts.append(_render_step(r))
    parts.append(_render_memory(r.memory))
    parts.append(_render_breaks(r))
    # graphs
    g: list[str] = []
    for c in r.compiles:
        g.append(f"<h3>{_e(_label(c))}</h3>")
        if c.error:
            g.append(f'<p class="bad">compile failed: {_e(c.error)}</p>')
        for gr in c.graphs:
            g.append(
                f"<details><summary>{_e(gr.stage)} <span class=muted>({gr.nodes} nodes)</span>"
                f"</summary><pre>{_e(str(gr.code))}</pre></details>"
            )
    parts.append("".join(g) or '<p class="muted">none recorded</p>')
    # guards
    gd: list[str] = []
    for c in r.compiles:
        gd.append(f"<h3>{_e(_label(c))}: {len(c.guards)} guards</h3>")
        gd.append(
            _table(
                ["guard", "kind", "made by"], [[x.text, x.kind, x.origin or "—"] for x in c.guards]
            )
        )
    parts.append("".join(gd) or '<p class="muted">none recorded</p>')
    # recompiles
    backward = [
        ["backward (compiled autograd)", x] for x in r.autograd.get("recompile reasons", [])
    ] + [
        ["backward captured again (compiled autograd)", x]
        for x in r.autograd.get("recapture reasons", [])
    ]
    parts.append(
        _table(["frame", "reason"], [[x.frame, x.reason] for x in r.recompiles] + backward)
    )
    # partition
    p: list[str] = []
    for c in r.compiles:
        if c.partition is None:
            continue
        pr = c.partition
        p.append(
            f"<h3>{_e(_label(c))}</h3><p>partitioner <span class=tag>{_e(pr.partitioner)}</span>"
            f" memory budget {_e(pr.memory_budget)}; saved for backward: {len(pr.saved)} values, "
            f"{_e(_fmt_bytes(pr.saved_bytes))}; recomputed in backward: {len(pr.recomputed)} ops</p>"
        )
        p.append(
            _table(
                ["saved value", "shape", "dtype", "bytes"],
                [[v.name, v.shape, v.dtype, _fmt_bytes(v.nbytes)] for v in pr.saved],
                frozenset({3}),
            )
        )
        if pr.recomputed:
            p.append("<p>recomputed: <code>" + _e(", ".join(pr.recomputed)) + "</code></p>")
    parts.append("".join(p) or '<p class="muted">none recorded (inference graphs only)</p>')
    # kernels
    k: list[str] = []
    segments = [(c, f"{c.frame} [{c.executor}]") for c in r.autograd_kernels]
    for c, label in [*((c, _label(c)) for c in r.compiles), *segments]:
        if not c.kernels and not c.fallbacks and not c.externs:
            continue
        per_call = f"{len(c.kernels)} kernels, {len(c.externs)} extern calls per call"
        k.append(f"<h3>{_e(label)} <span class=muted>({per_call})</span></h3>")
        k.append(
            _table(["kernel", "kind", "detail"], [[x.name, x.kind, x.detail] for x in c.kernels])
        )
        if c.externs:
            k.append(
                "<p>extern calls (aten by design): <code>"
                + _e(", ".join(c.externs))
                + "</code></p>"
            )
        if c.fallbacks:
            k.append(
                "<p>fallbacks to aten:</p><ul>"
                + "".join(f"<li><code>{_e(f)}</code></li>" for f in c.fallbacks)
                + "</ul>"
            )
    if not k:
        execs = sorted({c.executor for c in r.compiles})
        k.append(
            f'<p class="muted">no kernels recorded (executors used: {_e(", ".join(execs) or "none")}; '
            "the aten executor runs each graph op by op)</p>"
        )
    parts.append("".join(k))
    # autograd
    counters = sorted(
        (a, b) for a, b in r.autograd.items() if a not in ("recompile reasons", "recapture reasons")
    )
    ag = _table(["counter", "value"], [[a, b] for a, b in counters])
    for gr in r.autograd_graphs:
        ag += (
            f"<details><summary>{_e(gr.stage)} <span class=muted>({gr.nodes} nodes)</span>"
            f"</summary><pre>{_e(str(gr.code))}</pre></details>"
        )
    parts.append(ag)
    parts.append(_render_cudagraphs(r.cudagraphs, r.options.get("mode")))
    parts.append(_render_distributed(r.distributed))
    # timings
    stages = sorted({st for c in r.compiles for st in c.timings_ms})
    parts.append(
        _table(
            ["graph", *stages],
            [
                [
                    _label(c),
                    *(f"{c.timings_ms[st]:.1f}" if st in c.timings_ms else "—" for st in stages),
                ]
                for c in r.compiles
            ],
            frozenset(range(1, len(stages) + 1)),
        )
    )
    nav = "".join(f'<a href="#{sid}">{_e(title)}</a>' for sid, title in SECTIONS)
    body = "".join(
        f'<section id="{sid}"><h2>{_e(title)}</h2>{content}</section>'
        for (sid, title), content in zip(SECTIONS, parts, strict=True)
    )
    env = f"Python {platform.python_version()} · {platform.platform()} · created {r.created}"
    try:
        import torch

        env = f"torch {torch.__version__} · " + env
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<link rel="icon" href="data:,"><meta name="viewport" content="width=device-width, initial-scale=1"><title>{_e(r.title)}</title>'
        f"<style>{_CSS}</style></head><body><header><h1>{_e(r.title)}</h1><p>{_e(env)}</p></header>"
        f"<nav>{nav}</nav><main>{body}</main></body></html>\n"
    )


def _render_caches(r: Report) -> str:
    """Each on-disk cache's lookups: hits, misses, and every outcome by reason."""
    outcomes = {
        "captured graphs (capture and partition)": r.capture_cache,
        "compiled graphs (lowering and codegen)": r.graph_cache,
        "compiled-autograd graphs (eager run and retrace)": {
            k.removeprefix("disk cache "): n
            for k, n in r.autograd.items()
            if isinstance(k, str) and k.startswith("disk cache ")
        },
    }
    rows = [
        [
            name,
            hits,
            misses,
            ", ".join(f"{k}: {n}" for k, n in sorted(outcomes[name].items())) or "—",
        ]
        for name, (hits, misses) in r.cache_counts().items()
    ]
    return (
        f"<p>on-disk caches: <b>{_e(r.cache_line())}</b> (warm: every lookup hit; "
        "cold: none did)</p>"
        + _table(["cache", "hits", "misses", "outcomes"], rows, frozenset({1, 2}))
    )


def _fmt_ms(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"


def _render_step(r: Report) -> str:
    """The first compiled step: a timeline, its time by stage, and by graph and stage."""
    step = r.step_record()
    if step is None:
        return '<p class="muted">none recorded (nothing compiled yet)</p>'
    from .svg import legend, timeline_svg

    by_stage = step.by_stage()
    wall = step.wall_ms
    named = sum(ms for st, ms in by_stage.items() if st != "other")
    head = (
        f"<p>wall time <b>{_e(_fmt_ms(wall))}</b> ({_e(step.how)}); the stages below account "
        f"for {_e(_fmt_ms(named))} of it ({100 * named / wall if wall else 0:.1f}%), "
        "each instant counted once, in the innermost stage running then; "
        f"caches {_e(r.cache_line())}</p>"
    )
    rows = [
        [STAGE_LABELS.get(st, st), f"{ms:.1f}", f"{100 * ms / wall if wall else 0:.1f}"]
        for st, ms in by_stage.items()
    ]
    rows.append(["total (the step's wall time)", f"{wall:.1f}", "100.0"])
    per_graph = sorted(step.breakdown(), key=lambda x: (x.graph or "~", -x.ms))
    graph_rows = [
        [x.graph or "(no graph)", STAGE_LABELS.get(x.stage, x.stage), f"{x.ms:.1f}"]
        for x in per_graph
        if x.ms >= 0.05
    ]
    return (
        head
        + f'<div class="figure">{timeline_svg(step)}</div>'
        + legend(by_stage, wall)
        + _table(["stage", "ms", "% of the step"], rows, frozenset({1, 2}), "By stage")
        + "<h3>By graph and stage</h3>"
        + _table(["graph", "stage", "ms"], graph_rows, frozenset({2}))
    )


def _render_memory(mem: MemoryRecord | None) -> str:
    if mem is None:
        return (
            '<p class="muted">no step traced (<code>with report.trace_memory(): '
            "step()</code> records one; <code>stoker demo</code> traces a step after its "
            "loop)</p>"
        )
    from .svg import memory_svg

    phases = ", ".join(f"{n} {b - a:.1f} ms" for n, a, b in mem.phases) or "not marked"
    return (
        f"<p>{_e(mem.device)}: peak <b>{_e(_fmt_bytes(mem.peak))}</b> above what was live "
        f"before the step, at {_e(_fmt_ms(mem.peak_ms))} of {_e(_fmt_ms(mem.duration_ms))}; "
        f"{len(mem.t_ms)} allocator events ({_e(mem.source)}); phases: {_e(phases)}</p>"
        f'<div class="figure">{memory_svg(mem)}</div>'
    )


def _render_breaks(r: Report) -> str:
    if not r.graph_breaks:
        return '<p class="muted">none: every frame compiled as whole graphs</p>'
    rows = [[b.graph, b.where, b.reason, b.resumed_by or "—"] for b in r.graph_breaks]
    return (
        f"<p>{len(r.graph_breaks)} graph break(s): Dynamo compiled the code before each "
        "break as one graph, ran the break in Python, and compiles the code after it as "
        "another graph (a <code>torch_dynamo_resume_in_...</code> frame)</p>"
        + _table(["graph before the break", "user code", "reason", "code after it"], rows)
    )


def _render_cudagraphs(stats: list[Any], mode: Any) -> str:
    """Per compiled graph: recorded size keys, replays, plain launches and why."""
    if not stats:
        return f'<p class="muted">no graph recorded (mode={_e(repr(mode))}; CUDA graphs are mode="reduce-overhead")</p>'
    rows = []
    for s in stats:
        plain = "; ".join(f"{why} ×{n}" for why, n in s.plain.items())
        status = f"plain launches: {s.reason}" if s.reason else "graphed"
        rows.append(
            [
                s.label,
                status,
                s.warmups,
                s.records,
                s.replays,
                s.copied_in,
                s.copied_out,
                _mib(s.bytes_in),
                _mib(s.bytes_out),
                plain or "—",
            ]
        )
    heads = ["graph", "status", "warm-ups", "records", "replays", "inputs copied", "outputs copied"]
    heads += ["input buffers MiB", "outputs kept MiB", "plain runs (why)"]
    total = sum(s.bytes_in + s.bytes_out for s in stats)
    note = (
        f"<p>static memory kept by the recorded graphs: <code>{total / 2**20:.1f} MiB</code> "
        "(input buffers copied into per replay, and outputs in the pool, which the next "
        "replay overwrites; the pool's reused temporaries not counted)</p>"
    )
    return note + _table(heads, rows, frozenset({2, 3, 4, 5, 6, 7, 8}))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _render_distributed(d: dict[str, Any]) -> str:
    """DDP modes, buckets and all-reduces per step; where collectives sit in the backward."""
    if not d:
        return '<p class="muted">no DDP or FSDP2 module seen</p>'
    out: list[str] = []
    for i, m in enumerate(d.get("ddp", [])):
        out.append(
            f"<h3>DDP module {i}: mode <span class=tag>{_e(m['mode'])}</span></h3>"
            f"<p class=muted>{_e(m['why'])}; {len(m['buckets'])} bucket(s)</p>"
        )
        rows = [
            [k, c["bucket"], c["params"], c["bytes"], c["after_grads"]]
            for k, step in enumerate(m["steps"])
            for c in step
        ]
        out.append(
            _table(
                ["step (newest last)", "bucket", "params", "bytes", "started after gradients"],
                rows,
                frozenset({1, 2, 3, 4}),
            )
        )
    steps = d.get("steps", [])
    if steps:
        out.append(
            "<h3>Collectives per step (issued through Python; the newest steps)</h3>"
            + _table(
                ["step", "backward", "kind", "phase", "elements", "dtype", "issued by", "node"],
                [
                    [k, "stoker" if st["compiled"] else "eager", *_issued_cells(c)]
                    for k, st in enumerate(steps)
                    for c in st["issued"]
                ],
                frozenset({0, 4}),
            )
        )
    sites = d.get("backward_sites", [])
    if sites:
        out.append("<h3>Nodes issuing collectives in the newest captured backward graph</h3>")
        out.append(
            _table(
                ["node", "of", "kind", "backward compute after it"],
                [[s["at"], s["of"], s["kind"], s["compute_after"]] for s in sites],
                frozenset({0, 1, 3}),
            )
        )
    return "".join(out)


def _issued_cells(c: dict[str, Any]) -> list[Any]:
    """kind, phase, elements, dtype, and the backward node that issued it (compiled only)."""
    site = c["site"]
    if site is None:
        where = ["—", "—"]
    elif site["at"] is None:
        where = [site["kind"], "?"]
    else:
        where = [site["kind"], f"{site['at']}/{site['of']} (+{site['compute_after']} compute)"]
    return [c["kind"], c["phase"], c["numel"], c["dtype"], *where]


# ---------------------------------------------------------------------- compiled autograd
def autograd_stats() -> dict[str, Any]:
    """``stoker_autograd.stats()`` as a dict (with its warm-start cache's outcomes), or
    ``{}`` when stoker-autograd has no stats."""
    try:
        import stoker_autograd
    except ImportError:
        return {}
    stats = getattr(stoker_autograd, "stats", None)
    if stats is None:
        return {}
    value = stats()
    if isinstance(value, dict):
        # the warm-start cache's outcomes by reason ("miss (new key)": 1), for the report
        outcomes: dict[str, int] = getattr(stoker_autograd, "cache_outcomes", dict)()
        # why each backward was compiled again (the report's Recompiles section lists them)
        reasons: list[str] = getattr(stoker_autograd, "recompile_reasons", list)()
        # why a backward was captured again (its autograd nodes differ from an earlier one)
        again: list[str] = getattr(stoker_autograd, "recapture_reasons", list)()
        return (
            dict(value)
            | {f"disk cache {k}": n for k, n in sorted(outcomes.items())}
            | ({"recompile reasons": reasons} if reasons else {})
            | ({"recapture reasons": again} if again else {})
        )
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(value)
    return {k: v for k, v in vars(value).items() if not k.startswith("_")}
