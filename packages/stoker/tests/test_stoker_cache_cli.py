"""``stoker cache info|clear``."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from stoker import cli
from stoker._internal.cli import cache as cache_cli


def test_info_counts_entries_and_broken_files_then_clear_empties(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from stoker_shapes import DiskCache

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "stoker"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    store = DiskCache(tmp_path / "stoker" / "triton", "kernels", "1", ".py")
    for k in ("a", "b", "c"):
        store.put(k, b"x = 1\n")
    store.path("c").write_bytes(b"")  # a crash mid-write, in an older stoker
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "k.cubin").write_bytes(b"\0" * 10)

    assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "stoker") in out
    assert "triton/kernels" in out and "3 entries" in out and "1 broken" in out
    assert "1 files" in out  # Triton's cache, shown not touched

    assert cli.main(["cache", "clear"]) == 0
    assert not any((tmp_path / "stoker").rglob("*.py"))
    assert (tmp_path / "triton" / "k.cubin").exists()  # shared with Inductor: only on request
    assert cli.main(["cache", "clear", "--triton"]) == 0
    assert not (tmp_path / "triton" / "k.cubin").exists()
    buf = io.StringIO()
    cache_cli.info(buf)
    assert "(empty)" in buf.getvalue()


def test_info_on_a_missing_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "none2"))
    buf = io.StringIO()
    assert cache_cli.info(buf) == 0 and "(empty)" in buf.getvalue()
    assert cache_cli.clear(out=buf) == 0


def test_info_names_entries_of_another_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an entry an older (or newer) stoker wrote is sound but read as a miss: info says so
    from stoker_shapes import DiskCache

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "stoker"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    current = cache_cli._versions()
    assert {"capture/graphs", "autograd/graphs", "triton/graphs", "triton/kernels"} <= set(current)
    for folder, (kind, version) in current.items():
        top = tmp_path / "stoker" / folder.split("/")[0]
        root = top.parent if kind == folder else top  # autograd's kind is "autograd/graphs"
        DiskCache(root, kind, version).put("now", b"x")
        DiskCache(root, kind, "0-other" + version).put("old", b"x")
    buf = io.StringIO()
    cache_cli.info(buf)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("  ")]
    assert len(lines) == len(current), buf.getvalue()
    for ln in lines:
        assert "2 entries" in ln and "(1 of another version: read as misses" in ln, ln
