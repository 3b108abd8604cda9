"""View lowerings (index arithmetic, no copies), cat, constant_pad_nd, extern calls on strided views."""

import torch
import torch.nn.functional as F
from triton_helpers import check


def test_permute_transpose_expand():
    x = torch.randn(2, 3, 4)
    check(
        lambda x: (x.permute(2, 0, 1) + 1, x.transpose(0, 2) * 2, x[:, :1].expand(2, 5, 4) - 1), x
    )


def test_slice_select_squeeze_unsqueeze():
    x = torch.randn(4, 1, 6)
    check(
        lambda x: (
            x[1:3, :, ::2] + 1,
            x[:, 0, -2] * 2,
            x.squeeze(1).exp(),
            x.unsqueeze(0).unsqueeze(-1).sin(),
            x[..., -3:] + 0,
        ),
        x,
    )


def test_view_reshape_groups():
    x = torch.randn(2, 3, 4)
    check(
        lambda x: (
            x.view(6, 4) + 1,
            x.reshape(2, 12) * 2,
            x.reshape(24).cos(),
            x.view(2, 3, 2, 2) - 1,
            x.permute(1, 0, 2).reshape(3, 8) + 1,
            x.view(4, 6) * 3,
        ),
        x,
    )


def test_view_of_noncontiguous_input():
    x = torch.randn(6, 4).t()
    check(lambda x: (x.reshape(24) + 1, x.reshape(2, 2, 6) * 2), x)


def test_as_strided():
    x = torch.randn(16)
    check(
        lambda x: (
            torch.as_strided(x, (3, 3), (4, 1), 2) + 1,
            torch.as_strided(x + 1, (2, 4), (1, 2)) * 2,
        ),
        x,
    )


def test_cat_and_pad():
    a, b = torch.randn(3, 4), torch.randn(2, 4)
    check(
        lambda a, b: (
            torch.cat([a, b]) + 1,
            torch.cat([a, a * 2], 1),
            F.pad(a, (1, 2)),
            F.pad(a, (0, 1, 2, 0), value=3.0),
            F.pad(a, (-1, 1)),
        ),
        a,
        b,
    )


def test_split():
    x = torch.randn(6, 5)
    check(lambda x: [t * 2 for t in torch.split(x, [2, 4])] + [t + 1 for t in x.split(2, dim=1)], x)


def test_extern_matmul_takes_strided_view_without_copy():
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    fn = check(
        lambda x, w, b: (F.linear(x, w, b).relu(), x @ w.t() + 1, torch.bmm(x[None], w.t()[None])),
        x,
        w,
        b,
    )
    assert (
        "aten.mm.default" in fn.report.extern_calls
        or "aten.addmm.default" in fn.report.extern_calls
    )
    assert not fn.report.fallback_ops  # mm/addmm/bmm are extern by design, not fallbacks
    assert "as_strided(arg1" in fn.wrapper_source  # w.t() reaches mm as a view


def test_outputs_that_alias_inputs():
    x = torch.randn(4, 4)
    check(lambda x: (x, x.t(), x[1], x + 1), x)


def test_clone_is_a_copy_and_contiguous_for_externs():
    x = torch.randn(4, 6)
    gm_fn = check(lambda x: (x.clone(), torch.ops.aten.cumsum(x.t().contiguous(), 0)), x)
    out = gm_fn(x)
    assert out[0].data_ptr() != x.data_ptr()  # a clone never aliases its input


def test_empty_and_zero_size_tensors():
    x = torch.randn(0, 5)
    check(lambda x: (x + 1, x.sum(0), torch.zeros(2, 0) * 2, torch.eye(0)), x)


def test_backward_graphs_with_in_place_copies_and_expanded_extern_results():
    # make_fx of autograd.grad without functionalization leaves copy_ into views
    # (as_strided backward) and diagonal() of an expanded tensor (diag backward)
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)

    def f(x, y):
        a = torch.as_strided(x, (2, 2), (1, 2), 1)
        return torch.autograd.grad((a * a).sum() + torch.diag(y).sum(), [x, y])

    check(f, x, y)


def test_writes_through_an_extern_view_reach_the_base():
    # householder_product's backward: copy_ into diagonal(where(...)), then reads of where(...)
    x = torch.randn(5, 5)

    def f(x):
        w = torch.where(x > 0, x, 0.0)
        d = torch.ops.aten.diagonal.default(w, 0, -2, -1)
        torch.ops.aten.copy_.default(d, torch.ones(5))
        return ((w * 2).sum(0), w[:, :2] + 1)

    check(f, x)


def test_a_clone_taken_before_an_in_place_write_keeps_the_old_values():
    # margin_ranking_loss's joint graph: clone(add), then clamp_min_(add)
    x = torch.randn(6)

    def f(x):
        a = x * 2 - 1
        c = torch.ops.aten.clone.default(a)
        m = torch.ops.aten.clamp_min_.default(a, 0)
        return (c + 0, m.sum(), a * 1)

    check(f, x)


def test_expanded_outputs_keep_the_graphs_strides():
    # a forward that saves `norm.expand_as(x)` for its backward: the backward is
    # compiled for stride 0 along the expanded dim, so the forward must return that
    from triton_helpers import trace

    from stoker_triton import compile_graph

    x = torch.randn(5, 7)

    def f(x):
        return (
            # pointwise after the reduction: the expanded value is not a stored buffer
            x.norm(dim=1, keepdim=True).clamp_min(1e-3).expand_as(x),
            (x.amax(0) + 1).expand(3, 7).t(),
            x.sum(1, keepdim=True).expand(5, 7) * x,
        )

    check(f, x)
    out, ref = compile_graph(trace(f, x), [x])(x), f(x)
    assert [o.stride() for o in out] == [o.stride() for o in ref] == [(1, 0), (1, 0), (7, 1)]


def test_normalize_forward_and_backward_as_aot_compiler():
    from functorch.compile import aot_function

    from stoker_triton import compile_graph

    def f(x):
        return F.normalize(x, dim=1) * 2

    compiled = aot_function(f, fw_compiler=compile_graph, bw_compiler=compile_graph)
    for _ in range(2):
        a = torch.randn(4, 6, requires_grad=True)
        out, ref = compiled(a), f(a)
        torch.testing.assert_close(out, ref)
        w = torch.randn(4, 6)
        (g,) = torch.autograd.grad((out * w).sum(), a)
        (ge,) = torch.autograd.grad((ref * w).sum(), a)
        torch.testing.assert_close(g, ge)


def test_slice_scatter_is_a_kernel_not_a_fallback():
    """`slice_scatter` (a functionalized write into a slice: circular padding is made
    of them) was an aten fallback."""
    x, s = torch.randn(3, 8), torch.randn(3, 2)
    fn = check(
        lambda x, s: (
            torch.slice_scatter(x, s.sin(), 1, 2, 4),
            torch.slice_scatter(x, s, 1, -3, -1) * 2,
            torch.slice_scatter(x, x[:1].cos(), 0, 2),
            torch.slice_scatter(x, s.exp(), 1, 1, 8, 4),  # a step
        ),
        x,
        s,
    )
    assert not fn.report.fallback_ops, fn.report.fallback_ops
