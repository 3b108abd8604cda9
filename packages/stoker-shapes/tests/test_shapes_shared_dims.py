"""``ShapeContext.share_dim_symbols``: a contiguous input (or an int) whose dynamic
dims name Dims declared on an earlier input takes their symbols directly, without a
fresh symbol tied to them by a guard.  The guards must accept and reject exactly the
calls that the usual way's guards do, and the fakes must carry the same sizes and
strides (as expressions after the replacements)."""

from __future__ import annotations

import random
from typing import Any

import torch

from stoker_shapes import Dim, ShapeContext, Source


def _build(share: bool) -> tuple[ShapeContext, list[Any]]:
    b, t = Dim("b"), Dim("t")
    ctx = ShapeContext(policy="auto")
    ctx.share_dim_symbols = share
    args = [
        torch.randn(2, 5, 8),  # declares b and t
        torch.randn(2, 5, 8),  # shares both (contiguous)
        torch.randn(5, 2),  # shares both, in another order
        torch.randn(2, 9, 8)[:, :5],  # a slice: the usual way (a stride of its own)
        torch.randn(5, 3).t(),  # a view: the usual way
        # dense in another order of its dims (heads transposed), not a view: shares b, t
        torch.randn(2, 5, 3, 4).transpose(1, 2).detach(),
        torch.randn(2, 1, 5).transpose(1, 2).detach(),  # a size 1, not contiguous: usual way
    ]
    specs: list[Any] = [
        [b, t, None],
        [b, t, None],
        [t, b],
        [b, t, None],
        [None, t],
        [b, None, t, None],
        [b, t, None],
    ]
    fakes = [
        ctx.fakeify(a, Source.arg(0).item(i), dynamic=s)
        for i, (a, s) in enumerate(zip(args, specs))
    ]
    fakes.append(ctx.fakeify(5, Source.arg(1), dynamic=t))  # an int of Dim t
    assert len(fakes) == _INT + 1
    return ctx, fakes


_INT = 7  # where `_build` puts the int


def _call(rng: random.Random, bad: str | None) -> tuple[Any, ...]:
    b, t = rng.randint(2, 6), rng.randint(2, 9)
    b2 = b + 1 if bad == "b" else b
    t2 = t + 1 if bad == "t" else t
    n = t + 2 if bad == "int" else t
    tensors = [
        torch.randn(b, t, 8),
        torch.randn(b2, t, 8),
        torch.randn(t2, b),
        torch.randn(b, t + 4, 8)[:, :t],
        torch.randn(t, 3).t(),
        # "layout": contiguous where the compile saw the heads transposed
        torch.randn(b, 3, t, 4)
        if bad == "layout"
        else torch.randn(b, t, 3, 4).transpose(1, 2).detach(),
        torch.randn(b, 1, t).transpose(1, 2).detach(),
    ]
    return (tensors, n)


def test_shared_dim_symbols_guard_as_fresh_ones_do() -> None:
    plain_ctx, plain = _build(False)
    ctx, shared = _build(True)
    env, penv = ctx.shape_env, plain_ctx.shape_env
    # inputs 1, 2, 5 and the int took the Dims' symbols: nothing tied them by a guard
    assert shared[1].shape[0].node.expr == shared[0].shape[0].node.expr
    assert shared[2].shape[0].node.expr == shared[0].shape[1].node.expr

    # not a fresh symbol that a guard then replaced (``_expr``: before the replacements):
    # a dense input in another order of its dims shares too, a view does not
    def raw(fakes: list[Any]) -> set[Any]:
        return {d.node._expr for f in fakes for d in f.shape if isinstance(d, torch.SymInt)}

    assert raw(shared[5:6]) <= raw(shared[:4])
    assert not raw(shared[4:5]) <= raw(shared[:4])
    assert not raw(shared[6:7]) <= raw(shared[:6])  # a size 1: the usual way
    assert shared[_INT].node.expr == shared[0].shape[1].node.expr
    # the transposed heads' strides: expressions of the shared symbol, as the usual way
    # infers them (compared with it below)
    t_sym = shared[0].shape[1].node.expr
    heads = [
        env.replace(d.node.expr) if isinstance(d, torch.SymInt) else d for d in shared[5].stride()
    ]
    assert heads == [12 * t_sym, 4, 12, 1]
    assert len(env.guards) < len(penv.guards)
    # the same sizes and strides, up to the names of the symbols
    rename = {
        penv.replace(p): env.replace(s)
        for p, s in (
            (plain[0].shape[0].node.expr, shared[0].shape[0].node.expr),
            (plain[0].shape[1].node.expr, shared[0].shape[1].node.expr),
        )
    }
    for f, g in zip(shared[:_INT], plain[:_INT]):
        for a, c in ((f.shape, g.shape), (f.stride(), g.stride())):
            ours = [env.replace(d.node.expr) if isinstance(d, torch.SymInt) else d for d in a]
            theirs = [
                penv.replace(d.node.expr).xreplace(rename) if isinstance(d, torch.SymInt) else d
                for d in c
            ]
            # a stride symbol of its own (the slice) differs by name only
            assert len(ours) == len(theirs)
            for o, th in zip(ours, theirs):
                if isinstance(o, int) or isinstance(th, int):
                    assert o == th
                elif not (o.free_symbols - set(rename.values())):
                    assert o == th
    gs, pgs = ctx.produce_guards(), plain_ctx.produce_guards()
    rng = random.Random(0)
    for bad in (None, "b", "t", "int", "layout"):
        for _ in range(5):
            args = _call(rng, bad)
            assert gs.check(args) == pgs.check(args), (bad, gs.explain(args), pgs.explain(args))
            assert gs.check(args) == (bad is None), (bad, gs.explain(args))
