"""The compile worker pool: workers forked from a zygote, replaced when they die,
and plain subprocesses where the zygote cannot fork (`workers.py`, `zygote.py`)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker_triton._internal.compile import workers, xcompile, zygote
from stoker_triton._internal.compile.workers import Pool

_KERNEL = """
import triton
import triton.language as tl

@triton.jit
def kernel(ptr_a, ptr_b, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    m = i < xnumel
    tl.store(ptr_b + i, tl.sin(tl.load(ptr_a + i, m)) * {k}, m)
"""


def _kernels(tmp_path: Path, n: int) -> list[tuple[str, list[Any], list[tuple[int, int, int]]]]:
    from stoker_shapes import DiskCache
    from stoker_triton._internal.runtime import MODULE_FORMAT

    store = DiskCache(tmp_path, "kernels", MODULE_FORMAT, ".py")  # as the launching process's
    work = []
    for k in range(n):
        path = store.put(f"k{k}", _KERNEL.format(k=k + 2).encode())
        args = [torch.randn(100), torch.randn(100), 100, 1]
        work.append((str(path), args, [(128, 1, 4)]))
    return work


def _cubins(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*.cubin")}  # key/name


@pytest.fixture
def own_pool(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install pools of a test's own as xcompile's (the shared one stays as it was)."""
    made: list[Pool] = []

    def install(pool: Pool) -> Pool:
        made.append(pool)
        monkeypatch.setattr(xcompile, "_pool", pool)
        return pool

    yield install
    for p in made:
        p.shutdown(wait=True)


def test_forked_workers_build_the_binaries_subprocess_workers_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_pool: Any
) -> None:
    # the zygote's forks compile as the workers that each imported Triton did: the
    # same cubins, byte for byte, under the same names (Triton's cache keys)
    work = _kernels(tmp_path, 3)
    built = {}
    for mode in ("fork", "subprocess"):
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / mode))
        monkeypatch.setattr(xcompile, "_done", set())  # this process's "compiled already"
        pool = own_pool(Pool(2, env={workers.MODE_ENV: mode}))
        assert xcompile.precompile(work, ("cuda", 90, 32)) == (3, [])
        assert pool.mode == mode and pool.fallback is None
        if mode == "fork":
            assert pool.zygote.forks == pool.started >= 1
        else:  # each worker its own interpreter, as before the zygote
            assert pool.zygote is None and pool.started >= 1
        built[mode] = _cubins(tmp_path / mode)
    assert len(built["fork"]) == 3 and built["fork"] == built["subprocess"]


def test_a_worker_that_dies_fails_its_job_and_is_forked_again(
    tmp_path: Path, own_pool: Any
) -> None:
    pool = own_pool(Pool(1, start=True))
    assert pool.wait_ready(timeout=120) and pool.zygote.forks == 1
    # a kernel module whose import kills the worker in the middle of its job
    bad = tmp_path / "dies.py"
    source = "import os, sys\nsys.stderr.write('worker about to die\\n')\nos._exit(3)\n"
    bad.write_text(source)
    job = pool.submit("_compile_job", str(bad), source, [], {}, ("cuda", 90, 32))
    with pytest.raises(RuntimeError, match=r"a compile worker died: .*worker about to die"):
        job.result(timeout=120)
    assert pool.submit("_torch_imported").result(timeout=120) is False  # a new worker
    assert pool.zygote.forks == 2 and pool.fallback is None
    # one killed while idle is replaced before the next job, which does not fail
    os.kill(pool.pids[-1], signal.SIGKILL)
    _wait_dead(pool.pids[-1])
    assert pool.submit("_torch_imported").result(timeout=120) is False
    assert pool.zygote.forks == 3


def _wait_dead(pid: int) -> None:
    """Until `pid` has exited (a zombie until the zygote reaps it, or gone)."""
    for _ in range(600):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.05)
    raise AssertionError(f"worker {pid} still alive after SIGKILL")


def test_without_a_zygote_workers_start_as_subprocesses(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    own_pool: Any,
) -> None:
    # where os.fork does not exist (Windows), each worker imports Triton by itself,
    # as before the zygote; the reason is logged
    monkeypatch.delattr(os, "fork")
    work = _kernels(tmp_path, 2)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="stoker.kernels"):
        pool = own_pool(Pool(2))
        assert xcompile.precompile(work, ("cuda", 90, 32)) == (2, [])
    assert pool.fallback == "this platform has no os.fork"
    assert pool.zygote.forks == 0 and pool.started == 2
    assert "not forked: this platform has no os.fork" in caplog.text
    assert len(_cubins(tmp_path / "cache")) == 2


def test_a_zygote_that_fails_leaves_subprocess_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_pool: Any
) -> None:
    # the zygote's own start fails (here: it cannot import the compiler)
    def broken(self: zygote.Zygote) -> None:
        raise zygote.ZygoteError("the zygote could not import the compiler: test")

    monkeypatch.setattr(zygote.Zygote, "_start", broken)
    pool = own_pool(Pool(2))
    futs = [pool.submit("_torch_imported") for _ in range(4)]
    assert [f.result(timeout=120) for f in futs] == [False] * 4
    assert pool.fallback is not None and "could not import the compiler" in pool.fallback


_CHECKS = """
import os
import threading

os.environ["TRITON_INTERPRET"] = "0"  # as in the zygote (the interpreter loads numpy's threads)
from stoker_triton._internal.compile import xcompile
from stoker_triton._internal.compile.zygote import fork_refused

xcompile.import_compiler()  # what the zygote imports: fork allowed after it
print(repr(fork_refused()))
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
print(repr(fork_refused()))
stop.set()
t.join()
import torch  # may bring CUDA up (and starts no thread here)
print(repr(fork_refused()))
"""


def test_the_zygote_forks_only_single_threaded_without_cuda() -> None:
    import subprocess
    import sys

    # a fresh interpreter, not one forked from the tests' servers with torch imported
    env = {**os.environ, "STOKER_TEST_FRESH_PROCESS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHECKS], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    fresh, threaded, with_torch = proc.stdout.splitlines()[-3:]
    assert fresh == "None"
    assert "2 Python threads are running" in threaded
    assert with_torch != "None"  # torch's own threads, or torch itself


def test_the_zygote_process_is_single_threaded_and_torch_free(own_pool: Any) -> None:
    # what the zygote checks before each fork holds for the zygote itself: its forks
    # run (none would be forked otherwise) and none of them imported torch
    pool = own_pool(Pool(2, start=True))
    assert pool.wait_ready(timeout=120)
    assert pool.fallback is None and pool.zygote.forks == 2
    assert pool.submit("_torch_imported").result(timeout=120) is False


def test_workers_use_every_core_up_to_a_cgroup_quota(tmp_path: Path) -> None:
    assert xcompile.cpu_count() <= len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert xcompile.cgroup_cpus(v2) is None
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert xcompile.cgroup_cpus(v2) == 3
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert xcompile.cgroup_cpus(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    assert xcompile.cgroup_cpus(v1) == 4
    assert xcompile.cgroup_cpus(tmp_path / "none") is None


def test_a_bad_worker_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"STOKER_TRITON_WORKERS='threads'.*'fork'"):
        Pool(1, env={workers.MODE_ENV: "threads"})


_WARM = """
import os
os.environ["TRITON_INTERPRET"] = "0"
from triton.runtime.cache import triton_key
from stoker_triton._internal.compile import xcompile

xcompile.cpu_count = lambda: 1
assert triton_key.cache_info().currsize == 0
xcompile.start_workers()
xcompile._warming[0].join(timeout=300)
print("warm", triton_key.cache_info().currsize, xcompile._warming[0].name)
xcompile._executor().shutdown(wait=True)
"""


def test_starting_the_workers_warms_the_first_launch() -> None:
    # Found in a cold start's profile: the first launch in the main process computed
    # Triton's key of itself (a hash of its sources and libraries: 0.4-1.7 s here)
    # after every compile was done; now a thread computes it while the graph lowers.
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _WARM], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-3:] == ["warm", "1", "stoker-warm"], proc.stdout


def test_a_kernel_repeated_in_a_graph_compiles_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_pool: Any
) -> None:
    # A model's layers repeat their kernels (one module path, one specialization):
    # each was queued again while the first was still compiling (the workers'
    # "done" set is filled only when a compile ends), so identical compiles ran
    # side by side. Now the second launcher waits for the first one's job.
    (work,) = _kernels(tmp_path, 1)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    pool = own_pool(Pool(1))
    sent: list[str] = []
    submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda name, *a: sent.append(name) or submit(name, *a))
    before = xcompile.compiled_count
    pending = xcompile.submit_precompile([work, work, work], ("cuda", 90, 32))
    assert [f.result(timeout=300) for f in pending[work[0]]] == [None] * 3
    assert sent == ["_compile_job"] and xcompile.compiled_count == before + 1
