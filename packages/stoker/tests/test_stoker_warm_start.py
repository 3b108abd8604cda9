"""A second process training the same model loads every compiled graph (forward, backward,
compiled autograd's) from stoker-triton's cache; the report and `stoker cache info` show it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stoker import cli
from stoker._internal.report import Report

_TRAIN = """
import json, torch, torch.nn as nn, stoker
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
ref.load_state_dict(model.state_dict())
cm = stoker.compile(model, backend="interpret")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
for step in range(2):
    x = torch.randn(4, 8)
    for m, o in ((cm, opt), (ref, ropt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
import stoker_autograd
print(json.dumps(cm.stoker_report.summary() | {"outcomes": cm.stoker_report.graph_cache,
                                               "autograd": stoker_autograd.stats()}))
"""


def test_a_second_training_process_loads_every_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "STOKER_CACHE_DIR": str(tmp_path),
        "TRITON_INTERPRET": "1",
        "STOKER_TRITON_CHECK_TARGETS": "",
        "STOKER_TRITON_GRAPH_CACHE": "1",
        "STOKER_LOGS": "cache",
    }
    runs, logs = [], []
    for _ in range(2):
        p = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _TRAIN],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        logs.append(p.stderr)
    cold, warm = runs
    n = cold["cache_misses"]
    assert n >= 3 and cold["cache_hits"] == 0  # forward, backward, compiled autograd's
    assert cold["outcomes"] == {"miss (new key)": n}, cold
    assert warm["cache_hits"] == n and warm["cache_misses"] == 0, warm
    assert warm["kernels"] == cold["kernels"] and warm["fallbacks"] == cold["fallbacks"]
    assert logs[0].count("compiled-graph cache miss (new key)") == n, logs[0][-2000:]
    assert logs[1].count("compiled-graph cache hit") == n, logs[1][-2000:]
    # compiled autograd's warm-start cache: both steps' backwards loaded, none retraced
    assert logs[0].count("autograd cache miss: backward graph") == 2, logs[0][-2000:]
    assert logs[1].count("autograd cache hit: backward graph") == 2, logs[1][-2000:]
    assert warm["autograd"]["disk_hits"] == 2 and warm["autograd"]["compiles"] == 0, warm

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "triton/graphs" in out and "compiled graphs" in out, out
    assert "autograd/graphs" in out and "retraced backwards" in out, out


def test_the_report_counts_hits_and_misses() -> None:
    r = Report()
    for outcome in ("hit", "hit", "miss (new key)", "miss (guard replay failed)", ""):
        r.count_cache(outcome)
    s = r.summary()
    assert (s["cache_hits"], s["cache_misses"]) == (2, 2)
    html = r.to_html()
    assert "cache hits" in html and "miss (guard replay failed): 1" in html
