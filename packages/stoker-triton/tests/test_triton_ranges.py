"""Value ranges over a node's loops (`ranges.py`): the tests a lowering writes for the
general case (a negative index's wrap, a padded read's bounds, a concatenation's
pieces) folded where the loop ranges decide them, and kept where they do not."""

from __future__ import annotations

import math

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from stoker_triton._internal.ir import Const, IndexValue, Load, Op, Value, index_var
from stoker_triton._internal.ranges import expr_range, fold_ranges, loop_ranges

I64, B = torch.int64, torch.bool
x0, x1, r0 = index_var("x", 0), index_var("x", 1), index_var("r", 0)


def iv(e: sympy.Expr) -> IndexValue:
    return IndexValue(e, I64)


def wrap(v: Value, n: int) -> Op:
    """`v + n` where `v < 0` (the index lowerings' wrap)."""
    return Op(
        "where", (Op("lt", (v, Const(0, I64)), B), Op("add", (v, Const(n, I64)), I64), v), I64
    )


def inside(v: Value, n: int) -> Op:
    """`0 <= v < n` (the padding lowering's test)."""
    return Op("logical_and", (Op("ge", (v, Const(0, I64)), B), Op("lt", (v, Const(n, I64)), B)), B)


def test_expr_ranges_of_index_arithmetic() -> None:
    env = loop_ranges((sympy.Integer(8), sympy.Integer(64)), (sympy.Integer(4),))
    assert expr_range(2 * x0 + ModularIndexing(r0, 1, 2), env) == (0, 15)
    assert expr_range(FloorDiv(x1, 8) * 3 - 5, env) == (-5, 16)
    assert expr_range(ModularIndexing(x1, 8, 4), env) == (0, 3)
    assert expr_range(ModularIndexing(x1, 16, 8), env) == (0, 3)  # 63 // 16 = 3: no wrap
    assert expr_range(sympy.Mod(x0 + 3, 5), env) == (0, 4)
    assert expr_range(sympy.Max(x0, 20) - x1, env) == (20 - 63, 20)
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    sym = loop_ranges((s0,))
    assert sym[x0] == (0, math.inf)
    assert expr_range(x0 - s0, sym) == (-math.inf, math.inf)


def test_a_pooling_window_needs_no_wrap_and_no_bounds() -> None:
    """A 2x2 window's position `2 * x0 + r0 % 2` lies in [0, 15]: its wrap and its
    `0 <= i < 16` test fold away, and the masked load becomes a plain one."""
    pos = Op("add", (Op("mul", (iv(x0), Const(2, I64)), I64), iv(ModularIndexing(r0, 1, 2))), I64)
    ind = sympy.Symbol("ind0", integer=True)
    w = wrap(pos, 16)
    load = Load("buf0", ind, torch.float32, ((ind, w),))
    cond = inside(IndexValue(ind, I64, ((ind, w),)), 16)  # the padding tests the bound index
    fill = Const(-math.inf, torch.float32)
    masked = Op("masked", (cond, load, Const(0.0, torch.float32)), torch.float32)
    body = Op("where", (cond, masked, fill), torch.float32)
    env = loop_ranges((sympy.Integer(8),), (sympy.Integer(4),))
    out = fold_ranges(body, env)
    assert isinstance(out, Load), out
    assert out.indirect[0][1] == pos  # the wrap is gone: the position itself
    # one more column than the padded input has: the bounds test must stay
    wide = loop_ranges((sympy.Integer(9),), (sympy.Integer(4),))
    kept = fold_ranges(body, wide)
    assert isinstance(kept, Op) and kept.name == "where", kept
    assert "lt(" in repr(kept) and "ge(" not in repr(kept)  # only the upper bound can fail


def test_what_the_ranges_do_not_decide_stays() -> None:
    env = loop_ranges((sympy.Integer(8),))
    undecided = Op("lt", (iv(x0), Const(5, I64)), B)
    assert fold_ranges(undecided, env) is undecided
    loaded = Load("idx", x0, I64)  # an index tensor's values: any int64
    w = wrap(loaded, 10)
    assert fold_ranges(w, env) is w
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    sym = Op("lt", (iv(x0), iv(s0)), B)
    assert fold_ranges(sym, loop_ranges((s0,))) is sym
    # a float comparison has no range
    f = Op("lt", (Load("a", x0, torch.float32), Const(0.0, torch.float32)), B)
    assert fold_ranges(f, env) is f


def test_constants_reduce_selects_masks_ands_and_ors() -> None:
    env = loop_ranges((sympy.Integer(8),))
    a, b = Load("a", x0, torch.float32), Load("b", x0, torch.float32)
    true = Op("ge", (iv(x0), Const(0, I64)), B)
    false = Op("gt", (iv(x0), Const(7, I64)), B)
    c = Op("lt", (Load("c", x0, torch.float32), Const(0.0, torch.float32)), B)
    assert fold_ranges(Op("where", (true, a, b), torch.float32), env) == a
    assert fold_ranges(Op("where", (false, a, b), torch.float32), env) == b
    assert fold_ranges(
        Op("masked", (false, a, Const(0.0, torch.float32)), torch.float32), env
    ) == Const(0.0, torch.float32)
    assert fold_ranges(Op("logical_and", (true, c), B), env) == c
    assert fold_ranges(Op("logical_and", (false, c), B), env) == Const(False, B)
    assert fold_ranges(Op("logical_or", (true, c), B), env) == Const(True, B)
    assert fold_ranges(Op("bitwise_or", (false, c), B), env) == c
    assert fold_ranges(Op("logical_not", (false,), B), env) == Const(True, B)


def test_a_narrow_integer_that_may_wrap_has_its_dtype_range() -> None:
    env = loop_ranges((sympy.Integer(1000),))
    big = Op("mul", (IndexValue(x0, torch.int8), Const(1000, torch.int8)), torch.int8)
    neg = Op("lt", (big, Const(0, torch.int8)), B)
    assert fold_ranges(neg, env) is neg  # int8 * 1000 wraps: its sign is unknown
    wide = Op("lt", (Op("mul", (iv(x0), Const(1000, I64)), I64), Const(0, I64)), B)
    assert fold_ranges(wide, env) == Const(False, B)
