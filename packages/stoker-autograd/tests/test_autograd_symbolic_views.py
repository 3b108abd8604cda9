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
import random
from typing import Any

import pytest
import sympy
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
        # an eager node's gradient: sizes of symbols of their own, equal at the hints:
        # tied to the input's (the kernel's broadcasts would guard them so), then built
        own = _fake(ctx, (4, 6, 8), [Dim("b2"), Dim("t2"), None], arg=3)
        assert _exprs(own.shape) != _exprs(x.shape)
        tied = retrace._known_layer_norm_backward((own, *args[1:]), {})
        assert tied is not None and _exprs(own.shape) == _exprs(x.shape)
        # the normalized size and the input's last one symbols of their own too (an eager
        # node's, equal at the hints to the static weight): tied to it, then built
        y = _fake(ctx, (4, 6, 8), [Dim("b4"), Dim("t4"), Dim("c4")], arg=5)
        _out, ymean, yrstd = aten.native_layer_norm.default(y, [8], w, w, 1e-5)
        c = ctx.fakeify(8, Source.arg(6), dynamic=Dim("c5"))
        assert isinstance(c, torch.SymInt) and _exprs([c]) != _exprs(y.shape[2:])
        yargs = (y, y, [c], ymean, yrstd, w, w, list(mask))
        assert retrace._known_layer_norm_backward(yargs, {}) is not None
        assert _exprs([c]) == _exprs(y.shape[2:])
        # sizes that differ at the hints: the kernel's to refuse
        short = _fake(ctx, (4, 5, 8), [Dim("b3"), Dim("t3"), None], arg=4)
        assert retrace._known_layer_norm_backward((short, *args[1:]), {}) is None


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
        # an operand that is not contiguous: the kernel's layout rules (the first wins)
        xt = x.transpose(2, 3)
        for pair in ((x, xt), (xt, x)):
            ours = retrace._known_pointwise(aten.add.Tensor, pair, {})
            assert ours is not None
            assert _exprs(ours.stride()) == _exprs(aten.add.Tensor(*pair).stride())
        # sizes equal only at the hints: told equal (the broadcast's own guard), then built
        other = _fake(ctx, (2, 3, 5, 5), [Dim("b"), None, Dim("u"), Dim("t")], 5)
        assert _exprs(other.shape) != _exprs(x.shape)
        assert retrace._known_pointwise(aten.add.Tensor, (x, other), {}) is not None
        assert _exprs(other.shape) == _exprs(x.shape)
        # sizes that differ at the hints: the kernel's to refuse
        short = _fake(ctx, (2, 3, 4, 5), [Dim("b"), None, Dim("v"), Dim("t")], 6)
        assert retrace._known_pointwise(aten.add.Tensor, (x, short), {}) is None


def _fake_strided(ctx: ShapeContext, real: torch.Tensor, dims: list[Any], arg: int) -> Any:
    """A fake of ``real`` (any strides: a slice gets a stride symbol of its own)."""
    return ctx.fakeify(real, Source.arg(arg), dynamic=dims)


def _layout_cases(ctx: ShapeContext) -> list[Any]:
    """(op, args, kwargs) of pointwise ops over operands that are not all contiguous:
    permuted heads (``(B, T, H, D) -> (B, H, T, D)``), broadcasts, slices, expands."""
    b, t = Dim("b"), Dim("t")
    x = _fake(ctx, (2, 3, 5, 8), [b, None, t, None])  # (B, H, T, D)
    y = _fake(ctx, (2, 5, 3, 8), [b, t, None, None], 1).permute(0, 2, 1, 3)
    rope = _fake(ctx, (1, 1, 5, 8), [None, None, t, None], 2)
    w = _fake(ctx, (2, 5, 1), [b, t, None], 3)
    mask = _fake(ctx, (1, 1, 5, 8), [None, None, t, None], 4, torch.bool)
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        ids_real = torch.randint(0, 9, (2, 6))
    ids = _fake_strided(ctx, ids_real, [b, Dim("t1")], 5)[:, :-1]  # the token ids' slice
    half = x.to(torch.bfloat16)
    return [
        (aten.add.Tensor, (x, y), {}),  # the first operand's order wins
        (aten.add.Tensor, (y, x), {}),
        (aten.mul.Tensor, (y, rope), {}),  # a permuted operand times a broadcast one
        (aten.mul.Tensor, (rope, y), {}),
        (aten.sigmoid.default, (y,), {}),  # one dense operand: its own strides
        (aten.neg.default, (x[..., :4],), {}),  # a slice in order: contiguous
        (aten.div.Scalar, (w.expand(-1, -1, 8), 8), {}),  # an expanded operand
        (aten.where.self, (mask, y, x), {}),  # a broadcast mask first
        (aten.add.Tensor, (y, half), {}),  # mixed dtypes
        (aten.ge.Scalar, (ids, 0), {}),
        (aten.mul.Tensor, (x.transpose(1, 2), y.transpose(1, 2)), {}),
    ]


@pytest.mark.parametrize("case", range(11))
def test_a_known_pointwise_layout_is_what_the_kernel_makes(case: int) -> None:
    """Operands that are not all contiguous: the result's strides follow the kernel's
    dim ordering, decided from the expressions without a question to the shape env."""
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        op, args, kwargs = _layout_cases(ctx)[case]
        env = next(
            d.node.shape_env
            for a in args
            if isinstance(a, torch.Tensor)
            for d in a.shape
            if isinstance(d, torch.SymInt)
        )
        n_guards = len(env.guards)
        ours = retrace._known_pointwise(op, args, kwargs)
        assert len(env.guards) == n_guards, env.guards[n_guards:]  # asked nothing
        theirs = op(*args, **kwargs)
    assert ours is not None
    assert _exprs(ours.shape) == _exprs(theirs.shape)
    # equal for every value of the sizes (torch writes ``Max(1, t - 1)`` for ``t - 1``)
    assert _same_values(_exprs(ours.stride()), _exprs(theirs.stride())), (
        _exprs(ours.stride()),
        _exprs(theirs.stride()),
    )
    assert ours.dtype == theirs.dtype


def _same_values(a: list[Any], b: list[Any]) -> bool:
    """Are the expressions of ``a`` and ``b`` equal at random sizes (each symbol 2..64)?"""
    syms = set().union(*(sympy.sympify(e).free_symbols for e in (*a, *b)))
    rng = random.Random(0)
    for _ in range(20):
        at = {s: rng.randint(2, 64) for s in syms}
        if [sympy.sympify(e).subs(at) for e in a] != [sympy.sympify(e).subs(at) for e in b]:
            return False
    return True


def test_pointwise_layouts_the_expressions_do_not_settle_are_left_to_the_kernel() -> None:
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            real = torch.empty(4, 9, 11)[:, :6, :7]  # two strides of their own
        z = _fake_strided(ctx, real, [Dim("b"), Dim("t"), Dim("c")], 0)
        zt = z.transpose(1, 2)
        # which of the two stride symbols is larger: only a guard would say
        assert retrace._known_pointwise(aten.add.Tensor, (zt, zt.contiguous()), {}) is None
        # a size-1 dim of the result: its stride is the kernel's choice
        one = _fake(ctx, (2, 1, 5), [Dim("b"), None, Dim("t")], 1)
        assert retrace._known_pointwise(aten.add.Tensor, (one.transpose(0, 2), 1.0), {}) is None
        # a lone operand neither dense nor in order: empty_like's rules
        w = _fake(ctx, (2, 5, 8), [Dim("b"), Dim("t"), None], 2)
        assert retrace._known_pointwise(aten.neg.default, (w.transpose(1, 2)[:, :4],), {}) is None


def test_a_pointwise_op_of_sizes_equal_at_the_hints_ties_them_then_builds() -> None:
    """An eager node's operands hold a symbol per size (an embedding's backward masks
    its gradient by the ids): sizes of equal hints, 2 or more, are told equal (the
    guard the broadcast itself adds), then the result is built, as the kernel makes
    it; sizes of other hints, or a symbolic size against a 1, still go to the kernel."""
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        ids = _fake(ctx, (2, 5, 1), [Dim("b"), Dim("t"), None], 0, torch.bool)
        grad = _fake(ctx, (2, 5, 8), [Dim("b2"), Dim("t2"), None], 1)
        env = next(d.node.shape_env for d in ids.shape if isinstance(d, torch.SymInt))
        assert _exprs(ids.shape[:2]) != _exprs(grad.shape[:2])
        ours = retrace._known_pointwise(aten.mul.Tensor, (ids, grad), {})
        assert ours is not None and _exprs(ids.shape[:2]) == _exprs(grad.shape[:2])
        n_guards = len(env.guards)
        theirs = aten.mul.Tensor(ids, grad)
        assert len(env.guards) == n_guards  # the kernel needed nothing more
        assert _exprs(ours.shape) == _exprs(theirs.shape)
        assert _exprs(ours.stride()) == _exprs(theirs.stride())
        assert ours.dtype == theirs.dtype
        other = _fake(ctx, (2, 6, 8), [Dim("b3"), Dim("t3"), None], 2)
        assert retrace._known_pointwise(aten.mul.Tensor, (ids, other), {}) is None


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
    _matches_eager_at_each_size(
        model, [(2, 5), (3, 7), (4, 6)], lambda b, t: ((b, t, 16), (b, t, 16)), 1e-5
    )
    assert not symbolic_calls, symbolic_calls
    # the recomputed forward's pointwise ops, the layer norms' backwards
    assert {"_known_pointwise", "layer_norm_backward"} <= set(built), built


def _matches_eager_at_each_size(
    model: nn.Module, sizes: list[tuple[int, ...]], shapes: Any, atol: float
) -> None:
    """``model`` compiled over symbolic sizes and an eager copy, trained side by side at
    each of ``sizes`` (``shapes(*size)``: the input's and the output weight's shapes):
    the input's and every parameter's gradient equal eager's; the backward compiled."""
    ref = copy.deepcopy(model)
    fn = stoker_capture.aot_module(model, dynamic="dynamic")
    stoker_autograd.reset_stats()
    with stoker_autograd.enable(dynamic=True):
        for size in sizes:
            x_shape, w_shape = shapes(*size)
            x = torch.randn(x_shape, requires_grad=True)
            xr = x.detach().clone().requires_grad_(True)
            w = torch.randn(w_shape)
            model.zero_grad()
            ref.zero_grad()
            (fn(x) * w).sum().backward()
            with stoker_autograd.disabled():
                (ref(xr) * w).sum().backward()
            assert x.grad is not None and xr.grad is not None
            torch.testing.assert_close(x.grad, xr.grad, atol=atol, rtol=1e-4)
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=1e-4, msg=name)
    assert stoker_autograd.stats().get("compiles", 0) >= 1


def _counting(fn: Any, name: str, built: list[str]) -> Any:
    """``fn``, noting ``name`` in ``built`` each time it builds a result."""

    def wrapped(*args: Any) -> Any:
        out = fn(*args)
        if out is not None:
            built.append(name)
        return out

    return wrapped


def test_a_known_cat_is_what_the_kernel_makes() -> None:
    """``cat`` of contiguous tensors over symbolic sizes (a GPT-2 block's QKV gradients):
    contiguous, the sizes summed along the dim, without a question to sympy; where the
    layouts or the other sizes do not settle it, the kernel."""
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        b, t = Dim("b"), Dim("t")
        x = _fake(ctx, (2, 5, 8), [b, t, None])
        y = _fake(ctx, (2, 5, 4), [b, t, None], 1)
        z = _fake(ctx, (2, 3, 8), [b, Dim("u"), None], 2)
        h = _fake(ctx, (2, 3, 5, 4), [b, None, t, None], 3)
        env = next(d.node.shape_env for d in x.shape if isinstance(d, torch.SymInt))
        for args in (
            ([x, y, x], -1),
            ([x, z], 1),
            ([x],),
            ([h, h], 1),
            ([x, x.transpose(1, 2).contiguous().transpose(1, 2), x], 2),  # rank 3: contiguous
        ):
            n_guards = len(env.guards)
            ours = retrace._known_cat(args, {})
            assert len(env.guards) == n_guards
            theirs = aten.cat.default(*args)
            assert ours is not None, args
            assert _exprs(ours.shape) == _exprs(theirs.shape)
            assert _exprs(ours.stride()) == _exprs(theirs.stride())
            assert ours.dtype == theirs.dtype
        # rank 4 not contiguous, other sizes that differ as expressions: the kernel
        ht = h.transpose(1, 2).contiguous().transpose(1, 2)
        assert retrace._known_cat(([ht, ht], 1), {}) is None
        assert retrace._known_cat(([x, y], 1), {}) is None
        assert retrace._known_cat(([x, z], 2), {}) is None
        w = _fake(ctx, (2, 5, 8), [None, None, None], 4)
        assert retrace._known_cat(([w, w], 0), {}) is None  # static: the kernel is cheap


def test_a_known_full_is_what_the_kernel_makes() -> None:
    """``full`` (and ``zeros``, which torch's decomposition makes a ``full``) over
    symbolic sizes: contiguous, of the dtype asked, without a question to sympy."""
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        x = _fake(ctx, (2, 5, 8), [Dim("b"), Dim("t"), None])
        b, t, c = x.shape
        env = next(d.node.shape_env for d in x.shape if isinstance(d, torch.SymInt))
        for size, value, dtype in (
            ([b, t, c], 0, torch.float32),
            ([b, 3, t, c], 1.5, torch.bfloat16),
            ([t], False, torch.bool),
        ):
            kw = {"dtype": dtype, "layout": torch.strided, "device": torch.device("cpu")}
            n_guards = len(env.guards)
            ours = retrace._known_full((size, value), kw)
            assert len(env.guards) == n_guards
            theirs = aten.full.default(size, value, **kw)
            assert ours is not None
            assert _exprs(ours.shape) == _exprs(theirs.shape)
            assert _exprs(ours.stride()) == _exprs(theirs.stride())
            assert ours.dtype == theirs.dtype
        # no dtype (full infers it from the value), or no symbolic size: the kernel
        assert retrace._known_full(([b, t], 0), {"device": torch.device("cpu")}) is None
        cpu = {"dtype": torch.float32, "device": torch.device("cpu")}
        assert retrace._known_full(([2, 3], 0), cpu) is None
        zeros = retrace._zeros_as_full(([b, t],), {**cpu, "dtype": torch.bool})
        assert zeros is not None and zeros[0][1] is False  # bool zeros fill with False


class Rotary(nn.Module):
    """Heads permuted from ``(B, T, H, D)`` to ``(B, H, T, D)`` and a rotary embedding
    (halves sliced, negated, concatenated) as Hugging Face's Llama has it: pointwise
    ops over a permuted operand and a broadcast one, slices, an expanded mean."""

    def __init__(self, c: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qk = nn.Linear(c, 2 * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qk(x).split(c, -1)
        )
        pos = torch.arange(t, dtype=x.dtype)[:, None] * torch.ones(c // self.heads)
        cos, sin = pos.cos()[None, None], pos.sin()[None, None]

        def rotate(h: torch.Tensor) -> torch.Tensor:
            h1, h2 = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2 :]
            return torch.cat((-h2, h1), dim=-1)

        q = q * cos + rotate(q) * sin
        k = k * cos + rotate(k) * sin
        s = q + k.transpose(1, 2).contiguous().transpose(1, 2)
        return s * s.pow(2).mean(-1, keepdim=True).rsqrt()


def test_a_symbolic_backward_of_permuted_heads_builds_their_layouts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rotary attention's backward, retraced over symbolic sizes: pointwise ops
    over operands that are not all contiguous get their layout from the retrace's
    own rule (`_elementwise_strides`), and the gradients equal eager's at each size."""
    built: list[str] = []
    monkeypatch.setattr(
        retrace,
        "_elementwise_strides",
        _counting(retrace._elementwise_strides, "layout", built),
    )
    torch.manual_seed(0)
    model = Rotary()
    _matches_eager_at_each_size(
        model, [(2, 5), (3, 7), (4, 6)], lambda b, t: ((b, t, 16), (b, 2, t, 8)), 1e-5
    )
    assert "layout" in built


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_known_batch_norm_backward_is_what_the_kernel_makes(
    affine: bool, dtype: torch.dtype
) -> None:
    """``native_batch_norm_backward`` over symbolic sizes (a CNN's batch and image
    sizes): its results as the kernel (torch's decomposition) makes them, float32
    parameters beside a bfloat16 input included, each output masked off in turn."""
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        dims = [Dim("b"), None, Dim("h"), Dim("w")]
        x = _fake(ctx, (2, 3, 5, 6), dims, 0, dtype)
        g = _fake(ctx, (2, 3, 5, 6), dims, 1, dtype)
        w = _fake(ctx, (3,), [None], 2) if affine else None
        stats = [_fake(ctx, (3,), [None], 3 + i) for i in range(4)]
        env = next(d.node.shape_env for d in x.shape if isinstance(d, torch.SymInt))
        for mask in ([True, True, True], [True, False, True], [False, True, False]):
            args = (g, x, w, stats[0], stats[1], stats[2], stats[3], True, 1e-5, mask)
            n_guards = len(env.guards)
            ours = retrace._known_batch_norm_backward(args, {})
            assert len(env.guards) == n_guards
            theirs = aten.native_batch_norm_backward.default(*args)
            assert ours is not None
            for o, t in zip(ours, theirs, strict=True):
                assert (o is None) == (t is None), mask
                if o is None:
                    continue
                assert _exprs(o.shape) == _exprs(t.shape)
                assert _exprs(o.stride()) == _exprs(t.stride())
                assert o.dtype == t.dtype, mask
        # a channels-last gradient: the kernel's layout rules
        gt = g.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        args = (gt, x, w, *stats, True, 1e-5, [True, True, True])
        assert retrace._known_batch_norm_backward(args, {}) is None


def test_a_symbolic_backward_of_a_batch_norm_builds_its_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A conv + batch norm block's backward over symbolic batch and image sizes: the
    batch norm's backward is built by `_known_batch_norm_backward`, and the gradients
    equal eager's at each size."""
    built: list[str] = []
    monkeypatch.setitem(
        retrace._KNOWN,
        aten.native_batch_norm_backward.default,
        _counting(retrace._known_batch_norm_backward, "batch_norm_backward", built),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    _matches_eager_at_each_size(
        model,
        [(2, 5, 6), (3, 7, 5), (4, 6, 8)],
        lambda b, h, w: ((b, 3, h, w), (b, 4, h, w)),
        1e-4,
    )
    assert "batch_norm_backward" in built


NLL_CASES = [(1, False), (2, False), (0, False), (1, True)]  # (reduction, weight)


@pytest.mark.parametrize("case", range(len(NLL_CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_known_nll_loss_backward_is_what_the_kernel_makes(case: int, dtype: torch.dtype) -> None:
    """``nll_loss_backward`` (a cross-entropy's, through ``NllLossBackward0``) over a
    symbolic number of rows: contiguous ``(N, C)`` in the input's dtype, as torch's
    decomposition makes it, without a guard; a target whose rows are a symbol of their
    own (an eager node's size) is tied to the input's (the kernel's own check, one
    replacement), then built alike."""
    reduction, weighted = NLL_CASES[case]
    ctx = ShapeContext(policy="auto")
    with ctx.tracing():
        x = _fake(ctx, (6, 10), [Dim("n"), None], dtype=dtype)
        target = _fake(ctx, (6,), [Dim("n")], 1, torch.int64)
        grad = (
            _fake(ctx, (6,), [Dim("n")], 2, dtype)
            if reduction == 0
            else torch.empty((), dtype=dtype)
        )
        weight = torch.rand(10).to(dtype) if weighted else None
        total = torch.empty((), dtype=dtype)
        args = (grad, x, target, weight, reduction, -100, total)
        env = next(d.node.shape_env for d in x.shape if isinstance(d, torch.SymInt))
        n_guards = len(env.guards)
        ours = retrace._known_nll_loss_backward(args, {})
        assert len(env.guards) == n_guards, env.guards[n_guards:]  # asked nothing
        theirs = aten.nll_loss_backward.default(*args)
        assert ours is not None
        assert _exprs(ours.shape) == _exprs(theirs.shape)
        assert _exprs(ours.stride()) == _exprs(theirs.stride())
        assert ours.dtype == theirs.dtype
        # the target's rows a symbol of their own: tied (one guard, the kernel's), built
        other = _fake(ctx, (6,), [Dim("m")], 3, torch.int64)
        assert _exprs(other.shape) != _exprs(x.shape[:1])
        ours = retrace._known_nll_loss_backward((grad, x, other, *args[3:]), {})
        assert ours is not None and _exprs(other.shape) == _exprs(x.shape[:1])
        # rows that differ, a 3-d input, a transposed input, mixed dtypes: the kernel
        short = _fake(ctx, (5,), [Dim("k")], 4, torch.int64)
        assert retrace._known_nll_loss_backward((grad, x, short, *args[3:]), {}) is None
        x3 = _fake(ctx, (6, 10, 3), [Dim("n"), None, None], 5, dtype)
        assert retrace._known_nll_loss_backward((grad, x3, *args[2:]), {}) is None
        xt = x.t().contiguous().t()
        assert retrace._known_nll_loss_backward((grad, xt, *args[2:]), {}) is None
        other_dtype = torch.float64
        g64 = grad.to(other_dtype)
        assert retrace._known_nll_loss_backward((g64, *args[1:]), {}) is None


def test_an_eager_loss_backward_over_symbolic_sizes_builds_its_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cross-entropy computed eagerly around a dynamic AOT model: its functional
    backwards (``NllLossBackward0``, ``LogSoftmaxBackward0``) reach the retrace's proxy
    mode, not its own nodes; their ops still get the retrace's results
    (`_KnownResultsMode`), not torch's decompositions over symbolic sizes, and the
    gradients equal eager's at each batch size with one compile."""
    built: list[str] = []
    for op, name in (
        (aten.nll_loss_backward.default, "nll"),
        (aten._log_softmax_backward_data.default, "log_softmax"),
    ):
        monkeypatch.setitem(retrace._KNOWN, op, _counting(retrace._KNOWN[op], name, built))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
    ref = copy.deepcopy(model)
    fn = stoker_capture.aot_module(model, dynamic="dynamic")
    stoker_autograd.reset_stats()
    with stoker_autograd.enable(dynamic=True):
        for n in (6, 9, 4):
            x, y = torch.randn(n, 8), torch.randint(0, 5, (n,))
            model.zero_grad()
            ref.zero_grad()
            nn.functional.cross_entropy(fn(x), y).backward()
            with stoker_autograd.disabled():
                nn.functional.cross_entropy(ref(x), y).backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    st = stoker_autograd.stats()
    assert (st["compiles"], st["fallbacks"]) == (1, 0), st
    assert {"nll", "log_softmax"} <= set(built), built
