"""The module cache survives broken entries: each is a miss with one warning, rewritten."""

import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from triton_helpers import assert_same, fresh, trace

from stoker_shapes._internal import diskcache
from stoker_triton import compile_graph
from stoker_triton._internal import runtime


def _f(x, y):
    return (x * y + 1).sin(), (x - y).sum(-1)


def _forget_modules() -> None:
    """As in a new process: no kernel or wrapper module imported yet."""
    for name in [n for n in sys.modules if n.startswith("stoker_triton_")]:
        del sys.modules[name]


def _compile(x, y):
    fn = compile_graph(trace(_f, x, y), [x, y])
    a, b = fresh([x, y])
    assert_same(fn(a, b), _f(a, b), atol=1e-5)
    return fn


BREAK = {
    "random bytes": lambda p: p.write_bytes(os.urandom(300)),
    "empty file": lambda p: p.write_bytes(b""),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:100]),
    "other version": lambda p: p.write_bytes(
        p.read_bytes().replace(f" {runtime.MODULE_FORMAT} ".encode(), b" 0 ", 1)
    ),
    "plain source of an older stoker": lambda p: p.write_bytes(p.read_bytes().split(b"\n", 1)[1]),
}


@pytest.mark.parametrize("how", list(BREAK))
def test_broken_module_entries_are_misses(how, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(diskcache, "_warned", set())
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    _forget_modules()
    fn = _compile(x, y)
    files = [Path(k.path) for k in fn.report.kernels] + [Path(fn.report.wrapper_path)]
    assert all(p.is_relative_to(tmp_path) for p in files)
    for p in files:
        BREAK[how](p)
    _forget_modules()
    with caplog.at_level(logging.WARNING, logger="stoker.cache"):
        _compile(x, y)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == len(files), warned
    assert all(any(str(p) in w for w in warned) for p in files), warned
    for p in files:  # rewritten, valid
        kind = p.parent.name
        assert runtime.module_store(kind).read_valid(p).startswith(b"# stoker-triton")
    _forget_modules()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stoker.cache"):
        _compile(x, y)
    assert not caplog.records


def test_the_imported_source_is_the_validated_one(tmp_path, monkeypatch):
    # the module runs from the checked source, and inspect (hence @triton.jit) reads that
    # source too, not whatever the file holds later
    import inspect

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    src = "def kernel():\n    return 42\n"
    mod, path = runtime.load_module("kernels", src)
    path.write_bytes(b"garbage")
    assert mod.kernel() == 42 and inspect.getsource(mod.kernel) == src


def test_hits_and_misses_are_logged_with_why(tmp_path, monkeypatch, caplog):
    # STOKER_LOGS=cache shows misses (and why) and writes; +cache shows hits as well
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    # the module store alone (the compiled-graph cache has its own log test)
    monkeypatch.setenv("STOKER_TRITON_GRAPH_CACHE", "0")
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    _forget_modules()
    with caplog.at_level(logging.DEBUG, logger="stoker.cache"):
        fn = _compile(x, y)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        _forget_modules()
        _compile(x, y)
        second = [(r.levelno, r.getMessage()) for r in caplog.records]
    # one line per kernel and the wrapper: the wrapper's code object (the `code` store,
    # written beside it) is derived from it and quiet, so it does not repeat its lines
    n = len(fn.report.kernels) + 1
    assert len(list((tmp_path / "triton" / "code").glob("wrappers-*.bin"))) == 1
    assert sum("cache miss" in m and "(not on disk)" in m for m in first) == n, first
    assert sum(m.startswith("cache write") for m in first) == n, first
    assert not any("/code/" in m for m in first), first
    assert [lvl for lvl, m in second if "cache hit" in m] == [logging.DEBUG] * n, second
    assert not any("cache miss" in m for _, m in second), second


def test_a_wrappers_code_object_is_cached(tmp_path, monkeypatch, caplog):
    # a later process loads the wrapper's code object instead of compiling its source;
    # one made for another file, or one that does not load, is compiled again and rewritten
    import builtins
    import marshal

    from stoker_triton._internal.modcache import modules

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STOKER_TRITON_GRAPH_CACHE", "0")
    monkeypatch.setattr(diskcache, "_warned", set())
    compiled: list[str] = []

    def spy(source, filename, *args, **kwargs):
        compiled.append(str(filename))
        return builtins.compile(source, filename, *args, **kwargs)

    monkeypatch.setattr(modules, "compile", spy, raising=False)
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    _forget_modules()
    wrapper = _compile(x, y).report.wrapper_path
    assert compiled == [wrapper]
    (entry,) = (tmp_path / "triton" / "code").glob("wrappers-*.bin")
    key = entry.name.removesuffix(".bin")
    store = modules.code_store()
    assert marshal.loads(store.get(key)).co_filename == wrapper

    def again() -> list[str]:
        compiled.clear()
        _forget_modules()
        _compile(x, y)
        return list(compiled)

    assert again() == []  # loaded, not compiled
    source = Path(wrapper).read_text()
    store.put(key, marshal.dumps(builtins.compile(source, "/elsewhere/w.py", "exec")))
    assert again() == [wrapper]  # made for another file (the cache moved)
    assert marshal.loads(store.get(key)).co_filename == wrapper  # rewritten
    assert again() == []
    store.put(key, b"not marshal data")
    assert again() == [wrapper]
    entry.write_bytes(entry.read_bytes()[:50])  # broken: one warning naming it
    with caplog.at_level(logging.WARNING, logger="stoker.cache"):
        assert again() == [wrapper]
    assert [str(entry) in r.getMessage() for r in caplog.records] == [True], caplog.records
    assert again() == []


_SAME_SOURCES = """
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from stoker_triton import compile_graph

def f(x, w, b, g):
    h = torch.nn.functional.layer_norm(x @ w, (w.shape[1],)) * 2 + b
    y = torch.softmax(h.relu(), -1)
    return y, h.sum(0), (y * g).sum(), torch.tanh(h) * x.sum()

args = [torch.randn(8, 6), torch.randn(6, 5), torch.randn(5), torch.randn(8, 5)]
compile_graph(make_fx(f, decomposition_table=core_aten_decompositions())(*args), args)
"""


def test_generated_sources_do_not_depend_on_the_hash_seed(tmp_path):
    # Modules are keyed by their content: a wrapper whose text followed a set's order
    # (which buffers it frees after a step) was another file in every process, so two
    # processes compiling one graph into one cache left two wrappers, and a warm
    # process's compile of a broken graph entry could not find the file it rewrote.
    import subprocess

    sources = []
    for seed in ("0", "1"):  # two orders of every set and dict of strings
        cache = tmp_path / seed
        env = {
            **os.environ,
            "STOKER_CACHE_DIR": str(cache),
            "PYTHONHASHSEED": seed,
            "STOKER_TRITON_GRAPH_CACHE": "0",
            "STOKER_TRITON_CHECK_TARGETS": "",
        }
        p = subprocess.run(
            [sys.executable, "-c", _SAME_SOURCES],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        files = sorted(cache.glob("triton/*/*.py"))
        assert any(f.parent.name == "wrappers" for f in files), files
        sources.append({str(f.relative_to(cache)): f.read_bytes() for f in files})
    assert sources[0] == sources[1]
