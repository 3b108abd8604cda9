"""`stoker bench traffic`: the bytes stoker's kernels move per training step, over the
step's minimum, for every GPU-suite model (tiny sizes, nothing runs). Each model's ratio
is held to the one stored beside the benchmark (benchmarks/traffic_expected.json), so a
kernel or fusion change that moves more bytes fails here, on the CPU, long before a GPU
shows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stoker._internal.bench.registry import TRAFFIC_EXPECTED

EXPECTED = Path(TRAFFIC_EXPECTED)


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``stoker bench traffic --smoke`` (whose smoke run checks the stored ratios), with
    ``args`` for the benchmark itself."""
    out = tmp_path / "bench.json"
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", "bench", "traffic", "--smoke", "--json", str(out)]
        + (["--", *args] if args else []),
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=900,
    )


def test_each_suite_model_moves_the_bytes_it_moved(tmp_path):
    proc = _run(tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["benchmarks"]["traffic"]["status"] == "ok"
    rows = {r["model"]: r for r in doc["benchmarks"]["traffic"]["raw"]}
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
