"""The compile report of a real run, in a browser; the CLI's demo and explain, end to end."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import stoker
from stoker._internal.models import get_model
from stoker._internal.report import SECTIONS

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
    for stage in ("dynamo", "forward", "backward"):
        assert stage in {g.stage for c in rep.compiles for g in c.graphs}, stage
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
    assert report.exists() and 'id="guards"' in report.read_text()


def test_cli_demo_few_steps(tmp_path: Path) -> None:
    report = tmp_path / "demo.html"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "stoker.cli",
            "demo",
            "--steps",
            "6",
            "--device",  # auto picks the aten executor on the CPU, as in the docs sample
            "cpu",
            "--report",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for needle in (
        "executor: aten",
        "compile time",
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
    _check_the_docs_sample(p.stdout, p.stderr)


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
