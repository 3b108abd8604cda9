"""Run a test script in a fresh process with Triton's interpreter and the sm_90 cross-compile.

A fresh process because ``TRITON_INTERPRET`` must be set before Triton jits anything.
"""

import os
import subprocess
import sys


def run_interpreted(source: str) -> None:
    """Run ``source``; it must exit 0 and print ``ok`` last."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "STOKER_TRITON_CHECK_TARGETS": "cuda:90"}
    p = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", source],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
