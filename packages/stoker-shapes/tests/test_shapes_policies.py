"""Policies (static / dynamic / auto), shared Dims, aliasing, sources."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stoker_shapes import Dim, GuardedCache, ShapeContext, Source

Tracer = Callable[..., Any]


def add_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x + y) * 2


def test_static_policy_specializes_every_size(trace: Tracer) -> None:
    ctx = ShapeContext(policy="static")
    trace(ctx, add_mul, torch.randn(4, 3), torch.randn(4, 3))
    gs = ctx.produce_guards()
    assert gs.check((torch.randn(4, 3), torch.randn(4, 3)))
    assert not gs.check((torch.randn(5, 3), torch.randn(5, 3)))
    why = gs.explain((torch.randn(5, 3), torch.randn(5, 3)))
    assert why is not None and "args[0].size()[0] == 4 failed: got 5" in why
    assert "policy 'static'" in why


def test_dynamic_dim_accepts_other_sizes_within_range(trace: Tracer) -> None:
    ctx = ShapeContext()
    b = Dim("batch", max=32)
    trace(ctx, add_mul, torch.randn(4, 3), torch.randn(4, 3), dynamic=[{0: b}, {0: b}])
    gs = ctx.produce_guards()
    for n in (2, 7, 32):
        assert gs.check((torch.randn(n, 3), torch.randn(n, 3))), n
    assert not gs.check((torch.randn(33, 3), torch.randn(33, 3)))
    assert "<= 32" in (gs.explain((torch.randn(33, 3), torch.randn(33, 3))) or "")
    # sizes 0 and 1 stay specialized
    assert not gs.check((torch.randn(1, 3), torch.randn(1, 3)))
    # the static dim is still guarded
    assert not gs.check((torch.randn(4, 5), torch.randn(4, 5)))


def test_dynamic_policy_makes_user_dims_symbolic_and_params_static() -> None:
    ctx = ShapeContext(policy="dynamic")
    x = ctx.fakeify(torch.randn(4, 3), Source.arg(0))
    w = ctx.fakeify(
        torch.nn.Parameter(torch.randn(3, 5)), Source.module_path("lin.weight"), is_param=True
    )
    assert isinstance(x.shape[0], torch.SymInt) and isinstance(x.shape[1], torch.SymInt)
    assert w.shape == (3, 5) and not isinstance(w.shape[0], torch.SymInt)
    with ctx.tracing():
        x @ w
    gs = ctx.produce_guards()

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(5, 3, bias=False)
            self.lin.weight = torch.nn.Parameter(torch.randn(3, 5))

    m = M()
    assert gs.check((torch.randn(9, 3),), {}, m)
    m.lin.weight = torch.nn.Parameter(torch.randn(5, 3).T)  # same size, not contiguous
    assert not gs.check((torch.randn(9, 3),), {}, m)
    why = gs.explain((torch.randn(9, 3),), {}, m)
    assert why is not None and why.startswith("self.lin.weight")


def test_shared_dim_is_one_symbol_and_guards_equality() -> None:
    ctx = ShapeContext()
    b = Dim("batch")
    x = ctx.fakeify(torch.randn(4, 3), Source.arg(0), {0: b})
    y = ctx.fakeify(torch.randn(4, 2), Source.kwarg("mask"), {0: b})
    assert ctx.shape_env.replace(y.shape[0].node.expr) == x.shape[0].node.expr
    gs = ctx.produce_guards()
    assert gs.check((torch.randn(6, 3),), {"mask": torch.randn(6, 2)})
    bad = ((torch.randn(6, 3),), {"mask": torch.randn(5, 2)})
    assert not gs.check(*bad)
    why = gs.explain(*bad)
    assert why is not None
    assert "kwargs['mask'].size()[0] == args[0].size()[0] failed" in why
    assert "shared by" in why


def test_a_dim_shared_by_many_inputs_is_one_symbol_for_all() -> None:
    """Forty tensors and twenty ints share one Dim: every size is one symbol after the
    shape env's replacements (the trace then sees them equal), and the guards still
    check each against the others.  The shape env solves ``Eq(new, first)`` for the
    higher-named symbol; solving against the first symbol as it was, not as it was
    replaced, overwrote its replacement each time, and of these sixty sizes 17 stayed
    different symbols, related only by guards (so every expression over them
    stayed unsimplified, and slow)."""
    ctx = ShapeContext()
    b = Dim("batch")
    xs = ctx.fakeify([torch.randn(4, 3) for _ in range(40)], Source.arg(0), [{0: b}] * 40)
    ns = ctx.fakeify([4] * 20, Source.arg(1), [b] * 20)
    env = ctx.shape_env
    syms = {env.replace(x.shape[0].node.expr) for x in xs} | {env.replace(n.node.expr) for n in ns}
    assert len(syms) == 1, syms
    gs = ctx.produce_guards()
    good = [torch.randn(6, 3) for _ in range(40)]
    assert gs.check((good, [6] * 20))
    for k in (0, 17, 39):  # one tensor's size differs from the others'
        bad = [*good[:k], torch.randn(5, 3), *good[k + 1 :]]
        assert not gs.check((bad, [6] * 20)), k
    assert not gs.check((good, [6] * 19 + [5]))


def test_aliasing_inputs_stay_aliased_and_are_guarded() -> None:
    base = torch.randn(8, 4)
    a, b = base[:4], base[4:]
    ctx = ShapeContext()
    fa = ctx.fakeify(a, Source.arg(0))
    fb = ctx.fakeify(b, Source.arg(1))
    assert fa.untyped_storage()._cdata == fb.untyped_storage()._cdata
    assert fb.storage_offset() == 16
    gs = ctx.produce_guards()
    other = torch.randn(8, 4)
    assert gs.check((other[:4], other[4:]))
    # same metadata but separate storages: the alias guard must reject it
    c, d = torch.randn(8, 4), torch.randn(8, 4)
    assert not gs.check((c[:4], d[4:]))
    assert "aliased" in (gs.explain((c[:4], d[4:])) or "")


def test_non_view_input_guard_rejects_a_view() -> None:
    ctx = ShapeContext()
    ctx.fakeify(torch.randn(4), Source.arg(0))
    gs = ctx.produce_guards()
    assert gs.check((torch.randn(4),))
    assert not gs.check((torch.randn(8)[:4],))


def test_auto_policy_recompiles_once_then_stays_symbolic() -> None:
    compiled_sizes: list[object] = []

    def compile_fn(ctx: ShapeContext, args: tuple[torch.Tensor, ...], kwargs: dict[str, object]):  # type: ignore[no-untyped-def]
        x = ctx.fakeify(args[0], Source.arg(0))
        compiled_sizes.append(x.shape[0])
        with ctx.tracing():
            x.sum()
        return lambda t: t.sum()

    cache: GuardedCache[object] = GuardedCache(compile_fn, policy="auto")
    for n in (4, 4, 6, 9, 12):
        torch.testing.assert_close(cache(torch.ones(n, 2)), torch.tensor(2.0 * n))
    st = cache.stats()
    assert st["misses"] == 2 and st["hits"] == 3 and st["entries"] == 2
    assert compiled_sizes[0] == 4 and isinstance(compiled_sizes[1], torch.SymInt)
    assert "args[0].size()[0] == 4 failed: got 6" in st["reasons"][0]


def test_sources_read_nested_inputs() -> None:
    src = Source.kwarg("batch").item("x").size(1)
    assert src.name == "kwargs['batch']['x'].size()[1]"
    assert Source.module_path("layers.0.weight").name == "self.layers[0].weight"
    assert Source.from_json(src.to_json()) == src
    ctx = ShapeContext()
    out = ctx.fakeify({"x": torch.randn(2, 3), "n": 3, "flag": True}, Source.kwarg("batch"))
    assert set(out) == {"x", "n", "flag"}
    gs = ctx.produce_guards()
    assert gs.check((), {"batch": {"x": torch.randn(2, 3), "n": 3, "flag": True}})
    assert not gs.check((), {"batch": {"x": torch.randn(2, 3), "n": 4, "flag": True}})
    assert not gs.check((), {"batch": {"x": torch.randn(2, 3), "n": 3}})
    why = gs.explain((), {"batch": {"x": torch.randn(2, 3), "n": 4, "flag": True}})
    assert (
        why is not None and "kwargs['batch']['n'] == 3 failed: got kwargs['batch']['n'] = 4" in why
    )


def test_dynamic_int_input_becomes_symint() -> None:
    ctx = ShapeContext()
    n = ctx.fakeify(5, Source.arg(1), True)
    assert isinstance(n, torch.SymInt)
    gs = ctx.produce_guards()
    assert gs.check((None, 7)) and not gs.check((None, 7.5))


def test_auto_policy_makes_a_changing_int_dynamic() -> None:
    seen: list[object] = []

    def compile_fn(ctx: ShapeContext, args: Any, kwargs: Any) -> Any:
        seen.append(ctx.fakeify(args[0], Source.arg(0)))
        return lambda n: n + 1

    cache: GuardedCache[Any] = GuardedCache(compile_fn, policy="auto")
    assert [cache(n) for n in (3, 3, 4, 5)] == [4, 4, 5, 6]
    assert seen[0] == 3 and isinstance(seen[1], torch.SymInt)
    assert cache.stats()["misses"] == 2


def test_dynamic_policy_leaves_size_one_dims_static() -> None:
    ctx = ShapeContext(policy="dynamic")
    x = ctx.fakeify(torch.randn(1, 5), Source.arg(0))
    y = ctx.fakeify(torch.randn(3, 1), Source.arg(1), True)
    assert x.shape[0] == 1 and isinstance(x.shape[1], torch.SymInt)
    assert isinstance(y.shape[0], torch.SymInt) and y.shape[1] == 1
    gs = ctx.produce_guards()
    assert gs.check((torch.randn(1, 9), torch.randn(7, 1)))
    assert not gs.check((torch.randn(2, 9), torch.randn(7, 1)))


def test_dynamic_view_input_binds_its_stride_and_offset() -> None:
    base = torch.randn(6, 8)
    view = base[2:, 1:]  # storage offset 17, strides (8, 1)
    ctx = ShapeContext(policy="dynamic")
    fv = ctx.fakeify(view, Source.arg(0))
    with ctx.tracing():
        fv * 2
    gs = ctx.produce_guards()
    other = torch.randn(9, 10)
    assert gs.check((view,))
    assert gs.check((other[3:, 2:],))
    # offsets 0 and 1 are specialized like sizes: a contiguous copy (offset 0) recompiles
    assert not gs.check((other[3:, 2:].contiguous(),))


def test_dims_without_max_are_unbounded_so_a_multiple_of_one_can_be_solved() -> None:
    """``b.view(a, 10)`` with two Dims: the shape env solves ``b == 10*a`` for ``a``.
    A Dim without max used to get the finite stand-in 2**62, whose division by 10 is
    rounded in floats: ``tgt_bound=VR[20, 4611686018427388160] not a subset of
    src_bound=VR[20, 4611686018427387904]`` (compiled autograd retraces a backward
    that views a gradient to ``batch x 10`` this way, and fell back to eager)."""
    ctx = ShapeContext(policy="static")
    x, y = ctx.fakeify(
        [torch.randn(3, 4), torch.randn(30)],
        Source.arg(0),
        dynamic=[[Dim("a"), False], [Dim("b")]],
    )
    with ctx.tracing():
        out = (y.view(x.shape[0], 10)[:, :4] * x).sum(0)
    assert tuple(out.shape) == (4,)
    gs = ctx.produce_guards()
    for n in (2, 9, 1000):
        assert gs.check(([torch.randn(n, 4), torch.randn(10 * n)],)), n
    assert not gs.check(([torch.randn(5, 4), torch.randn(40)],))  # b != 10*a
    assert not gs.check(([torch.randn(1, 4), torch.randn(10)],))  # 0 and 1 specialize
    assert "<=" not in str(gs), str(gs)  # no upper bound was asked for
