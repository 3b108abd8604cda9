"""Pointwise lowering rules vs eager (float32 unless the rule is about dtypes)."""

import pytest
import torch
from triton_helpers import check

aten = torch.ops.aten

UNARY = [
    torch.neg,
    torch.abs,
    torch.exp,
    torch.exp2,
    torch.expm1,
    torch.log,
    torch.log2,
    torch.log10,
    torch.log1p,
    torch.sqrt,
    torch.rsqrt,
    torch.sin,
    torch.cos,
    torch.tan,
    torch.sinh,
    torch.cosh,
    torch.tanh,
    torch.sigmoid,
    torch.erf,
    torch.erfc,
    torch.reciprocal,
    torch.floor,
    torch.ceil,
    torch.trunc,
    torch.round,
    torch.sign,
    torch.relu,
    torch.isnan,
    torch.isinf,
    torch.isfinite,
    torch.signbit,
    torch.logical_not,
]
POSITIVE = {torch.log, torch.log2, torch.log10, torch.sqrt, torch.rsqrt}


@pytest.mark.parametrize("op", UNARY, ids=lambda o: o.__name__)
def test_unary(op):
    x = torch.randn(6, 16) * 2
    if op in POSITIVE:
        check(lambda x: op(x.abs() + 0.1), x, kernels=1, rtol=1e-4)
    else:
        check(lambda x: op(x), x, kernels=1, atol=1e-5, rtol=1e-4)


BINARY = [
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.maximum,
    torch.minimum,
    torch.remainder,
    torch.fmod,
    torch.eq,
    torch.ne,
    torch.lt,
    torch.le,
    torch.gt,
    torch.ge,
    torch.logical_and,
    torch.logical_or,
    torch.logical_xor,
    torch.hypot,
    torch.copysign,
    torch.pow,
]


@pytest.mark.parametrize("op", BINARY, ids=lambda o: o.__name__)
def test_binary_broadcast(op):
    a, b = torch.randn(4, 1, 8), torch.randn(3, 1) + 2.5
    if op is torch.pow:
        a = a.abs() + 0.5
    check(lambda a, b: op(a, b), a, b, kernels=1, rtol=1e-4)


@pytest.mark.parametrize(
    "op",
    [
        torch.bitwise_and,
        torch.bitwise_or,
        torch.bitwise_xor,
        torch.floor_divide,
        torch.remainder,
        torch.pow,
    ],
)
def test_integer_binary(op):
    a = torch.randint(-20, 20, (5, 7))
    b = torch.randint(1, 5, (7,))
    check(lambda a, b: op(a, b), a, b, kernels=1)


def test_scalars_and_alpha():
    check(
        lambda x: (
            torch.add(x, x * 2, alpha=3) - 1.5,
            torch.sub(x, 2, alpha=2),
            3 / (x.abs() + 1),
            x**2,
            x**0.5,
        ),
        torch.rand(4, 5),
    )


def test_type_promotion():
    i = torch.randint(-5, 5, (4, 6))
    f = torch.randn(6)
    b = torch.rand(4, 6) > 0.5
    h = torch.randn(4, 6).to(torch.float64)
    check(
        lambda i, f, b, h: (
            i + f,
            i * 2.5,
            i / 2,
            b + b,
            b & (i > 0),
            i.to(torch.float32),
            f.to(torch.int32),
            h * f,
            torch.true_divide(i, i.abs() + 1),
        ),
        i,
        f,
        b,
        h,
    )


def test_where_clamp():
    x = torch.randn(5, 8)
    check(
        lambda x: (
            torch.where(x > 0, x, 0.1 * x),
            x.clamp(-0.5, 0.5),
            x.clamp(min=0),
            x.clamp(max=0.2),
            torch.where(x < 0, 1.0, 2.0),
        ),
        x,
        kernels=1,
    )


def test_creation_ops():
    x = torch.randn(3, 4)
    check(
        lambda x: (
            x + torch.full((3, 4), 2.0),
            torch.zeros_like(x),
            torch.ones(3, 4) * x,
            torch.arange(12).view(3, 4) + x,
            torch.arange(2, 11, 3),
            torch.arange(0.0, 1.0, 0.25),
            torch.scalar_tensor(3.0) * x,
        ),
        x,
    )


def test_noncontiguous_inputs():
    x = torch.randn(8, 6).t()  # strides (1, 6)
    y = torch.randn(6, 16)[:, ::2]  # a strided slice
    check(lambda x, y: (x.sin() + y, x * 2), x, y, kernels=1)


def test_chain_of_ten_pointwise_ops_is_one_kernel():
    def f(x, y):
        z = x + y
        z = z * 2
        z = z.sin()
        z = z - y
        z = z.exp()
        z = z / 3
        z = z.tanh()
        z = z + x
        z = z.relu()
        return z.sigmoid()

    check(f, torch.randn(16, 32), torch.randn(32), kernels=1, rtol=1e-4)


def test_shared_subexpression_is_not_exponential():
    def f(x):
        for _ in range(30):
            x = x * x + x
            x = x.clamp(-1, 1)
        return x

    check(f, torch.rand(4, 4) * 0.1, max_kernels=30)


def test_dtype_casts_roundtrip():
    x = torch.randn(4, 8) * 100
    check(
        lambda x: (
            x.to(torch.int64),
            x.to(torch.int8).to(torch.float32),
            x.to(torch.bool),
            (x > 0).to(torch.float32),
            x.to(torch.float64),
        ),
        x,
    )


@pytest.mark.parametrize(
    ("dst", "src"),
    [((4, 8), (4, 8)), ((4, 8), (8,)), ((2, 3, 4), (3, 1))],
)
def test_functional_copy_is_a_kernel_not_a_fallback(dst: tuple[int, ...], src: tuple[int, ...]):
    """`aten.copy` (a functionalized `buffer.copy_(x)`, InstanceNorm's running stats) was
    an aten fallback: src broadcast to self's size, cast to self's dtype."""

    def f(d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.copy(d, s.exp()) * 2 + d.to(torch.float32)

    fn = check(f, torch.randn(dst, dtype=torch.float64).to(torch.bfloat16), torch.randn(src))
    assert not fn.report.fallback_ops, fn.report.fallback_ops


def test_channels_last_input_keeps_its_layout_and_values() -> None:
    """A channels-last input: the output is channels-last as in eager, each element
    right (the kernel walks the layout in memory order)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) * x + 1

    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    fn = check(f, x)
    assert fn(x).stride() == f(x).stride() == (128, 1, 32, 8)
