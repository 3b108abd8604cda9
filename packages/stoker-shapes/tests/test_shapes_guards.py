"""Guard explanations, JSON round trips, the C++/Python check paths, GuardedCache."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker_shapes import (
    Dim,
    GuardedCache,
    GuardSet,
    RecompileLimitError,
    ShapeContext,
    Source,
)
from stoker_shapes._internal import guards as guards_mod

Tracer = Callable[..., Any]


def broadcast_to_eight(x: torch.Tensor) -> torch.Tensor:
    return x + torch.ones(8)  # forces the dynamic size of x to 8


def test_explain_names_source_op_and_line(trace: Tracer) -> None:
    ctx = ShapeContext(policy="dynamic")
    trace(ctx, broadcast_to_eight, torch.randn(8))
    gs = ctx.produce_guards()
    assert gs.check((torch.randn(8),))
    why = gs.explain((torch.randn(16),))
    assert why is not None
    assert why.startswith("args[0].size()[0] == 8 failed: got 16")
    assert "aten.add.Tensor" in why
    assert "test_shapes_guards.py:" in why and "x + torch.ones(8)" in why


def test_str_lists_every_guard_with_its_origin(trace: Tracer) -> None:
    ctx = ShapeContext()
    b = Dim("batch", max=100)

    def f(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 3:  # refines the range of the batch dim
            return x * 2
        return x

    trace(ctx, f, torch.randn(8, 2), dynamic=[{0: b}])
    text = str(ctx.produce_guards())
    assert "args[0]: Tensor(float32, cpu, size=(?, 2), stride=(2, 1))" in text
    assert "args[0].size()[0] >= 4" in text
    assert "if x.shape[0] > 3" in text  # the refinement's origin is the user's line


@functools.cache
def _rich_guard_set() -> GuardSet:
    """Tensor, shared-dim, divisibility, range, int and str guards in one set."""
    ctx = ShapeContext()
    b = Dim("batch", max=64)
    x = ctx.fakeify(torch.randn(8, 3), Source.arg(0), {0: b})
    y = ctx.fakeify(torch.randn(8, 1, requires_grad=True), Source.arg(1), {0: b})
    n = ctx.fakeify(3, Source.arg(2))
    ctx.fakeify("sum", Source.arg(3))
    with ctx.tracing():
        z = x.reshape(-1) * 2
        if x.shape[0] % 2 == 0:
            z.sum() + y.sum() + n
    return ctx.produce_guards()


def _inputs() -> st.SearchStrategy[tuple[Any, ...]]:
    size = st.integers(0, 70)
    dtype = st.sampled_from([torch.float32, torch.float64])

    @st.composite
    def make(draw: st.DrawFn) -> tuple[Any, ...]:
        n, m = draw(size), draw(size)
        cols = draw(st.sampled_from([3, 4]))
        x = torch.empty(n, cols, dtype=draw(dtype))
        if draw(st.booleans()):
            x = torch.empty(cols, n).T  # non-contiguous
        y = torch.empty(m if draw(st.booleans()) else n, 1, requires_grad=draw(st.booleans()))
        k = draw(st.sampled_from([3, 4, 3.0]))
        mode = draw(st.sampled_from(["sum", "mean"]))
        return (x, y, k, mode)

    return make()


@settings(max_examples=300, deadline=None)
@given(args=_inputs())
def test_json_round_trip_checks_identically(args: tuple[Any, ...]) -> None:
    gs = _rich_guard_set()
    good = (torch.randn(6, 3), torch.randn(6, 1, requires_grad=True), 3, "sum")
    assert gs.check(good) and not gs.check((*good[:3], "mean"))
    gs2 = GuardSet.from_json(gs.to_json())
    assert gs2.source == gs.source
    ok = gs.check(args)
    assert gs2.check(args) == ok
    assert (gs.explain(args) is None) == ok


def test_python_fallback_matches_cpp_tensor_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _rich_guard_set()
    monkeypatch.setattr(guards_mod, "_tensor_guards", lambda specs: None)
    slow = GuardSet.from_json(fast.to_json())
    assert "___tg" not in slow.source and "___tg" in fast.source
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        n = int(torch.randint(0, 12, (), generator=gen))
        x = torch.randn(n, 3, dtype=torch.float64 if n == 5 else torch.float32)
        y = torch.randn(n if n % 3 else n + 1, 1, requires_grad=bool(n % 2))
        args = (x, y, 3, "sum")
        assert slow.check(args) == fast.check(args)


def test_guarded_cache_hit_miss_and_reasons() -> None:
    calls: list[tuple[int, ...]] = []

    def compile_fn(ctx: ShapeContext, args: Any, kwargs: Any) -> Callable[..., Any]:
        x = ctx.fakeify(args[0], Source.arg(0), False)
        calls.append(tuple(x.shape))
        return lambda t: t * 2

    cache: GuardedCache[Callable[..., Any]] = GuardedCache(compile_fn, policy="static")
    cache(torch.ones(2))
    cache(torch.ones(2))
    cache(torch.ones(3))
    cache(torch.ones(2))
    st_ = cache.stats()
    assert calls == [(2,), (3,)]
    assert (st_["hits"], st_["misses"], st_["entries"]) == (2, 2, 2)
    assert st_["reasons"] == [
        "args[0].size()[0] == 2 failed: got 3; static because of policy 'static' "
        "(declare the dim dynamic with a Dim, or use policy 'auto')"
    ]


def _static_cache(**kw: Any) -> GuardedCache[Callable[..., Any]]:
    def compile_fn(ctx: ShapeContext, args: Any, kwargs: Any) -> Callable[..., Any]:
        ctx.fakeify(args[0], Source.arg(0), False)
        return lambda t: t + 1

    return GuardedCache(compile_fn, policy="static", **kw)


def test_guarded_cache_limit_lists_every_reason() -> None:
    cache = _static_cache(limit=3)
    for n in (1, 2, 3):
        cache(torch.ones(n))
    with pytest.raises(RecompileLimitError) as err:
        cache(torch.ones(4))
    assert len(err.value.reasons) == 3
    msg = str(err.value)
    assert "hitting the limit of 3" in msg and "got 4" in msg and "got 2" in msg


def test_guarded_cache_fallback_warns_once() -> None:
    eager_calls = []

    def eager(t: torch.Tensor) -> torch.Tensor:
        eager_calls.append(t.shape)
        return t + 1

    cache = _static_cache(limit=1, fallback=eager)
    cache(torch.ones(1))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.testing.assert_close(cache(torch.ones(2)), torch.full((2,), 2.0))
        torch.testing.assert_close(cache(torch.ones(3)), torch.full((3,), 2.0))
    assert len([w for w in rec if "Falling back to eager" in str(w.message)]) == 1
    assert len(eager_calls) == 2 and cache.stats()["fallbacks"] == 2


@pytest.mark.parametrize("built_under", ["autocast", "none"])
def test_tensor_guards_do_not_depend_on_autocast(built_under: str) -> None:
    """Autocast is a thread-local mode, not tensor metadata: a guard set built (or loaded)
    inside an autocast region checks the same inputs the same way outside it, and back.
    Callers that depend on the autocast state key their caches on it themselves."""
    ctx = ShapeContext()
    x = ctx.fakeify(torch.randn(4, 3), Source.arg(0))
    with ctx.tracing():
        x * 2
    region = torch.autocast("cpu", dtype=torch.bfloat16)
    with region if built_under == "autocast" else contextlib.nullcontext():
        gs = ctx.produce_guards()
        loaded = GuardSet.from_json(gs.to_json())
    good, bad = (torch.randn(4, 3),), (torch.randn(4, 3, dtype=torch.float64),)
    for g in (gs, loaded):
        for inside in (True, False):
            with region if inside else contextlib.nullcontext():
                assert g.check(good), (built_under, inside, g.explain(good))
                assert g.explain(good) is None
                assert not g.check(bad)
                assert "dtype" in (g.explain(bad) or "")


@pytest.mark.parametrize("kind", [list, tuple])
def test_ints_guarded_by_value_compare_as_one_slice(kind: type) -> None:
    """A run of ints guarded by value in one list or tuple (compiled autograd's sizes)
    is checked by one slice comparison; it passes and fails exactly as the per-item
    guards do: a changed value, a bool or float equal to the value, a shorter list."""
    sizes = [-100, 16, 1, 8, 48, 2**40, 16, 0]
    ctx = ShapeContext(policy="static")
    ctx.fakeify(torch.randn(2), Source.arg(0))
    ctx.fakeify(kind(sizes), Source.arg(1))
    ctx.fakeify([3, 1.5], Source.arg(2))  # a run of one int: checked alone
    gs = ctx.produce_guards()
    assert gs.source.count("___s = args[1][0:8]") == 1, gs.source
    assert "args[1][3]" not in gs.source
    # each guard is kept (explain names the one that fails); a reloaded set checks alike
    assert "type(args[1][3]) is int and args[1][3] == 8" in [g.code for g in gs.guards]
    loaded = GuardSet.from_json(gs.to_json())
    t = torch.randn(2)
    assert gs.check((t, kind(sizes), [3, 1.5])) and loaded.check((t, kind(sizes), [3, 1.5]))
    bad: list[list[Any]] = []
    for i in range(len(sizes)):
        for other in (sizes[i] + 1, float(sizes[i]), "x"):
            bad.append([*sizes[:i], other, *sizes[i + 1 :]])
    bad.append([*sizes[:2], True, *sizes[3:]])  # True == 1 but is not an int
    bad += [sizes[:-1], [*sizes, 1]]
    for b in bad:
        args = (t, kind(b), [3, 1.5])
        assert not gs.check(args), b
        assert gs.explain(args) is not None, b
    assert not gs.check((t, list(sizes) if kind is tuple else tuple(sizes), [3, 1.5]))
    assert not gs.check((t, kind(sizes), [4, 1.5]))
