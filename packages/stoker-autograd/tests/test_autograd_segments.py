"""SegmentedBackward: what the compiler gets (tensors, never a tuple), where segments are
cut (at Python calls only, never at an accumulate-grad), and that the gradients, the
``.grad`` each hook sees and stealing match eager."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import stoker_autograd
from stoker_autograd._internal.ops import call_hook
from stoker_autograd._internal.segments import SegmentedBackward


def test_items_of_a_multi_output_op_stay_in_its_segment() -> None:
    # x -> var_mean (a tuple) -> an opaque hook -> items of the tuple used after the hook
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 3)
    hook = g.placeholder("hook")  # hooks reach the graph as inputs
    vm = g.call_function(torch.ops.aten.var_mean.correction, (x, [1]), {"keepdim": True})
    hooked = g.call_function(call_hook, (hook, x), {"hook_type": "tensor_pre_hook"})
    var = g.call_function(operator.getitem, (vm, 0))
    mean = g.call_function(operator.getitem, (vm, 1))
    out = g.call_function(torch.ops.aten.add.Tensor, (var, mean))
    out2 = g.call_function(torch.ops.aten.mul.Tensor, (out, hooked))
    g.output((out2,))
    gm = fx.GraphModule(torch.nn.Module(), g)

    seen: list[list[Any]] = []

    def compiler(sub: fx.GraphModule, examples: list[Any]) -> Any:
        seen.append(list(examples))
        for node in sub.graph.nodes:
            if node.op == "output":
                targets = [a.target for a in node.args[0]]
                assert torch.ops.aten.var_mean.correction not in targets, "returned the tuple"
        return sub

    run = SegmentedBackward(gm, compiler)
    assert len(seen) == 2 and not any(isinstance(e, tuple) for ex in seen for e in ex)
    t = torch.randn(4, 3)
    v, m = torch.var_mean(t, 1, keepdim=True)
    torch.testing.assert_close(run(t, lambda a: a * 2)[0], (v + m) * (t * 2))


def _items_graph(uses_made_backwards: bool) -> fx.GraphModule:
    """var_mean's two items, in graph order var then mean; their uses made in that
    order, or mean's first (as a retrace may make them: `n.users` follows the uses)."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 3)
    vm = g.call_function(torch.ops.aten.var_mean.correction, (x, [1]), {"keepdim": True})
    if uses_made_backwards:
        mean = g.call_function(operator.getitem, (vm, 1))
        with g.inserting_before(mean):
            var = g.call_function(operator.getitem, (vm, 0))
    else:
        var = g.call_function(operator.getitem, (vm, 0))
        mean = g.call_function(operator.getitem, (vm, 1))
    g.output((var, mean))
    return fx.GraphModule(torch.nn.Module(), g)


def test_items_follow_graph_order_not_the_order_their_uses_were_made() -> None:
    """The segments' code, hence stoker-triton's cache key, must not depend on how the
    graph was built: a retraced backward and the same graph loaded from the autograd
    disk cache (built node by node, in graph order) gave a layer norm's two gradient
    items in swapped order, so every warm start missed the compiled-graph cache."""
    codes = []
    for backwards in (False, True):
        rec = _Recorder()
        SegmentedBackward(_items_graph(backwards), rec)
        (sub,) = rec.segments
        pos = {n: i for i, n in enumerate(sub.graph.nodes)}  # names differ; places do not
        codes.append(
            [(n.op, n.target, fx.map_arg(n.args, pos.__getitem__)) for n in sub.graph.nodes]
        )
    assert codes[0] == codes[1], codes


# ------------------------------------------------ accumulate-grad does not cut a segment
class _Recorder:
    """A compiler that counts the segments it gets and runs each as it is."""

    def __init__(self) -> None:
        self.segments: list[fx.GraphModule] = []
        self.outputs: list[int] = []  # storage of every tensor a segment returned

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.segments.append(gm)

        def run(*args: Any) -> Any:
            outs = gm(*args)
            self.outputs += [o.untyped_storage().data_ptr() for o in outs]
            return outs

        return run


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))


Step = Callable[[nn.Module, list[Any]], None]


def _plain(m: nn.Module, log: list[Any]) -> None:
    m.zero_grad()
    m(torch.randn(4, 6)).pow(2).sum().backward()


def _run(
    make: Callable[[], nn.Module], step: Step, steps: int = 3
) -> tuple[_Recorder, list[Any], list[Any], nn.Module]:
    """Runs ``step`` eagerly and compiled (seed by seed); compares every ``.grad`` after
    every step and what the steps logged (hooks log the ``.grad`` they see)."""
    eager, compiled = make(), make()
    rec = _Recorder()
    log_e: list[Any] = []
    log_c: list[Any] = []
    for i in range(steps):
        torch.manual_seed(i)
        step(eager, log_e)
        log_e.append([p.grad.clone() if p.grad is not None else None for p in eager.parameters()])
    with stoker_autograd.enable(compiler=rec):
        for i in range(steps):
            torch.manual_seed(i)
            step(compiled, log_c)
            log_c.append(
                [p.grad.clone() if p.grad is not None else None for p in compiled.parameters()]
            )
    assert stoker_autograd.stats()["cache_hits"] >= 1  # a compiled variant ran
    torch.testing.assert_close(log_c, log_e, atol=1e-5, rtol=1e-4)
    return rec, log_e, log_c, compiled


def _grads_now(m: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def test_mlp_backward_is_one_segment() -> None:
    rec, *_ = _run(_mlp, _plain)
    assert len(rec.segments) == 1
    assert stoker_autograd.stats()["segments"] == 1
    # the segment returns the six gradients; nothing in it writes .grad
    (out,) = [n for n in rec.segments[0].graph.nodes if n.op == "output"]
    assert len(out.args[0]) >= 6


def test_each_gradient_is_dropped_right_after_its_accumulate() -> None:
    """A copied gradient is freed before the next is copied (peak memory as when each
    accumulate-grad had its own segment)."""
    m = _mlp()
    with stoker_autograd.enable(compiler=_Recorder()) as session:
        for _ in range(2):
            _plain(m, [])
    run = session.graphs[0].variants[0].fn
    assert isinstance(run, SegmentedBackward)
    (seg,) = [s for s in run.steps if getattr(s, "accumulates", None)]
    assert len(seg.accumulates) == 6
    for (acc, _), drops in zip(seg.accumulates, seg.drops):
        assert drops == [acc.args[2]], (acc, drops)


def test_post_accumulate_grad_hook_cuts_and_sees_every_earlier_grad() -> None:
    def step(m: nn.Module, log: list[Any]) -> None:
        m.zero_grad()
        h = m[2].weight.register_post_accumulate_grad_hook(lambda p: log.append(_grads_now(m)))
        m(torch.randn(4, 6)).pow(2).sum().backward()
        h.remove()

    rec, log_e, *_ = _run(_mlp, step)
    assert len(rec.segments) == 2
    seen = log_e[0]  # what the hook saw: its own .grad and the later layer's, not the earlier
    assert seen[2] is not None and seen[4] is not None and seen[0] is None


def test_tensor_hook_on_a_parameter_cuts_and_sees_the_grads_before_it() -> None:
    def step(m: nn.Module, log: list[Any]) -> None:
        m.zero_grad()

        def hook(g: torch.Tensor) -> torch.Tensor:
            log.append(_grads_now(m))
            return g * 3

        h = m[2].bias.register_hook(hook)
        m(torch.randn(4, 6)).pow(2).sum().backward()
        h.remove()

    rec, *_ = _run(_mlp, step)
    assert len(rec.segments) == 2


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, m: nn.Module, log: list[Any]) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.model, ctx.log = m, log
        return x**3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # a custom backward sees the .grad of the layers after it, as eager shows it
        ctx.log.append(_grads_now(ctx.model))
        (x,) = ctx.saved_tensors
        return g * 3 * x**2, None, None


def test_custom_function_cuts_and_sees_the_grads_before_it() -> None:
    def step(m: nn.Module, log: list[Any]) -> None:
        m.zero_grad()
        y = _Cube.apply(m[1](m[0](torch.randn(4, 6))), m, log)
        m[2:](y).pow(2).sum().backward()

    rec, log_e, *_ = _run(_mlp, step)
    assert len(rec.segments) == 2
    assert log_e[0][4] is not None and log_e[0][0] is None


def test_grads_match_eager_first_assignment_then_accumulating() -> None:
    def step(m: nn.Module, log: list[Any]) -> None:  # no zero_grad: the 2nd step adds
        m(torch.randn(4, 6)).pow(2).sum().backward()

    rec, *_ = _run(_mlp, step)
    assert len(rec.segments) == 2  # .grad None, then defined: two captures, one segment each


def test_grads_match_eager_zero_grad_to_zeros() -> None:
    def step(m: nn.Module, log: list[Any]) -> None:
        m.zero_grad(set_to_none=False)
        m(torch.randn(4, 6)).pow(2).sum().backward()

    _run(_mlp, step, steps=4)


class _Shared(nn.Module):
    """A parameter used twice, and one stored transposed (strides (1, 4))."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4))
        self.t = nn.Parameter(torch.randn(6, 4).t())
        self.s = nn.Parameter(torch.randn(4, 6))  # elementwise: its gradient is a fresh mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.t.t() @ self.w) @ self.w
        return (h.sum(1, keepdim=True) * x * self.s).sum()


def test_param_used_twice_and_transposed_layout_match_eager() -> None:
    def step(m: nn.Module, log: list[Any]) -> None:
        m.zero_grad()
        m(torch.randn(3, 6).expand(4, 3, 6).reshape(12, 6)[:4]).backward()
        log.append([p.grad.stride() for p in m.parameters()])  # type: ignore[union-attr]

    rec, *_, m = _run(_Shared, step)
    assert len(rec.segments) == 1
    assert m.t.grad is not None and m.t.grad.stride() == (1, 4)


def test_a_fresh_gradient_is_stolen_then_added_in_place_as_eager_does() -> None:
    """First backward: ``.grad`` is the segment's own output (no copy).  Second: the
    same tensor object, added into in place.  A view, or a tensor the hook keeps, is
    copied instead."""
    m = _Shared()
    rec = _Recorder()
    with stoker_autograd.enable(compiler=rec):
        for _ in range(2):  # the first run is uncompiled; the second compiles
            m.zero_grad()
            m(torch.randn(4, 6)).backward()
        m.zero_grad()
        rec.outputs.clear()
        m(torch.randn(4, 6)).backward()
        first = m.s.grad
        assert first is not None
        assert first.untyped_storage().data_ptr() in rec.outputs  # stolen
        m(torch.randn(4, 6)).backward()
        assert m.s.grad is first  # accumulated in place, as eager
        # .w's gradient is a sum of two matmuls' results: stolen or not, never aliased
        assert m.w.grad is not None and m.w.grad.untyped_storage().data_ptr() not in [
            p.untyped_storage().data_ptr() for p in (m.s.grad, m.t.grad)
        ]


def _stolen(
    make: Callable[[], nn.Module], watched: Callable[[nn.Module], list[nn.Parameter]]
) -> tuple[list[bool], nn.Module, nn.Module, _Recorder]:
    """Three steps of a compiled and an eager copy; whether each watched parameter's
    last `.grad` is memory a segment returned (stolen, not copied)."""
    m, e = make(), make()
    rec = _Recorder()
    stolen: list[bool] = []
    with stoker_autograd.enable(compiler=rec):
        for _ in range(3):
            x = torch.randn(4, 6)
            for model in (m, e):
                model.zero_grad()
                rec.outputs.clear()
                if model is e:
                    with stoker_autograd.disabled():
                        model(x).pow(2).sum().backward()
                else:
                    model(x).pow(2).sum().backward()
                    stolen = [
                        p.grad is not None and p.grad.untyped_storage().data_ptr() in rec.outputs
                        for p in watched(m)
                    ]
    for p, q in zip(m.parameters(), e.parameters()):
        assert p.grad is not None and q.grad is not None
        assert p.grad.stride() == q.grad.stride()
        torch.testing.assert_close(p.grad, q.grad)
    return stolen, m, e, rec


def test_linear_gradients_are_stolen_from_the_segment_as_eager_steals_them() -> None:
    """A Linear's weight gradient comes out as a transposed view of the segment's matmul
    buffer, its bias gradient as a view of a sum: views of memory nobody else holds,
    with the parameter's layout, so eager steals them and so does the runtime."""
    stolen, m, _, _ = _stolen(_mlp, lambda m: list(m.parameters()))
    assert stolen == [True] * 6, stolen
    assert all(p.grad is not None and p.grad._base is None for p in m.parameters())


def test_items_of_a_multi_output_backward_op_are_stolen_as_eager_steals_them() -> None:
    """A LayerNorm's weight and bias gradients are items of ``native_layer_norm_backward``'s
    output tuple (the op stays whole in the backward graph): fresh tensors nobody else
    holds, stolen as eager steals them, not copied into ``.grad``."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))

    stolen, _, _, rec = _stolen(make, lambda m: [m[1].weight, m[1].bias])
    targets = {n.target for gm in rec.segments for n in gm.graph.nodes}
    assert torch.ops.aten.native_layer_norm_backward.default in targets
    assert stolen == [True, True], stolen


def test_static_outputs_are_copied_into_grad_never_stolen() -> None:
    """A compiled segment that says ``static_outputs`` (a CUDA graph's buffers, overwritten by
    its next replay) hands out gradients that accumulate-grad must copy."""

    kept: list[torch.Tensor] = []  # alive, so no later tensor can reuse their memory

    class _Static(_Recorder):
        def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
            run = super().__call__(gm, example_inputs)

            class Fn:
                static_outputs = True

                def __call__(self, *args: Any) -> Any:
                    outs = run(*args)
                    kept.extend(outs)
                    return outs

            return Fn()

    m, e = _mlp(), _mlp()
    rec = _Static()
    ran = 0  # the first backward of a new graph runs eagerly
    with stoker_autograd.enable(compiler=rec):
        for _ in range(3):
            x = torch.randn(4, 6)
            m.zero_grad()
            rec.outputs.clear()
            m(x).pow(2).sum().backward()
            ran += bool(rec.outputs)
            assert not any(
                p.grad.untyped_storage().data_ptr() in rec.outputs  # type: ignore[union-attr]
                for p in m.parameters()
            )
            e.zero_grad()
            with stoker_autograd.disabled():
                e(x).pow(2).sum().backward()
            for p, q in zip(m.parameters(), e.parameters()):
                assert p.grad is not None and q.grad is not None
                assert p.grad.stride() == q.grad.stride()
                torch.testing.assert_close(p.grad, q.grad)
    assert ran >= 2


class _Twins(nn.Module):
    """Two parameters whose gradients are equal: a compiler may return one tensor for both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.randn(4, 6))
        self.b = nn.Parameter(torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.a).sum() + (x * self.b).sum()


def _cse(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A compiler that hands back one tensor for outputs of equal value."""

    def run(*args: Any) -> Any:
        outs: list[torch.Tensor] = []
        for o in gm(*args):
            same = [p for p in outs if p.shape == o.shape and torch.equal(p, o)]
            outs.append(same[0] if same else o)
        return tuple(outs)

    return run


def test_a_gradient_the_compiler_returns_twice_is_not_stolen() -> None:
    """Stealing one tensor into two ``.grad`` would alias them, and the next in-place
    accumulation would add twice: such a gradient is copied."""
    e, m = _Twins(), _Twins()
    with stoker_autograd.enable(compiler=_cse):
        for i in range(4):  # zero_grad every other step: stolen/copied, then accumulated
            x = torch.randn(4, 6)
            for model in (e, m):
                if i % 2 == 0:
                    model.zero_grad()
                if model is e:
                    with stoker_autograd.disabled():
                        model(x).backward()
                else:
                    model(x).backward()
            assert m.a.grad is not None and m.b.grad is not None
            assert m.a.grad.untyped_storage().data_ptr() != m.b.grad.untyped_storage().data_ptr()
            torch.testing.assert_close(m.a.grad, e.a.grad)
            torch.testing.assert_close(m.b.grad, e.b.grad)
    assert stoker_autograd.stats()["cache_hits"] >= 1


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a * x


def _returns_its_inputs(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A compiler that hands back an input tensor for an output of equal value."""

    def run(*args: Any) -> Any:
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        outs = []
        for o in gm(*args):
            same = [i for i in ins if i.shape == o.shape and torch.equal(i, o)]
            outs.append(same[0] if same else o)
        return tuple(outs)

    return run


def test_a_gradient_that_is_a_segment_input_is_copied_not_stolen() -> None:
    """A compiled segment may return one of its inputs as a gradient (here the
    caller's own ``gradient=`` tensor): its storage is held by one tensor only, yet
    that tensor is also an input, so stealing would make ``.grad`` the caller's
    tensor: it is copied, and changing the caller's tensor leaves ``.grad`` alone."""
    m = _Scale()
    x = torch.ones(4, 6)
    with stoker_autograd.enable(compiler=_returns_its_inputs):
        for _ in range(3):
            m.zero_grad()
            gout = torch.randn(4, 6)
            m(x).backward(gout)
            assert m.a.grad is not None
            assert m.a.grad.untyped_storage().data_ptr() != gout.untyped_storage().data_ptr()
            want = gout.clone()
            gout.zero_()
            torch.testing.assert_close(m.a.grad, want)
    assert stoker_autograd.stats()["cache_hits"] >= 1


def test_a_segment_makes_its_python_code_only_when_it_runs() -> None:
    """A compiler that loads a segment from its cache never runs the graph module: its
    code is not generated for it (gpt-m's backward: 643 nodes), yet runs when called."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 3)
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 3))
    z = g.call_function(torch.ops.aten.sin.default, (y,))
    g.output((z,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    given: list[fx.GraphModule] = []

    def compiler(sub: fx.GraphModule, examples: list[Any]) -> Any:
        given.append(sub)
        return sub

    run = SegmentedBackward(gm, compiler)
    (sub,) = given
    assert sub._needs_recompile()  # type: ignore[operator]  # a _LazyGraphModule
    ran = run.steps[0].fn  # what runs: what the compiler returned, boxed
    assert ran.graph is sub.graph  # the graph is not copied to box it
    assert not ran.has_code  # its code is made at the first call, not now
    t = torch.randn(4, 3)
    torch.testing.assert_close(run(t)[0], torch.sin(t * 3))
    assert ran.has_code
    assert sub._needs_recompile()  # the boxed code is the only code made
    assert "sin" in ran.code


# ---------------------------------------------------------------- segment counts per model
# Keep the compiled backward whole; cut only at real Python calls (user hooks,
# custom Functions). One capture per model below; the count is what a compiler is handed.


class _TinyGPT(nn.Module):
    """Embedding, pre-LN attention (softmax), GELU MLP, tied head: a language model's ops."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(8), nn.LayerNorm(8), nn.LayerNorm(8)
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        q, k, v = self.qkv(self.ln1(x)).split(8, dim=-1)
        mask = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).tril()
        att = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~mask, float("-inf"))
        x = x + self.proj(att.softmax(-1) @ v)
        x = x + self.mlp(self.ln2(x))
        return self.lnf(x) @ self.emb.weight.t()  # tied head: the embedding read twice


def _gpt_step(m: nn.Module, log: list[Any]) -> None:
    m.zero_grad()
    idx = torch.randint(0, 11, (2, 6))
    nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.roll(-1, 1).flatten()).backward()


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )


def _cnn_step(m: nn.Module, log: list[Any]) -> None:
    m.zero_grad()
    m(torch.randn(2, 3, 8, 8)).pow(2).sum().backward()


def _hooked_step(m: nn.Module, log: list[Any]) -> None:
    """Two user hooks: a tensor hook on a weight and a post-accumulate-grad hook."""
    m.zero_grad()
    h1 = m[2].weight.register_hook(lambda g: g * 2)
    h2 = m[0].bias.register_post_accumulate_grad_hook(lambda p: log.append(_grads_now(m)))
    m(torch.randn(4, 6)).pow(2).sum().backward()
    h1.remove(), h2.remove()


def _custom_step(m: nn.Module, log: list[Any]) -> None:
    m.zero_grad()
    m[2:](_Cube.apply(m[1](m[0](torch.randn(4, 6))), m, log)).pow(2).sum().backward()


@pytest.mark.parametrize(
    ("make", "step", "segments"),
    [
        (_mlp, _plain, 1),
        (_TinyGPT, _gpt_step, 1),  # layer norms, softmax, embedding, tied head: no cut
        (_cnn, _cnn_step, 1),  # convolution, batch norm (buffers), max-pool: no cut
        (_mlp, _hooked_step, 3),  # a cut at each of the two hooks
        (_mlp, _custom_step, 2),  # a cut at the custom Function's backward
    ],
    ids=["mlp", "tiny-gpt", "cnn-batchnorm", "two-hooks", "custom-function"],
)
def test_segment_count_per_model(make: Callable[[], nn.Module], step: Step, segments: int) -> None:
    rec, *_ = _run(make, step)
    assert stoker_autograd.stats()["captures"] == 1
    assert len(rec.segments) == segments, [s.graph for s in rec.segments]
    assert stoker_autograd.stats()["segments"] == segments  # what the report shows
