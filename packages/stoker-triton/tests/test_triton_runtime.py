"""Extern fallback, the report, debug output, the disk cache, buffer reuse, the light import."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_helpers import check, trace

from stoker_triton import CompileReport, compile_graph


def test_unlowered_op_falls_back_to_aten_logged_once_and_counted(caplog):
    x = torch.randn(4, 6)

    def f(x):
        a = torch.ops.aten.cumsum(x, 1)  # no lowering: an extern aten call
        b = torch.ops.aten.cumsum(a * 2, 0)
        return (a.sin(), b + 1)

    with caplog.at_level(logging.INFO, logger="stoker.kernels"):
        fn = check(f, x, rtol=1e-4)
    assert fn.report.fallback_ops == {"aten.cumsum.default": 2}
    msgs = [r.getMessage() for r in caplog.records if "cumsum" in r.getMessage()]
    assert len(msgs) == 1, msgs


def test_a_caller_autocast_region_does_not_reach_the_extern_calls():
    # The graph's dtypes are decided when it is traced; an autocast region around
    # the call used to turn the extern fp32 matmul into a bf16 one written into an
    # fp32 buffer (NaN and garbage). Calls outside a region keep the fast path.
    a, b = torch.randn(8, 8), torch.randn(8, 8)

    def f(a, b):
        return (a @ b).relu() + 1

    fn = compile_graph(trace(f, a, b), [a, b])
    ref = f(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(a, b)
        assert torch.is_autocast_enabled("cpu")  # the caller's region is left as it was
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(fn(a, b), ref)


def test_report_contents_and_debug_print(capsys):
    x = torch.randn(4, 8)
    fn = compile_graph(trace(lambda x: torch.softmax(x, -1) + x.sum(), x), [x], debug=True)
    r = fn.report
    assert isinstance(r, CompileReport)
    assert set(r.timings_ms) >= {"prepare", "lower", "schedule", "codegen", "load"}
    assert r.fusion_groups and all(r.fusion_groups)
    err = capsys.readouterr().err
    assert "=== stoker-triton IR ===" in err and "@triton.jit" in err and "def call(args)" in err
    assert "kernel" in str(r)


def test_debug_env_var(capsys, monkeypatch):
    monkeypatch.setenv("STOKER_TRITON_DEBUG", "1")
    x = torch.randn(3)
    compile_graph(trace(lambda x: x + 1, x), [x])
    assert "=== wrapper ===" in capsys.readouterr().err


def test_sources_are_cached_on_disk_by_content():
    x = torch.randn(5, 5)
    fn1 = compile_graph(trace(lambda x: x.cos() * 3, x), [x])
    fn2 = compile_graph(trace(lambda x: x.cos() * 3, x), [x])
    p1, p2 = fn1.report.kernels[0].path, fn2.report.kernels[0].path
    assert p1 == p2 and Path(p1).exists()
    assert str(Path(p1)).startswith(os.environ["STOKER_CACHE_DIR"])
    from stoker_triton._internal.runtime import module_store

    stored = module_store("wrappers").read_valid(fn1.report.wrapper_path)
    assert stored.decode() == fn1.wrapper_source


def test_intermediate_buffers_freed_or_reused():
    x = torch.randn(6, 6)

    def f(x):
        a = torch.ops.aten.cumsum(x, 0)  # extern: forces realized inputs/outputs
        b = torch.ops.aten.cumsum(a.exp(), 0)
        c = torch.ops.aten.cumsum(b.sin(), 0)
        return (c.cos(),)

    fn = check(f, x, rtol=1e-4, atol=1e-5)
    src = fn.wrapper_source
    assert "del " in src or "# reuse" in src, src


def test_internal_buffers_never_stored():
    x = torch.randn(4, 16)
    fn = check(lambda x: torch.softmax(x, -1), x)
    assert fn.report.kernels[0].source.count("tl.store") == 1
    assert fn.wrapper_source.count("empty_strided(") == 1


def test_wrong_input_strides_are_relaid_not_misread():
    x = torch.randn(4, 6)
    fn = compile_graph(trace(lambda x: x * 2, x), [x])
    xt = torch.randn(6, 4).t()  # same shape, other strides
    torch.testing.assert_close(fn(xt), xt * 2)


def test_an_extern_graph_runs_without_grad_and_leaves_grad_mode_as_it_was():
    """The wrapper switches grad mode off around its aten calls by torch's C functions
    (no context-manager object per call): it must restore it, also when the call fails."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    fn = compile_graph(trace(lambda a, b: (a @ b).relu(), a, b), [a, b])
    assert "empty_strided(" in fn.wrapper_source and "if arg" in fn.wrapper_source
    a.requires_grad_(True)
    out = fn(a, b)
    assert not out.requires_grad and torch.is_grad_enabled()
    torch.testing.assert_close(out, (a @ b).relu().detach())
    with torch.no_grad():
        torch.testing.assert_close(fn(a, b), (a @ b).relu())
        assert not torch.is_grad_enabled()
    try:
        fn(a, torch.randn(8, 9))  # relaid into (8, 8): the copy fails inside the call
        raise AssertionError("a (8, 9) input must not run")
    except RuntimeError:
        pass
    assert torch.is_grad_enabled()


def test_import_does_not_import_triton():
    code = "import sys, stoker_triton; assert 'triton' not in sys.modules, 'triton imported'; print('ok')"
    env = {**os.environ, "STOKER_TEST_FRESH_PROCESS": "1"}  # not forked with Dynamo imported
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, env=env
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_the_compile_workers_import_no_torch():
    """What the zygote imports before it forks the workers (`xcompile.import_compiler`,
    the package's `__init__` included) must not import torch: torch starts a thread,
    and the zygote refuses to fork a process with one; the workers then start as
    interpreters that each import Triton and torch (10 CPU s each here)."""
    code = (
        "import os, sys\n"
        "from stoker_triton._internal.compile import xcompile\n"
        "xcompile.import_compiler()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert len(os.listdir('/proc/self/task')) == 1, 'a second thread'\n"
        "print('ok')\n"
    )
    # a process that starts as a fresh interpreter, not from the tests' preloaded torch
    env = {**os.environ, "TRITON_INTERPRET": "0", "STOKER_TEST_FRESH_PROCESS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, env=env
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_scalar_and_none_outputs():
    x = torch.randn(3, 4)
    gm = trace(lambda x: (x + 1, None, 3), x)
    fn = compile_graph(gm, [x])
    out = fn(x)
    torch.testing.assert_close(out[0], x + 1)
    assert out[1] is None and out[2] == 3


def test_autotune_results_persist_on_disk(tmp_path, monkeypatch):
    from stoker_triton._internal import runtime

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime._Tuned, "data", {})
    runtime._Tuned.put("abc", "1024,1", [512, 1, 4])
    monkeypatch.setattr(runtime._Tuned, "data", {})  # as a new process would
    assert runtime._Tuned.get("abc", "1024,1") == [512, 1, 4]
    assert (tmp_path / "triton" / "autotune" / "abc.json").exists()


@pytest.mark.parametrize("how", ["random bytes", "empty file", "truncated", "other triton"])
def test_a_broken_autotune_entry_is_a_miss_then_rewritten(tmp_path, monkeypatch, caplog, how):
    import triton

    from stoker_shapes._internal import diskcache
    from stoker_triton._internal import runtime

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(diskcache, "_warned", set())
    monkeypatch.setattr(runtime._Tuned, "data", {})
    runtime._Tuned.put("abc", "1024,1", [512, 1, 4])
    path = tmp_path / "triton" / "autotune" / "abc.json"
    good = path.read_bytes()
    path.write_bytes(
        {
            "random bytes": os.urandom(len(good)),
            "empty file": b"",
            "truncated": good[: len(good) // 2],
            "other triton": good.replace(
                f"-triton{triton.__version__} ".encode(), b"-triton0.0 ", 1
            ),
        }[how]
    )
    assert path.read_bytes() != good
    monkeypatch.setattr(runtime._Tuned, "data", {})  # as a new process would
    with caplog.at_level(logging.WARNING, logger="stoker.cache"):
        assert runtime._Tuned.get("abc", "1024,1") is None  # timed again
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(path) in warned[0], warned
    runtime._Tuned.put("abc", "1024,1", [256, 1, 8])
    monkeypatch.setattr(runtime._Tuned, "data", {})
    assert runtime._Tuned.get("abc", "1024,1") == [256, 1, 8]


def test_block_choice_under_the_interpreter_is_one_config():
    from stoker_triton._internal.runtime import Launcher

    lau = Launcher(None, "sha", is_reduction=True, persistent=True, has_atomics=False)
    lau.interpret = True  # as under TRITON_INTERPRET=1, also when this suite runs on a GPU
    cands = lau.candidates(100, 300)
    assert len(cands) == 1 and cands[0][1] == 512  # RBLOCK holds the whole row
    lau2 = Launcher(None, "sha", is_reduction=False, persistent=True, has_atomics=False)
    lau2.interpret = False
    assert len(lau2.candidates(1 << 20, 1)) == 1  # on a GPU: one heuristic config ...
    lau2.autotune = True
    assert len(lau2.candidates(1 << 20, 1)) > 1  # ... or, under max-autotune, configs to time


def test_complex_ops_run_through_aten():
    x = torch.randn(4, 3)
    fn = check(
        lambda x: (torch.view_as_real(torch.view_as_complex(x[:, :2].contiguous()) * 2) + 1,), x
    )
    assert fn.report.fallback_ops, str(fn.report)


def test_stage_checks_catch_a_broken_program():
    import pytest

    from stoker_triton._internal.ir import Load, PointwiseNode
    from stoker_triton._internal.lowering import lower_graph
    from stoker_triton._internal.verify import verify_program

    x = torch.randn(3, 4)
    gm = trace(lambda x: x.exp() + 1, x)
    program, _ = lower_graph(gm, [x], None, x.device)
    verify_program(program)  # a good program passes
    node = program.nodes[0]
    assert isinstance(node, PointwiseNode)
    program.nodes[0] = PointwiseNode(node.name, node.size, Load("nowhere", 0, torch.float32))
    with pytest.raises(AssertionError, match="unknown buffer nowhere"):
        verify_program(program)


def test_gpu_autotuner_picks_the_fastest_config_skips_broken_ones_and_remembers(
    tmp_path, monkeypatch
):
    # The GPU path of Launcher._choose, with a stub kernel and a stub timer:
    # no GPU here, but the selection logic is the one a GPU run uses.
    import triton.testing

    from stoker_triton._internal import runtime

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime._Tuned, "data", {})
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, XBLOCK, RBLOCK, num_warps):
                if XBLOCK == 2048:
                    raise RuntimeError("out of resources")  # a config that does not compile
                launched.append((grid, XBLOCK, RBLOCK, num_warps))

            return run

    cost = {1024: 3.0, 512: 2.0, 4096: 1.5}  # XBLOCK -> stub milliseconds

    def fake_bench(fn, warmup, rep):
        fn()
        return cost[launched[-1][1]]

    def native_launcher():
        lau = runtime.Launcher(
            Kernel(),
            "sha-x",
            is_reduction=False,
            persistent=False,
            has_atomics=False,
            autotune=True,
        )
        lau.interpret = False  # the GPU path
        lau.n_ptrs = 1
        return lau

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    lau = native_launcher()
    lau(object(), 1 << 20, 1)
    assert lau.configs[(1 << 20, 1)] == (4096, 1, 8)
    assert launched[-1] == (((1 << 20) // 4096,), 4096, 1, 8)  # the real launch, best config
    # a new process reads the choice from disk and benchmarks nothing
    monkeypatch.setattr(runtime._Tuned, "data", {})
    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **k: 1 / 0)
    lau2 = native_launcher()
    lau2(object(), 1 << 20, 1)
    assert lau2.configs[(1 << 20, 1)] == (4096, 1, 8)


def test_without_max_autotune_nothing_is_timed(tmp_path, monkeypatch):
    import triton.testing

    from stoker_triton._internal import runtime

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **k: 1 / 0)
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, XBLOCK, RBLOCK, num_warps: launched.append((XBLOCK, num_warps))

    lau = runtime.Launcher(
        Kernel(), "sha-y", is_reduction=False, persistent=False, has_atomics=False
    )
    lau.interpret = False
    lau.n_ptrs = 1
    lau(object(), 1 << 20, 1)
    assert launched == [lau.heuristic(1 << 20, 1)[::2]]
    assert not (tmp_path / "triton" / "autotune").exists()
