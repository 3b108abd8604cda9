"""The compile report of a real run, in a browser; the CLI's demo and explain, end to end."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import stoker
from stoker._internal.bench.models import get_model
from stoker._internal.report.report import SECTIONS

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
)


def _train_two_sizes(path: Path) -> stoker.Report:
    spec = get_model("mlp")
    model = spec.build()
    compiled = stoker.compile(model, report=str(path))
    gen = torch.Generator().manual_seed(0)
    for n in (4, 4, 9):
        inputs, target = spec.batch(n, gen)
        spec.loss(compiled(*inputs), target).backward()
    rep: stoker.Report = compiled.stoker_report
    rep.flush()
    return rep


def test_report_of_a_real_run(tmp_path: Path) -> None:
    path = tmp_path / "report.html"
    rep = _train_two_sizes(path)
    page = path.read_text(encoding="utf-8")
    for sid, title in SECTIONS:
        assert f'id="{sid}"' in page and title in page, sid
    assert rep.n_guards > 0
    assert "TENSOR_MATCH" in page or "matches float32" in page  # input guards are listed
    assert rep.recompiles, "batch 4 → 9 should have recompiled once"
    assert "size mismatch" in page or "size()" in page
    for stage in ("dynamo", "forward"):
        assert stage in {g.stage for c in rep.compiles for g in c.graphs}, stage
    # the backward: compiled autograd's segments (the forward's own AOT backward, which
    # compiled autograd inlines, is compiled only if something calls it)
    assert rep.autograd_kernels, "the compiled backward's kernels are not in the report"
    assert any(c.partition is not None and c.partition.saved for c in rep.compiles)
    assert "<script" not in page and "http://" not in page and "https://" not in page


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_opens_in_headless_chromium(tmp_path: Path) -> None:
    path = tmp_path / "report.html"
    _train_two_sizes(path)
    p = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    console = [line for line in p.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    assert 'id="guards"' in p.stdout and 'id="partition"' in p.stdout


def test_stoker_report_env_var(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import torch, stoker
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        c = stoker.compile(m)
        c(torch.randn(3, 4)).sum().backward()
    """)
    )
    env = {
        **os.environ,
        "STOKER_REPORT": str(tmp_path / "env.html"),
        "STOKER_LOGS": "graphs,guards",
    }
    p = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "env.html").exists()
    assert "[stoker.graphs]" in p.stderr and "[stoker.guards]" in p.stderr


def test_cli_explain_runs_a_script(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text(
        textwrap.dedent("""
        import sys, torch
        m = torch.nn.Linear(4, 2)
        c = torch.compile(m, backend="stoker")
        c(torch.randn(3, 4)).sum().backward()
        print("args", sys.argv[1:])
    """)
    )
    report = tmp_path / "explain.html"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "stoker.cli",
            "explain",
            "--report",
            str(report),
            str(script),
            "--flag",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "args ['--flag', '1']" in p.stdout
    assert "[stoker.graphs]" in p.stderr and "[stoker.autograd]" in p.stderr
    assert "first compiled step " in p.stderr and "on-disk caches " in p.stderr, p.stderr[-2000:]
    assert report.exists() and 'id="guards"' in report.read_text()


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, Path]]:
    """``stoker demo`` twice with one cache directory: cold, then warm (stdout, stderr,
    report). On the CPU, auto picks the aten executor, as in the docs' sample."""
    tmp = tmp_path_factory.mktemp("demo")
    runs = []
    for i, steps in enumerate((6, 2)):
        report = tmp / f"demo-{i}.html"
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "stoker.cli",
                "demo",
                "--steps",
                str(steps),
                "--device",
                "cpu",
                "--report",
                str(report),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp,
            env={**os.environ, "STOKER_CACHE_DIR": str(tmp / "cache")},
        )
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append((p.stdout, p.stderr, report))
    return runs


def test_cli_demo_few_steps(demo_runs: list[tuple[str, str, Path]]) -> None:
    out, err, report = demo_runs[0]
    for needle in (
        "executor: c",
        "C kernels",
        "compile time",
        "of which: ",
        "on-disk caches: cold (hits 0, ",
        "steady step time, eager",
        "steady step time, stoker",
        "loss curves agree",
        "graphs",
        "guards",
        "report:",
    ):
        assert needle in out, (needle, out)
    diff = float(out.split("max |diff| = ")[1].split()[0])
    assert diff < 1e-3, out
    assert report.exists()
    _check_the_docs_sample(out, err)

    warm = demo_runs[1][0]
    assert "on-disk caches: warm (" in warm and "misses 0)" in warm, warm


def _cli_first_step_s(out: str) -> float:
    return float(out.split("compile time (first compiled step):")[1].split()[0])


class _Png:
    """The pixels of an 8-bit RGB(A) PNG (what Chromium's screenshots are), no library."""

    def __init__(self, data: bytes) -> None:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        pos, idat = 8, b""
        while pos < len(data):
            n = int.from_bytes(data[pos : pos + 4], "big")
            kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
            if kind == b"IHDR":
                self.w, self.h = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
                depth, color, interlace = body[8], body[9], body[12]
                assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color)
                self.bpp = 3 if color == 2 else 4
            elif kind == b"IDAT":
                idat += body
            pos += 12 + n
        raw, stride = zlib.decompress(idat), self.w * self.bpp
        rows: list[bytearray] = []
        prev = bytearray(stride)
        for y in range(self.h):
            f, line = (
                raw[y * (stride + 1)],
                bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
            )
            for i in range(stride):
                a = line[i - self.bpp] if i >= self.bpp else 0
                b, c = prev[i], prev[i - self.bpp] if i >= self.bpp else 0
                if f == 1:
                    line[i] = (line[i] + a) & 255
                elif f == 2:
                    line[i] = (line[i] + b) & 255
                elif f == 3:
                    line[i] = (line[i] + (a + b) // 2) & 255
                elif f == 4:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    line[i] = (
                        line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)
                    ) & 255
            rows.append(line)
            prev = line
        self.rows = rows

    def count(self, rgb: tuple[int, int, int], tol: int = 6) -> int:
        n = 0
        for line in self.rows:
            for i in range(0, len(line), self.bpp):
                if all(abs(line[i + k] - rgb[k]) <= tol for k in range(3)):
                    n += 1
        return n


def _hex(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_demo_report_timeline_and_memory_render_in_chromium(
    demo_runs: list[tuple[str, str, Path]], tmp_path: Path
) -> None:
    """The warm demo's report in headless Chromium: no console errors; the timeline and the
    memory plot are drawn (their colors are on the screen); the stages in the DOM sum to
    the first-step time the CLI printed, within 5%."""
    from stoker._internal.report.svg import COLORS

    out, _, report = demo_runs[1]
    base = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    p = subprocess.run(
        [
            *base,
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tmp_path / 'p1'}",
            "--dump-dom",
            report.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    console = [ln for ln in p.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    dom = p.stdout
    assert '<svg class="timeline"' in dom and '<svg class="memory"' in dom
    # the "By stage" table as Chromium parsed it
    table = dom.split("<caption>By stage</caption>")[1].split("</table>")[0]
    cells = [c.split("</td>")[0] for c in table.split("<td")[1:]]
    rows = {
        cells[i].split(">", 1)[1]: float(cells[i + 1].split(">", 1)[1])
        for i in range(0, len(cells), 3)
    }
    total = rows.pop("total (the step's wall time)")
    other = rows.pop("other (in no stage: gaps, unmarked code)", 0.0)
    cli_ms = _cli_first_step_s(out) * 1e3
    assert total == pytest.approx(cli_ms, abs=6), (total, cli_ms)  # the CLI prints 0.01 s
    assert sum(rows.values()) == pytest.approx(cli_ms, rel=0.05), (rows, other, cli_ms)
    # drawn: a screenshot of each section (the report's own markup and style, that
    # section alone, so the picture is small) shows its colors
    page = report.read_text()
    head = page.split("<main>")[0] + "<main>"

    def shot(section: str) -> _Png:
        one = page.split(f'<section id="{section}">')[1].split("</section>")[0]
        alone = tmp_path / f"{section}.html"
        alone.write_text(f'{head}<section id="{section}">{one}</section></main></body></html>')
        png = tmp_path / f"{section}.png"
        s = subprocess.run(
            [
                *base,
                f"--user-data-dir={tmp_path / section}",
                "--window-size=1250,520",
                f"--screenshot={png}",
                alone.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert s.returncode == 0 and png.exists(), s.stderr[-2000:]
        return _Png(png.read_bytes())

    step = shot("step")
    assert step.count(_hex(COLORS["dynamo"])) > 200, "the timeline's Dynamo spans are drawn"
    assert step.count(_hex(COLORS["run forward"])) > 50, "the first forward run is drawn"
    mem = shot("memory")
    assert mem.count(_hex("#2a4d8f")) > 100, "the live-bytes line is drawn"
    assert mem.count(_hex("#a12b2b")) > 10, "the peak is marked"


_TRACED = textwrap.dedent(
    """
    import torch, stoker
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    c = torch.compile(m, backend="stoker")
    for _ in range(2):
        c(torch.randn(5, 6)).sum().backward()
    """
)


def _tlparse() -> str | None:
    here = Path(sys.executable).with_name("tlparse")
    return str(here) if here.exists() else shutil.which("tlparse")


def test_torch_trace_shows_stokers_stages_and_graphs(tmp_path: Path) -> None:
    """Under TORCH_TRACE, stoker logs its stages as chromium events and its graphs as
    tlparse's artifacts; tlparse (where installed) puts them on the compile's page and in
    its Perfetto timeline."""
    trace = tmp_path / "trace"
    p = subprocess.run(
        [sys.executable, "-c", _TRACED],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TORCH_TRACE": str(trace), "STOKER_CACHE_DIR": str(tmp_path / "c")},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (log,) = trace.iterdir()
    records: list[dict[str, Any]] = []  # each record, with its payload under "payload"
    for line in log.read_text().splitlines():
        if line.startswith("\t"):
            records[-1]["payload"] = records[-1].get("payload", "") + line[1:] + "\n"
        elif "{" in line:
            records.append(json.loads(line[line.index("{") :]))
    keys = {k for r in records for k in r}
    for kind in ("aot_joint_graph", "aot_forward_graph", "aot_backward_graph"):
        assert kind in keys, kind
    joint = next(r for r in records if "aot_joint_graph" in r)
    assert joint.get("frame_id") == 0 and joint.get("frame_compile_id") == 0, joint
    assert "torch.ops.aten" in joint["payload"], "the joint graph itself is the payload"
    ca = [r for r in records if "compiled_autograd_graph" in r]
    assert ca and ca[0].get("compiled_autograd_id") == 0, ca
    names = {r["artifact"]["name"] for r in records if "artifact" in r}
    assert {"stoker_guards", "stoker_compile_stages"} <= names, names
    events = [json.loads(r["payload"]) for r in records if "chromium_event" in r]
    stoker_events = [e for e in events if e.get("cat") == "stoker"]
    assert {e["args"]["stage"] for e in stoker_events} >= {
        "Dynamo trace",
        "capture",
        "partition",
        "compiled autograd: capture",
        "compiled autograd: retrace",
    }, stoker_events
    # on Dynamo's clock: stoker's capture lies inside Dynamo's backend_compile event
    backend = [e for e in events if e.get("name") == "backend_compile"]
    (capture,) = [e for e in stoker_events if e["name"] == "capture: joint graph"]
    starts = [e["ts"] for e in backend if e["ph"] == "B"]
    ends = [e["ts"] for e in backend if e["ph"] == "E"]
    assert (
        starts and ends and starts[0] <= capture["ts"] <= capture["ts"] + capture["dur"] <= ends[0]
    )
    tool = _tlparse()
    if tool is None:
        pytest.skip("tlparse is not installed (pip install tlparse): checked the raw trace only")
    out = tmp_path / "tl"
    t = subprocess.run(
        [tool, str(log), "-o", str(out), "--no-browser", "--overwrite"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert t.returncode == 0, t.stderr[-2000:]
    files = [f.relative_to(out).as_posix() for f in out.rglob("*") if f.is_file()]
    first = [f for f in files if f.startswith("-_0_0_0/")]
    for kind in ("aot_joint_graph", "aot_forward_graph", "aot_backward_graph", "stoker_guards"):
        assert any(f.split("/")[1].startswith(kind) for f in first), (kind, first)
    assert any(f.startswith("0_") and "compiled_autograd_graph" in f for f in files), files
    events = json.loads((out / "chromium_events.json").read_text())
    mine = [e for e in events if e.get("cat") == "stoker"]
    stages = {e["args"]["stage"] for e in mine}
    assert {"Dynamo trace", "capture", "partition", "compiled autograd: capture"} <= stages


ROOT = Path(__file__).resolve().parents[1]


def _label(line: str) -> str:
    """A line of the demo's output without its numbers, paths and progress-bar fill."""
    line = re.sub(r"\[[#.]+\]", "[bar]", line)
    line = re.sub(r"(?<![\w/])/\S+", "PATH", line)
    line = re.sub(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", "#", line)
    return " ".join(line.split())


def _check_the_docs_sample(stdout: str, stderr: str) -> None:
    """The sample `stoker demo` output in README.md and docs/stoker.md is what the demo
    prints, numbers aside: each sample line is a line of this run, and each line this
    run printed to stdout is in the sample."""
    real = {_label(x) for x in re.split(r"[\r\n]", stdout + "\n" + stderr) if x.strip()}
    printed = {_label(x) for x in stdout.splitlines() if x.strip()}
    for doc in (ROOT / "README.md", ROOT / "docs" / "stoker.md"):
        found = re.search(
            r"^\$ stoker demo\n(.*?)^```", doc.read_text(encoding="utf-8"), re.M | re.S
        )
        assert found, f"{doc.name} has no sample of `$ stoker demo`"
        sample = {_label(x) for x in found.group(1).splitlines() if x.strip()}
        stale = sample - real
        assert not stale, f"{doc.name}'s sample shows lines the demo no longer prints: {stale}"
        missing = printed - sample
        assert not missing, f"the demo prints lines {doc.name}'s sample lacks: {missing}"
