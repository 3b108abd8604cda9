"""Symbolic sizes: kernels take sizes as arguments; every size assumption is a guard."""

import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from triton_helpers import assert_same, compile_dynamic

from stoker_shapes import Dim, ShapeContext, Source
from stoker_triton import compile_graph


def test_pointwise_and_views_with_a_dynamic_batch():
    def f(x, b):
        return ((x * 2 + b).sin().view(-1), x.t() + 1, x[1:].sum(0))

    ctx, fn = compile_dynamic(
        f, [torch.randn(5, 8), torch.randn(8)], [{0: Dim("batch", max=64)}, None]
    )
    assert any("s" in str(a) for k in fn.report.kernels for a in [k.xnumel])  # sizes are symbolic
    guards = ctx.produce_guards()
    for n in (3, 5, 17):
        x, b = torch.randn(n, 8), torch.randn(8)
        assert guards.check([x, b], {}, None)
        assert_same(fn(x, b), f(x, b), rtol=1e-4)


def test_dynamic_reduction_row_adds_a_guard():
    """Keeping a whole row in one block is an assumption about its size: a guard."""

    def f(x):
        return torch.softmax(x, -1)

    ctx, fn = compile_dynamic(f, [torch.randn(4, 24)], [{1: Dim("row", max=100000)}])
    assert any("8192" in g for g in fn.report.guards_added), str(fn.report)
    guards = ctx.produce_guards()
    assert "8192" in str(guards)
    for n in (7, 24, 100):
        x = torch.randn(4, n)
        assert guards.check([x], {}, None)
        assert_same(fn(x), f(x))
    # a row too long for the persistent kernel fails the guard: the caller recompiles
    assert not guards.check([torch.randn(4, 9000)], {}, None)


def test_dynamic_layernorm_backward_and_int_input():
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)

    def f(x, w):
        y = F.layer_norm(x, (16,), w)
        return torch.autograd.grad((y * y).sum(), [x, w])

    _ctx, fn = compile_dynamic(f, [x, w], [{0: Dim("batch", max=64)}, None])
    for n in (2, 9):
        xs = torch.randn(n, 16, requires_grad=True)
        assert_same(fn(xs, w), f(xs, w), rtol=1e-4, atol=1e-4)


def test_symint_scalar_input():
    def f(x, n):
        return (x * n, x.sum() + n)

    ctx = ShapeContext(policy="dynamic")
    fx = ctx.fakeify(torch.randn(3, 4), Source.arg(0), dynamic={0: Dim("b", max=32)})
    fn_ = ctx.fakeify(5, Source.arg(1), dynamic=True)
    with ctx.tracing():
        gm = make_fx(f, decomposition_table=core_aten_decompositions())(fx, fn_)
    fn = compile_graph(gm, [fx, fn_])
    x = torch.randn(7, 4)
    assert_same(fn(x, 3), f(x, 3), rtol=1e-4)


def test_symbols_seen_only_in_strides_and_offsets_are_read_from_the_input():
    # a slice of a tensor whose width varies: its row stride is a symbol no size carries
    def f(x):
        return (x * 2).sum(1), x.t() + 1

    ctx = ShapeContext(policy="dynamic")
    fake = ctx.fakeify(torch.randn(6, 9)[1::2, 2:5], Source.arg(0))
    sizes = {str(s) for s in fake.shape}
    assert any(str(s) not in sizes for s in (fake.stride(0), fake.storage_offset()))
    with ctx.tracing():
        gm = make_fx(f, decomposition_table=core_aten_decompositions())(fake)
    fn = compile_graph(gm, [fake])
    for rows, n in ((6, 7), (8, 11), (6, 13)):
        x = torch.randn(rows, n)[1::2, 2:5]
        assert_same(fn(x), f(x), rtol=1e-5)
