"""Caches that cannot break a run, end to end (new processes, Triton kernels under the interpreter).

Two processes compile the same function into one cache directory at once; then every
cached module is corrupted, emptied or left unwritable, and a new process still runs
(with one warning per broken file), matching eager forward and gradients each time.
Every cache the run fills (stoker-triton's kernels, wrappers and compiled graphs,
stoker-capture's captured graphs, stoker-autograd's stored backwards) is broken each
way a cache can break (random bytes, empty, truncated, another version) and must be
rewritten by the next run; a read-only cache directory is read and never written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stoker_shapes._internal.diskcache import inspect_file

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
with stoker.autograd_enabled(False):  # the reference: eager's own backward
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


def _start(
    script: Path, cache: Path, seed: int, prefix: tuple[str, ...] = (), **env: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*prefix, sys.executable, str(script), str(seed)],
        env=_env(cache) | env,
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
    # one valid entry each: the files one process alone writes, every one sound
    alone = tmp_path / "alone"
    _finish(_start(script, alone, 0))
    names = {str(p.relative_to(cache)) for p in _entries(cache)}
    assert names == {str(p.relative_to(alone)) for p in _entries(alone)}
    assert all(inspect_file(p)[2] is None for p in _entries(cache))
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


# The caches a CPU run of _SCRIPT fills (a training step through compiled autograd).
# triton/binaries and triton/compiled are written on the native (GPU) path only:
# tests/test_triton_warmload.py and test_triton_compile_once.py break them there.
_KINDS = {"triton/kernels", "triton/wrappers", "triton/graphs", "capture/graphs", "autograd/graphs"}


def _entries(cache: Path) -> dict[Path, str]:
    """Every file under the cache directory and its folder ("triton/kernels")."""
    return {p: str(p.parent.relative_to(cache)) for p in sorted(cache.rglob("*")) if p.is_file()}


def _other_version(data: bytes) -> bytes:
    """The entry as another stoker would write it: a sound header and checksum, another version."""
    head, body = data.split(b"\n", 1)
    magic, cache, kind, version, digest = head.split(b" ")
    assert magic + b" " + cache == b"# stoker-cache", head
    return b" ".join([magic, cache, kind, b"0-other" + version, digest]) + b"\n" + body


def _cold_run(tmp_path: Path) -> tuple[Path, Path, dict[Path, bytes]]:
    """The training script, its cache directory after one cold process, and the bytes
    of every entry that process wrote."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    cache = tmp_path / "cache"
    _finish(_start(script, cache, 1))
    return script, cache, {p: p.read_bytes() for p in _entries(cache)}


BREAK = {
    "random bytes": lambda data: os.urandom(len(data)),
    "empty file": lambda data: b"",
    "truncated (half-written)": lambda data: data[: len(data) // 2],
    "another version": _other_version,
}


@pytest.mark.slow
def test_every_cache_broken_every_way_is_a_miss_and_rewritten(tmp_path: Path) -> None:
    script, cache, sound = _cold_run(tmp_path)
    cold = {p: inspect_file(p) for p in sound}  # (kind, version, None)
    kinds = set(_entries(cache).values())
    assert _KINDS <= kinds, kinds
    unread = [p for p, kind in _entries(cache).items() if kind == "capture/sites"]
    for i, (how, brk) in enumerate(BREAK.items()):
        for p, data in sound.items():
            p.write_bytes(brk(data))
        err = _finish(_start(script, cache, 2 + i))
        warned = [ln for ln in err.splitlines() if "stoker cache: ignoring" in ln]
        # one warning per broken file, naming it; capture/sites (what changed since a
        # code site's last entry) is read on a new key only, and rewritten with its graph
        for p in sound:
            assert sum(f"{p}:" in w for w in warned) == (p not in unread), (how, p, err[-3000:])
        assert len(warned) == len(sound) - len(unread), (how, err[-3000:])
        # every file rewritten under its name, sound, of this stoker's version
        assert set(_entries(cache)) == set(sound), how
        assert {p: inspect_file(p) for p in sound} == cold, how
        assert not list(cache.rglob("*.tmp")), how
    err = _finish(_start(script, cache, 9, STOKER_LOGS="cache"))
    assert "stoker cache:" not in err and "miss" not in err, err[-3000:]


def _read_only() -> tuple[str, ...]:
    """A command prefix under which the cache directory cannot be written (root ignores
    file modes unless it gives up CAP_DAC_OVERRIDE), or skip."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make a directory read-only")
    caps = "-dac_override,-dac_read_search,-fowner"
    return (setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}")


@pytest.mark.slow
def test_a_read_only_cache_directory_is_read_never_written(tmp_path: Path) -> None:
    script, cache, before = _cold_run(tmp_path)
    dirs = [cache, *(p for p in cache.rglob("*") if p.is_dir())]
    for p in before:
        p.chmod(0o444)
    for d in dirs:
        d.chmod(0o555)
    try:
        # every entry sound: all hits, nothing to write, no warning
        err = _finish(_start(script, cache, 2, _read_only(), STOKER_LOGS="cache"))
        assert "stoker cache:" not in err and "miss" not in err, err[-3000:]
        hits = [err.count(f"{what} cache hit") for what in ("captured-graph", "autograd")]
        assert hits == [1, 1] and err.count("compiled-graph cache hit") >= 2, err[-3000:]
        # broken entries in a read-only directory: a warning per file, one that the
        # directory cannot be written, and the run still matches eager
        for p in before:
            p.chmod(0o644)
            p.write_bytes(b"")
            p.chmod(0o444)
        err = _finish(_start(script, cache, 3, _read_only()))
        assert err.count("stoker cache: cannot write") == 1, err[-3000:]
        assert err.count("stoker cache: ignoring") >= len(_KINDS), err[-3000:]
        assert all(p.read_bytes() == b"" for p in before)  # nothing written there
    finally:
        for d in dirs:
            d.chmod(0o755)
