"""aot_function / aot_module vs eager: forward outputs, mutated inputs and all gradients."""

from __future__ import annotations

import pytest
import torch
from capture_compare import assert_same, check_fn, clone_inputs, grads_of

from stoker_capture import aot_function, aot_module


def test_mlp_function() -> None:
    def f(x, w1, w2):
        return torch.tanh(x @ w1) @ w2

    check_fn(
        f,
        aot_function(f),
        lambda: [
            torch.randn(4, 3),
            torch.randn(3, 5, requires_grad=True),
            torch.randn(5, 2, requires_grad=True),
        ],
    )


def test_input_data_mutation() -> None:
    def f(x, y):
        x.add_(y)
        return x * y

    check_fn(f, aot_function(f), lambda: [torch.randn(4, 3), torch.randn(4, 3, requires_grad=True)])


def test_input_mutation_of_a_non_leaf_that_requires_grad() -> None:
    def f(x, y):
        x.mul_(y)
        return x.sin()

    compiled = aot_function(f)
    w = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    outs, grads = [], []
    for fn in (f, compiled):
        x = w * 2  # a non-leaf: mutating it is allowed, and it has history
        out = fn(x, y)
        outs.append((out, x))
        grads.append(grads_of((out, x), [w, y]))
    assert_same(outs[1], outs[0])
    assert_same(grads[1], grads[0])


def test_input_metadata_mutation() -> None:
    def f(x, y):
        x.t_()
        return x @ y

    check_fn(f, aot_function(f), lambda: [torch.randn(3, 4), torch.randn(3, 2, requires_grad=True)])


def test_outputs_alias_inputs_and_each_other() -> None:
    def f(x, y):
        z = x * 2
        return x.view(-1), y.t(), z, z[0], y, z.view(2, -1)[1]

    compiled = aot_function(f)
    check_fn(
        f,
        compiled,
        lambda: [torch.randn(4, 3, requires_grad=True), torch.randn(2, 5, requires_grad=True)],
    )
    x, y = torch.randn(4, 3), torch.randn(2, 5)
    out = compiled(x, y)
    assert out[0]._base is x and out[1]._base is y and out[4] is y
    assert out[3]._base is out[2] and out[5]._base is out[2]


def test_outputs_aliasing_an_intermediate() -> None:
    def f(x):
        z = x.exp()
        return z[0], z[1]

    compiled = aot_function(f)
    check_fn(f, compiled, lambda: [torch.randn(2, 3, requires_grad=True)])
    a, b = compiled(torch.randn(2, 3))
    assert a.untyped_storage()._cdata == b.untyped_storage()._cdata


def test_non_float_and_detached_outputs() -> None:
    def f(x):
        y = x * 3
        return (
            x.argmax(1),
            x.detach() * 2,
            x.sum(),
            x.shape[0] * 2,
            "tag",
            x.detach(),
            y,
            y.detach()[0],
        )

    check_fn(f, aot_function(f), lambda: [torch.randn(3, 4, requires_grad=True)])


def test_batchnorm_training_updates_running_stats() -> None:
    torch.manual_seed(0)
    m_e = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    m_c = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    m_c.load_state_dict(m_e.state_dict())
    compiled = aot_module(m_c)
    for _ in range(2):
        x = torch.randn(2, 3, 6, 6)
        out_e, out_c = m_e(x), compiled(x)
        assert_same(out_c, out_e, atol=1e-5, rtol=1e-4)
        assert_same(
            grads_of(out_c, list(m_c.parameters())),
            grads_of(out_e, list(m_e.parameters())),
            atol=1e-4,
            rtol=1e-4,
        )
    for (n, a), (_, b) in zip(m_c.named_buffers(), m_e.named_buffers()):
        torch.testing.assert_close(a, b, msg=n)
    assert int(m_c[1].num_batches_tracked) == 2


def test_tied_weights() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.out = torch.nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx):
            return self.out(self.emb(idx).tanh())

    m = Tied()
    compiled = aot_module(m)
    idx = torch.randint(0, 10, (3, 5))
    out_c = compiled(idx)
    g_c = grads_of(out_c, [m.emb.weight])
    out_e = m(idx)
    g_e = grads_of(out_e, [m.emb.weight])
    assert_same(out_c, out_e)
    assert_same(g_c, g_e)


def test_no_grad_takes_the_inference_path() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ref.load_state_dict(m.state_dict())
    compiled = aot_module(m)
    x = torch.randn(6, 4)
    with torch.no_grad():
        out = compiled(x)
        assert_same(out, ref(x))
    assert not out.requires_grad
    assert_same(m.state_dict(), ref.state_dict())
    assert compiled.cache_stats(grad=False)["misses"] == 1
    assert compiled.cache_stats(grad=True)["misses"] == 0
    out = compiled(x)  # grad mode: a separate, joint compilation
    assert out.requires_grad and compiled.cache_stats(grad=True)["misses"] == 1


def test_retain_graph_backward_twice() -> None:
    lin = torch.nn.Linear(3, 3)
    compiled = aot_module(lin)
    x = torch.randn(2, 3)
    out = compiled(x).pow(2).sum()
    out.backward(retain_graph=True)
    g1 = lin.weight.grad.clone()
    out.backward()
    torch.testing.assert_close(lin.weight.grad, 2 * g1)
    lin.weight.grad = None
    lin(x).pow(2).sum().backward()
    torch.testing.assert_close(lin.weight.grad, g1)


def test_transformer_encoder_layer() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True
    )
    compiled = aot_module(layer)
    x = torch.randn(2, 5, 16, requires_grad=True)
    xe, xc = clone_inputs([x, x])
    out_c, out_e = compiled(xc), layer(xe)
    assert_same(out_c, out_e, atol=1e-5, rtol=1e-4)
    params = list(layer.parameters())
    assert_same(
        grads_of(out_c, [xc, *params]), grads_of(out_e, [xe, *params]), atol=1e-4, rtol=1e-4
    )


def test_symbolic_number_outputs_under_dynamic_shapes() -> None:
    def f(x):
        return x.sin(), x.shape[0] * 2

    compiled = aot_function(f, dynamic="dynamic")
    for n in (3, 5):
        check_fn(f, compiled, lambda n=n: [torch.randn(n, 2, requires_grad=True)])
    assert compiled.cache_stats()["misses"] == 1


def test_train_eval_switch_recompiles() -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ref.load_state_dict(m.state_dict())
    compiled = aot_module(m)
    x = torch.randn(8, 4)
    assert_same(compiled(x), ref(x))
    m.eval(), ref.eval()  # BatchNorm now uses running stats: another graph
    assert_same(compiled(x), ref(x))
    m.train(), ref.train()
    assert_same(compiled(x), ref(x))
    assert_same(m.state_dict(), ref.state_dict())


def test_closure_over_a_tensor_is_a_clear_error() -> None:
    import pytest

    from stoker_capture import UnsupportedError

    bias = torch.randn(3)
    compiled = aot_function(lambda x: x + bias)
    with pytest.raises(UnsupportedError, match="not one of its inputs"):
        compiled(torch.randn(2, 3))


@pytest.mark.parametrize("name", ["lstm", "mha_with_mask_kwarg"])
def test_more_modules(name: str) -> None:
    torch.manual_seed(0)
    kwargs: dict = {}
    if name == "lstm":
        m: torch.nn.Module = torch.nn.LSTM(4, 5, batch_first=True)
        args: tuple = (torch.randn(2, 3, 4),)
    else:
        m = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        args = (torch.randn(2, 4, 8),) * 3
        kwargs = {
            "attn_mask": torch.triu(torch.ones(4, 4, dtype=torch.bool), 1),
            "need_weights": False,
        }
    compiled = aot_module(m)
    out_c, out_e = compiled(*args, **kwargs), m(*args, **kwargs)
    assert_same(out_c, out_e, atol=1e-5, rtol=1e-4)
    params = list(m.parameters())
    assert_same(grads_of(out_c, params), grads_of(out_e, params), atol=1e-4, rtol=1e-4)


def test_dropout_draws_fresh_masks_per_call() -> None:
    compiled = aot_module(torch.nn.Dropout(0.5))
    x = torch.ones(2000, requires_grad=True)
    a, b = compiled(x), compiled(x)
    assert not torch.equal(a, b)  # not a mask baked in at capture
    assert set(a.detach().unique().tolist()) <= {0.0, 2.0}
    (g,) = torch.autograd.grad(a.sum(), x)
    torch.testing.assert_close(g, a.detach())  # the backward uses the same mask


def test_parameter_mutated_under_no_grad_in_forward() -> None:
    class Clamped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)  # weight clipping inside forward
            return self.lin(x)

    torch.manual_seed(0)
    m, ref = Clamped(), Clamped()
    ref.load_state_dict(m.state_dict())
    compiled = aot_module(m)
    x = torch.randn(2, 3)
    out_c, out_e = compiled(x), ref(x)
    assert_same(out_c, out_e)
    assert_same(m.state_dict(), ref.state_dict())
    assert_same(grads_of(out_c, list(m.parameters())), grads_of(out_e, list(ref.parameters())))


@pytest.mark.parametrize("dynamic", ["auto", "dynamic"])
def test_data_dependent_output_sizes(dynamic: str) -> None:
    def f(x):
        return x[x > 0] * 2, torch.nonzero(x > 0), x[x > 0].sum()

    compiled = aot_function(f, dynamic=dynamic)
    for n in (6, 9):
        check_fn(f, compiled, lambda n=n: [torch.randn(n, requires_grad=True)])
    with torch.no_grad():
        x = torch.randn(7)
        assert_same(compiled(x), f(x))


def test_forward_hook_added_after_compiling_is_seen() -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    compiled = aot_module(m)
    x = torch.randn(2, 3)
    assert_same(compiled(x), m(x))
    handle = m[0].register_forward_hook(lambda mod, args, out: out * 2)
    assert_same(compiled(x), m(x))  # a new graph with the hook traced in
    handle.remove()
    assert_same(compiled(x), m(x))


@pytest.mark.parametrize("grad", [True, False])
def test_linalg_error_check_is_kept_and_raises(grad: bool) -> None:
    # torch 2.13 registers aten._linalg_check_errors as an ordered side effect;
    # capture records it as a plain call, which must survive to the compiled graph
    def f(a, b):
        return torch.linalg.solve(a, b) + torch.linalg.inv(a)

    graphs: list[str] = []

    def compiler(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    compiled = aot_function(f, compiler, dynamic="static", debug_checks=True)

    def make() -> list[torch.Tensor]:
        a = torch.randn(3, 3, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
        return [a.requires_grad_(grad), torch.randn(3, 3, dtype=torch.float64, requires_grad=grad)]

    with torch.set_grad_enabled(grad):
        check_fn(f, compiled, make)
        assert "_linalg_check_errors" in graphs[0]
        singular = torch.zeros(3, 3, dtype=torch.float64, requires_grad=grad)
        with pytest.raises(torch.linalg.LinAlgError, match="singular"):
            f(singular, torch.randn(3, 3, dtype=torch.float64))  # eager raises ...
        with pytest.raises(torch.linalg.LinAlgError, match="singular"):
            compiled(singular, torch.randn(3, 3, dtype=torch.float64))  # ... and so does capture


def test_outputs_aliasing_with_another_dtype() -> None:
    # a view of an input (or of another output) in another dtype comes back in that
    # dtype, still a view of its base, with eager's gradients
    def f(x, c):
        z = x * 2
        return (
            torch.view_as_complex(x),
            torch.view_as_real(c),
            z,
            torch.view_as_complex(z)[1:],
            x[1].view(torch.int32),
        )

    compiled = aot_function(f)
    check_fn(
        f,
        compiled,
        lambda: [
            torch.randn(3, 2, requires_grad=True),
            torch.randn(4, dtype=torch.complex64, requires_grad=True),
        ],
    )
    x, c = torch.randn(3, 2), torch.randn(4, dtype=torch.complex64)
    with torch.no_grad():
        out = compiled(x, c)
    want = f(x, c)
    assert [o.dtype for o in out] == [w.dtype for w in want]
    assert_same(out, want)
    assert out[0]._base is x and out[1]._base is c
    assert out[4].untyped_storage()._cdata == x.untyped_storage()._cdata
    assert out[3].untyped_storage()._cdata == out[2].untyped_storage()._cdata


@pytest.mark.parametrize("structure", ["single", "tuple", "nested"])
def test_fresh_outputs_in_each_structure(structure: str) -> None:
    """Only fresh outputs, no mutation: the runtime returns the graph's outputs as they
    are (its steady fast path), in the function's own output structure."""

    def f(x, w):
        y = torch.tanh(x @ w)
        if structure == "single":
            return y
        if structure == "tuple":
            return y, y.sum(), (x * 2).relu()
        return {"y": y, "rest": [y.sum(), {"z": (x * 2).relu()}]}

    check_fn(
        f,
        aot_function(f),
        lambda: [torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)],
    )


def test_the_callers_saved_tensor_hooks_see_no_traced_tensor() -> None:
    """A compile inside ``saved_tensors_hooks`` (a checkpoint's recomputation, CPU
    offloading): the hooks get the compiled Function's real saved tensors at run time,
    never the fake tensors of the trace (a checkpoint's hook stopped the trace)."""
    seen: list[str] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(type(t).__name__)
        return t

    f = aot_function(lambda x: (x.sin() * x).sum())
    x = torch.randn(4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = f(x)  # the first call compiles, inside the hooks
    y.backward()
    assert seen and set(seen) == {"Tensor"}, seen
    torch.testing.assert_close(x.grad, x.detach().cos() * x.detach() + x.detach().sin())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("batched", [True, False])
def test_multilabel_margin_loss_stops_at_the_first_minus_one(reduction: str, batched: bool) -> None:
    """torch's decomposition counted the target slots after the first -1 as class 0
    (`torch_fixes.py`); eager stops there."""
    shape = (3, 4) if batched else (4,)
    target = torch.full(shape, -1)
    target[..., :2] = torch.tensor([2, 0])  # the slots after the -1 still hold a class
    target[..., 3] = 1
    if batched:
        target[1, 1] = -1

    def f(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.multilabel_margin_loss(x, t, reduction=reduction)

    def make_args() -> list[torch.Tensor]:
        return [torch.randn(shape, requires_grad=True), target]

    check_fn(f, aot_function(f), make_args, atol=1e-5, rtol=1e-4)


def test_torch_decomposition_fix_is_undone_after_tracing() -> None:
    from stoker_capture._internal.tracing.torch_fixes import _FIXES

    before = {op: op.py_kernels.get(torch._C.DispatchKey.Autograd) for op in _FIXES}
    aot_function(lambda x: x.sin())(torch.randn(3, requires_grad=True)).sum().backward()
    assert {op: op.py_kernels.get(torch._C.DispatchKey.Autograd) for op in _FIXES} == before
