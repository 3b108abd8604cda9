"""`tools/bench_traffic.py`: the bytes stoker's kernels move per training step, over the
step's minimum, for every GPU-suite model (tiny sizes, nothing runs). Each model's ratio
is held to the one stored in tools/traffic_expected.json, so a kernel or fusion change
that moves more bytes fails here, on the CPU, long before a GPU shows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = ROOT / "tools" / "traffic_expected.json"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STOKER_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_traffic.py"), "--smoke", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


def test_each_suite_model_moves_the_bytes_it_moved(tmp_path):
    out = tmp_path / "traffic.json"
    proc = _run("--json", str(out), "--check", str(EXPECTED), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {r["model"]: r for r in json.loads(out.read_text())}
    stored = json.loads(EXPECTED.read_text())["smoke"]
    assert set(rows) == set(stored)
    for r in rows.values():
        # every kernel's bytes add up to the step's, and no kernel reads its input
        # more than twice (a looped norm: statistics, then the output)
        ks = [k for g in r["graphs"].values() for k in g["kernels"]]
        assert sum(k["total"] for k in ks) == r["kernel_bytes"] and ks
        assert all(k["passes"] <= 2.0 for k in ks), r["model"]


def test_a_ratio_above_the_stored_one_fails(tmp_path):
    stored = json.loads(EXPECTED.read_text())
    lower = {"smoke": {"mlp-l": stored["smoke"]["mlp-l"] * 0.9}}
    path = tmp_path / "expected.json"
    path.write_text(json.dumps(lower))
    proc = _run("--models", "mlp-l", "--check", str(path), tmp_path=tmp_path)
    assert proc.returncode == 1 and "traffic regression: mlp-l" in proc.stderr, proc.stderr
