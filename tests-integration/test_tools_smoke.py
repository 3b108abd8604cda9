"""The GPU benchmark script must not rot on machines without a GPU: run it in
--smoke mode (tiny sizes, Triton's interpreter) and read its table."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_triton_smoke_prints_every_case(tmp_path):
    env = {**os.environ, "STOKER_CACHE_DIR": str(tmp_path), "STOKER_TRITON_CHECK_TARGETS": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_triton.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [
        ln
        for ln in proc.stdout.splitlines()
        if ln.startswith(("pointwise", "reduction", "softmax", "layernorm"))
    ]
    assert len(rows) == 7, proc.stdout
    # fusion: every case is one kernel (softmax, layernorm+gelu included)
    assert all(int(r[28:36]) == 1 for r in rows), proc.stdout
