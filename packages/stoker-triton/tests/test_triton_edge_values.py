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
