"""Each kernel is compiled once: by the parallel precompile, never again at its launch.

On the CPU, a stand-in CUDA driver (`stoker_triton._internal.fakegpu`: targets
sm_90, loads and launches nothing) lets Triton's real launch path run in a new process with
``TRITON_INTERPRET=0``: binding, specialization, the cache key, the disk-cache
lookup. Triton's compilation listener tells a compile (cache miss) from a load.
Then one configuration per kernel (heuristics) unless ``max_autotune``.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from triton_helpers import run_on_fake_gpu

from stoker_triton._internal import runtime
from stoker_triton._internal.compile import xcompile

_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from triton import knobs
from triton.runtime.jit import JITFunction

from stoker_triton._internal.fakegpu import install

install()
runs = []
_run = JITFunction.run
JITFunction.run = lambda self, *a, **k: runs.append(1) or _run(self, *a, **k)
events = []
knobs.compilation.listener = lambda **kw: events.append(kw["cache_hit"])

from stoker_shapes import Dim, ShapeContext, Source
from stoker_triton import compile_graph
from stoker_triton._internal import pipeline, runtime

runtime.native_target = lambda device: ("cuda", 90, 32)  # CPU tensors stand in for the GPU's
if sys.argv[1] == "no-precompile":
    pipeline.precompile = lambda make_jobs, device: 0


def f(x, w, b):
    h = torch.nn.functional.layer_norm(x @ w, (w.shape[1],)) * 2 + b
    return torch.softmax(h.relu(), -1), h.sum(0), torch.nn.functional.dropout(h, 0.5)


args = [torch.randn(64, 32), torch.randn(32, 48), torch.randn(48)]
if sys.argv[2] == "static":
    gm = make_fx(f, decomposition_table=core_aten_decompositions())(*args)
    fn = compile_graph(gm, args)
else:  # a symbolic batch: precompiled at the shape env's hints
    ctx = ShapeContext(policy="dynamic")
    fakes = [ctx.fakeify(a, Source.arg(i), dynamic=d)
             for i, (a, d) in enumerate(zip(args, [{0: Dim("b", max=512)}, None, None]))]
    with ctx.tracing():
        gm = make_fx(f, decomposition_table=core_aten_decompositions())(*fakes)
    fn = compile_graph(gm, fakes)
assert not events, events  # compiling the graph compiled nothing in this process
for _ in range(3):  # new random seeds each call: still one binary per kernel
    fn(*args)
# later calls launch without the binder; binaries recorded by an earlier process, never
from stoker_triton._internal.runtime import warmload
warm = warmload.stats.get("hits", 0)
assert len(runs) == len(fn.report.kernels) - warm, (runs, warmload.stats)
from stoker_triton._internal.compile import xcompile
started = int(xcompile._pool is not None)
if started:  # forked from the zygote, not one interpreter per worker
    assert xcompile._pool.mode == "fork" and xcompile._pool.fallback is None, xcompile._pool.fallback
    assert xcompile._pool.zygote.forks >= 1
print("RESULT", len(fn.report.kernels), events.count(False), events.count(True), started, warm)
"""


def _run_full(tmp_path: Path, mode: str, shapes: str) -> tuple[int, int, int, int, int]:
    """(kernels, Triton compiles, Triton cache loads, workers started, warm-loaded binaries)."""
    out = run_on_fake_gpu(tmp_path, _SCRIPT, mode, shapes, name="launch")
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    kernels, compiled, loaded, started, warm = (int(v) for v in line.split()[1:])
    return kernels, compiled, loaded, started, warm


def _run(tmp_path: Path, mode: str, shapes: str) -> tuple[int, int, int]:
    return _run_full(tmp_path, mode, shapes)[:3]


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_the_launch_loads_what_the_precompile_built(tmp_path: Path, shapes: str) -> None:
    kernels, compiled, loaded, started, warm = _run_full(tmp_path, "precompile", shapes)
    assert kernels >= 3 and started and warm == 0
    assert compiled == 0 and loaded == kernels, (kernels, compiled, loaded)
    if shapes == "static":
        # a second process with the same caches (a warm start) starts no compile workers:
        # on an H100 that start cost a warm gpt-m many seconds before these markers;
        # and it launches the binaries the first one recorded, asking Triton for none
        again = _run_full(tmp_path, "precompile", shapes)
        assert again == (kernels, 0, 0, 0, kernels), again


def test_without_the_precompile_the_launch_compiles(tmp_path: Path) -> None:
    # the control: the count above can fail
    kernels, compiled, loaded = _run(tmp_path, "no-precompile", "static")
    assert compiled == kernels and loaded == 0, (kernels, compiled, loaded)


def test_one_configuration_per_kernel_unless_max_autotune() -> None:
    for red, pers, x, r in [
        (False, False, 1 << 20, 1),
        (True, True, 4096, 512),
        (True, False, 64, 1 << 16),
    ]:
        lau = runtime.Launcher(None, "sha", red, pers, has_atomics=False)
        assert lau.candidates(x, r, native=True) == [lau.heuristic(x, r)]
        tuned = runtime.Launcher(None, "sha", red, pers, has_atomics=False, autotune=True)
        cands = tuned.candidates(x, r, native=True)
        assert len(cands) > 1 and cands[0] == lau.heuristic(x, r)
        assert len(set(cands)) == len(cands)
    atomics = runtime.Launcher(None, "sha", False, False, has_atomics=True, autotune=True)
    assert len(atomics.candidates(1 << 20, 1, native=True)) == 1  # re-running it would add twice


def test_heuristic_configs_fit_a_block() -> None:
    for red, pers in [(False, False), (True, True), (True, False)]:
        lau = runtime.Launcher(None, "sha", red, pers, has_atomics=False)
        for x in (1, 3, 100, 1 << 20):
            for r in (1, 7, 512, 4096) if red else (1,):
                xb, rb, w = lau.heuristic(x, r)
                assert xb * rb <= 8192 and w in (4, 8)
                if pers:
                    assert rb >= r  # a persistent reduction holds its whole row


def test_seeds_keep_one_specialization() -> None:
    torch.manual_seed(0)
    seeds = [runtime.new_seed() for _ in range(2000)]
    assert all(s % 2 == 1 and s > 1 and s < 2**31 for s in seeds)
    assert runtime.PRECOMPILE_SEED % 2 == 1 and runtime.PRECOMPILE_SEED > 1
    torch.manual_seed(0)
    assert runtime.new_seed() == seeds[0]  # reproducible


def test_every_core_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    quota = xcompile.cgroup_cpus()
    cores = len(os.sched_getaffinity(0))
    assert xcompile.cpu_count() == (cores if quota is None else min(cores, quota))
    # and the pool has one worker per core
    from stoker_triton._internal.compile import workers

    made: list[int] = []

    class Pool:
        def __init__(self, n: int, start: bool = False) -> None:
            made.append(n)

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(workers, "Pool", Pool)
    monkeypatch.setattr(xcompile, "_pool", None)
    xcompile._executor()
    assert made == [xcompile.cpu_count()]


@pytest.mark.gpu
def test_no_compile_at_the_launch_on_a_gpu(tmp_path: Path, monkeypatch) -> None:
    """The real path: precompiled in workers, loaded (never compiled) by the launches."""
    import triton
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton import compile_graph

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    xcompile._executor().shutdown(wait=True)  # new workers see the cache dir
    xcompile._pool = None
    events: list[bool] = []
    monkeypatch.setattr(
        triton.knobs.compilation, "listener", lambda **kw: events.append(kw["cache_hit"])
    )

    def f(x, w):
        return torch.softmax((x @ w).relu() * 2, -1), (x @ w).sum(0)

    args = [torch.randn(256, 64, device="cuda"), torch.randn(64, 96, device="cuda")]
    fn = compile_graph(make_fx(f, decomposition_table=core_aten_decompositions())(*args), args)
    out = fn(*args)
    torch.testing.assert_close(out[0], f(*args)[0], rtol=1e-4, atol=1e-5)
    assert events.count(False) == 0 and events.count(True) == len(fn.report.kernels), events
    # this process has CUDA up: the workers were forked by the zygote, a fresh interpreter
    pool = xcompile._executor()
    assert pool.mode == "fork" and pool.fallback is None and pool.zygote.forks >= 1
    xcompile._executor().shutdown(wait=True)
    xcompile._pool = None


class _Recorded(Future):  # type: ignore[type-arg]
    """A compile job's future that records whether a launch waited for it."""

    waited = False

    def result(self, timeout: float | None = None) -> Any:
        self.waited = True
        return super().result(timeout)


def test_compiling_a_graph_does_not_wait_for_its_precompile(monkeypatch) -> None:
    # Found reading a cold start: `compile_graph` waited for every kernel of the graph
    # to compile in the workers, so a forward's compiles held up the lowering of its
    # backward, and the first launch waited for the last kernel. Now it queues them
    # and returns; each kernel's first launch waits for its own compiles only.
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton import compile_graph

    queued: list[tuple[str, _Recorded]] = []

    def submit(work: Any, target: Any) -> dict[str, list[Future[Any]]]:
        out: dict[str, list[Future[Any]]] = {}
        for path, _args, configs in work:
            for _cfg in configs:
                fut = _Recorded()
                queued.append((path, fut))
                out.setdefault(path, []).append(fut)
        return out

    monkeypatch.setattr(runtime, "native_target", lambda device: ("cuda", 90, 32))
    monkeypatch.setattr(xcompile, "submit_precompile", submit)

    def f(x: torch.Tensor) -> Any:
        return torch.softmax(x * 2, -1), (x + 1).sum(0)

    x = torch.randn(8, 16)
    fn = compile_graph(make_fx(f, decomposition_table=core_aten_decompositions())(x), [x])
    assert len({p for p, _ in queued}) >= 2 and not any(q.done() for _, q in queued)
    for _, q in queued:
        q.set_result(None)  # the workers finish
    out = fn(x)
    torch.testing.assert_close(out[0], f(x)[0])
    torch.testing.assert_close(out[1], f(x)[1])
    assert all(q.waited for _, q in queued)  # each launch waited for its kernel's compile


def test_each_kernel_is_queued_as_soon_as_it_is_loaded(monkeypatch) -> None:
    # The workers sat idle while the main process loaded every kernel module of a
    # graph (0.76 s for gpt-m's forward on the H100) and then queued all of them; now
    # each kernel's compiles are queued right after its module is loaded.
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton import compile_graph
    from stoker_triton._internal import pipeline
    from stoker_triton._internal.modcache import modules

    events: list[str] = []
    load_module, store_module = pipeline.load_module, modules.store_module

    def load(kind: str, src: str) -> Any:
        events.append(f"load {kind}")
        return load_module(kind, src)

    def store(kind: str, src: str) -> Any:
        events.append(f"store {kind}")
        return store_module(kind, src)

    def queue(make_jobs: Any, device: Any) -> int:
        events.append(f"queue {len(make_jobs())}")
        return 0

    monkeypatch.setattr(pipeline, "load_module", load)
    monkeypatch.setattr(modules, "store_module", store)
    monkeypatch.setattr(pipeline, "precompile", queue)

    def f(x: torch.Tensor) -> Any:
        return torch.softmax(x * 2, -1), (x + 1).sum(0), x.relu().amax(-1)

    x = torch.randn(8, 16)
    fn = compile_graph(make_fx(f, decomposition_table=core_aten_decompositions())(x), [x])
    n = len(fn.report.kernels)
    assert n >= 2
    assert events == ["store kernels", "queue 1"] * n + ["load wrappers", "store wrappers"], events


def test_a_kernel_module_is_imported_at_its_first_launch(monkeypatch, tmp_path) -> None:
    # Importing a kernel module runs `triton.jit` on its kernel and on each of its
    # prelude's ~34 helpers (gpt-m's cold first step made 2453 JITFunctions, ~2 CPU s);
    # a graph compiled in the first step may first run in the second (compiled
    # autograd's backward), so the cold path stores the module and imports it at
    # the kernel's first launch.
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx
    from triton.runtime import jit

    from stoker_triton import compile_graph

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    made: list[str] = []
    init = jit.JITFunction.__init__

    def counted(self: Any, fn: Any, *a: Any, **k: Any) -> None:
        made.append(fn.__name__)
        init(self, fn, *a, **k)

    monkeypatch.setattr(jit.JITFunction, "__init__", counted)

    def f(x: torch.Tensor) -> Any:  # constants no other test uses: modules not imported yet
        return torch.softmax(x * 7.125, -1), (x - 0.375).sum(0)

    x = torch.randn(8, 16)
    fn = compile_graph(make_fx(f, decomposition_table=core_aten_decompositions())(x), [x])
    n = len(fn.report.kernels)
    assert n >= 2 and made == []  # stored, none imported
    out = fn(x)
    # each imported once, at its launch (kernels are named by their source: `stoker_...`)
    assert made.count("kernel") == 0
    assert sorted(m for m in made if m.startswith("stoker_")) == sorted(
        k.fn_name for k in fn.report.kernels
    )
    torch.testing.assert_close(out[0], f(x)[0])
    torch.testing.assert_close(out[1], f(x)[1])
    made.clear()
    fn(x)
    assert made == []


def test_a_kernel_shared_by_two_graphs_compiles_once(monkeypatch, tmp_path) -> None:
    # A model's graphs share kernels (its layers in a forward and a backward, the
    # backward compiled autograd captures): kernel modules are keyed by their source,
    # and a compile queued or done for one (path, arguments, target, config) is not
    # queued again, by any graph.
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton import compile_graph

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STOKER_TRITON_GRAPH_CACHE", "0")  # the second graph compiles too
    jobs: list[str] = []

    class Pool:
        def submit(self, fn: str, path: str, *a: Any) -> Future[Any]:
            jobs.append(path)
            return Future()  # still running while the second graph queues

    monkeypatch.setattr(runtime, "native_target", lambda device: ("cuda", 90, 32))
    monkeypatch.setattr(xcompile, "_executor", lambda start=False: Pool())
    monkeypatch.setattr(xcompile, "_built_before", lambda key: False)

    def f(x: torch.Tensor) -> Any:
        return torch.softmax(x * 5.5, -1)

    def g(x: torch.Tensor, y: torch.Tensor) -> Any:  # f's kernel and one of its own
        return torch.softmax(x * 5.5, -1), (y - 2.5).amax(0)

    x, y = torch.randn(8, 16), torch.randn(4, 8)
    decomp = core_aten_decompositions()
    one = compile_graph(make_fx(f, decomposition_table=decomp)(x), [x])
    two = compile_graph(make_fx(g, decomposition_table=decomp)(x, y), [x, y])
    paths = [k.path for k in (*one.report.kernels, *two.report.kernels)]
    assert len(paths) == 3 and len(set(paths)) == 2, paths  # one kernel in both graphs
    assert sorted(jobs) == sorted(set(paths)), jobs  # compiled once
