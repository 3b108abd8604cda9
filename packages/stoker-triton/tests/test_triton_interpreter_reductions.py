"""The test runs' whole-block reductions and scans for Triton's interpreter
(tests-support/interpreter_reductions.py, installed by the root conftest and, in the
processes the tests start, by tests-support/sitecustomize.py)
give what Triton's own element loops give, on stoker's combine functions."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from stoker_triton._internal.codegen.ops import PRELUDE, PRELUDE_BF16

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="replaces a path of Triton's interpreter; native kernels never take it",
)

# stoker's combine functions (`PRELUDE`, as every kernel module defines them) in reductions
# and a scan of every form the interpreter takes: along rows and columns, kept dims, whole
# block, tuples (Welford)
_KERNELS = """
import triton
import triton.language as tl
{prelude}

@triton.jit
def reductions(x_ptr, mx_ptr, mn_ptr, pr_ptr, mean_ptr, m2_ptr, all_ptr, R: tl.constexpr, C: tl.constexpr):
    rows = tl.arange(0, R)
    x = tl.load(x_ptr + rows[:, None] * C + tl.arange(0, C)[None, :])
    tl.store(mx_ptr + rows, tl.reduce(x, 1, _max_nan))
    tl.store(mn_ptr + tl.arange(0, C), tl.reduce(x, 0, _min_nan))
    tl.store(pr_ptr + rows[:, None], tl.reduce(x, 1, _prod_combine, keep_dims=True))
    w = tl.full(x.shape, 1.0, tl.float32)
    mean, m2, _ = tl.reduce((x, tl.zeros_like(x), w), 1, _welford_combine)
    tl.store(mean_ptr + rows, mean)
    tl.store(m2_ptr + rows, m2)
    tl.store(all_ptr, tl.reduce(x, None, _max_nan))


@triton.jit
def scan(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(out_ptr + offs, tl.associative_scan(tl.load(x_ptr + offs), 1, _max_nan))
"""


SUPPORT = Path(__file__).resolve().parents[3] / "tests-support"


def _module(name, path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


@pytest.fixture(scope="module")
def mods(tmp_path_factory):
    fast = _module("interpreter_reductions", SUPPORT / "interpreter_reductions.py")
    assert fast.install()
    path = tmp_path_factory.mktemp("kernels") / "combine_kernels.py"
    path.write_text(_KERNELS.format(prelude=PRELUDE + PRELUDE_BF16["interpret"]))
    return fast, _module("stoker_test_combine_kernels", path)


def _run_reductions(kernels, x):
    r, c = x.shape
    outs = [torch.empty(n) for n in (r, c, r, r, r, 1)]
    kernels.reductions[(1,)](x, *outs, r, c)
    return outs


@pytest.mark.parametrize("cols", [1, 8, 16, 32])
def test_whole_block_reductions_give_what_the_element_loop_gives(mods, cols):
    fast_loops, kernels = mods
    x = torch.randn(8, cols) + 1.5
    x[1, cols // 2] = float("nan")  # NaN propagates through max and min
    x[2] = 3.0  # ties
    fast = _run_reductions(kernels, x)
    with fast_loops.triton_own_loops():
        slow = _run_reductions(kernels, x)
    mx, mn, pr, mean, m2, whole = fast
    torch.testing.assert_close(mx, slow[0], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(mn, slow[1], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(whole, slow[5], equal_nan=True, rtol=0, atol=0)
    # a pairwise tree rounds otherwise than a left fold: as close as two orders get
    torch.testing.assert_close(pr, slow[2], equal_nan=True)
    torch.testing.assert_close(mean, slow[3], equal_nan=True)
    torch.testing.assert_close(m2, slow[4], equal_nan=True, rtol=1e-5, atol=1e-5)
    # and what eager computes
    torch.testing.assert_close(mx, x.amax(1), equal_nan=True)
    torch.testing.assert_close(mean, x.mean(1), equal_nan=True)


def test_whole_slice_scan_gives_what_the_element_loop_gives(mods):
    fast_loops, kernels = mods
    x = torch.randn(4, 16)
    x[0, 5] = float("nan")
    fast, slow = torch.empty_like(x), torch.empty_like(x)
    kernels.scan[(1,)](x, fast, 4, 16)
    with fast_loops.triton_own_loops():
        kernels.scan[(1,)](x, slow, 4, 16)
    torch.testing.assert_close(fast, slow, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(fast[1:], torch.cummax(x[1:], 1).values)


def test_processes_the_tests_start_install_it_when_they_import_the_interpreter():
    """Through PYTHONPATH (set by the root conftest) the start-up hook patches Triton's
    interpreter when a process imports it, and imports nothing before."""
    import subprocess

    code = (
        "import sys\n"
        "before = sorted(m for m in ('numpy', 'triton', 'interpreter_reductions') if m in sys.modules)\n"
        "from triton.runtime import interpreter\n"
        "print(before, getattr(interpreter.ReduceOps.generic_reduce, 'whole_block', False),"
        " getattr(interpreter.ScanOps.generic_scan, 'whole_block', False))\n"
    )
    # a fresh interpreter (`before` must be empty), not one forked with torch imported
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "STOKER_TEST_SLOW_REDUCE": "",
        "STOKER_TEST_FRESH_PROCESS": "1",
    }
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[]", "True", "True"], out.stdout
    env["STOKER_TEST_SLOW_REDUCE"] = "1"  # Triton's own loops
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.stdout.split() == ["[]", "False", "False"], out.stdout + out.stderr[-3000:]
