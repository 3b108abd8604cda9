"""The CLI's edges and wrong options: one line that says what to do, never a traceback.

Usage errors of the ``stoker`` command exit with status 2; `stoker.compile` options
of the wrong type raise `StokerConfigError` up front. Also: ``stoker bench --models``
runs only what it names, timings come with their spread, and ``stoker explain`` reports
what a script compiled even when the script calls ``stoker.reset()``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import stoker
from stoker import cli
from stoker._internal.bench import bench, harness, registry
from stoker._internal.config import CompileOptions, StokerConfigError


def _one_line_error(err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err and ": error: " in lines[0], err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _stoker(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


# ----------------------------------------------------------------------------- demo


def test_demo_steps_0_is_a_usage_error(tmp_path: Path) -> None:
    # statistics.StatisticsError from the empty list of step times, before
    p = _stoker("demo", "--steps", "0", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    _one_line_error(p.stderr, "stoker demo: error: --steps 0", "at least 1 step")
    assert p.stdout == "" and not (tmp_path / "stoker-demo-report.html").exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--device", "cuda"], ["--device cuda", "--device cpu"]),
        (["--device", "cuda:1"], ["--device cuda:1", "--device cpu"]),
        (["--device", "tpu"], ["--device tpu", "cpu or cuda"]),
        (["--device", "mps"], ["--device mps", "cpu or cuda"]),
        (["--batch", "0"], ["--batch 0"]),
        (["--ranks", "0"], ["--ranks 0"]),
        (["--backend", "triton", "--device", "cpu"], ["--backend triton on cpu", "interpret"]),
    ],
)
def test_demo_without_cuda_and_other_bad_arguments(
    args: list[str],
    needles: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a machine without CUDA (this one, or a GPU box pretending): an AssertionError
    # "Torch not compiled with CUDA enabled" from deep inside torch, before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("STOKER_BACKEND", raising=False)
    assert cli.main(["demo", "--steps", "1", *args]) == 2
    out = capsys.readouterr()
    _one_line_error(out.err, "stoker demo: error:", *needles)
    assert out.out == ""


def test_demo_argparse_errors_are_one_line_too(tmp_path: Path) -> None:
    p = _stoker("demo", "--steps", "many", cwd=tmp_path)
    assert p.returncode == 2
    _one_line_error(p.stderr, "invalid int value: 'many'", "stoker demo --help")


# ----------------------------------------------------------------------------- cache


@pytest.mark.parametrize("action", ["info", "clear"])
def test_cache_dir_that_is_a_file(
    action: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `stoker cache info` printed "(empty)" for it, before
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    for where, what in ((f, "is a file"), (f / "sub", f"is under {f}, which is a file")):
        monkeypatch.setenv("STOKER_CACHE_DIR", str(where))
        assert cli.main(["cache", action]) == 2
        _one_line_error(capsys.readouterr().err, f"STOKER_CACHE_DIR={where} {what}", "directory")
    assert f.read_text() == "x"  # clear removed nothing
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "fine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(f))
    assert cli.main(["cache", "info"]) == 2
    _one_line_error(capsys.readouterr().err, f"TRITON_CACHE_DIR={f} is a file")


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("fullgraph", "no", "fullgraph='no': use True or False"),
        ("fullgraph", 1, "fullgraph=1: use True or False"),
        ("compiled_autograd", "off", "compiled_autograd='off': use True or False"),
        ("dynamic", 1, "dynamic=1: use None (automatic), True or False"),
        ("dynamic", "auto", "dynamic='auto'"),
        ("memory_budget", "0.5", "memory_budget='0.5': use a number in [0, 1]"),
        ("memory_budget", True, "memory_budget=True"),
        ("recompile_limit", "8", "recompile_limit='8': use a whole number"),
        ("recompile_limit", 2.5, "recompile_limit=2.5"),
        ("cudagraph_limit", None, "cudagraph_limit=None"),
        ("report", 3, "report=3: use a file path or None"),
        ("extra", "debug", "extra='debug': use a dict"),
        ("mode", None, "mode=None; choose one of default, max-autotune, reduce-overhead"),
        ("backend", 1, "backend=1 is not a stoker backend"),
    ],
)
def test_wrongly_typed_options_fail_at_compile(option: str, value: Any, needle: str) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(StokerConfigError) as e:
        stoker.compile(model, **{option: value})
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(StokerConfigError):  # the torch.compile backend's options: the same check
        stoker.backend.with_options(**{option: value})


def test_well_typed_options_still_pass(tmp_path: Path) -> None:
    opts = CompileOptions.from_kwargs(
        fullgraph=True,
        dynamic=False,
        memory_budget=1,
        recompile_limit=3,
        report=tmp_path / "r.html",
        extra={"debug_checks": True},
    )
    assert opts.report == str(tmp_path / "r.html") and opts.memory_budget == 1


# ----------------------------------------------------------------------------- bench


def test_bench_models_runs_only_those(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `stoker bench --models mlp` ran every sibling benchmark script first (minutes)
    ran: list[tuple[str, str]] = []
    scripts: list[bool] = []

    def fake_run(name: str, backend: str, steps: int, *a: Any, **k: Any) -> dict[str, Any]:
        ran.append((name, backend))
        return {
            "model": name,
            "backend": backend,
            "first_step_s": 1.0,
            **bench.spread_ms([0.002, 0.001, 0.004]),
        }

    def fake_program(b: Any, *a: Any) -> tuple[dict[str, Any], Any]:
        scripts.append(b.name)
        return {"status": "ok", "seconds": 0.0}, {"us": 1.0}

    monkeypatch.setattr(bench, "_cold_then_warm", fake_run)
    monkeypatch.setattr(harness, "run_program", fake_program)
    monkeypatch.setattr(registry, "_run_gpu_suite", lambda o: pytest.fail("ran the GPU suite"))
    monkeypatch.setitem(
        registry.REGISTRY, "gpu", dataclasses.replace(registry.REGISTRY["gpu"], run=lambda o: [])
    )
    js = str(tmp_path / "b.json")
    assert cli.main(["bench", "--models", "mlp", "--backends", "eager,stoker", "--json", js]) == 0
    assert ran == [("mlp", "eager"), ("mlp", "stoker")] and scripts == []
    out = capsys.readouterr().out
    assert "steady ms min / median / max" in out and "1.00 / 2.00 / 4.00" in out, out
    doc = json.loads((tmp_path / "b.json").read_text())
    assert [r["case"] for r in doc["rows"]] == ["mlp eager", "mlp stoker"]
    assert (tmp_path / "b.md").read_text().count("| mlp eager | steady_ms |") == 1
    ran.clear()
    assert cli.main(["bench", "--backends", "eager", "--json", js]) == 0  # a full run
    programs = [b.name for b in registry.REGISTRY.values() if b.module]
    assert scripts == programs and {m for m, _ in ran} >= {"mlp", "gpt", "cnn"}
    scripts.clear()
    assert cli.main(["bench", "capture", "--json", js, "--", "--pipeline", "gpt-m"]) == 0
    assert scripts == ["capture"]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--models", "resnet"], ["--models: unknown resnet", "mlp"]),
        (["--backends", "eagre"], ["--backends: unknown eagre", "aot_eager"]),
        (["--suite", "gpu", "--models", "gpt"], ["--models: unknown gpt", "gpt-m"]),
        (["--steps", "0"], ["--steps 0"]),
        (["--device", "cuda"], ["--device cuda", "--device cpu"]),
        (["shapse"], ["unknown benchmark shapse", "capture_pipeline", "--list"]),
        (["shapes", "capture", "--", "--x"], ["after `--` go to one benchmark"]),
    ],
)
def test_bench_bad_arguments(
    args: list[str],
    needles: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "_cold_then_warm", lambda *a, **k: pytest.fail("ran a model"))
    monkeypatch.setattr(harness, "run_program", lambda *a: pytest.fail("ran a program"))
    assert cli.main(["bench", *args]) == 2
    _one_line_error(capsys.readouterr().err, "stoker bench: error:", *needles)


def test_bench_spread_of_the_steady_steps() -> None:
    s = bench.spread_ms([0.003, 0.001, 0.002, 0.010])
    assert (s["steady_ms_min"], s["steady_ms"], s["steady_ms_max"]) == pytest.approx(
        (1.0, 2.5, 10.0)
    )
    assert s["steady_repeats"] == 4
    assert bench.spread_ms([])["steady_ms"] is None
    table = bench.format_table([{"model": "m", "backend": "b", **s}])
    assert "1.00 / 2.50 / 10.00" in table
    # a row of an older JSON (median only) still prints
    assert "2.50" in bench.format_table([{"model": "m", "backend": "b", "steady_ms": 2.5}])


# ----------------------------------------------------------------------------- explain


def test_explain_reports_what_the_script_compiled_across_resets(tmp_path: Path) -> None:
    # "the script compiled nothing with stoker", before, for a script that resets at the end
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import torch, stoker

        class First(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 2)

            def forward(self, x):
                return torch.relu(self.fc(x))

        class Second(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 3)

            def forward(self, x):
                return torch.tanh(self.fc(x))

        c = stoker.compile(First())
        c(torch.randn(3, 4)).sum().backward()
        stoker.reset()
        c = torch.compile(Second(), backend="stoker")
        c(torch.randn(3, 4)).sum().backward()
        stoker.reset()
        print("done")
        """)
    )
    report = tmp_path / "out" / "explain.html"
    p = _stoker("explain", "--logs", "", "--report", str(report), str(script), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done" in p.stdout and "compiled nothing" not in p.stderr, p.stderr
    second = tmp_path / "out" / "explain-2.html"
    assert f"report written to {report} (1 graph; first compiled step " in p.stderr, p.stderr
    assert f"report written to {second} (1 graph; first compiled step " in p.stderr, p.stderr
    assert p.stderr.count("on-disk caches cold (hits 0, misses ") == 2, p.stderr
    first_html, second_html = report.read_text(), second.read_text()
    # each report holds its own model's graph (First: relu; Second: tanh)
    assert "aten.relu" in first_html and "aten.tanh" not in first_html
    assert "aten.tanh" in second_html and "aten.relu" not in second_html


def test_explain_says_so_when_nothing_was_compiled(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("import stoker\nstoker.reset()\nprint('plain')\n")
    p = _stoker("explain", "--logs", "", str(script), cwd=tmp_path)
    assert p.returncode == 0 and "plain" in p.stdout, p.stderr
    assert "the script compiled nothing with stoker" in p.stderr


def test_explain_bad_logs_topic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    old = os.environ.get("STOKER_LOGS")
    assert cli.main(["explain", "--logs", "grpahs", str(script)]) == 2
    _one_line_error(capsys.readouterr().err, "--logs grpahs", "graphs")
    assert os.environ.get("STOKER_LOGS") == old  # nothing was set before the check
