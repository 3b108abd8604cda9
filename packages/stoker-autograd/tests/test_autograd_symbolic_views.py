"""Views over symbolic sizes in the retrace: built from the sizes' expressions
(``retrace._known_view``) instead of torch's generic reshape, which decides every
split and merge through sympy.  The result must be the view torch's kernel makes
(same sizes and strides, as expressions), where it applies; where it does not
(``-1``, a merge of dims that are not one block, numels equal only at the hints) it
must leave the view to the kernel.  Likewise ``native_layer_norm``'s results
(``retrace._known_layer_norm``: a checkpointed block recomputes it in the backward).  End to end: a dynamic backward full of views
retraces without the generic reshape and its gradients equal eager's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import stoker_autograd
from stoker_autograd._internal import retrace, runtime
from stoker_shapes import Dim, ShapeContext, Source

stoker_capture = pytest.importorskip("stoker_capture")
aten = torch.ops.aten


def _fake(
    ctx: ShapeContext,
    shape: tuple[int, ...],
    dims: list[Any],
    arg: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A fake of ``shape`` with symbolic sizes where ``dims`` name a `Dim`; made outside
    the fake mode (a real tensor to fakeify)."""
    with ctx.fake_mode, torch._subclasses.fake_tensor.unset_fake_temporarily():
        real = torch.empty(shape, dtype=dtype)
    return ctx.fakeify(real, Source.arg(arg), dynamic=dims)


def _exprs(v: Any) -> list[Any]:
    return [retrace._expr(d) for d in v]


# (input shape, its dims' Dim names (None: static), view size from the input's sizes)
CASES = [
    ((4, 6, 8), ["b", "t", None], lambda b, t, c: [b * t, c]),  # merge
    ((24, 8), ["r", None], lambda r, c: [r, 2, 4]),  # split the static dim
    ((4, 6, 8), ["b", "t", None], lambda b, t, c: [b, t, 2, 4]),  # heads
    ((4, 6, 8), ["b", "t", None], lambda b, t, c: [1, b, t, 1, c, 1]),  # size-1 dims
    ((4, 6, 8), ["b", None, None], lambda b, t, c: [b, t * c]),
    ((4, 6, 8), ["b", "t", None], lambda b, t, c: [b * t * c]),
    ((4, 6, 8), ["b", "t", None], lambda b, t, c: [-1, c]),  # a hole the sizes fill
    ((4, 6, 8), ["b", "t", None], lambda b, t, c: [b, -1, 2, 4]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_known_view_is_the_view_torch_makes(case: int) -> None:
    shape, names, size_of = CASES[case]
    for sliced in (False, True):  # contiguous, and a slice of a wider last dim (qkv.split)
        ctx = ShapeContext(policy="auto")
        dims = [Dim(n) if n else None for n in names]
        with ctx.tracing():
            base = _fake(ctx, (*shape[:-1], shape[-1] * (3 if sliced else 1)), dims)
            x = base[..., : shape[-1]] if sliced else base
            size = size_of(*x.shape)
            env = next(d.node.shape_env for d in x.shape if isinstance(d, torch.SymInt))
            n_guards = len(env.guards)
            ours = retrace._known_view((x, size), {})
            assert len(env.guards) == n_guards, env.guards[n_guards:]  # asked nothing
            try:
                theirs = aten.view.default(x, size)
            except Exception:  # not a view: ours must not make one either
                assert ours is None, (shape, size, sliced)
                continue
        assert ours is not None, (shape, size, sliced)
        assert _exprs(ours.shape) == _exprs(theirs.shape)
        assert _exprs(ours.stride()) == _exprs(theirs.stride()), (shape, size, sliced)
        assert retrace._expr(ours.storage_offset()) == retrace._expr(theirs.storage_offset())
        assert ours._base is not None  # a view of the input, as the kernel's


def test_views_the_sizes_do_not_settle_are_left_to_the_kernel() -> None:
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        x = _fake(ctx, (4, 6, 8), [Dim("b"), Dim("t"), None])
        b, t, c = x.shape
        assert retrace._known_view((x, [-1, 3]), {}) is None  # b*t*8 / 3: not whole
        assert retrace._known_view((x, [-1, -1]), {}) is None
        xt = x.transpose(0, 1)  # (t, b, c): b and t are not one block
        assert retrace._known_view((xt, [t * b, c]), {}) is None
        y = _fake(ctx, (24, 8), [Dim("r"), None], arg=1)  # r == b*t only at the hints
        assert retrace._known_view((y, [b, t, c]), {}) is None
        z = _fake(ctx, (4, 8), [None, None], arg=2)  # static: the kernel is cheap there
        assert retrace._known_view((z, [32]), {}) is None


@pytest.mark.parametrize("affine", [True, False])
def test_a_known_layer_norm_is_what_the_kernel_makes(affine: bool) -> None:
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        x = _fake(ctx, (4, 6, 8), [Dim("b"), Dim("t"), None])
        w = _fake(ctx, (8,), [None], arg=1) if affine else None
        args = (x, [8], w, w, 1e-5)
        ours = retrace._known_layer_norm(args, {})
        theirs = aten.native_layer_norm.default(*args)
        assert ours is not None
        for o, t in zip(ours, theirs, strict=True):
            assert _exprs(o.shape) == _exprs(t.shape)
            assert _exprs(o.stride()) == _exprs(t.stride())
            assert o.dtype == t.dtype
        # normalized sizes that are not the input's last sizes: the kernel's to refuse
        assert retrace._known_layer_norm((x, [6, 8], None, None, 1e-5), {}) is None


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, True), (False, True, False)])
def test_a_known_layer_norm_backward_is_what_the_kernel_makes(
    affine: bool, mask: tuple[bool, bool, bool]
) -> None:
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        x = _fake(ctx, (4, 6, 8), [Dim("b"), Dim("t"), None])
        g = _fake(ctx, (4, 6, 8), [Dim("b"), Dim("t"), None], arg=1)
        w = _fake(ctx, (8,), [None], arg=2) if affine else None
        _out, mean, rstd = aten.native_layer_norm.default(x, [8], w, w, 1e-5)
        args = (g, x, [8], mean, rstd, w, w, list(mask))
        ours = retrace._known_layer_norm_backward(args, {})
        theirs = aten.native_layer_norm_backward.default(*args)
        assert ours is not None
        for o, t in zip(ours, theirs, strict=True):
            assert (o is None) == (t is None)
            if o is None or t is None:
                continue
            assert _exprs(o.shape) == _exprs(t.shape)
            assert _exprs(o.stride()) == _exprs(t.stride())
            assert o.dtype == t.dtype
        # statistics of other sizes, or normalized sizes that are not the input's last
        # sizes: the kernel's to check (or to refuse)
        assert retrace._known_layer_norm_backward((g, x, [6, 8], *args[3:]), {}) is None
        other = (g, x, [8], mean.view(mean.shape[0], -1), rstd, w, w, list(mask))
        assert retrace._known_layer_norm_backward(other, {}) is None


POINTWISE_BACKWARDS = [
    (aten.gelu_backward.default, (), {}),
    (aten.gelu_backward.default, (), {"approximate": "tanh"}),
    (aten._softmax_backward_data.default, (-1, torch.float32), {}),
    (aten._softmax_backward_data.default, (1, None), {}),  # None: the tensors' dtype
    (aten._log_softmax_backward_data.default, (-1, torch.float32), {}),
    (aten.threshold_backward.default, (0.0,), {}),
    (aten.sigmoid_backward.default, (), {}),
    (aten.tanh_backward.default, (), {}),
]


@pytest.mark.parametrize("case", range(len(POINTWISE_BACKWARDS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_known_pointwise_backward_is_what_the_kernel_makes(case: int, dtype: torch.dtype) -> None:
    op, extra, kwargs = POINTWISE_BACKWARDS[case]
    extra = tuple(dtype if e is None else e for e in extra)
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        g = _fake(ctx, (4, 6, 8), [Dim("b"), Dim("t"), None], dtype=dtype)
        y = _fake(ctx, (4, 6, 8), [Dim("b"), Dim("t"), None], arg=1, dtype=dtype)
        ours = retrace._known_pointwise_backward((g, y, *extra), kwargs)
        theirs = op(g, y, *extra, **kwargs)
        assert ours is not None
        assert _exprs(ours.shape) == _exprs(theirs.shape)
        assert _exprs(ours.stride()) == _exprs(theirs.stride())
        assert ours.dtype == theirs.dtype
        # a transposed operand, or mixed dtypes: the kernel's layout and promotion
        yt = y.transpose(0, 1).contiguous().transpose(0, 1)
        assert retrace._known_pointwise_backward((g, yt, *extra), kwargs) is None
        other = torch.float64 if dtype != torch.float64 else torch.float32
        assert retrace._known_pointwise_backward((g, y.to(other), *extra), kwargs) is None


def _pointwise_cases(x: Any, mask: Any, bias: Any, half: Any, ints: Any) -> list[Any]:
    scalar = torch.tensor(2.0)  # zero-dim: promotes by category only
    return [
        (aten.where.self, (mask, x, x), {}),  # a (1, 1, T, T) mask broadcast
        (aten.where.self, (mask, x, scalar), {}),
        (aten.clamp.default, (x, 0.0, 1.0), {}),
        (aten.clamp.default, (ints, 0), {}),
        (aten.gelu.default, (x,), {"approximate": "tanh"}),
        (aten.add.Tensor, (x, bias), {}),  # a (T,) bias broadcast
        (aten.add.Tensor, (x, half), {}),  # float32 + bfloat16
        (aten.add.Tensor, (half, scalar), {}),  # stays bfloat16
        (aten.mul.Tensor, (ints, 0.5), {}),  # int64 * float: the default dtype
        (aten.div.Tensor, (ints, ints), {}),  # true division of ints
        (aten.ge.Scalar, (x, 0), {}),
        (aten.bitwise_not.default, (mask,), {}),
        (aten.sigmoid.default, (ints,), {}),
    ]


@pytest.mark.parametrize("case", range(13))
def test_a_known_pointwise_result_is_what_the_kernel_makes(case: int) -> None:
    ctx = ShapeContext(policy="auto")
    bt = [Dim("b"), None, Dim("t"), Dim("t")]
    with ctx.tracing():
        x = _fake(ctx, (2, 3, 5, 5), bt)
        mask = _fake(ctx, (1, 1, 5, 5), [None, None, Dim("t"), Dim("t")], 1, torch.bool)
        bias = _fake(ctx, (5,), [Dim("t")], 2)
        half = _fake(ctx, (2, 3, 5, 5), bt, 3, torch.bfloat16)
        ints = _fake(ctx, (2, 3, 5, 5), bt, 4, torch.int64)
        op, args, kwargs = _pointwise_cases(x, mask, bias, half, ints)[case]
        ours = retrace._known_pointwise(op, args, kwargs)
        theirs = op(*args, **kwargs)
        assert ours is not None
        assert _exprs(ours.shape) == _exprs(theirs.shape)
        assert _exprs(ours.stride()) == _exprs(theirs.stride())
        assert ours.dtype == theirs.dtype
        # an operand that is not contiguous: the kernel's layout rules
        xt = x.transpose(2, 3)
        assert retrace._known_pointwise(aten.add.Tensor, (x, xt), {}) is None
        # sizes equal only at the hints: the kernel's guard
        other = _fake(ctx, (2, 3, 5, 5), [Dim("b"), None, Dim("u"), Dim("t")], 5)
        assert retrace._known_pointwise(aten.add.Tensor, (x, other), {}) is None


def test_known_addmm_and_contiguous_clone_are_what_the_kernels_make() -> None:
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        x = _fake(ctx, (10, 8), [Dim("r"), None])
        w = _fake(ctx, (6, 8), [None, None], 1)
        b = _fake(ctx, (6,), [None], 2)
        y = _fake(ctx, (4, 3, 8), [Dim("b"), None, Dim("t")], 3)
        cases = [
            (aten.addmm.default, (b, x, w.t()), {}, retrace._known_addmm),
            (aten.addmm.default, (b, x, w.t()), {"beta": 0.5}, retrace._known_addmm),
            (aten.addmm.default, (b.view(1, 6), x, w.t()), {}, retrace._known_addmm),
            (
                aten.clone.default,
                (y.transpose(1, 2),),
                {"memory_format": torch.contiguous_format},
                retrace._known_clone,
            ),
            (aten.clone.default, (y,), {}, retrace._known_clone),
        ]
        for op, args, kwargs, known in cases:
            ours = known(args, kwargs)
            theirs = op(*args, **kwargs)
            assert ours is not None, (op, kwargs)
            assert _exprs(ours.shape) == _exprs(theirs.shape)
            assert _exprs(ours.stride()) == _exprs(theirs.stride())
            assert ours.dtype == theirs.dtype
        # inner sizes that differ as expressions (equal at the hints): the kernel's guard
        z = _fake(ctx, (8, 6), [Dim("k"), None], 4)
        assert retrace._known_addmm((b, x, z), {}) is None


class Heads(nn.Module):
    """qkv split into heads by views of ``(B, T, C)`` slices, merged back by a view."""

    def __init__(self, c: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads) for z in self.qkv(x).split(c, -1))
        a = (q * k).softmax(-1) * v
        return self.proj(a.contiguous().view(b, t, c)).view(b * t, c)  # type: ignore[no-any-return]


def test_a_symbolic_backward_of_views_skips_the_generic_reshape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counts torch's generic reshape on symbolic inputs during the retrace: none left
    (before `_known_view`, every view of the backward went through it), and the
    gradients equal eager's at each size."""
    generic, replay = torch._refs._reshape_view_helper, runtime.retrace  # type: ignore[attr-defined]
    symbolic_calls: list[Any] = []
    retracing: list[bool] = []

    def counting(a: Any, *shape: Any, **kw: Any) -> Any:
        if retracing and any(isinstance(d, torch.SymInt) for d in (*a.shape, *a.stride())):
            symbolic_calls.append((a.shape, shape))
        return generic(a, *shape, **kw)

    calls: list[bool] = []

    def in_retrace(*args: Any, **kwargs: Any) -> Any:
        calls.append(True)
        retracing.append(True)
        try:
            return replay(*args, **kwargs)
        finally:
            retracing.pop()

    monkeypatch.setattr(torch._refs, "_reshape_view_helper", counting)
    monkeypatch.setattr(runtime, "retrace", in_retrace)
    torch.manual_seed(0)
    model = Heads()
    ref = copy.deepcopy(model)
    fn = stoker_capture.aot_module(model, dynamic="dynamic")
    stoker_autograd.reset_stats()
    with stoker_autograd.enable(dynamic=True):
        for b, t in [(2, 5), (3, 7), (4, 6)]:
            x = torch.randn(b, t, 16)
            model.zero_grad()
            ref.zero_grad()
            fn(x).pow(2).sum().backward()
            with stoker_autograd.disabled():
                ref(x).pow(2).sum().backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert stoker_autograd.stats().get("compiles", 0) >= 1
    assert calls  # the backward was retraced (with symbolic sizes: the forward's)
    assert not symbolic_calls, symbolic_calls


class Block(nn.Module):
    """Layer norms (affine and not) and the fused pointwise backwards of a transformer
    block (GELU, softmax, tanh, sigmoid, ReLU; SiLU's decomposes), under non-reentrant checkpointing
    as the benchmark's checkpointed GPT has them."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(c)
        self.ln_plain = nn.LayerNorm(c, elementwise_affine=False)
        self.fc = nn.Linear(c, c)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.fc(self.ln(x)), approximate="tanh")
        h = h.softmax(-1) + torch.tanh(h) * torch.sigmoid(h) + nn.functional.silu(h)
        return self.ln_plain(torch.relu(h) + nn.functional.gelu(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        y = checkpoint(self.inner, x, use_reentrant=False)
        return y.log_softmax(-1)  # type: ignore[no-any-return]


def test_a_symbolic_backward_of_fused_backwards_skips_their_decompositions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counts torch's decompositions of the fused backwards (their fake kernels) on
    symbolic inputs during the retrace: none (`_known_layer_norm_backward`,
    `_known_pointwise_backward`), and the gradients equal eager's at each size."""
    from torch._decomp import decomposition_table

    replay = runtime.retrace  # type: ignore[attr-defined]
    retracing: list[bool] = []
    symbolic_calls: list[str] = []
    fused = [
        aten.native_layer_norm_backward.default,
        aten.gelu_backward.default,
        aten._softmax_backward_data.default,
        aten._log_softmax_backward_data.default,
        aten.tanh_backward.default,
        aten.sigmoid_backward.default,
        aten.threshold_backward.default,
    ]

    def counting(op: Any, decomp: Any) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            shapes = [d for a in args if isinstance(a, torch.Tensor) for d in a.shape]
            if retracing and any(isinstance(d, torch.SymInt) for d in shapes):
                symbolic_calls.append(str(op))
            return decomp(*args, **kwargs)

        return fn

    for op in fused:
        if op in decomposition_table:
            monkeypatch.setitem(decomposition_table, op, counting(op, decomposition_table[op]))

    def in_retrace(*args: Any, **kwargs: Any) -> Any:
        retracing.append(True)
        try:
            return replay(*args, **kwargs)
        finally:
            retracing.pop()

    monkeypatch.setattr(runtime, "retrace", in_retrace)
    built: list[str] = []
    monkeypatch.setattr(
        retrace, "_known_pointwise", _counting(retrace._known_pointwise, "_known_pointwise", built)
    )
    monkeypatch.setitem(
        retrace._KNOWN,
        aten.native_layer_norm_backward.default,
        _counting(retrace._known_layer_norm_backward, "layer_norm_backward", built),
    )
    torch.manual_seed(0)
    model = Block()
    ref = copy.deepcopy(model)
    fn = stoker_capture.aot_module(model, dynamic="dynamic")
    stoker_autograd.reset_stats()
    with stoker_autograd.enable(dynamic=True):
        for b, t in [(2, 5), (3, 7), (4, 6)]:
            x = torch.randn(b, t, 16, requires_grad=True)
            xr = x.detach().clone().requires_grad_(True)
            w = torch.randn(b, t, 16)
            model.zero_grad()
            ref.zero_grad()
            (fn(x) * w).sum().backward()
            with stoker_autograd.disabled():
                (ref(xr) * w).sum().backward()
            assert x.grad is not None and xr.grad is not None
            torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-4)
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert stoker_autograd.stats().get("compiles", 0) >= 1
    assert not symbolic_calls, symbolic_calls
    # the recomputed forward's pointwise ops, the layer norms' backwards
    assert {"_known_pointwise", "layer_norm_backward"} <= set(built), built


def _counting(fn: Any, name: str, built: list[str]) -> Any:
    """``fn``, noting ``name`` in ``built`` each time it builds a result."""

    def wrapped(*args: Any) -> Any:
        out = fn(*args)
        if out is not None:
            built.append(name)
        return out

    return wrapped
