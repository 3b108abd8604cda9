"""Lowerings at the edges of their dtypes, against eager bit for bit: round
with decimals (ties, large values, signed zeros), Python scalars outside an
integer dtype's range (clamp's checked bounds, wrapping comparisons), and
accumulating scatters into dtypes with no atomic add (int8, uint8).

Each of these once failed: `round.decimals` ran through aten, `clamp(uint8,
-2, 3)` did not compile for sm_90, and 8-bit accumulating scatters used an
atomic add sm_90 does not have. Every kernel is also compiled for sm_90
under the interpreter (STOKER_TRITON_CHECK_TARGETS, the conftest default).
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from triton_helpers import device, trace
from triton_ptx import instructions, kernel_ptx

from stoker_triton import compile_graph

DEV = device()
FLOAT = [torch.float32, torch.float16, torch.bfloat16]
BITS = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}


def _compiled(f, *args):
    fn = compile_graph(trace(f, *args), list(args))
    assert not fn.report.fallback_ops, fn.report.fallback_reasons
    return fn


def _same_bits(got, ref):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype in BITS:  # NaN payloads aside, every bit (signed zeros too)
        got = torch.where(got.isnan(), float("nan"), got).view(BITS[ref.dtype])
        ref = torch.where(ref.isnan(), float("nan"), ref).view(BITS[ref.dtype])
    assert torch.equal(got, ref), (got, ref)


# -- round(x, decimals) --------------------------------------------------------


def _round_inputs(dtype, decimals):
    """Random values at several scales, exact ties of x * 10**d (x / 10**-d),
    values that round to a signed zero, huge values and non-finite ones."""
    g = torch.Generator().manual_seed(1234 + decimals)
    scale = 10.0 ** (-decimals)
    rnd = torch.randn(512, generator=g) * torch.logspace(-3, 6, 512)
    ties = (torch.arange(-40, 40) + 0.5) * scale
    special = [0.0, -0.0, 0.049, -0.049, 0.4999999, -0.4999999, 2.0**23 + 1, -(2.0**24) - 2]
    special += [1e30, -3e38, 6e4, float("inf"), float("-inf"), float("nan")]
    x = torch.cat([rnd, ties, torch.tensor(special) * max(scale, 1.0)])
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [*FLOAT, torch.float64], ids=str)
@pytest.mark.parametrize("decimals", [1, 2, 3, -1, -2, 0, 40])
def test_round_decimals_matches_eager_bit_for_bit(dtype, decimals):
    x = _round_inputs(dtype, decimals)

    def f(x):
        return torch.round(x, decimals=decimals), torch.round(x * 3, decimals=decimals) + 1

    fn = _compiled(f, x)
    for got, ref in zip(fn(x), f(x)):
        _same_bits(got, ref)


def test_round_without_decimals_is_exact_where_floor_of_x_plus_half_is_not():
    x = torch.tensor([0.49999997, -0.49999997, 2.0**23 + 1, -(2.0**23) - 1, 2.5, 3.5, -2.5, -0.4])
    x = torch.cat([x, torch.randn(200) * 1e4]).to(DEV)
    _same_bits(_compiled(torch.round, x)(x), torch.round(x))


def test_round_decimals_gradient_is_zero():
    x = torch.randn(4, 8, device=DEV, requires_grad=True)

    def f(x, g):
        return torch.autograd.grad(torch.round(x, decimals=2), x, g)

    g = torch.randn(4, 8, device=DEV)
    with torch.enable_grad():
        gm = trace(f, x, g)
    out = compile_graph(gm, [x, g])(x, g)
    assert torch.equal(out[0], torch.zeros_like(x))


def test_round_decimals_of_an_integer_tensor_raises_as_eager():
    x = torch.arange(6, device=DEV)
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.round(x, decimals=1)
    fn = compile_graph(
        torch.fx.symbolic_trace(lambda x: torch.ops.aten.round.decimals(x, decimals=1)), [x]
    )
    with pytest.raises(RuntimeError, match="not implemented"):
        fn(x)


def test_round_decimals_divides_with_ieee_rounding_on_a_gpu():
    # `/` on float32 is div.full.f32 (within 2 ulp) in Triton's PTX; eager's
    # kernel divides with IEEE rounding, so the kernel must use div.rn.
    x = torch.randn(64)
    fn = _compiled(lambda x: torch.round(x, decimals=2), x)
    ins = instructions(kernel_ptx(fn, [x, fn(x), x.numel(), 1], xblock=64))
    assert any(i.startswith("div.rn.f32") for i in ins), ins
    assert not any(i.startswith(("div.full", "div.approx")) for i in ins), ins


# -- Python scalars outside an integer dtype's range ---------------------------


INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def _edge_ints(dtype):
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**40)), min(info.max, 2**40)
    edges = torch.tensor([info.min, info.min + 1, -2, -1, 0, 1, 2, 3, info.max - 1, info.max])
    rnd = torch.randint(lo, hi, (200,))
    return torch.cat([edges.clamp(info.min, info.max).to(dtype), rnd.to(dtype)]).to(DEV)


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_clamp_bounds_convert_as_eager(dtype):
    # a negative bound wraps into uint8 (clamp(x, -2, 3) is 3 everywhere:
    # -2 bounds at 254); for signed dtypes every bound here is in range
    x = _edge_ints(dtype)

    def f(x):
        return (
            torch.clamp(x, -2, 3),
            torch.clamp_min(x, -2),
            torch.clamp_max(x, -2),
            torch.clamp(x, min=-1),
            torch.clamp(x, max=-100),
            torch.clamp(x, 5, 1),
            torch.clamp(x, -0.5, 0.5),  # float bounds promote to float
        )

    fn = _compiled(f, x)
    x = _edge_ints(dtype)
    for got, ref in zip(fn(x), f(x)):
        _same_bits(got, ref)


@pytest.mark.parametrize(
    "dtype, bound",
    [(torch.uint8, 256), (torch.uint8, -256), (torch.int8, -129), (torch.float16, 7e4)],
    ids=str,
)
def test_clamp_bound_outside_the_dtype_raises_eagers_error(dtype, bound):
    x = torch.ones(8, dtype=dtype, device=DEV)
    with pytest.raises(RuntimeError, match="without overflow"):
        torch.clamp(x, bound)
    gm = make_fx(lambda x: torch.clamp(x, bound), tracing_mode="fake")(x)  # eager would raise
    fn = compile_graph(gm, [x])
    with pytest.raises(RuntimeError, match="without overflow"):
        fn(x)


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
def test_clamp_with_a_nan_bound_is_nan_everywhere_as_eager(dtype):
    x = torch.randn(32, device=DEV).to(dtype)
    nan = float("nan")

    def f(x):
        return torch.clamp(x, nan, 1.0), torch.clamp_min(x, nan), torch.clamp(x, 0.0, nan)

    for got, ref in zip(_compiled(f, x)(x), f(x)):
        _same_bits(got, ref)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=str)
def test_out_of_range_scalars_wrap_in_ops_as_eager(dtype):
    # TensorIterator casts the scalar to the op's dtype: `uint8 < -1` compares
    # with 255, `where(c, uint8, -1)` writes 255, `int8 == 200` compares with -56
    x = _edge_ints(dtype)
    idx = torch.tensor([[0, 3, 5]], device=DEV)

    def f(x):
        return (
            x < -1,
            x == -1,
            x >= 200,
            x == 200,
            torch.where(x > 100, x, -1),
            x.masked_fill(x > 100, -1),
            x + -1,
            x * -3,
            torch.full_like(x, -1),
            x.view(1, -1).scatter(1, idx, -2),
        )

    fn = _compiled(f, x)
    x = _edge_ints(dtype)
    for got, ref in zip(fn(x), f(x)):
        _same_bits(got, ref)


# -- accumulating scatters into 8-bit integers ---------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=str)
def test_accumulating_scatters_into_8_bit_integers_wrap_as_eager(dtype):
    # many adds into few places: sums overflow and wrap (no atomic add on sm_90
    # for 8-bit integers, so these run as aten calls inside the compiled graph)
    info = torch.iinfo(dtype)

    def inputs():
        x = torch.randint(info.min, info.max + 1, (4, 8), dtype=dtype, device=DEV)
        src = torch.randint(info.min, info.max + 1, (64, 8), dtype=dtype, device=DEV)
        idx = torch.randint(0, 4, (64, 8), device=DEV)
        rows = torch.randint(0, 4, (64,), device=DEV)
        return x, src, idx, rows

    def f(x, src, idx, rows):
        return (
            torch.index_put(x, (rows,), src, accumulate=True),
            torch.scatter_add(x, 0, idx, src),
            torch.scatter(x, 0, idx, src, reduce="add"),
            torch.scatter(x, 0, idx, 100, reduce="add"),
            torch.scatter_add(x, 0, idx, src) + 1,  # a kernel after the aten call
        )

    args = inputs()
    fn = _compiled(f, *args)
    assert fn.report.extern_calls, "expected the accumulating scatters as aten calls"
    args = inputs()
    for got, ref in zip(fn(*args), f(*args)):
        _same_bits(got, ref)
