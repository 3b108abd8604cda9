"""Low-precision dtypes: run natively on a GPU only (the interpreter's bf16 arithmetic is wrong)."""

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import check

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pointwise_low_precision(dtype):
    x = torch.randn(64, 128, device="cuda", dtype=dtype)
    check(
        lambda x: (x.sin() * 2 + x.exp() / 3, x.to(torch.float32) + 1),
        x,
        max_kernels=2,
        atol=2e-2,
        rtol=2e-2,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_layernorm_low_precision(dtype):
    x = torch.randn(64, 1000, device="cuda", dtype=dtype)
    w = torch.randn(1000, device="cuda", dtype=dtype)
    check(
        lambda x, w: (torch.softmax(x, -1), F.layer_norm(x, (1000,), w)), x, w, atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reductions_low_precision_accumulate_in_fp32(dtype):
    x = torch.randn(32, 5000, device="cuda", dtype=dtype)
    check(lambda x: (x.sum(-1), x.float().var(-1), x.amax(0)), x, atol=1e-1, rtol=2e-2)


def test_layernorm_backward_bf16():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(x, w):
        y = F.layer_norm(x, (256,), w)
        return torch.autograd.grad((y.float() ** 2).sum(), [x, w])

    check(f, x, w, atol=5e-1, rtol=5e-2)
