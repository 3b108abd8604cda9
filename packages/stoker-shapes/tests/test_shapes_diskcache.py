"""DiskCache and atomic_write: every broken entry is a miss with one warning; writes are atomic."""

import errno
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stoker_shapes import DiskCache, atomic_write
from stoker_shapes._internal import diskcache


@pytest.fixture
def store(tmp_path: Path) -> DiskCache:
    return DiskCache(tmp_path, "things", "3", ".txt")


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(diskcache, "_warned", set())
    monkeypatch.setattr(diskcache, "_fallback_dir", None)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_round_trip_and_layout(store: DiskCache, tmp_path: Path) -> None:
    assert store.get("k") is None
    path = store.put("k", b"hello\nworld")
    assert path == tmp_path / "things" / "k.txt"
    assert store.get("k") == b"hello\nworld"
    assert store.get_entry("k") == (path, b"hello\nworld")
    assert path.read_bytes().startswith(b"# stoker-cache things 3 ")
    assert [p.name for p in path.parent.iterdir()] == ["k.txt"]  # no temporary file left


BROKEN = {
    "empty file": lambda good: b"",
    "random bytes": lambda good: os.urandom(64),
    "truncated": lambda good: good[: len(good) - 3],
    "header only": lambda good: good[: good.index(b"\n") + 1],
    "flipped byte": lambda good: good[:-1] + bytes([good[-1] ^ 1]),
    "other version": lambda good: good.replace(b"things 3 ", b"things 2 ", 1),
    "other kind": lambda good: good.replace(b"things 3 ", b"stuff 3 ", 1),
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_broken_entry_is_a_miss_warned_once_and_rewritten(store, how, caplog) -> None:
    path = store.put("k", b"the body")
    path.write_bytes(BROKEN[how](path.read_bytes()))
    with caplog.at_level(logging.INFO, logger="stoker.cache"):
        assert store.get("k") is None
        assert store.get("k") is None
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(path) in warned[0], warned
    store.put("k", b"the body")
    assert store.get("k") == b"the body"


def test_read_valid_names_the_file(store) -> None:
    path = store.put("k", b"x")
    assert store.read_valid(path) == b"x"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"k\.txt is not a valid things entry \(empty file\)"):
        store.read_valid(path)


def test_unwritable_directory_warns_once_and_caches_privately(store, monkeypatch, caplog) -> None:
    real_mkstemp = diskcache.tempfile.mkstemp
    refused = []

    def mkstemp(*a, dir=None, **k):  # the cache directory is on a read-only file system
        if Path(dir).is_relative_to(store.dir):
            refused.append(dir)
            raise OSError(errno.EROFS, "Read-only file system")
        return real_mkstemp(*a, dir=dir, **k)

    monkeypatch.setattr(diskcache.tempfile, "mkstemp", mkstemp)
    with pytest.raises(OSError, match="Read-only"):
        atomic_write(store.path("x"), b"x")  # user files: the error, not a fallback
    with caplog.at_level(logging.WARNING, logger="stoker.cache"):
        p1 = store.put("a", b"A")
        p2 = store.put("b", b"B")
    assert refused and not p1.is_relative_to(store.dir) and p1.parent == p2.parent
    assert store.get("a") == b"A" and store.get("b") == b"B"
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(store.dir.parent) in warned[0], warned


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="root writes into read-only directories; the simulated EROFS test covers this",
)
def test_read_only_directory(store) -> None:
    store.put("k", b"old")
    store.dir.chmod(0o555)
    try:
        path = store.put("new", b"new")
        assert not path.is_relative_to(store.dir)
        assert store.get("k") == b"old" and store.get("new") == b"new"
    finally:
        store.dir.chmod(0o755)


def test_atomic_write_leaves_the_old_file_on_error(tmp_path, monkeypatch) -> None:
    target = tmp_path / "f.bin"
    atomic_write(target, b"old")

    def fail(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(diskcache.os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_concurrent_writers_in_two_processes(tmp_path) -> None:
    """Two processes rewrite one key (and read it) many times at once: every read
    is a hit or a miss, never a broken entry; one valid entry and no stray files remain."""
    script = textwrap.dedent(
        f"""
        import logging, sys
        from stoker_shapes import DiskCache
        errors = []
        class H(logging.Handler):
            def emit(self, r):
                if r.levelno >= logging.WARNING: errors.append(r.getMessage())
        logging.getLogger("stoker.cache").addHandler(H())
        s = DiskCache({str(tmp_path)!r}, "k", "1")
        body = b"x" * 200000
        for i in range(200):
            s.put("same", body)
            got = s.get("same")
            assert got is None or got == body
        assert not errors, errors
        print("ok")
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and all("ok" in o for o in outs)
    s = DiskCache(tmp_path, "k", "1")
    assert s.get("same") == b"x" * 200000
    assert [p.name for p in s.dir.iterdir()] == ["same"]


def test_clear(store) -> None:
    store.put("a", b"1")
    store.put("b", b"2")
    assert store.clear() == 2 and store.get("a") is None


def test_kind_and_version_must_be_one_word(tmp_path) -> None:
    with pytest.raises(ValueError, match="no spaces"):
        DiskCache(tmp_path, "a b", "1")


def test_a_quiet_cache_logs_below_debug_but_warns_about_broken_entries(tmp_path, caplog) -> None:
    # bookkeeping entries (stoker-triton's "already compiled" markers) miss as a rule:
    # their misses, writes and hits stay out of STOKER_LOGS=cache (INFO) and +cache (DEBUG)
    quiet = DiskCache(tmp_path, "marks", "1", ".ok", quiet=True)
    with caplog.at_level(logging.DEBUG, logger="stoker.cache"):
        assert quiet.get("k") is None
        path = quiet.put("k", b"built\n")
        assert quiet.get("k") == b"built\n"
        assert caplog.records == []
        path.write_bytes(b"garbage")
        assert quiet.get("k") is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING], caplog.records
    loud = DiskCache(tmp_path, "other", "1")
    with caplog.at_level(logging.DEBUG, logger="stoker.cache"):
        caplog.clear()
        loud.get("k")
    assert [r.levelno for r in caplog.records] == [logging.INFO]
