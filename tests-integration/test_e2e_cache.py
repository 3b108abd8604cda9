"""Caches that cannot break a run, end to end (new processes, Triton kernels under the interpreter).

Two processes compile the same function into one cache directory at once; then every
cached module is corrupted, emptied or left unwritable, and a new process still runs
(with one warning per broken file), matching eager forward and gradients each time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import torch, stoker

def f(x, w):
    return torch.nn.functional.gelu(x @ w).sum(-1).softmax(0)

g = stoker.compile(f, backend="interpret")
torch.manual_seed(int(__import__("sys").argv[1]))
x, w = torch.randn(6, 8, requires_grad=True), torch.randn(8, 5, requires_grad=True)
out = g(x, w)
out.pow(2).sum().backward()
gx, gw = x.grad, w.grad
x.grad = w.grad = None
ref = f(x, w)
ref.pow(2).sum().backward()
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-6)
torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-6)
print("matches eager")
"""


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "STOKER_LOGS"}
    env.update(STOKER_CACHE_DIR=str(cache), STOKER_TRITON_CHECK_TARGETS="")
    return env


def _start(script: Path, cache: Path, seed: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), str(seed)],
        env=_env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(p: subprocess.Popen[str]) -> str:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0 and "matches eager" in out, err[-3000:]
    return err


def _modules(cache: Path) -> list[Path]:
    """Generated modules and stoker-capture's captured graphs."""
    return sorted([*(cache / "triton").glob("*/*.py"), *(cache / "capture").glob("graphs/*")])


@pytest.mark.slow
def test_concurrent_writers_then_broken_entries(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    cache = tmp_path / "cache"
    # two processes, one cache directory, the same graphs, at the same time
    for err in [_finish(p) for p in [_start(script, cache, s) for s in (1, 2)]]:
        assert "stoker cache" not in err, err[-2000:]
    files = _modules(cache)
    assert files and not list(cache.rglob("*.tmp"))
    assert any(p.parent.name == "graphs" and p.parent.parent.name == "capture" for p in files)
    # random bytes in half the files, nothing in the others (a crash, a full disk)
    for i, p in enumerate(files):
        p.write_bytes(os.urandom(200) if i % 2 else b"")
    err = _finish(_start(script, cache, 3))
    warned = [ln for ln in err.splitlines() if "stoker cache: ignoring" in ln]
    assert len(warned) == len(files), err[-3000:]
    assert all(any(str(p) in w for w in warned) for p in files)
    # rewritten: the next process runs without a warning
    err = _finish(_start(script, cache, 4))
    assert "stoker cache" not in err, err[-2000:]


@pytest.mark.slow
def test_unwritable_cache_directory(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    err = _finish(_start(script, blocker / "cache", 5))
    warned = [ln for ln in err.splitlines() if "stoker cache: cannot write" in ln]
    assert len(warned) == 1, err[-3000:]  # once, naming the cache root
