"""Reductions over any dims (persistent and looped), and the fused normalizations."""

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import check


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
def test_sum_mean_amax_amin(looped):
    x = torch.randn(3, 5, 40)
    opts = {"options": {"persistent_rnumel_max": 16}} if looped else {}
    check(
        lambda x: (
            x.sum(-1),
            x.sum((0, 2)),
            x.mean(1, keepdim=True),
            x.amax(-1),
            x.amin((0, 1)),
            x.sum(),
            x.mean(),
        ),
        x,
        rtol=1e-4,
        atol=1e-4,
        **opts,
    )


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
def test_arg_prod_any_all(looped):
    x = torch.randn(4, 40)
    x[1, 7] = 10.0  # a clear maximum
    x[2, 3] = -10.0
    opts = {"options": {"persistent_rnumel_max": 16}} if looped else {}
    check(
        lambda x: (
            x.argmax(1),
            x.argmin(1),
            x.argmax(),
            x.argmin(0, keepdim=True),
            (x * 0.1 + 1).prod(1),
            (x > 0).any(1),
            (x > -3).all(0),
            (x > 0).any(),
        ),
        x,
        fresh_inputs=False,
        rtol=1e-4,
        **opts,
    )


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
def test_var_std_one_pass(looped):
    x = torch.randn(6, 50) * 3 + 1
    opts = {"options": {"persistent_rnumel_max": 16}} if looped else {}
    fn = check(
        lambda x: (
            x.var(1),
            x.std(0, keepdim=True),
            torch.var_mean(x, 1, correction=0),
            x.var(),
            torch.std_mean(x, (0, 1)),
        ),
        x,
        rtol=1e-4,
        atol=1e-4,
        **opts,
    )
    assert "looped-reduction" in {k.kind for k in fn.report.kernels} or not looped


def test_integer_and_bool_sums():
    x = torch.randint(-4, 4, (5, 6))
    check(lambda x: (x.sum(1), (x > 0).sum(0), x.amax(1), x.prod(0)), x)


def test_reduction_over_noncontiguous_and_broadcast():
    x = torch.randn(8, 6).t()
    y = torch.randn(6, 1)
    check(lambda x, y: ((x * y).sum(1), (x + y).amax(0)), x, y, rtol=1e-4)


def test_softmax_forward_is_one_kernel():
    check(lambda x: torch.softmax(x, -1), torch.randn(8, 33), kernels=1)


def test_log_softmax_and_softmax_on_inner_dim():
    x = torch.randn(3, 17, 5)
    check(lambda x: (torch.log_softmax(x, -1), torch.softmax(x, 1)), x, rtol=1e-4, atol=1e-5)


def test_layernorm_gelu_forward_is_one_kernel():
    x, w, b = torch.randn(6, 32), torch.randn(32), torch.randn(32)
    check(
        lambda x, w, b: F.gelu(F.layer_norm(x, (32,), w, b)),
        x,
        w,
        b,
        kernels=1,
        rtol=1e-4,
        atol=1e-5,
    )


def test_layernorm_training_outputs_mean_and_rstd():
    x, w, b = torch.randn(2, 3, 16), torch.randn(16), torch.randn(16)
    fn = check(
        lambda x, w, b: torch.ops.aten.native_layer_norm(x, [16], w, b, 1e-5),
        x,
        w,
        b,
        rtol=1e-4,
        atol=1e-5,
    )
    assert fn.report.n_kernels == 1, str(fn.report)


def test_batch_norm_training_forward():
    x = torch.randn(4, 3, 5, 5)
    w, b = torch.randn(3), torch.randn(3)
    rm, rv = torch.zeros(3), torch.ones(3)
    check(
        lambda x, w, b, rm, rv: torch.ops.aten._native_batch_norm_legit_functional(
            x, w, b, rm, rv, True, 0.1, 1e-5
        ),
        x,
        w,
        b,
        rm,
        rv,
        rtol=1e-4,
        atol=1e-5,
    )


def _grad_graph(f, *args):
    def g(*a):
        out = f(*a)
        return torch.autograd.grad(out, [t for t in a if t.requires_grad], torch.ones_like(out))

    return g


def test_softmax_backward():
    x = torch.randn(4, 24, requires_grad=True)
    fn = check(
        _grad_graph(lambda x: torch.softmax(x, -1) * torch.arange(24.0), x), x, rtol=1e-4, atol=1e-5
    )
    assert fn.report.n_kernels <= 2, str(fn.report)


def test_layernorm_backward():
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    fn = check(
        _grad_graph(lambda x, w, b: F.layer_norm(x, (16,), w, b) ** 2, x, w, b),
        x,
        w,
        b,
        rtol=1e-4,
        atol=1e-4,
    )
    assert fn.report.n_kernels <= 4, str(fn.report)


def test_gelu_tanh_silu_backward():
    x = torch.randn(5, 9, requires_grad=True)
    check(
        _grad_graph(
            lambda x: F.gelu(x) + F.silu(x) + torch.tanh(x) + F.gelu(x, approximate="tanh"), x
        ),
        x,
        kernels=1,
        rtol=1e-4,
        atol=1e-5,
    )


def test_batch_norm_backward():
    x = torch.randn(4, 3, 6, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    check(
        _grad_graph(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True) ** 2, x, w, b),
        x,
        w,
        b,
        rtol=1e-3,
        atol=1e-4,
    )


def test_pointwise_epilogue_of_a_reduction_is_in_its_kernel():
    """Pointwise ops on a reduction's result (an RMS scale, a loss's
    mean and scaling) run in the reduction's kernel, not a kernel of their own."""
    x, w = torch.randn(8, 40), torch.randn(8)
    check(lambda x, w: ((x * x).mean(1).add(1e-6).rsqrt() * w + 1,), x, w, kernels=1, rtol=1e-4)
    check(lambda x: (x.amax(1).exp() * 2, x.sum(1).sigmoid()), x, kernels=1, rtol=1e-4)


def test_sibling_reductions_share_a_kernel():
    x = torch.randn(8, 32)
    check(lambda x: (x.sum(1), x.amax(1), (x * x).sum(1)), x, kernels=1, rtol=1e-4)


def test_cross_entropy_forward_backward():
    x = torch.randn(6, 10, requires_grad=True)
    t = torch.randint(0, 10, (6,))

    def f(x, t):
        loss = F.cross_entropy(x, t)
        return (loss, *torch.autograd.grad(loss, [x]))

    check(f, x, t, rtol=1e-4, atol=1e-5)


def test_reductions_of_one_element_and_of_0_dim_tensors():
    x = torch.randn(3, 1, 4)
    s = torch.randn(())
    check(
        lambda x, s: (
            x.sum(1),
            x.amax(1, keepdim=True),
            x.argmax(1),
            x.var(1, correction=0),
            s.sum(0),
            s.argmax(),
            s.mean(-1),
            (x > 0).any(1),
        ),
        x,
        s,
    )


def test_max_min_propagate_nan_like_eager():
    x = torch.randn(4, 40)
    x[1, 5] = float("nan")
    x[3, 0] = float("nan")
    check(lambda x: (x.amax(1), x.amin(1), x.amax(0), torch.softmax(x, -1)), x, fresh_inputs=False)
    check(
        lambda x: (x.amax(1), x.amin(0)),
        x,
        fresh_inputs=False,
        options={"persistent_rnumel_max": 16},
    )


def _arg_rows() -> torch.Tensor:
    """Rows that trip NaN-blind or tie-blind argmax/argmin (40 wide, so looped runs lanes)."""
    nan, inf = float("nan"), float("inf")
    x = torch.randn(13, 40)
    x[0, 0] = nan  # NaN first
    x[1, 21] = nan  # NaN in the middle
    x[2, 39] = nan  # NaN last
    x[3, 30] = nan  # two NaNs: the first one counts
    x[3, 9] = nan
    x[4] = nan  # all NaN
    x[5, [3, 17, 33]] = 5.0  # tied maxima
    x[5, [20, 36]] = -5.0  # tied minima
    x[6] = -inf  # all -inf
    x[7] = inf  # all +inf
    x[8, [10, 25]] = inf
    x[8, [2, 12]] = -inf
    x[9] = 0.0  # all equal
    x[10, [4, 20]] = inf  # NaN after inf and -inf
    x[10, 6] = -inf
    x[10, 31] = nan
    x[11, 17] = nan  # NaN in a later lane block than the maximum
    x[11, 2] = 100.0
    return x


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
def test_argmax_argmin_nan_ties_and_infs_like_eager(looped):
    x = _arg_rows()
    opts = {"options": {"persistent_rnumel_max": 16}} if looped else {}

    def f(x):
        xt = x.t().contiguous()
        return (
            x.argmax(1),
            x.argmin(1),
            x.argmax(-1, keepdim=True),
            x.argmin(1, keepdim=True),
            xt.argmax(0),
            xt.argmin(0, keepdim=True),
            x[4:5].argmax(),  # flattened, all NaN
            x[6:8].argmin(),  # flattened, -inf row then +inf row
            x.argmax(),
            x.argmin(),
            torch.max(x, 1).indices,
            torch.min(x, 1).indices,
        )

    ref = f(x)
    assert ref[0][:5].tolist() == [0, 21, 39, 9, 0]  # the rows mean what they say
    check(f, x, fresh_inputs=False, **opts)


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
def test_argmax_argmin_of_rows_at_the_dtype_limits(looped):
    lo, hi = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
    x = torch.randint(-5, 5, (3, 40))
    x[0] = lo
    x[1] = hi
    opts = {"options": {"persistent_rnumel_max": 16}} if looped else {}
    check(lambda x: (x.argmax(1), x.argmin(1)), x, fresh_inputs=False, **opts)
