"""More model shapes through stoker.compile with Triton kernels under the interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = [
    "attn",
    "groupnorm",
    "mixed",
    "pool",
    "custom_fn_dynamic",
    "autocast_bf16",
    "torch_compile_backend",
]


@pytest.mark.slow
def test_more_models_match_eager_forward_gradients_and_buffers(tmp_path: Path) -> None:
    script = Path(__file__).with_name("more_models_script.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "STOKER_CACHE_DIR": str(tmp_path)}
    p = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    ok = {
        ln.split()[0]
        for ln in p.stdout.splitlines()
        if len(ln.split()) > 1 and ln.split()[1] == "ok"
    }
    assert ok == set(CASES), p.stdout[-3000:] + p.stderr[-3000:]
    assert p.returncode == 0, p.stdout[-3000:]
