"""No-op copies (`lowering/noop.py`): a same-layout clone reads its input's
buffer, unless an output, an input mutation or an in-place write could see the
aliasing."""

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from triton_helpers import assert_same, check, fresh, trace

from stoker_triton import compile_graph
from stoker_triton._internal.lowering.noop import noop_copies


def _stores(fn) -> int:
    return fn.wrapper_source.count("empty_strided(")


def _attn(s, v):
    p = torch.softmax(s, -1)
    return p, torch.bmm(p.clone(), v)  # the forward saves `p`; the bmm reads a clone of it


def test_softmax_clone_bmm_stores_softmax_once():
    s, v = torch.randn(2, 4, 8), torch.randn(2, 8, 3)
    gm = trace(_attn, s, v)
    assert [n.target for n in noop_copies(gm)] == [torch.ops.aten.clone.default]
    fn = check(_attn, s, v)
    # one (2, 4, 8) buffer (the output the bmm reads), not a second store of it
    assert _stores(fn) == 1, fn.wrapper_source
    assert fn.wrapper_source.count("kernel0.go(") == 1, fn.wrapper_source


def test_softmax_clone_bmm_gradients_match_eager():
    s0, v0 = torch.randn(2, 4, 8), torch.randn(2, 8, 3)

    def fwd_bwd(s, v, g):
        s, v = s.detach().requires_grad_(), v.detach().requires_grad_()
        out = torch.bmm(torch.softmax(s, -1).clone(), v)
        return (out, *torch.autograd.grad(out, (s, v), g))

    g0 = torch.randn(2, 4, 3)
    gm = make_fx(fwd_bwd)(s0, v0, g0)
    assert noop_copies(gm)  # the rule fires on the forward's clone
    fn = compile_graph(gm, [s0, v0, g0])
    args = fresh([s0, v0, g0])
    assert_same(list(fn(*args)), list(fwd_bwd(*args)), atol=1e-5, rtol=1e-4)


def test_clone_that_is_an_output_is_its_own_tensor():
    def f(x):
        y = x * 2
        return y, y.clone(), x.clone().view(-1)

    x = torch.randn(3, 4)
    assert not noop_copies(trace(f, x))
    fn = check(f, x)
    a = torch.randn(3, 4)
    y, c, cx = fn(a)
    c.add_(1)
    cx.add_(1)
    assert_same([y, a], [a * 2, a])  # neither the other output nor the input changed
    assert c.data_ptr() != y.data_ptr() and cx.data_ptr() != a.data_ptr()


@pytest.mark.parametrize("functional", [True, False])
def test_clone_of_a_mutated_input_is_not_aliased(functional):
    """Also a write-after-read check: values read from `x` before the write
    (the clone, `x * 2`) are stored before it, not computed after it."""

    def f(x):
        y = x.clone()
        x.mul_(2)
        return y + 1, x + 0

    x = torch.randn(3, 4)
    if functional:  # as captured graphs mutate inputs: functional ops, then `copy_`
        gm = make_fx(torch.func.functionalize(f, remove="mutations_and_views"))(x)
    else:
        gm = trace(f, x)
    written = {torch.ops.aten.copy_.default, torch.ops.aten.mul_.Tensor}
    assert written & {n.target for n in gm.graph.nodes}
    assert not noop_copies(gm)
    fn = compile_graph(gm, [x])
    a = torch.randn(3, 4)
    a0 = a.clone()
    out = fn(a)
    assert_same(list(out), [a0 + 1, a0 * 2])
    assert_same(a, a0 * 2)


def test_clone_with_another_layout_still_copies():
    def f(x, w):
        return torch.mm(x.t().clone(memory_format=torch.contiguous_format), w)

    x, w = torch.randn(4, 3), torch.randn(4, 5)
    assert not noop_copies(trace(f, x, w))  # the transpose's clone is contiguous
    fn = check(f, x, w)
    assert "as_strided(arg0" not in fn.wrapper_source  # mm reads a contiguous copy


class _WritesItsInput(torch._ops.HigherOrderOperator):
    def __call__(self, x):
        return super().__call__(x)


def test_a_higher_order_op_counts_as_writing_its_tensors():
    """A higher-order op (a user Triton kernel, `auto_functionalized`) states
    no writes in a schema: the clone of a tensor it takes stays a copy."""

    def f(x):
        return x.clone() * 2, x + 1

    x = torch.randn(3, 4)
    gm = trace(f, x)
    assert noop_copies(gm)  # x is not written: the clone reads x
    hop = _WritesItsInput("stoker_test_writes_its_input")
    add = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor)
    with gm.graph.inserting_after(add):
        gm.graph.call_function(hop, (add.args[0],))
    assert not noop_copies(gm)


def test_a_multi_output_value_read_after_an_in_place_write_keeps_the_old_values():
    def f(x):
        parts = (x * 2).split(2)
        x.mul_(3)
        return parts[0] + 1, parts[1] + 1, x + 0

    x = torch.randn(4, 3)
    gm = trace(f, x)
    write = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mul_.Tensor)
    for n in [n for n in gm.graph.nodes if n.target is operator.getitem]:
        write.append(n)  # the split's getitems after the write (a graph may order them so)
    gm.recompile()
    fn = compile_graph(gm, [x])
    a = torch.randn(4, 3)
    a0 = a.clone()
    assert_same(list(fn(a)), [a0[:2] * 2 + 1, a0[2:] * 2 + 1, a0 * 3])
