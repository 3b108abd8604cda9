"""The compiled-graph cache: a warm compile loads the wrapper and kernels, lowers nothing,
replays the guards the cold compile added, and misses whenever anything in its key changes."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_helpers import assert_same, compile_dynamic, fresh, trace

from stoker_shapes import Dim
from stoker_shapes._internal import diskcache
from stoker_triton import compile_graph
from stoker_triton._internal import graphcache
from stoker_triton._internal import lowering as lowering_mod

HERE = os.path.dirname(os.path.abspath(__file__))


def _mlp(x, w, b):
    return (torch.nn.functional.gelu(x @ w + b).softmax(-1), (x * 2).sum(0))


def _softmax(x):
    return torch.softmax(x, -1) * 3


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STOKER_TRITON_GRAPH_CACHE", "1")
    monkeypatch.setattr(diskcache, "_warned", set())
    lowered = []
    real = lowering_mod.lower_graph  # imported by the cold path only

    def counting(*a, **k):
        lowered.append(1)
        return real(*a, **k)

    monkeypatch.setattr(lowering_mod, "lower_graph", counting)
    return lowered


def _static(f, *args, options=None):
    fn = compile_graph(trace(f, *args), list(args), options=options)
    new = fresh(list(args))
    assert_same(fn(*new), f(*new), atol=1e-5, rtol=1e-4)
    return fn


def _dynamic(f, args, dynamic):
    ctx, fn = compile_dynamic(f, args, dynamic)
    return fn, ctx.produce_guards()


def _guard_texts(guards) -> list[str]:
    return [g.text for g in guards.guards]


def test_second_compile_hits_and_lowers_nothing(cache, caplog):
    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))
    with caplog.at_level(logging.INFO, logger="stoker.cache"):
        cold = _static(_mlp, *args)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        warm = _static(_mlp, *args)
        second = [r.getMessage() for r in caplog.records]
    # STOKER_LOGS=cache: one line per graph, hit or miss and why
    assert sum("compiled-graph cache miss (new key)" in m for m in first) == 1, first
    assert sum("compiled-graph cache hit" in m for m in second) == 1, second
    assert cold.report.cache == "miss (new key)" and len(cache) == 1
    assert warm.report.cache == "hit" and len(cache) == 1  # no second lowering
    # the report still shows what the cold compile made
    assert [k.kind for k in warm.report.kernels] == [k.kind for k in cold.report.kernels]
    assert warm.report.extern_calls == cold.report.extern_calls
    assert warm.wrapper_source == cold.wrapper_source


CHANGES = {
    "graph": lambda: _static(lambda x, w, b: (torch.relu(x @ w + b), x.sum(0)), *_MLP_ARGS),
    "dtype": lambda: _static(_mlp, *(a.double() for a in _MLP_ARGS)),
    "shape": lambda: _static(_mlp, torch.randn(6, 8), *_MLP_ARGS[1:]),
    "layout": lambda: _static(_mlp, torch.randn(8, 4).t(), *_MLP_ARGS[1:]),
    "option": lambda: _static(_mlp, *_MLP_ARGS, options={"persistent_rnumel_max": 8}),
}
_MLP_ARGS = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_graph_input_or_option_misses(cache, change):
    _static(_mlp, *_MLP_ARGS)
    fn = CHANGES[change]()
    assert fn.report.cache == "miss (new key)" and len(cache) == 2


def test_another_torch_triton_or_stoker_triton_version_misses(cache, monkeypatch):
    import triton

    import stoker_triton

    _static(_mlp, *_MLP_ARGS)
    code = graphcache._code_version()
    for v in (torch.__version__, triton.__version__, stoker_triton.__version__):
        assert v in code, code
    monkeypatch.setattr(graphcache, "_code_version", lambda: code.replace(" triton ", " triton 0"))
    fn = _static(_mlp, *_MLP_ARGS)
    assert fn.report.cache == "miss (new key)" and len(cache) == 2


def test_a_corrupt_entry_warns_misses_and_is_rewritten(cache, tmp_path, caplog):
    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))
    _static(_mlp, *args)
    (entry,) = (tmp_path / "triton" / "graphs").iterdir()
    entry.write_bytes(entry.read_bytes()[:50])
    with caplog.at_level(logging.INFO, logger="stoker.cache"):
        again = _static(_mlp, *args)
    assert again.report.cache == "miss (corrupt entry)" and len(cache) == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(entry) in warned[0], warned
    assert _static(_mlp, *args).report.cache == "hit" and len(cache) == 2  # rewritten


def test_a_missing_kernel_module_is_a_miss(cache, tmp_path):
    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))
    cold = _static(_mlp, *args)
    for name in [n for n in sys.modules if n.startswith("stoker_triton_kernels_")]:
        del sys.modules[name]  # as in a new process
    Path(cold.report.kernels[0].path).unlink()
    assert _static(_mlp, *args).report.cache == "miss (missing module)" and len(cache) == 2


def test_dynamic_hit_replays_the_guards_and_other_sizes_recompile(cache):
    cold, cold_guards = _dynamic(_softmax, [torch.randn(4, 24)], [{1: Dim("row", max=100000)}])
    assert cold.report.guards_added  # the row fits one block: a guard
    warm, warm_guards = _dynamic(_softmax, [torch.randn(4, 24)], [{1: Dim("row", max=100000)}])
    assert warm.report.cache == "hit" and len(cache) == 1
    assert _guard_texts(warm_guards) == _guard_texts(cold_guards)
    assert [str(g) for g in warm_guards.guards] == [str(g) for g in cold_guards.guards]
    for n in (7, 100):
        x = torch.randn(4, n)
        assert warm_guards.check([x], {}, None)
        assert_same(warm(x), _softmax(x))
    # a row the guard excludes: that variant does not apply; compiled again, correctly
    long, long_guards = _dynamic(_softmax, [torch.randn(4, 9000)], [{1: Dim("row", max=100000)}])
    assert long.report.cache == "miss (guard replay failed)" and len(cache) == 2
    assert _guard_texts(long_guards) != _guard_texts(cold_guards)
    x = torch.randn(4, 10000)
    assert long_guards.check([x], {}, None)
    assert_same(long(x), _softmax(x), atol=1e-5)
    # both variants are kept under one key
    for n in (30, 12000):
        fn, _ = _dynamic(_softmax, [torch.randn(4, n)], [{1: Dim("row", max=100000)}])
        assert fn.report.cache == "hit", n
    assert len(cache) == 2


_CHILD = r"""
import json, os, sys
sys.path.insert(0, {here!r})
import torch
import test_triton_graph_cache as t
import builtins
from stoker_triton._internal import graphcache, lowering
from stoker_triton._internal.modcache import modules
lowered = []
real = lowering.lower_graph
lowering.lower_graph = lambda *a, **k: (lowered.append(1), real(*a, **k))[1]
compiled = []  # wrapper sources compiled (else their code came from the code cache)
modules.compile = lambda src, path, mode: (compiled.append(path), builtins.compile(src, path, mode))[1]
torch.manual_seed(0)
static = t._static(t._mlp, torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))
dyn, guards = t._dynamic(t._softmax, [torch.randn(4, 24)], [{{1: t.Dim("row", max=100000)}}])
x = torch.randn(4, 40)
t.assert_same(dyn(x), t._softmax(x))
print(json.dumps({{"caches": [static.report.cache, dyn.report.cache], "lowered": len(lowered),
                  "guards": t._guard_texts(guards), "stats": graphcache.stats,
                  "wrapper compiles": len(compiled)}}))
"""


def test_a_second_process_hits_every_graph(tmp_path):
    env = {
        **os.environ,
        "STOKER_CACHE_DIR": str(tmp_path),
        "TRITON_INTERPRET": "1",
        "STOKER_TRITON_CHECK_TARGETS": "",
        "STOKER_TRITON_GRAPH_CACHE": "1",
    }
    runs = []
    for _ in range(2):
        p = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _CHILD.format(here=HERE)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["caches"] == ["miss (new key)"] * 2 and cold["lowered"] == 2
    assert warm["caches"] == ["hit"] * 2 and warm["lowered"] == 0, warm
    assert warm["stats"] == {"hits": 2}
    assert warm["guards"] == cold["guards"] and warm["guards"]
    # the warm process runs each wrapper from the code the cold one compiled and stored
    assert cold["wrapper compiles"] == 2 and warm["wrapper compiles"] == 0


def test_a_wrapper_code_object_for_another_file_or_broken_is_compiled_again(
    cache, tmp_path, monkeypatch, caplog
):
    from stoker_triton._internal.modcache import modules

    src = "def make_call(launchers, consts):\n    return 42\n"
    sha, path = modules.store_module("wrappers", src)
    calls = []
    monkeypatch.setattr(
        modules, "compile", lambda *a: (calls.append(a[1]), compile(*a))[1], raising=False
    )
    code = modules.cached_code("wrappers", sha, path, src)
    assert calls == [str(path)]
    assert modules.cached_code("wrappers", sha, path, src) is not code  # loaded, not compiled
    assert calls == [str(path)]
    ns: dict[str, object] = {}
    exec(modules.cached_code("wrappers", sha, path, src), ns)
    assert ns["make_call"]([], {}) == 42  # type: ignore[operator]
    # the cache directory moved: the stored code names the old file
    moved = tmp_path / "elsewhere.py"
    assert modules.cached_code("wrappers", sha, moved, src).co_filename == str(moved)
    assert calls == [str(path), str(moved)]
    # a broken entry: warned, compiled again, rewritten
    store = modules.code_store()
    entry = store.path(f"wrappers-{sha}")
    entry.write_bytes(entry.read_bytes()[:-5])
    with caplog.at_level(logging.WARNING, logger="stoker.cache"):
        assert modules.cached_code("wrappers", sha, moved, src).co_filename == str(moved)
    assert len(calls) == 3 and any(str(entry) in r.getMessage() for r in caplog.records)
    assert modules.cached_code("wrappers", sha, moved, src) is not None and len(calls) == 3


def test_switched_off_it_neither_reads_nor_writes(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_TRITON_GRAPH_CACHE", "0")
    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))
    assert _static(_mlp, *args).report.cache == ""
    assert _static(_mlp, *args).report.cache == "" and len(cache) == 2
    assert not (tmp_path / "triton" / "graphs").exists()
    assert graphcache.enabled() is False


def test_nested_outputs_and_constants_on_a_hit(cache):
    """The output structure comes from the entry; constants from the caller's module."""

    def f(x):
        return {"a": x.sin(), "b": [x * 2, x.sum()]}

    x = torch.randn(4, 8)
    gm = trace(f, x)
    gm.register_buffer("scale", torch.full((8,), 3.0))
    g = gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        c = g.get_attr("scale")
        c.meta["val"] = gm.scale
        a = out.args[0]["a"]
        m = g.call_function(torch.ops.aten.mul.Tensor, (a, c))
        m.meta["val"] = torch.empty(4, 8)
    out.args = ({"a": m, "b": out.args[0]["b"]},)
    gm.recompile()
    cold = compile_graph(gm, [x])
    gm.scale.fill_(5.0)  # read at the call, not baked in: a hit sees the new value
    warm = compile_graph(gm, [x])
    assert warm.report.cache == "hit" and len(cache) == 1
    y = torch.randn(4, 8)
    want = {"a": y.sin() * 5, "b": [y * 2, y.sum()]}
    for fn in (cold, warm):
        got = fn(y)
        assert isinstance(got, dict) and isinstance(got["b"], list)
        assert_same([got["a"], *got["b"]], [want["a"], *want["b"]])
