"""Random ops: reproducible from torch's seed, right distribution, dropout."""

import torch
import torch.nn.functional as F
from triton_helpers import trace

from stoker_triton import compile_graph


def _compile(f, *args):
    return compile_graph(trace(f, *args), list(args))


def test_rand_randn_reproducible_and_distributed():
    x = torch.zeros(64, 64)
    fn = _compile(lambda x: (torch.rand_like(x), torch.randn(64, 64), torch.rand(3)), x)
    torch.manual_seed(123)
    a = fn(x)
    torch.manual_seed(123)
    b = fn(x)
    c = fn(x)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a[0], c[0])  # a new seed per call
    assert not torch.equal(a[0], a[1])  # streams differ
    u, n = a[0], a[1]
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.02
    assert abs(float(n.mean())) < 0.05 and abs(float(n.std()) - 1.0) < 0.05


def test_dropout_and_bernoulli():
    x = torch.randn(32, 64)

    def f(x):
        return (
            torch.ops.aten.native_dropout(x, 0.25, True),
            torch.bernoulli(torch.full((32, 64), 0.3)),
        )

    fn = _compile(f, x)
    (y, mask), bern = fn(x)
    assert mask.dtype == torch.bool and y.shape == x.shape
    torch.testing.assert_close(y, torch.where(mask, x / 0.75, 0.0))
    assert abs(float(mask.float().mean()) - 0.75) < 0.05
    assert abs(float(bern.mean()) - 0.3) < 0.05
    assert not fn.report.fallback_ops, str(fn.report)


def test_dropout_forward_backward_share_the_mask():
    x = torch.randn(16, 16, requires_grad=True)

    def f(x):
        y = F.dropout(x, 0.5, True)
        return (y, *torch.autograd.grad(y.sum(), [x]))

    fn = _compile(f, x)
    y, g = fn(x)
    keep = y != 0
    torch.testing.assert_close(g, keep.float() * 2.0)
