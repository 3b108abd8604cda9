"""A second process training the same model loads every Dynamo graph's capture from
stoker-capture's cache and every compiled graph (forward, backward, compiled autograd's)
from stoker-triton's; the report and `stoker cache info` show it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker import cli
from stoker._internal.report.report import Report

_TRAIN = """
import json, os, torch, torch.nn as nn, stoker
dev, backend = os.environ["TRAIN_DEVICE"], os.environ["TRAIN_BACKEND"]
jit = {"JITFunctions made": 0, "Triton compiles": 0}
if backend == "triton":  # count Triton's front end: a warm process should not reach it
    import triton.compiler
    from triton.runtime.jit import JITFunction
    _init, _compile = JITFunction.__init__, triton.compiler.compile
    def _counted_init(self, *a, **k):
        jit["JITFunctions made"] += 1
        _init(self, *a, **k)
    def _counted_compile(*a, **k):
        jit["Triton compiles"] += 1
        return _compile(*a, **k)
    JITFunction.__init__, triton.compiler.compile = _counted_init, _counted_compile
def build():
    if os.environ.get("TRAIN_MODEL") == "cnn":  # convolutions the C backend runs channels-last
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
            nn.Flatten(), nn.Linear(16 * 32 * 32, 4),
        )
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
def batch():
    if os.environ.get("TRAIN_MODEL") == "cnn":
        return torch.randn(8, 3, 32, 32, device=dev)
    return torch.randn(4, 8, device=dev)
torch.manual_seed(0)
model, ref = build().to(dev), build().to(dev)
ref.load_state_dict(model.state_dict())
cm = stoker.compile(model, backend=backend)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
for step in range(2):
    x = batch()
    for m, o in ((cm, opt), (ref, ropt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
import stoker_autograd
warm = {}
if backend == "triton":
    from stoker_triton._internal.runtime import warmload
    warm = dict(warmload.stats)
forward = [str(g.code) for c in cm.stoker_report.compiles for g in c.graphs if g.stage == "forward"]
print(json.dumps(cm.stoker_report.summary() | {"outcomes": cm.stoker_report.graph_cache,
                                               "autograd": stoker_autograd.stats(),
                                               "jit": jit, "warmload": warm,
                                               "forward": forward}))
"""


def _cold_and_warm(cache: Path, **env: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The summaries and logs of two processes training with one cache directory."""
    env = {
        **os.environ,
        "STOKER_CACHE_DIR": str(cache),
        "STOKER_TRITON_GRAPH_CACHE": "1",
        "STOKER_CAPTURE_CACHE": "1",
        "STOKER_LOGS": "cache",
        **env,
    }
    runs, logs = [], []
    for i in range(2):
        report = cache / f"report-{i}.html"  # written again at exit, with the last counters
        p = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _TRAIN],
            capture_output=True,
            text=True,
            env={**env, "STOKER_REPORT": str(report)},
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]) | {"html": report.read_text()})
        logs.append(p.stderr)
    return runs, logs


def _check_every_graph_loaded(runs: list[dict[str, Any]], logs: list[str]) -> None:
    cold, warm = runs
    n = cold["graph_cache_misses"]
    # the forward and compiled autograd's backward; the eager reference trained beside it
    # keeps the eager engine (compiled autograd is scoped to stoker-compiled forwards)
    assert n >= 2 and cold["graph_cache_hits"] == 0
    assert cold["autograd"]["captures"] == 1, cold["autograd"]
    assert cold["outcomes"] == {"miss (new key)": n}, cold
    assert warm["graph_cache_hits"] == n and warm["graph_cache_misses"] == 0, warm
    # every cache's lookups, counted once: all missed, then all hit
    assert (cold["cache"], warm["cache"]) == ("cold", "warm"), (cold, warm)
    assert warm["cache_hits"] == cold["cache_misses"] and warm["cache_misses"] == 0, warm
    assert warm["kernels"] == cold["kernels"] and warm["fallbacks"] == cold["fallbacks"]
    assert cold["capture_cache_misses"] == cold["graphs"] and cold["capture_cache_hits"] == 0
    assert warm["capture_cache_hits"] == warm["graphs"] and warm["capture_cache_misses"] == 0
    assert warm["guards"] == cold["guards"]
    assert logs[0].count("compiled-graph cache miss (new key)") == n, logs[0][-2000:]
    assert logs[1].count("compiled-graph cache hit") == n, logs[1][-2000:]
    assert logs[1].count("captured-graph cache hit") == warm["graphs"], logs[1][-2000:]
    # compiled autograd's warm-start cache: the compiled model's backward loaded, not retraced
    assert logs[0].count("autograd cache miss: backward graph") == 1, logs[0][-2000:]
    assert logs[1].count("autograd cache hit: backward graph") == 1, logs[1][-2000:]
    assert warm["autograd"]["disk_hits"] == 1 and warm["autograd"]["compiles"] == 0, warm
    # the report names every cache's outcomes (compiled autograd's with its counters)
    assert "miss (new key): " in cold["html"] and "hit: " in warm["html"]
    assert "<td>disk cache miss (new key)</td><td>1</td>" in cold["html"], cold["html"]
    assert "<td>disk cache hit</td><td>1</td>" in warm["html"], warm["html"]
    assert "disk cache miss" not in warm["html"]


def test_a_second_training_process_loads_every_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("triton")
    runs, logs = _cold_and_warm(
        tmp_path,
        TRAIN_DEVICE="cpu",
        TRAIN_BACKEND="interpret",
        TRITON_INTERPRET="1",
        STOKER_TRITON_CHECK_TARGETS="",
    )
    _check_every_graph_loaded(runs, logs)

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "triton/graphs" in out and "compiled graphs" in out, out
    assert "capture/graphs" in out and "captured graphs" in out, out
    assert "autograd/graphs" in out and "retraced backwards" in out, out


def test_a_second_process_loads_the_channels_last_convolutions_of_the_c_backend(
    tmp_path: Path,
) -> None:
    """The C backend's layout pass edits the captured graph before it is cached: the
    second process loads that graph (its convolutions channels-last), and every compiled
    graph, as the first process left them, and trains as eager does."""
    runs, logs = _cold_and_warm(tmp_path, TRAIN_DEVICE="cpu", TRAIN_BACKEND="c", TRAIN_MODEL="cnn")
    _check_every_graph_loaded(runs, logs)
    for run in runs:
        (forward,) = run["forward"]
        assert "memory_format = torch.channels_last" in forward, forward
    assert runs[0]["forward"] == runs[1]["forward"]


def test_the_report_counts_hits_and_misses() -> None:
    r = Report()
    for outcome in ("hit", "hit", "miss (new key)", "miss (guard replay failed)", ""):
        r.count_cache(outcome)
    s = r.summary()
    assert (s["graph_cache_hits"], s["graph_cache_misses"]) == (2, 2)
    assert (s["cache_hits"], s["cache_misses"], s["cache"]) == (2, 2, "partly warm")
    html = r.to_html()
    assert "caches" in html and "miss (guard replay failed): 1" in html
    for outcome in ("hit", "miss (new key)", "uncacheable: a subgraph", ""):
        r.count_capture_cache(outcome)
    s = r.summary()
    # an uncacheable graph is no lookup that missed: it is listed, not counted
    assert (s["capture_cache_hits"], s["capture_cache_misses"]) == (1, 1)
    assert (s["cache_hits"], s["cache_misses"]) == (3, 3)
    assert "captured graphs" in r.to_html() and "uncacheable: a subgraph: 1" in r.to_html()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (native Triton)")
def test_a_second_gpu_process_skips_capture_partition_and_codegen(tmp_path: Path) -> None:
    """The warm start on a GPU: every capture and every compiled graph loaded."""
    runs, logs = _cold_and_warm(
        tmp_path, TRAIN_DEVICE="cuda", TRAIN_BACKEND="triton", TRITON_INTERPRET="0"
    )
    _check_every_graph_loaded(runs, logs)
    # every kernel launched from the binary the cold process recorded (runtime/warmload.py):
    # no kernel module imported, no JITFunction made, no Triton compile or cache lookup
    cold, warm = runs
    assert cold["jit"]["Triton compiles"] > 0 and cold["warmload"].get("records", 0) > 0, cold
    assert warm["jit"] == {"JITFunctions made": 0, "Triton compiles": 0}, warm
    assert warm["warmload"].get("hits") == cold["warmload"]["records"], warm["warmload"]
