"""A value an extern reads that is also a graph output is stored once: the
output is the buffer made for the extern when the layouts agree,
never a buffer another output or an input already is."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from triton_helpers import assert_same, check, fresh

from stoker_triton import compile_graph


def _stores(fn) -> int:
    return fn.wrapper_source.count("empty_strided(")


def _attn(s, v):
    p = torch.softmax(s, -1)
    return p, torch.bmm(p, v)


def test_softmax_read_by_bmm_and_returned_is_stored_once():
    s, v = torch.randn(2, 4, 8), torch.randn(2, 8, 3)
    fn = check(_attn, s, v)
    assert _stores(fn) == 1, fn.wrapper_source  # the (2, 4, 8) softmax, once
    p, out = fn(*fresh([s, v]))
    assert p.data_ptr() != out.data_ptr()


def test_softmax_read_by_bmm_gradients_match_eager():
    s0, v0, g0 = torch.randn(2, 4, 8), torch.randn(2, 8, 3), torch.randn(2, 4, 3)

    def fwd_bwd(s, v, g):
        s, v = s.detach().requires_grad_(), v.detach().requires_grad_()
        p = torch.softmax(s, -1)
        out = torch.bmm(p, v)
        return (p.detach(), out, *torch.autograd.grad(out, (s, v), g))

    gm = make_fx(fwd_bwd)(s0, v0, g0)
    fn = compile_graph(gm, [s0, v0, g0])
    # the softmax once (the bmm reads it, the graph returns it) and the grad of s
    assert fn.wrapper_source.count("empty_strided((2, 4, 8)") == 2, fn.wrapper_source
    args = fresh([s0, v0, g0])
    assert_same(list(fn(*args)), list(fwd_bwd(*args)), atol=1e-5, rtol=1e-4)


def test_a_value_returned_twice_stays_two_tensors():
    def f(s, v):
        p = torch.softmax(s, -1)
        return p, p, torch.bmm(p, v)

    s, v = torch.randn(2, 4, 8), torch.randn(2, 8, 3)
    fn = check(f, s, v)
    assert _stores(fn) == 2, fn.wrapper_source  # the bmm's buffer is one of them
    s1, v1 = fresh([s, v])
    a, b, _ = fn(s1, v1)
    assert a.data_ptr() != b.data_ptr()
    a.add_(1)
    assert_same(b, torch.softmax(s1, -1))


def test_an_input_returned_and_read_by_an_extern_stays_its_own_tensor():
    def f(x, w):
        y = x * 1  # pointwise of an input: stored for the mm, and returned
        return y, torch.mm(y, w), x

    x, w = torch.randn(4, 3), torch.randn(3, 5)
    fn = check(f, x, w)
    a = torch.randn(4, 3)
    y, _, xa = fn(a, torch.randn(3, 5))
    assert y.data_ptr() != a.data_ptr() and xa.data_ptr() == a.data_ptr()


def _ln_addmm(x, w, b, lw, lb):
    h = torch.nn.functional.layer_norm(x, (x.shape[-1],), lw, lb)
    return h, torch.addmm(b, h, w)  # the forward saves the LN output for the backward


def test_layernorm_output_read_by_addmm_and_saved_is_stored_once():
    x, w, b = torch.randn(6, 8), torch.randn(8, 5), torch.randn(5)
    lw, lb = torch.randn(8), torch.randn(8)
    fn = check(_ln_addmm, x, w, b, lw, lb)
    # one (6, 8) buffer for the LN output (plus what the LN kernel keeps for its
    # statistics, if any): not a second (6, 8) store of it
    assert fn.wrapper_source.count("empty_strided((6, 8)") == 1, fn.wrapper_source


def test_layernorm_addmm_gradients_match_eager():
    args0 = [torch.randn(6, 8), torch.randn(8, 5), torch.randn(5), torch.randn(8), torch.randn(8)]
    g0 = torch.randn(6, 5)

    def fwd_bwd(x, w, b, lw, lb, g):
        leaves = [t.detach().requires_grad_() for t in (x, w, b, lw, lb)]
        h, out = _ln_addmm(*leaves)
        return (h.detach(), out, *torch.autograd.grad(out, leaves, g))

    gm = make_fx(fwd_bwd)(*args0, g0)
    fn = compile_graph(gm, [*args0, g0])
    # the LN output once (the addmm reads it, the graph returns it) and the grad of x
    assert fn.wrapper_source.count("empty_strided((6, 8)") == 2, fn.wrapper_source
    args = fresh([*args0, g0])
    assert_same(list(fn(*args)), list(fwd_bwd(*args)), atol=1e-4, rtol=1e-4)


def _ln_linear(x, w, b, lw, lb):
    h = torch.nn.functional.layer_norm(x, (x.shape[-1],), lw, lb)
    return h, torch.addmm(b, h.view(-1, h.shape[-1]), w)  # the addmm reads a reshape of h


def test_saved_output_whose_reshape_an_addmm_reads_is_stored_once():
    x, w, b = torch.randn(2, 3, 8), torch.randn(8, 5), torch.randn(5)
    lw, lb = torch.randn(8), torch.randn(8)
    fn = check(_ln_linear, x, w, b, lw, lb)
    stored = [s for s in ("empty_strided((6, 8)", "empty_strided((2, 3, 8)")]
    assert sum(fn.wrapper_source.count(s) for s in stored) == 1, fn.wrapper_source
    h, out = fn(*fresh([x, w, b, lw, lb]))
    assert h.shape == (2, 3, 8) and h.is_contiguous() and h.data_ptr() != out.data_ptr()


def test_a_non_contiguous_output_is_not_a_reshape_of_the_extern_buffer():
    def f(x, w):
        y = x * 2
        return y.t(), torch.mm(y.t().reshape(4, 3), w)

    x, w = torch.randn(4, 3), torch.randn(3, 5)
    fn = check(f, x, w)
    yt, _ = fn(*fresh([x, w]))
    assert yt.shape == (3, 4)


def test_saved_reshape_gradients_match_eager():
    args0 = [torch.randn(2, 3, 8), torch.randn(8, 5), torch.randn(5)]
    args0 += [torch.randn(8), torch.randn(8), torch.randn(6, 5)]

    def fwd_bwd(x, w, b, lw, lb, g):
        leaves = [t.detach().requires_grad_() for t in (x, w, b, lw, lb)]
        h, out = _ln_linear(*leaves)
        return (h.detach(), out, *torch.autograd.grad(out, leaves, g))

    gm = make_fx(fwd_bwd)(*args0)
    fn = compile_graph(gm, args0)
    args = fresh(args0)
    assert_same(list(fn(*args)), list(fwd_bwd(*args)), atol=1e-4, rtol=1e-4)
