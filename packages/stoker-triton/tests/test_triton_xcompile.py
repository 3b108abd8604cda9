"""Cross-compilation for a GPU target with Triton's real compiler, without a GPU."""

import os
import textwrap
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from triton_helpers import check

from stoker_triton import compile_graph
from stoker_triton._internal.compile import xcompile

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="cross-compiling checks the interpreter's kernels; a GPU run compiles them natively",
)


def test_every_kernel_and_config_is_compiled_for_the_target(monkeypatch):
    monkeypatch.setenv(xcompile.ENV, "cuda:90,cuda:80")
    before = xcompile.compiled_count
    x = torch.randn(24, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    idx = torch.randint(0, 24, (7,))

    def f(x, w, idx):
        y = F.layer_norm(x, (40,), w).relu()
        e = F.embedding(idx, y)  # gather forward, scatter-add (atomics) backward
        return torch.autograd.grad((e * 1.5).sum() + y.softmax(-1).amax(), [x, w])

    check(f, x, w, idx, atol=1e-4, rtol=1e-4)
    # each kernel x the configuration its GPU launch uses x two targets, all compiled to cubin
    assert xcompile.compiled_count - before >= 2 * 2


def _kernel_file(tmp_path, name, source):
    """A kernel module as the launching process stores it (a checked cache entry)."""
    from stoker_shapes import DiskCache
    from stoker_triton._internal.runtime import MODULE_FORMAT

    return DiskCache(tmp_path, "kernels", MODULE_FORMAT, ".py").put(name, source.encode())


def test_a_kernel_the_compiler_rejects_names_its_file(tmp_path, monkeypatch):
    monkeypatch.setenv(xcompile.ENV, "cuda:90")
    path = _kernel_file(
        tmp_path,
        "bad_kernel",
        textwrap.dedent(
            """
            import triton
            import triton.language as tl

            @triton.jit
            def kernel(ptr_a, ptr_b, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
                i = tl.arange(0, XBLOCK)
                v = tl.load(ptr_a + i)
                tl.store(ptr_b + i, tl.dot(v, v))  # tl.dot needs 2-D blocks
            """
        ),
    )
    a = torch.randn(64)
    with pytest.raises(xcompile.CrossCompileError, match=r"bad_kernel\.py.*cuda:90.*XBLOCK=64"):
        xcompile.check(str(path), [a, a.clone(), 64, 1], [(64, 1, 4)])


def test_compile_workers_never_import_torch(tmp_path, monkeypatch):
    # A worker imports Triton and `xcompile` only: a fraction of a second here, where
    # importing torch took 3.5 s (on the H100, whose Python had no bytecode cache,
    # sixteen workers did that at once before the first precompile). Failed before:
    # the package's __init__ and xcompile imported torch.
    monkeypatch.setenv(xcompile.ENV, "cuda:90")
    path = _kernel_file(
        tmp_path,
        "copy_kernel",
        textwrap.dedent(
            """
            import triton
            import triton.language as tl

            @triton.jit
            def kernel(ptr_a, ptr_b, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
                i = tl.arange(0, XBLOCK)
                tl.store(ptr_b + i, tl.load(ptr_a + i, i < xnumel) * 2, i < xnumel)
            """
        ),
    )
    a = torch.randn(64, dtype=torch.bfloat16)
    assert xcompile.check(str(path), [a, a[1:], 63, 1], [(64, 1, 4), (64, 1, 8)]) == 2
    # the GPU precompile also builds Triton's launcher: never through Triton's active
    # driver, whose creation imports torch (6 s per worker on the H100, found there)
    ok, errors = xcompile.precompile([(str(path), [a, a, 64, 1], [(64, 1, 2)])], ("cuda", 90, 32))
    assert (ok, errors) == (1, [])
    pool = xcompile._executor()
    asked = [pool.submit("_torch_imported") for _ in range(4 * len(pool.threads))]
    assert not any(f.result(timeout=120) for f in asked)


def test_a_started_pool_starts_its_workers_before_any_job():
    # On a GPU the workers start when a graph's lowering begins, so their start
    # (importing Triton's compiler: seconds on the H100's Python) overlaps it.
    import time

    from stoker_triton._internal.compile.workers import Pool

    pool = Pool(2, start=True)
    try:
        deadline = time.monotonic() + 60
        while pool.started < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.started == 2  # no job submitted yet
        assert pool.submit("_torch_imported").result(timeout=120) is False
        assert pool.started == 2  # the job ran on a started worker
    finally:
        pool.shutdown(wait=True)
    lazy = Pool(2)
    time.sleep(0.2)
    assert lazy.started == 0
    lazy.shutdown(wait=True)


def test_workers_start_early_for_a_cold_cache_only(tmp_path, monkeypatch):
    # stoker's backend starts them before capture on a GPU; a cache that holds built
    # kernels is likely a warm start, which needs no worker at all
    import stoker_triton
    from stoker_triton._internal import runtime

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    started: list[int] = []
    monkeypatch.setattr(xcompile, "start_workers", lambda: started.append(1))
    cuda = torch.device("cuda")
    assert not stoker_triton.start_compile_workers(cuda)  # no driver here: not a GPU
    monkeypatch.setattr(runtime, "native_target", lambda d: ("cuda", 90, 32))
    assert stoker_triton.start_compile_workers(cuda) and started == [1]
    xcompile._markers().put("k", b"built\n")
    assert not stoker_triton.start_compile_workers(cuda) and started == [1]


def test_an_error_inside_a_jit_helper_names_its_reason(tmp_path, monkeypatch):
    # Triton reports it as a CompilationError at the call site; the reason
    # ("Cannot bitcast ...") is only in the exception's cause chain
    monkeypatch.setenv(xcompile.ENV, "cuda:90")
    path = _kernel_file(
        tmp_path,
        "bad_helper",
        textwrap.dedent(
            """
            import triton
            import triton.language as tl

            @triton.jit
            def _bits(x):
                return x.to(tl.uint32, bitcast=True)

            @triton.jit
            def kernel(ptr_a, ptr_b, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
                i = tl.arange(0, XBLOCK)
                tl.store(ptr_b + i, _bits(tl.load(ptr_a + i)))
            """
        ),
    )
    a = torch.randn(64, dtype=torch.float64)
    with pytest.raises(xcompile.CrossCompileError, match="Cannot bitcast data-type of size 64"):
        xcompile.check(str(path), [a, torch.empty(64, dtype=torch.int32), 64, 1], [(64, 1, 4)])


def test_the_gpu_build_of_a_kernel_is_what_is_compiled(tmp_path, monkeypatch):
    # Interpreter builds round to bfloat16 on the bits; that helper bitcasts
    # float32 and does not compile for a 16-bit value, which a GPU build's plain
    # cast takes. Cross-compiling must judge the module a GPU would load.
    from stoker_triton._internal.codegen.ops import PRELUDE_BF16

    monkeypatch.setenv(xcompile.ENV, "cuda:90")
    body = textwrap.dedent(
        """
        @triton.jit
        def kernel(ptr_a, ptr_b, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
            i = tl.arange(0, XBLOCK)
            tl.store(ptr_b + i, _to_bf16(tl.load(ptr_a + i)))
        """
    )
    head = "import triton\nimport triton.language as tl\n"
    interp = head + PRELUDE_BF16["interpret"] + body
    path = _kernel_file(tmp_path, "interp_kernel", interp)
    a = torch.randn(64).to(torch.bfloat16)
    assert xcompile.check(str(path), [a, a.clone(), 64, 1], [(64, 1, 4)]) == 1
    native = xcompile.gpu_source(interp)
    assert PRELUDE_BF16["interpret"] not in native and PRELUDE_BF16["native"] in native
    assert xcompile.gpu_source(native) == native  # a GPU build is its own


def test_a_bad_target_spec_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(xcompile.ENV, "sm90")
    with pytest.raises(ValueError, match="cuda:<compute capability>"):
        xcompile.targets()


def test_signature_specializes_like_tritons_launcher():
    a = torch.empty(32, dtype=torch.bfloat16)
    sig, consts, attrs = xcompile.signature(
        ["p", "xnumel", "rnumel", "s0"], [a, 48, 1, 2**40], {"XBLOCK": 64, "RBLOCK": 1}
    )
    assert sig == {
        "p": "*bf16",
        "xnumel": "i32",
        "rnumel": "constexpr",
        "s0": "i64",
        "XBLOCK": "constexpr",
        "RBLOCK": "constexpr",
    }
    assert consts == {"XBLOCK": 64, "RBLOCK": 1, "rnumel": 1}
    assert attrs[(1,)] == [["tt.divisibility", 16]] and (3,) in attrs  # 48 and 2**40 % 16 == 0


_SAME_KEY = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from stoker_triton._internal.compile import xcompile as xc
path = sys.argv[1]
fn = xc._native_module(path).kernel
backend = triton.compiler.make_backend(GPUTarget("cuda", 90, 32))
real = [torch.randn(48), torch.randn(64)[1:49], 48, 1]
kw = {"XBLOCK": 64, "RBLOCK": 1, "num_warps": 4}
a, ao = xc._source(fn, real, kw, backend)
b, bo = xc._source(fn, [xc._stand_in(xc._arg_spec(x)) for x in real], kw, backend)
assert a.hash() == b.hash() and ao.hash() == bo.hash(), (a.attrs, b.attrs)
print("same key")
"""


def test_gpu_precompile_builds_what_the_launch_will_look_up(tmp_path, monkeypatch):
    # Workers compile from a description of the launch arguments; the key they
    # compile under must be the one Triton's launcher computes from the real ones.
    import subprocess
    import sys

    path = _kernel_file(
        tmp_path,
        "k",
        textwrap.dedent(
            """
            import triton
            import triton.language as tl

            @triton.jit
            def kernel(ptr_a, ptr_b, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
                i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
                m = i < xnumel
                tl.store(ptr_b + i, tl.load(ptr_a + i, m) * 2, m)
            """
        ),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _SAME_KEY, str(path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "same key" in proc.stdout, proc.stderr[-2000:]

    # and the workers fill Triton's disk cache for the target, every config
    xcompile._executor().shutdown(wait=True)  # new workers see the cache dir below
    xcompile._pool = None
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    args = [torch.randn(48), torch.randn(64)[1:49], 48, 1]
    ok, errors = xcompile.precompile(
        [(str(path), args, [(64, 1, 4), (128, 1, 8)])], ("cuda", 90, 32)
    )
    assert (ok, errors) == (2, [])
    assert len(list((tmp_path / "cache").rglob("*.cubin"))) == 2
    xcompile._executor().shutdown(wait=True)
    xcompile._pool = None  # later tests start workers with the usual cache dir


def test_precompile_jobs_describe_their_arguments_inside_a_fake_mode(monkeypatch):
    # Found on the H100: a forward graph compiles inside a FakeTensorMode, where the
    # jobs' example tensors came out fake, reading their address raised, and the
    # whole precompile was skipped: all 25 gpt-m forward kernels compiled at their
    # launches, one after another, in the main process.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stoker_triton._internal import pipeline

    seen: list[list[Any]] = []

    def record(make_jobs, device):
        jobs = make_jobs()
        # no tensor at all: under a fake mode it is fake (torch 2.11 raises on its
        # address; 2.13 warns and reads 0)
        assert not any(isinstance(a, torch.Tensor) for _l, args, _x, _r in jobs for a in args)
        seen.extend([xcompile._arg_spec(a) for a in args] for _lau, args, _x, _r in jobs)
        return 0

    monkeypatch.setattr(pipeline, "precompile", record)
    x = torch.randn(8, 16)
    gm = make_fx(
        lambda x: torch.softmax(x * 2, -1), decomposition_table=core_aten_decompositions()
    )(x)
    with FakeTensorMode():  # as stoker-capture compiles a forward: fake inputs, fake mode on
        compile_graph(gm, [torch.empty(8, 16)])
    assert seen == [[("tensor", "float32", True), ("tensor", "float32", True), 8, 16]], seen


_SCRIPT_WITHOUT_MAIN_GUARD = """
import os
os.environ["TRITON_INTERPRET"] = "1"
os.environ["STOKER_TRITON_CHECK_TARGETS"] = "cuda:90"
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from stoker_triton import compile_graph
from stoker_triton._internal.compile import xcompile

x = torch.randn(8, 16)
gm = make_fx(lambda x: torch.softmax(x * 2, -1), decomposition_table=core_aten_decompositions())(x)
out = compile_graph(gm, [x])(x)
torch.testing.assert_close(out, torch.softmax(x * 2, -1))
print("workers:", xcompile._pool.mode, xcompile._pool.fallback, xcompile._pool.zygote.forks)
print("script body ran; cross-compiles:", xcompile.compiled_count)
"""


def test_workers_do_not_rerun_a_script_without_a_main_guard(tmp_path):
    # multiprocessing's spawn would import this script again in every worker
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT_WITHOUT_MAIN_GUARD)
    env = {**os.environ, "STOKER_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("script body ran")]
    assert len(lines) == 1 and int(lines[0].rsplit(" ", 1)[1]) >= 1, proc.stdout
    # the workers were forked from the zygote (a fresh interpreter: no script there either)
    mode = next(ln for ln in proc.stdout.splitlines() if ln.startswith("workers:")).split()
    assert mode[1:3] == ["fork", "None"] and int(mode[3]) >= 1, proc.stdout
