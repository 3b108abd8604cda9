"""The report's first compiled step (timeline and accounting), memory over a step, graph
breaks, the caches' warm/cold state, and the Chrome trace, on the real pipeline (CPU)."""

from __future__ import annotations

import html.parser
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import stoker
from stoker._internal.report import memprobe
from stoker._internal.report.memtrace import MemoryRecord, cuda_record, curve
from stoker._internal.report.report import Report
from stoker._internal.report.timeline import Span, StageTime, StepRecord, account


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _rows(rows: list[StageTime]) -> dict[tuple[str, str], float]:
    return {(r.graph, r.stage): round(r.ms, 6) for r in rows}


# ----------------------------------------------------------------------------- accounting


def test_account_counts_each_instant_once_in_the_innermost_stage() -> None:
    ms = 1_000_000
    spans = [
        Span("dynamo", "frame", 0, 10 * ms, "graph 0"),
        Span("backend", "backend", 2 * ms, 8 * ms, "graph 0"),
        Span("capture", "capture", 3 * ms, 5 * ms),  # no graph: the enclosing span's
        Span("gc", "gc", 4 * ms, 4 * ms + ms // 2),
        Span("run backward", "backward", 12 * ms, 15 * ms, "backward graph 0"),
        Span("autograd retrace", "retrace", 13 * ms, 14 * ms, "backward graph 0"),
    ]
    got = _rows(account(spans, -1 * ms, 16 * ms))
    assert got == {
        ("graph 0", "dynamo"): 4.0,
        ("graph 0", "backend"): 4.0,
        ("graph 0", "capture"): 1.5,
        ("graph 0", "gc"): 0.5,
        ("backward graph 0", "run backward"): 2.0,
        ("backward graph 0", "autograd retrace"): 1.0,
        ("", "other"): 4.0,  # 1 before, 2 between, 1 after
    }
    assert sum(got.values()) == 17.0  # the window, exactly


def test_account_clips_to_the_window_and_ignores_spans_outside() -> None:
    ms = 1_000_000
    spans = [Span("capture", "c", 0, 10 * ms, "g"), Span("codegen", "k", 20 * ms, 30 * ms, "g")]
    got = _rows(account(spans, 5 * ms, 12 * ms))
    assert got == {("g", "capture"): 5.0, ("", "other"): 2.0}


def test_step_record_by_stage_sums_to_its_wall_time() -> None:
    ms = 1_000_000
    step = StepRecord(
        0,
        10 * ms,
        "test",
        [Span("dynamo", "d", 0, 6 * ms, "g"), Span("capture", "c", 1 * ms, 2 * ms)],
    )
    by = step.by_stage()
    assert list(by) == ["dynamo", "capture", "other"]  # STAGE_LABELS' order, other last
    assert by == pytest.approx({"dynamo": 5.0, "capture": 1.0, "other": 4.0})
    assert sum(by.values()) == pytest.approx(step.wall_ms)


# ----------------------------------------------------------------------------- first step


def test_the_first_step_of_a_real_compile_is_accounted_for(tmp_path: Path) -> None:
    stoker.reset()
    path = tmp_path / "r.html"
    c = stoker.compile(_mlp(), report=str(path))
    x = torch.randn(5, 6)
    c(x).sum().backward()
    rep: Report = c.stoker_report
    step = rep.first_step
    assert step is not None, "the first backward closes the first step"
    by = step.by_stage()
    for stage in ("dynamo", "capture", "partition", "autograd capture", "run forward"):
        assert by.get(stage, 0) > 0, (stage, by)
    assert "run backward" in by or "autograd retrace" in by, by
    assert sum(by.values()) == pytest.approx(step.wall_ms, rel=1e-9)
    assert by.get("other", 0.0) < 0.05 * step.wall_ms, by  # stages claim 95% or more
    graphs = {r.graph for r in step.breakdown()}
    assert any(g.startswith("graph 0 ") for g in graphs) and any(
        g.startswith("backward graph") for g in graphs
    ), graphs
    # a second step adds no first-step span, and the report's figures stay put
    c(x).sum().backward()
    # (the summary gives milliseconds to 3 decimals)
    assert rep.first_step is step
    assert rep.summary()["first_step_ms"] == pytest.approx(step.wall_ms, rel=0, abs=5e-4)
    rep.flush()
    page = path.read_text()
    for needle in ('<svg class="timeline"', 'class="share"', "First compiled step", "By stage"):
        assert needle in page, needle
    assert "<script" not in page
    stoker.reset()


def test_a_caller_marks_the_step_it_timed(tmp_path: Path) -> None:
    import time

    stoker.reset()
    c = stoker.compile(_mlp())
    opt = torch.optim.SGD(c.parameters(), lr=0.1)
    t0 = time.perf_counter()
    c(torch.randn(4, 6)).sum().backward()
    opt.step()
    t1 = time.perf_counter()
    step = c.stoker_report.mark_first_step(t0, t1)
    assert step.wall_ms == pytest.approx((t1 - t0) * 1e3, rel=1e-6)
    assert sum(step.by_stage().values()) == pytest.approx(step.wall_ms, rel=1e-9)
    assert step.by_stage()["dynamo"] > 0
    stoker.reset()


def test_demo_report_accounts_for_the_first_step_the_cli_prints(tmp_path: Path) -> None:
    """`stoker demo`'s figure (its first compiled step) is what the report breaks down."""
    from stoker._internal.bench.demo import format_result, train_side_by_side

    stoker.reset()
    res = train_side_by_side(
        steps=2,
        batch=2,
        backend="aten",
        device="cpu",
        report=str(tmp_path / "demo.html"),
        seed=0,
        progress=False,
    )
    wall_ms = res.times_compiled[0] * 1e3
    assert sum(res.first_step.values()) == pytest.approx(wall_ms, rel=1e-6)
    named = sum(ms for st, ms in res.first_step.items() if st != "other")
    assert named >= 0.95 * wall_ms, res.first_step  # within 5% of the CLI's figure
    for stage in ("dynamo", "capture", "autograd capture", "run forward", "user"):
        assert res.first_step.get(stage, 0) > 0, (stage, res.first_step)
    text = format_result(res)
    assert "of which: Dynamo trace " in text and "on-disk caches: cold (hits 0," in text, text
    groups = [float(x) for x in re.findall(r"(\d+\.\d+) s\b", text.split("of which:")[1])]
    assert len(groups) == 9 and sum(groups) == pytest.approx(wall_ms / 1e3, abs=0.05), text
    page = (tmp_path / "demo.html").read_text()
    assert '<svg class="timeline"' in page and '<svg class="memory"' in page
    assert "the step the caller timed" in page
    stoker.reset()


# ----------------------------------------------------------------------------- memory


def test_memory_of_a_cpu_step_matches_the_allocator_events() -> None:
    stoker.reset()
    c = stoker.compile(_mlp())
    x = torch.randn(64, 6)
    rep: Report = c.stoker_report

    def step() -> None:
        c(x).sum().backward()

    step()  # compiled,
    step()  # and .grad set: the traced step is a steady one

    with rep.trace_memory():
        step()
    mem = rep.memory
    assert mem is not None and mem.device == "cpu" and mem.t_ms
    assert mem.t_ms == sorted(mem.t_ms) and 0 <= mem.peak_ms <= mem.duration_ms
    assert mem.peak == memprobe.peak_live_bytes(step), "the same events, the same peak"
    assert mem.peak >= 64 * 16 * 4  # at least the hidden activation
    names = [p[0] for p in mem.phases]
    assert names == ["forward", "backward"], mem.phases
    (_, f0, f1), (_, b0, b1) = mem.phases
    assert 0 <= f0 <= f1 <= b0 <= b1 <= mem.duration_ms + 1e-6
    assert '<svg class="memory"' in rep.to_html() and 'class="peak"' in rep.to_html()
    stoker.reset()


def test_cuda_history_becomes_live_bytes_with_its_peak() -> None:
    """The GPU path's arithmetic on a CUDA allocator trace (no GPU needed)."""
    t0 = 1_000_000.0
    entries = [
        {"action": "segment_alloc", "size": 2 << 20, "time_us": t0 + 1},  # not a tensor block
        {"action": "alloc", "size": 512, "time_us": t0 - 50},  # before the step: ignored
        {"action": "alloc", "size": 1024, "time_us": t0 + 10},
        {"action": "alloc", "size": 4096, "time_us": t0 + 20},
        {"action": "free_requested", "size": 1024, "time_us": t0 + 25},
        {"action": "free_completed", "size": 1024, "time_us": t0 + 30},
        {"action": "alloc", "size": 512, "time_us": t0 + 40},
        {"action": "free_completed", "size": 4096, "time_us": t0 + 50},
    ]
    rec = cuda_record(entries, t0, t0 + 100, "cuda:0", 777, [("forward", 0.0, 0.02)])
    assert rec.live == [1024, 5120, 4096, 4608, 512]
    assert rec.t_ms == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    assert (rec.peak, rec.peak_ms) == (5120, pytest.approx(0.02))
    assert rec.duration_ms == pytest.approx(0.1) and rec.baseline == 777
    # entries on another clock: placed from the first one
    shifted = [dict(e, time_us=e["time_us"] - 5e5) for e in entries]
    other = cuda_record(shifted, t0, t0 + 100, "cuda:0", 0, [])
    assert other.peak == 5120 + 512 and other.t_ms[0] == 0.0


def test_curve_keeps_the_order_of_same_time_events() -> None:
    assert curve([(1.0, 10), (1.0, -10), (0.5, 4)]) == ([0.5, 1.0, 1.0], [4, 14, 4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_of_a_gpu_step_from_the_caching_allocator() -> None:
    stoker.reset()
    c = stoker.compile(_mlp().cuda())
    x = torch.randn(256, 6, device="cuda")
    c(x).sum().backward()
    rep: Report = c.stoker_report
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with rep.trace_memory():
        c(x).sum().backward()
    mem = rep.memory
    assert mem is not None and mem.device.startswith("cuda") and mem.baseline == base
    peak = torch.cuda.max_memory_allocated() - base
    assert mem.peak == peak, (mem.peak, peak)
    assert [p[0] for p in mem.phases] == ["forward", "backward"]
    stoker.reset()


# ----------------------------------------------------------------------------- graph breaks


class _Breaks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(x)


def test_graph_breaks_name_the_reason_the_line_and_the_resume_graph(tmp_path: Path) -> None:
    stoker.reset()
    m = _Breaks()
    c = stoker.compile(m, report=str(tmp_path / "b.html"))
    x = torch.randn(3, 4)
    out = c(x)
    torch.testing.assert_close(out, m(x))
    out.sum().backward()
    rep: Report = c.stoker_report
    assert len(rep.compiles) == 2 and len(rep.graph_breaks) == 1, rep.graph_breaks
    b = rep.graph_breaks[0]
    line = _Breaks.forward.__code__.co_firstlineno + 2
    assert b.where.startswith(f"{__file__}:{line} in forward"), b.where
    assert "graph_break" in b.where and b.reason, b
    assert b.graph.startswith("graph 0 ")
    assert b.resumed_by.startswith("graph 1 torch_dynamo_resume_in_forward_at_"), b.resumed_by
    assert rep.summary()["graph_breaks"] == 1
    page = rep.to_html()
    assert f"{Path(__file__).name}:{line}" in page and "torch_dynamo_resume_in_forward" in page
    stoker.reset()


# ----------------------------------------------------------------------------- caches


def test_cache_state_counts_every_cache_once() -> None:
    r = Report()
    assert r.cache_state() == "off" and r.summary()["cache"] == "off"
    r.count_capture_cache("hit")
    r.autograd = {"disk_hits": 2, "disk_misses": 0, "disk cache hit": 2}
    assert r.cache_state() == "warm" and r.cache_line() == "warm (hits 3, misses 0)"
    r.count_cache("miss (new key)")
    s = r.summary()
    assert (s["cache"], s["cache_hits"], s["cache_misses"]) == ("partly warm", 3, 1)
    assert (s["capture_cache_hits"], s["graph_cache_misses"], s["autograd_cache_hits"]) == (1, 1, 2)
    cold = Report()
    cold.count_capture_cache("miss (new key)")
    cold.count_capture_cache("uncacheable: a subgraph")  # not a lookup that missed
    assert cold.cache_line() == "cold (hits 0, misses 1)"
    page = r.to_html()
    assert "partly warm (hits 3, misses 1)" in page and "hit: 2" in page


# ----------------------------------------------------------------------------- the page


class _Svg(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_timeline_and_memory_svg_are_well_formed() -> None:
    ms = 1_000_000
    r = Report()
    r.first_step = StepRecord(
        0,
        10 * ms,
        "test",
        [Span("dynamo", "Dynamo <frame>", 0, 6 * ms, "g"), Span("capture", "c", 1 * ms, 2 * ms)],
    )
    r.memory = MemoryRecord(
        "cpu", "test", [1.0, 2.0, 3.0], [100, 300, 50], [("forward", 0, 2)], 4.0
    )
    page = r.to_html()
    p = _Svg()
    p.feed(page)
    svgs = [a.get("class") for t, a in p.tags if t == "svg"]
    assert svgs == ["timeline", "memory"]
    shares = [a for t, a in p.tags if t == "rect" and a.get("class") == "share"]
    assert [a["data-stage"] for a in shares] == ["dynamo", "capture", "other"]
    widths = [float(a["width"] or 0) for a in shares]
    assert sum(widths) == pytest.approx(1100 - 70)  # the bar spans the whole step
    assert "Dynamo &lt;frame&gt;" in page and "<script" not in page and "http" not in page
    (peak,) = [a for t, a in p.tags if t == "circle" and a.get("class") == "peak"]
    assert float(peak["cx"] or 0) > 70 and "peak 300" not in page and "peak 0.3 KiB" in page


# ----------------------------------------------------------------------------- STOKER_TRACE


_TRACED = textwrap.dedent(
    """
    import torch, stoker
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    c = stoker.compile(m)
    opt = torch.optim.SGD(c.parameters(), lr=0.1)
    for _ in range(3):
        c(torch.randn(5, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    """
)


def _run(script: str, env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=tmp,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_stoker_trace_writes_a_chrome_trace_of_the_compile_and_a_step(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    _run(_TRACED, {"STOKER_TRACE": str(out), "STOKER_CACHE_DIR": str(tmp_path / "c")}, tmp_path)
    doc = json.loads(out.read_text())
    events: list[dict[str, Any]] = doc["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert {"name", "ts", "dur", "pid", "tid", "cat"} <= set(e) and e["dur"] >= 0, e
        assert isinstance(e["ts"], float | int) and isinstance(e["pid"], int)
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in events)
    steps = {e["name"]: e for e in spans if e["tid"] == 1}
    assert set(steps) == {"first compiled step", "steady step"}, steps
    first, steady = steps["first compiled step"], steps["steady step"]
    assert first["ts"] + first["dur"] <= steady["ts"]
    inside = [
        e
        for e in spans
        if e["tid"] == 0 and steady["ts"] <= e["ts"] <= steady["ts"] + steady["dur"] + 1e-3
    ]
    assert {e["name"] for e in inside} >= {"forward", "backward"}, inside
    stages = {e["args"]["stage"] for e in spans if e["tid"] == 0}
    assert {"Dynamo trace", "capture", "partition", "compiled autograd: capture"} <= stages, stages
    # spans sit on one clock: each compile stage inside the first step
    in_first = [e for e in spans if e["tid"] == 0 and e["args"]["stage"] == "capture"]
    assert in_first and all(
        first["ts"] <= e["ts"] and e["ts"] + e["dur"] <= first["ts"] + first["dur"] + 1e-3
        for e in in_first
    )
