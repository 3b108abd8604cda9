"""The backend's plumbing (report, guards, recompiles, logs, the compiled-autograd switch)
with stoker-capture replaced by a stub that runs Dynamo's graph as it is.  The real
pipeline is exercised end to end in tests-integration/."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import stoker
import stoker_autograd
import stoker_capture


def _stub_dynamo_backend(compiler: Callable[..., Any], **_: Any) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return compiler(gm, example_inputs)  # type: ignore[no-any-return]

    return backend


@pytest.fixture
def stub_capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(stoker_capture, "dynamo_backend", _stub_dynamo_backend, raising=False)
    # the stub hands Dynamo's own graph (torch ops, autograd recording) to the executor:
    # the aten executor runs it as it is, a kernel executor needs stoker-capture's graphs
    monkeypatch.setenv("STOKER_BACKEND", "aten")
    stoker.reset()
    yield
    stoker.reset()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_report_guards_recompiles_and_autograd(
    stub_capture: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a cache of its own: it counts compiles, which an earlier run's disk hits would skip
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "r.html"
    stoker.set_logs("recompiles,guards")
    try:
        m = _model()
        c = stoker.compile(m, report=str(path))
        assert stoker_autograd.is_enabled(), "stoker.compile should switch compiled autograd on"
        before = stoker_autograd.stats()
        for n in (3, 3, 5):
            x = torch.randn(n, 4)
            out = c(x)
            torch.testing.assert_close(out, m(x))
            # the stub makes no stoker Function, so the backward holds no node of a
            # stoker-compiled forward: opt in (with the switch's compiler, which reports)
            with stoker.autograd_enabled(True):
                out.sum().backward()
        after = stoker_autograd.stats()
        assert after["captures"] > before["captures"]
    finally:
        stoker.set_logs("")
    rep = c.stoker_report
    assert stoker.last_report() is rep
    assert rep.n_graphs == 2 and len(rep.recompiles) == 1
    assert (
        "size mismatch" in rep.recompiles[0].reason
        and "expected 3, actual 5" in rep.recompiles[0].reason
    )
    texts = [g.text for g in rep.compiles[0].guards]
    assert any("L['args'][0] matches float32[3, 4]" in t for t in texts), texts
    assert rep.compiles[0].frame.startswith("Sequential.forward")
    err = capsys.readouterr().err
    assert "[stoker.recompiles]" in err and "[stoker.guards]" in err
    assert rep.autograd_graphs, "the backward graph compiled autograd captured is in the report"
    # accumulate-grad does not cut: each compiled backward is one segment
    assert after["segments"] - before["segments"] == after["compiles"] - before["compiles"] > 0
    assert rep.autograd["segments"] >= 1
    rep.flush()
    page = path.read_text()
    assert "expected 3, actual 5" in page and "matches float32[3, 4]" in page
    assert "compiled autograd graph 0 [aten]" in page
    assert "<td>segments</td>" in page, "segments per backward are among the autograd counters"


def test_autograd_switch_scoping(stub_capture: None) -> None:
    m = _model()
    stoker.compile(m)
    assert stoker_autograd.is_enabled()
    with stoker.autograd_enabled(False):
        before = stoker_autograd.stats()
        m(torch.randn(2, 4)).sum().backward()
        assert stoker_autograd.stats() == before
    assert stoker_autograd.is_enabled()
    stoker.reset()
    assert not stoker_autograd.is_enabled()
    with stoker.autograd_enabled(True):
        assert stoker_autograd.is_enabled()
    assert not stoker_autograd.is_enabled()


def test_compiled_autograd_off_leaves_engine_alone(stub_capture: None) -> None:
    c = stoker.compile(_model(), compiled_autograd=False)
    c(torch.randn(2, 4)).sum().backward()
    assert not stoker_autograd.is_enabled()


def test_backend_by_name_uses_the_entry_point(stub_capture: None) -> None:
    m = _model()
    c = torch.compile(m, backend="stoker")
    x = torch.randn(3, 4)
    torch.testing.assert_close(c(x), m(x))
    rep = stoker.backend.report
    assert rep.n_graphs == 1
    assert any("L['args'][0] matches float32[3, 4]" in g.text for g in rep.compiles[0].guards)
    assert stoker_autograd.is_enabled()


def test_missing_capture_function_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(stoker_capture, "dynamo_backend", raising=False)
    stoker.reset()
    c = stoker.compile(_model(), compiled_autograd=False)
    with pytest.raises(Exception, match=r"stoker_capture.dynamo_backend is needed"):
        c(torch.randn(2, 4))
    stoker.reset()


def test_interpret_sets_env_early(stub_capture: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    stoker.compile(_model(), backend="interpret", compiled_autograd=False)
    assert os.environ.get("TRITON_INTERPRET") == "1"


CHROMIUM = shutil.which("chromium")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_opens_in_chromium_without_console_errors(
    stub_capture: None, tmp_path: Path
) -> None:
    path = tmp_path / "r.html"
    c = stoker.compile(_model(), report=str(path))
    with stoker.autograd_enabled(True):  # the stub makes no stoker Function: opt in
        c(torch.randn(3, 4)).sum().backward()
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
    console = [ln for ln in p.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    assert 'id="guards"' in p.stdout and "matches float32[3, 4]" in p.stdout


def test_compile_a_function(stub_capture: None) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).relu().sum(-1)

    c = stoker.compile(f, compiled_autograd=False)
    x, w = torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)
    torch.testing.assert_close(c(x, w), f(x, w))
    assert c.stoker_report.compiles[0].frame.startswith("f ")


def _failing_dynamo_backend(compiler: Callable[..., Any], **_: Any) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        raise RuntimeError("the compiler broke")

    return backend


@pytest.mark.parametrize("how", ["stoker.compile", "torch.compile"])
def test_dynamo_names_the_backend_stoker(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setattr(stoker_capture, "dynamo_backend", _failing_dynamo_backend, raising=False)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin() + 1

    g = stoker.compile(f) if how == "stoker.compile" else torch.compile(f, backend=stoker.backend)
    with pytest.raises(
        Exception, match=r"backend='stoker' raised:\s*RuntimeError: the compiler broke"
    ):
        g(torch.randn(3))


@pytest.mark.parametrize("mode", ["default", "max-autotune"])
def test_mode_reaches_the_triton_compiler(
    stub_capture: None, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    import stoker_triton

    seen: list[Any] = []

    def compile_graph(gm: Any, inputs: Any, options: Any = None) -> Any:
        seen.append(options)
        return gm

    monkeypatch.setattr(stoker_triton, "compile_graph", compile_graph)
    g = stoker.compile(lambda x: x.sin() + 1, backend="interpret", mode=mode)
    x = torch.randn(3)
    torch.testing.assert_close(g(x), x.sin() + 1)
    assert seen == [{"max_autotune": True} if mode == "max-autotune" else None]


def test_unknown_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"mode='fast'; choose one of default, max-autotune"):
        stoker.compile(lambda x: x, mode="fast")


def test_report_lists_the_backward_segments_kernels_per_call() -> None:
    """Kernels in the report. The compiled-autograd backward's segments
    (no Dynamo graph) are listed beside the forward, each graph with its kernels and
    extern calls per call; the summary counts the backward's kernels."""
    torch.manual_seed(0)
    nn = torch.nn
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    stoker.reset()
    c = stoker.compile(m, backend="interpret", dynamic=False)
    for _ in range(2):
        c(torch.randn(3, 4)).pow(2).sum().backward()
    rep = c.stoker_report
    stoker.reset()
    seg = rep.autograd_kernels
    assert seg and all(s.executor == "interpret" for s in seg), seg
    assert rep.summary()["backward_kernels"] == sum(len(s.kernels) for s in seg) > 0
    assert all(k.name.startswith("backward/") for s in seg for k in s.kernels), seg
    assert any(s.externs for s in seg), seg  # the Linear gradients' matmuls
    html = rep.to_html()
    assert "compiled autograd graph 0 [interpret]" in html
    for r in [rep.compiles[0], seg[0]]:
        assert f"({len(r.kernels)} kernels, {len(r.externs)} extern calls per call)" in html
