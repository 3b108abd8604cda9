"""The report's pictures, as inline SVG (no script, nothing fetched).

`timeline_svg`: the first compiled step as a flame chart (one lane per nesting
depth, a rectangle per stage span, a tooltip each) above a bar of the step's
time by stage. `memory_svg`: live bytes over a traced step, with the forward
and backward shaded and the peak marked.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from .timeline import STAGE_LABELS, Span, StepRecord

if TYPE_CHECKING:
    from .memtrace import MemoryRecord

COLORS: dict[str, str] = {
    "dynamo": "#6f8fd8",
    "backend": "#b9c2d0",
    "capture": "#e0a458",
    "partition": "#d9803f",
    "codegen": "#c0504d",
    "kernel compile": "#8e3b46",
    "autograd capture": "#5fae8b",
    "autograd retrace": "#3f8f6f",
    "autograd compile": "#2d6b53",
    "cache load": "#9b7fc6",
    "cache write": "#7a5ea8",
    "run forward": "#f2c14e",
    "run backward": "#e8a33d",
    "report": "#a0a7b4",
    "gc": "#d46a9f",
    "other": "#e4e7ec",
}

_W = 1100  # drawing width in px
_FONT = "font-family:system-ui,sans-serif;font-size:11px"


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _fmt_ms(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"


def legend(by_stage: dict[str, float], wall_ms: float) -> str:
    """The stage colors with each stage's share, as HTML (under the timeline)."""
    items = []
    for stage, ms in by_stage.items():
        if ms < 0.05:  # a stage that ran but took no time worth a swatch (the table has it)
            continue
        pct = 100 * ms / wall_ms if wall_ms else 0.0
        items.append(
            f'<span class="lg"><span class="sw" style="background:{COLORS.get(stage, "#999")}">'
            f"</span>{_e(STAGE_LABELS.get(stage, stage))} {_e(_fmt_ms(ms))} ({pct:.1f}%)</span>"
        )
    return '<p class="legend">' + " ".join(items) + "</p>"


def _depths(spans: list[Span]) -> list[int]:
    """Each span's nesting depth (0: inside no other span)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start_ns, -spans[i].end_ns, i))
    depth = [0] * len(spans)
    stack: list[int] = []  # open spans, by index
    for i in order:
        s = spans[i]
        while stack and spans[stack[-1]].end_ns <= s.start_ns:
            stack.pop()
        depth[i] = len(stack)
        stack.append(i)
    return depth


def timeline_svg(step: StepRecord, max_spans: int = 3000) -> str:
    """The step's spans, one lane per nesting depth, over the step's bar by stage."""
    wall = max(step.end_ns - step.start_ns, 1)
    spans = [s for s in step.spans if s.end_ns > s.start_ns]
    spans.sort(key=lambda s: s.start_ns - s.end_ns)  # longest first: kept when too many
    spans = spans[:max_spans]
    depth = _depths(spans)
    lanes = max(depth, default=-1) + 1
    lane_h, top, bar_h = 18, 34, 16

    def x(t: int) -> float:
        return 60 + (_W - 70) * (t - step.start_ns) / wall

    out = [
        f'<svg class="timeline" width="{_W}" '
        f'height="{top + lanes * lane_h + 30}" role="img" aria-label="first compiled step '
        f'timeline" style="{_FONT}">'
    ]
    # the step's time by stage, in one bar
    pos = float(step.start_ns)
    by_stage = step.by_stage()
    for stage, ms in by_stage.items():
        w = (_W - 70) * ms * 1e6 / wall
        out.append(
            f'<rect class="share" data-stage="{_e(stage)}" x="{x(int(pos)):.2f}" y="4" '
            f'width="{max(w, 0):.2f}" height="{bar_h}" fill="{COLORS.get(stage, "#999")}">'
            f"<title>{_e(STAGE_LABELS.get(stage, stage))}: {_e(_fmt_ms(ms))}</title></rect>"
        )
        pos += ms * 1e6
    out.append(f'<text x="4" y="{4 + bar_h - 4}">by stage</text>')
    for i, s in enumerate(spans):
        x0, x1 = x(s.start_ns), x(s.end_ns)
        y = top + depth[i] * lane_h
        label = s.name if (x1 - x0) > 7 * len(s.name) else ""
        what = f"{s.name} [{s.graph}]" if s.graph else s.name
        out.append(
            f'<g class="span" data-stage="{_e(s.stage)}"><rect x="{x0:.2f}" y="{y}" '
            f'width="{max(x1 - x0, 0.5):.2f}" height="{lane_h - 2}" '
            f'fill="{COLORS.get(s.stage, "#999")}" stroke="#fff" stroke-width="0.5">'
            f"<title>{_e(what)}: {_e(_fmt_ms(s.ms))} "
            f"(at {_e(_fmt_ms((s.start_ns - step.start_ns) / 1e6))})</title></rect>"
            + (f'<text x="{x0 + 3:.2f}" y="{y + 12}">{_e(label)}</text>' if label else "")
            + "</g>"
        )
    # time axis
    axis_y = top + lanes * lane_h + 4
    out.append(f'<line x1="60" y1="{axis_y}" x2="{_W - 10}" y2="{axis_y}" stroke="#888"/>')
    for k in range(6):
        t = step.start_ns + wall * k // 5
        out.append(
            f'<text x="{x(t):.1f}" y="{axis_y + 14}" text-anchor="middle">'
            f"{_e(_fmt_ms((t - step.start_ns) / 1e6))}</text>"
        )
    out.append("</svg>")
    return "".join(out)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{n / 1024:.1f} KiB"


def memory_svg(mem: MemoryRecord) -> str:
    """Live bytes over the traced step: a step line, phases shaded, the peak marked."""
    h, left, right, top, bottom = 220, 70, 10, 10, 30
    dur = max(mem.duration_ms, max(mem.t_ms, default=0.0), 1e-6)
    lo = min(0, min(mem.live, default=0))
    hi = max(mem.peak, 1)

    def x(t: float) -> float:
        return left + (_W - left - right) * t / dur

    def y(v: float) -> float:
        return top + (h - top - bottom) * (1 - (v - lo) / (hi - lo))

    out = [
        f'<svg class="memory" width="{_W}" height="{h}" '
        f'role="img" aria-label="live bytes over the step" style="{_FONT}">'
    ]
    for name, a, b in mem.phases:
        fill = COLORS["run forward"] if name == "forward" else COLORS["run backward"]
        out.append(
            f'<rect class="phase" x="{x(a):.2f}" y="{top}" width="{max(x(b) - x(a), 0.5):.2f}" '
            f'height="{h - top - bottom}" fill="{fill}" opacity="0.25"><title>{_e(name)}: '
            f"{_e(_fmt_ms(b - a))}</title></rect>"
            f'<text x="{x(a) + 3:.2f}" y="{top + 12}">{_e(name)}</text>'
        )
    pts = [f"{x(0):.2f},{y(0):.2f}"]
    prev = 0
    for t, v in zip(mem.t_ms, mem.live):
        pts.append(f"{x(t):.2f},{y(prev):.2f}")
        pts.append(f"{x(t):.2f},{y(v):.2f}")
        prev = v
    pts.append(f"{x(dur):.2f},{y(prev):.2f}")
    out.append(
        f'<polyline class="live" points="{" ".join(pts)}" fill="none" stroke="#2a4d8f" '
        'stroke-width="1.5"/>'
    )
    px, py = x(mem.peak_ms), y(mem.peak)
    out.append(
        f'<circle class="peak" cx="{px:.2f}" cy="{py:.2f}" r="4" fill="#a12b2b">'
        f"<title>peak {_e(_mib(mem.peak))} at {_e(_fmt_ms(mem.peak_ms))}</title></circle>"
        f'<text x="{min(px + 6, _W - 150):.2f}" y="{max(py - 4, top + 10):.2f}" fill="#a12b2b">'
        f"peak {_e(_mib(mem.peak))}</text>"
    )
    # axes: bytes on the left, time below
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#888"/>')
    out.append(
        f'<line x1="{left}" y1="{h - bottom}" x2="{_W - right}" y2="{h - bottom}" stroke="#888"/>'
    )
    for k in range(5):
        tick = lo + (hi - lo) * k / 4
        out.append(
            f'<text x="{left - 4}" y="{y(tick) + 4:.1f}" text-anchor="end">{_e(_mib(tick))}</text>'
        )
    for k in range(6):
        t = dur * k / 5
        out.append(
            f'<text x="{x(t):.1f}" y="{h - bottom + 14}" text-anchor="middle">'
            f"{_e(_fmt_ms(t))}</text>"
        )
    out.append("</svg>")
    return "".join(out)
