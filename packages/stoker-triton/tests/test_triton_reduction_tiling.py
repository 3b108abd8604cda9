"""Reductions that read their input once: persistent rows, online softmax when a
row does not fit, outer reductions tiled along the contiguous kept dim and split
when they have few outputs, and the launch configuration by row size."""

import os

import pytest
import sympy
import torch
import torch.nn.functional as F
from triton_helpers import check

from stoker_triton._internal import tiling
from stoker_triton._internal.runtime.launcher import Launcher, outer_tile

INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="cross-compiling checks the interpreter's kernels; a GPU run compiles them natively",
)
LOOPED = {"options": {"persistent_rnumel_max": 16}}  # rows of more than 16 loop
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def rms_norm(x, w):
    """RMSNorm as models write it (F.rms_norm traces an in-place add that runs through aten)."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w


def _grad_graph(f):
    def g(*a):
        out = f(*a)
        return torch.autograd.grad(out, [t for t in a if t.requires_grad], torch.ones_like(out))

    return g


def _input_loads(src: str, arg: str = "in_ptr0") -> int:  # x: loaded first
    return src.count(f"tl.load({arg} +")


NORMS = {
    "softmax": lambda x, w: torch.softmax(x, -1),
    "log_softmax": lambda x, w: torch.log_softmax(x, -1),
    "layernorm": lambda x, w: F.layer_norm(x, (x.shape[-1],), w),
    "rmsnorm": rms_norm,
}


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("cols", [40, 37], ids=["pow2-ish", "odd"])
def test_row_that_fits_is_one_persistent_kernel_reading_the_input_once(name, cols):
    x, w = torch.randn(5, cols), torch.randn(cols)
    fn = check(NORMS[name], x, w, kernels=1, **TOL[torch.float32])
    (k,) = fn.report.kernels
    assert k.kind == "persistent-reduction"
    assert _input_loads(k.source) == 1, k.source


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_that_does_not_fit_loops_twice(name, dtype):
    """Statistics in one loop (online softmax; Welford or the sum of squares), the
    output in a second: the input is read twice, never three times."""
    x, w = torch.randn(3, 37).to(dtype), torch.randn(37).to(dtype)
    fn = check(NORMS[name], x, w, kernels=1, **TOL[dtype], **LOOPED)
    (k,) = fn.report.kernels
    assert k.kind == "looped-reduction"
    assert k.source.count("for roffset") == 2, k.source
    assert _input_loads(k.source) == 2, k.source
    if "softmax" in name:
        assert "omax" in k.source  # the running max rescales the running sum


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
def test_softmax_rows_with_nan_and_infinities_match_eager(looped):
    inf, nan = float("inf"), float("nan")
    x = torch.randn(7, 40)
    x[0] = -inf  # every element -inf: NaN in eager
    x[1, 3] = nan
    x[2, 30] = inf  # one +inf: NaN in eager (inf - inf)
    x[3, :20] = -inf  # the first lanes see only -inf: no -inf - -inf in the rescale
    x[4, 39] = 80.0  # the max comes last: every lane rescales
    x[5, :] = 0.0  # all equal
    x[6, 0] = 1e4  # a max far above the rest
    opts = LOOPED if looped else {}
    check(
        lambda x: (torch.softmax(x, -1), torch.log_softmax(x, -1), torch.logsumexp(x, -1)),
        x,
        fresh_inputs=False,
        **opts,
    )


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layernorm", "rmsnorm"])
def test_backward_matches_eager(name, looped):
    x = torch.randn(4, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    f = NORMS[name]
    opts = LOOPED if looped else {}
    check(
        _grad_graph(lambda x, w: f(x, w) * x.detach().cos() * w), x, w, atol=1e-4, rtol=1e-4, **opts
    )


def test_half_precision_backward():
    x = torch.randn(3, 33, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(33, dtype=torch.bfloat16, requires_grad=True)
    check(
        _grad_graph(lambda x, w: F.layer_norm(x, (33,), w) * 2 + torch.softmax(x, -1)),
        x,
        w,
        **TOL[torch.bfloat16],
    )


def test_single_pass_long_rows_loop_and_short_rows_stay_persistent():
    """One read either way: a row above LOOP_SINGLE_PASS_ABOVE loops in 2048-wide
    chunks (sum(-1) as before), a short one is held whole with several rows per program."""
    fn = check(lambda x: x.sum(-1), torch.randn(2, 1500), kernels=1, rtol=1e-4, atol=1e-4)
    assert fn.report.kernels[0].kind == "looped-reduction"
    fn = check(lambda x: x.sum(-1), torch.randn(2, 1000), kernels=1, rtol=1e-4, atol=1e-4)
    assert fn.report.kernels[0].kind == "persistent-reduction"


def _outer(fn) -> list[bool]:
    return ["REDUCTION_HINT = 'outer'" in open(k.path).read() for k in fn.report.kernels]


@pytest.mark.parametrize(
    "red",
    [
        lambda x: x.sum(0),
        lambda x: x.amax(0),
        lambda x: x.amin(0),
        lambda x: (x > 0.5).any(0),
        lambda x: (x > -3).all(0),
        lambda x: (x * 0.001 + 1).prod(0),
        lambda x: x.mean(0),
    ],
    ids=["sum", "amax", "amin", "any", "all", "prod", "mean"],
)
def test_outer_reduction_with_few_outputs_is_split_and_tiled_along_the_kept_dim(red):
    x = torch.randn(2048, 24)
    fn = check(red, x, kernels=2, rtol=1e-4, atol=1e-4)
    assert _outer(fn) == [True, True], [k.source for k in fn.report.kernels]
    assert all(k.kind == "looped-reduction" for k in fn.report.kernels)


def test_outer_reduction_of_a_non_power_of_two_row_and_a_3d_tensor():
    check(lambda x: x.sum(0), torch.randn(3000, 7), kernels=2, rtol=1e-4, atol=1e-4)
    check(lambda x: x.sum((0, 1)), torch.randn(64, 40, 6), kernels=2, rtol=1e-4, atol=1e-4)


def test_no_split_for_arg_reductions_welford_or_short_columns():
    x = torch.randn(2048, 24)
    fn = check(lambda x: x.argmax(0), x, kernels=1, fresh_inputs=False)
    assert _outer(fn) == [True]
    check(lambda x: x.var(0), x, kernels=1, rtol=1e-4, atol=1e-4)
    check(lambda x: x.sum(0), torch.randn(500, 24), kernels=1, rtol=1e-4, atol=1e-4)


def test_full_reduction_is_split_in_two():
    fn = check(lambda x: (x.sum(), x.amax()), torch.randn(4, 5000), rtol=1e-4, atol=1e-4)
    assert fn.report.n_kernels >= 2


def test_split_factor_follows_inductors_outer_rule():
    n = sympy.Integer
    assert tiling.split_factor(n(8192), n(16384), outer=True) == 16  # bench sum(0)
    assert tiling.split_factor(n(8448), n(16384), outer=True) == 1  # enough outputs
    assert tiling.split_factor(n(8192), n(512), outer=True) == 1  # short columns
    assert tiling.split_factor(n(24), n(3000), outer=True) == 24  # a divisor of 3000
    assert tiling.split_factor(sympy.Symbol("s0"), n(16384), outer=True) == 1  # dynamic
    assert tiling.split_factor(n(1), n(1 << 20), outer=False) == 512
    assert tiling.split_factor(n(16384), n(1 << 20), outer=False) == 1


def _launcher(reduction: bool, persistent: bool, outer: bool = False) -> Launcher:
    lau = Launcher(None, "", reduction, persistent, False)
    lau.outer = outer
    return lau


def test_launch_configuration_by_row_size_and_layout():
    h = lambda lau, x, r: lau.heuristic(x, r)  # noqa: E731
    assert h(_launcher(False, True), 1 << 27, 1) == (1024, 1, 4)  # pointwise: unchanged
    assert h(_launcher(True, False), 16384, 8192) == (1, 2048, 8)  # looped sum(-1): unchanged
    persistent = _launcher(True, True)
    assert h(persistent, 16384, 8192) == (1, 8192, 8)  # softmax / layernorm rows
    assert h(persistent, 16384, 4096) == (1, 4096, 8)
    assert h(persistent, 16384, 1024) == (2, 1024, 8)
    assert h(persistent, 16384, 40) == (32, 64, 8)
    outer = _launcher(True, False, outer=True)
    assert h(outer, 131072, 1024) == (64, 8, 4)  # sum(0)'s partials: 256 B of a row per step
    assert h(outer, 8192, 16) == (32, 16, 4)  # ... and their sum
    assert h(outer, 24, 128) == (2, 64, 2)  # few outputs: more programs
    assert outer_tile(512, 100, persistent=True) == (16, 128, 8)  # whole rows when persistent


@INTERPRETED
def test_every_config_compiles_for_sm90(monkeypatch):
    """The bench's row size (8192, persistent: 8 warps) and its long rows (looped,
    online softmax), compiled by Triton's real compiler for sm_90 at the launch
    configuration a GPU would use (the interpreter runs them at small sizes)."""
    from stoker_triton._internal.compile import xcompile

    monkeypatch.setenv(xcompile.ENV, "cuda:90")
    before = xcompile.compiled_count
    x = torch.randn(2, 8192, requires_grad=True)
    w = torch.randn(8192, requires_grad=True)
    check(
        _grad_graph(lambda x, w: F.layer_norm(x, (8192,), w) + torch.softmax(x, -1)),
        x,
        w,
        atol=1e-4,
        rtol=1e-4,
    )
    check(lambda x: (torch.log_softmax(x, -1), rms_norm(x, 1.0)), torch.randn(2, 9000), rtol=1e-4)
    check(lambda x: x.sum(0), torch.randn(2048, 24), kernels=2, rtol=1e-4, atol=1e-4)
    assert xcompile.compiled_count > before


@pytest.mark.parametrize("kind", ["pointwise", "persistent", "looped", "outer", "outer-persistent"])
def test_every_heuristic_config_is_a_valid_launch(kind):
    """Powers of two (tl.arange needs them), a persistent row held whole, a warp count
    Triton takes, and at most 16384 elements per program (registers)."""
    lau = _launcher(kind != "pointwise", kind in ("pointwise", "persistent", "outer-persistent"))
    lau.outer = kind.startswith("outer")
    xs = [1, 2, 3, 7, 24, 100, 384, 1000, 1025, 5000, 8192, 40000, 131072, 1 << 27]
    rs = [1] if kind == "pointwise" else [2, 3, 16, 40, 100, 1000, 1024, 3000, 8192]
    for x in xs:
        for r in rs:
            xb, rb, w = cfg = lau.heuristic(x, r)
            assert all(v & (v - 1) == 0 for v in cfg) and 1 <= w <= 16, (x, r, cfg)
            assert xb * rb <= 16384, (x, r, cfg)
            if lau.persistent and lau.is_reduction:
                assert rb >= r, (x, r, cfg)


def test_looped_bool_min_max_keep_the_accumulator_type(monkeypatch):
    """A looped amin/amax over bools (more kernels loop now): the identity promoted the
    update to int32, which Triton's compiler refuses for a loop-carried bool."""
    from stoker_triton._internal.compile import xcompile

    monkeypatch.setenv(xcompile.ENV, "cuda:90")
    x = torch.randn(6, 40)
    check(lambda x: ((x > 0).amin(1), (x > -1).amax(1), (x > 0).amin(0)), x, **LOOPED)
    check(lambda x: (torch.min(x > 0, 1), torch.max(x > 0, 0)), x, fresh_inputs=False, **LOOPED)


def test_memory_order_of_dense_layouts() -> None:
    """The loop order that walks a stored layout in memory order: channels-last NCHW
    is (0, 2, 3, 1); row-major, non-dense (a slice, a broadcast) and symbolic layouts
    give None (nothing to reorder, or nothing safe to)."""
    ints = [sympy.Integer(v) for v in (2, 16, 8, 8)]
    cl = [sympy.Integer(v) for v in (1024, 1, 128, 16)]
    assert tiling.memory_order(ints, cl) == (0, 2, 3, 1)
    assert tiling.memory_order((2, 16, 8, 8), (1024, 64, 8, 1)) is None  # row-major
    assert tiling.memory_order((4, 3), (1, 4)) == (1, 0)  # a transposed matrix
    assert tiling.memory_order((4, 3), (1, 8)) is None  # a slice: not dense
    assert tiling.memory_order((4, 3), (0, 1)) is None  # a broadcast
    # a size-1 dim keeps its place among the dims that move
    assert tiling.memory_order((2, 16, 1, 8), (128, 1, 128, 16)) == (0, 3, 2, 1)
    s = sympy.Symbol("s0", positive=True, integer=True)
    assert tiling.memory_order((s, 16), (1, s)) is None
