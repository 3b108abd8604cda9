"""Small models end to end: as an aot_function compiler (forward and backward), and joint graphs."""

import torch
import torch.nn.functional as F
from functorch.compile import aot_function  # tests may use torch's AOT to drive the compiler
from triton_helpers import check

from stoker_triton import compile_graph


def _grads(f, params, *inputs):
    out = f(*params, *inputs)
    return torch.autograd.grad(out.float().pow(2).sum(), params)


def test_mlp_as_aot_function_compiler_forward_and_backward():
    torch.manual_seed(0)
    w1, b1 = torch.randn(12, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    w2, b2 = torch.randn(16, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    x = torch.randn(8, 12)

    def mlp(w1, b1, w2, b2, x):
        h = F.gelu(x @ w1 + b1)
        return torch.log_softmax(h @ w2 + b2, -1)

    reports = []

    def compiler(gm, inputs):
        fn = compile_graph(gm, inputs)
        reports.append(fn.report)
        return fn

    cf = aot_function(mlp, fw_compiler=compiler, bw_compiler=compiler)
    params = (w1, b1, w2, b2)
    got = _grads(cf, params, x)
    want = _grads(mlp, params, x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cf(*params, x), mlp(*params, x), rtol=1e-4, atol=1e-5)
    assert len(reports) == 2  # forward and backward graphs
    assert all(r.extern_calls for r in reports)  # the matmuls


def test_gpt_block_forward_and_backward():
    torch.manual_seed(0)
    d, t, h = 16, 6, 2
    p = [
        torch.randn(d, 3 * d) * 0.2,
        torch.randn(d, d) * 0.2,
        torch.ones(d),
        torch.zeros(d),
        torch.randn(d, 4 * d) * 0.2,
        torch.randn(4 * d, d) * 0.2,
    ]
    p = [t_.requires_grad_() for t_ in p]
    x = torch.randn(2, t, d)

    def block(wqkv, wo, g, bln, w1, w2, x):
        y = F.layer_norm(x, (d,), g, bln)
        q, k, v = (y @ wqkv).split(d, -1)
        q, k, v = (z.view(2, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (d // h) ** 0.5
        mask = torch.ones(t, t).tril() == 0
        att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
        z = (att @ v).transpose(1, 2).reshape(2, t, d) @ wo
        x = x + z
        return x + F.gelu(F.layer_norm(x, (d,)) @ w1) @ w2

    def joint(*a):
        return _grads(block, a[:6], a[6])

    check(block, *p, x, rtol=1e-4, atol=1e-4)
    check(joint, *p, x, rtol=1e-3, atol=1e-4)


def test_small_cnn_forward_and_backward():
    torch.manual_seed(0)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    g, b = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    fc = torch.randn(4, 5, requires_grad=True)
    x = torch.randn(2, 3, 8, 8)

    def cnn(w, g, b, fc, x):
        y = F.conv2d(x, w, padding=1)
        y = F.relu(F.batch_norm(y, None, None, g, b, training=True))
        y = F.max_pool2d(y, 2).mean((2, 3))
        return y @ fc

    def joint(*a):
        return _grads(cnn, a[:4], a[4])

    fn = check(cnn, w, g, b, fc, x, rtol=1e-4, atol=1e-4)
    assert "aten.convolution.default" in fn.report.extern_calls
    check(joint, w, g, b, fc, x, rtol=1e-3, atol=1e-4)
