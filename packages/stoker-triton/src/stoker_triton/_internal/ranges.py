"""Value ranges of a node's integer values, and the tests they decide.

Lowerings write the general case: an index wraps when negative (``x[i]`` with
``i < 0``), a padded read asks whether its position lies inside the input, a
concatenation asks which piece a position falls in. Over a node's own loop
ranges most of these tests have one answer: a pooling window's positions
``2 * (x3 % 8) + r0 % 2`` lie in ``[0, 15]``, so the wrap's ``i < 0`` is
false and the padding's ``0 <= i < 16`` is true. `fold_ranges` computes an
interval for every integer and boolean value of a body, from the ranges of the
index variables (``x_k`` in ``[0, size_k)``, ``r_k`` in ``[0, reduce_size_k)``),
and replaces a comparison whose interval is one point by a constant; a select
or mask on a constant takes its branch. Both emitters then print fewer
operations and plain loads where they printed masked ones, which the C
compiler vectorises.

Intervals are closed, ``(lo, hi)`` with ``math.inf`` for an unknown end. Only
integer and boolean values get one; a float is unknown. A symbolic size gives
its variable the range ``[0, inf)``, so a test against it stays as it is. An
interval is only ever an over-approximation: a fold happens only when every
value in the interval gives the same answer.

This room imports torch and sympy only (the IR).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from .ir import Const, Expr, IndexValue, Load, Op, Value, index_var

Interval = tuple[float, float]
UNKNOWN: Interval = (-math.inf, math.inf)
_BOOL: Interval = (0, 1)


def loop_ranges(
    size: Sequence[Expr], reduce_size: Sequence[Expr] = ()
) -> dict[sympy.Symbol, Interval]:
    """The ranges of a node's index variables ``x_k`` and ``r_k``."""
    out: dict[sympy.Symbol, Interval] = {}
    for prefix, sizes in (("x", size), ("r", reduce_size)):
        for k, s in enumerate(sizes):
            out[index_var(prefix, k)] = (0, int(s) - 1) if s.is_number else (0, math.inf)
    return out


def _dtype_range(dtype: torch.dtype) -> Interval:
    if dtype == torch.bool:
        return _BOOL
    if dtype.is_floating_point or dtype.is_complex:
        return UNKNOWN
    info = torch.iinfo(dtype)
    return (info.min, info.max)


def _mul(a: Interval, b: Interval) -> Interval:
    ends: list[float] = []
    for x in a:
        for y in b:
            if (x == 0 and math.isinf(y)) or (y == 0 and math.isinf(x)):
                ends.append(0)  # 0 * unbounded: the end is at most 0 * a finite value
            else:
                ends.append(x * y)
    return (min(ends), max(ends))


def _floordiv(a: Interval, d: int) -> Interval:
    """``a // d`` for a positive constant ``d``."""
    lo = -math.inf if math.isinf(a[0]) else a[0] // d
    hi = math.inf if math.isinf(a[1]) else a[1] // d
    return (lo, hi)


def _modulo(a: Interval, m: int) -> Interval:
    """``a % m`` (Python's sign: the result has the divisor's) for a positive constant ``m``."""
    if a[0] >= 0 and a[1] < m:
        return a
    if not (math.isinf(a[0]) or math.isinf(a[1])) and a[0] // m == a[1] // m:
        return (a[0] % m, a[1] % m)  # one period: the remainder does not wrap
    return (0, m - 1)


def expr_range(e: Expr, env: Mapping[sympy.Symbol, Interval]) -> Interval:
    """An interval holding every value of the index expression ``e``."""
    if e.is_Integer:
        return (int(e), int(e))
    if e.is_Symbol:
        hit = env.get(e)  # type: ignore[call-overload]
        if hit is not None:
            return hit
        if e.is_positive:
            return (1, math.inf)
        return (0, math.inf) if e.is_nonnegative else UNKNOWN
    if e.is_Add:
        lo: float = 0
        hi: float = 0
        for a in e.args:
            r = expr_range(a, env)
            lo, hi = lo + r[0], hi + r[1]
        return (lo, hi)
    if e.is_Mul:
        out: Interval = (1, 1)
        for a in e.args:
            out = _mul(out, expr_range(a, env))
        return out
    if isinstance(e, FloorDiv):
        base, div = e.args
        if div.is_number and div > 0:
            return _floordiv(expr_range(base, env), int(div))
        return UNKNOWN
    if isinstance(e, ModularIndexing):
        base, div, mod = e.args
        if div.is_number and div > 0 and mod.is_number and mod > 0:
            return _modulo(_floordiv(expr_range(base, env), int(div)), int(mod))
        return UNKNOWN
    if isinstance(e, sympy.Mod):
        base, mod = e.args
        if mod.is_number and mod > 0:
            return _modulo(expr_range(base, env), int(mod))
        return UNKNOWN
    if isinstance(e, sympy.Max | sympy.Min):
        rs = [expr_range(a, env) for a in e.args]
        pick = max if isinstance(e, sympy.Max) else min
        return (pick(r[0] for r in rs), pick(r[1] for r in rs))
    return UNKNOWN


def _within(r: Interval, dtype: torch.dtype) -> Interval:
    """``r`` if a value of ``dtype`` can hold all of it, else the dtype's range (a wrap)."""
    full = _dtype_range(dtype)
    if r[0] < full[0] or r[1] > full[1]:
        return full
    return r


def _compare(name: str, a: Interval, b: Interval) -> bool | None:
    """The answer of ``a <name> b`` when every pair of values gives the same one."""
    if name == "lt":
        return True if a[1] < b[0] else False if a[0] >= b[1] else None
    if name == "le":
        return True if a[1] <= b[0] else False if a[0] > b[1] else None
    if name == "gt":
        return True if a[0] > b[1] else False if a[1] <= b[0] else None
    if name == "ge":
        return True if a[0] >= b[1] else False if a[1] < b[0] else None
    if name in ("eq", "ne"):
        if a[1] < b[0] or b[1] < a[0]:
            return name == "ne"
        if a[0] == a[1] == b[0] == b[1]:
            return name == "eq"
    return None


_COMPARISONS = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})
_ANDS = frozenset({"logical_and", "bitwise_and"})
_ORS = frozenset({"logical_or", "bitwise_or"})


class _Folder:
    def __init__(self, env: Mapping[sympy.Symbol, Interval]) -> None:
        self.env = dict(env)
        self.memo: dict[int, tuple[Value, Interval]] = {}

    def range_of(self, v: Value) -> Interval:
        return self.fold(v)[1]

    def fold(self, v: Value) -> tuple[Value, Interval]:
        hit = self.memo.get(id(v))
        if hit is None:
            hit = self._fold(v)
            self.memo[id(v)] = hit
        return hit

    def _bound(
        self, indirect: tuple[tuple[sympy.Symbol, Value], ...]
    ) -> tuple[tuple[tuple[sympy.Symbol, Value], ...], dict[sympy.Symbol, Interval]]:
        out = []
        env = dict(self.env)
        for sym, b in indirect:
            nb, r = self.fold(b)
            out.append((sym, nb))
            env[sym] = r
        return tuple(out), env

    def _fold(self, v: Value) -> tuple[Value, Interval]:
        dtype = v.dtype
        if isinstance(v, Const):
            if dtype.is_floating_point or dtype.is_complex:
                return v, UNKNOWN
            x = int(v.value)
            return v, (x, x)
        if isinstance(v, IndexValue):
            ind, env = self._bound(v.indirect)
            nv: Value = v if ind == v.indirect else IndexValue(v.expr, dtype, ind)
            if dtype.is_floating_point:
                return nv, UNKNOWN
            return nv, _within(expr_range(v.expr, env), dtype)
        if isinstance(v, Load):
            ind, _ = self._bound(v.indirect)
            nl: Value = v if ind == v.indirect else Load(v.buf, v.index, dtype, ind)
            return nl, _dtype_range(dtype)
        if not isinstance(v, Op):
            return v, _dtype_range(dtype)
        parts = [self.fold(a) for a in v.args]
        args = [p[0] for p in parts]
        rs = [p[1] for p in parts]
        folded = self._rule(v, args, rs)
        if folded is not None:
            return folded
        no: Value = v if all(a is b for a, b in zip(args, v.args)) else Op(v.name, args, dtype)
        return no, self._op_range(v.name, rs, dtype)

    def _rule(self, v: Op, args: list[Value], rs: list[Interval]) -> tuple[Value, Interval] | None:
        name, dtype = v.name, v.dtype
        if name in _COMPARISONS and all(
            a.dtype != torch.bool and not a.dtype.is_floating_point for a in args
        ):
            answer = _compare(name, rs[0], rs[1])
            if answer is not None:
                return Const(answer, torch.bool), (int(answer), int(answer))
        if name in ("where", "masked") and isinstance(args[0], Const):
            pick = args[1] if args[0].value else args[2]
            if pick.dtype == dtype:
                return self.fold(pick)
        if dtype == torch.bool and (name in _ANDS or name in _ORS):
            absorbing = name in _ORS  # True absorbs an or; False an and
            rest = []
            for a in args:
                if isinstance(a, Const):
                    if bool(a.value) == absorbing:
                        return Const(absorbing, torch.bool), (int(absorbing), int(absorbing))
                    continue  # the neutral value drops out
                rest.append(a)
            if not rest:
                return Const(not absorbing, torch.bool), (int(not absorbing),) * 2
            if len(rest) == 1 and rest[0].dtype == torch.bool:
                return self.fold(rest[0])
            if len(rest) < len(args):
                return Op(name, rest, dtype), _BOOL
        if name == "logical_not" and isinstance(args[0], Const):
            answer = not args[0].value
            return Const(answer, torch.bool), (int(answer), int(answer))
        return None

    def _op_range(self, name: str, rs: list[Interval], dtype: torch.dtype) -> Interval:
        if dtype == torch.bool:
            return _BOOL
        if dtype.is_floating_point or dtype.is_complex:
            return UNKNOWN
        if name == "add":
            return _within((rs[0][0] + rs[1][0], rs[0][1] + rs[1][1]), dtype)
        if name == "sub":
            return _within((rs[0][0] - rs[1][1], rs[0][1] - rs[1][0]), dtype)
        if name == "mul":
            return _within(_mul(rs[0], rs[1]), dtype)
        if name == "neg":
            return _within((-rs[0][1], -rs[0][0]), dtype)
        if name in ("identity", "to"):
            return _within(rs[0], dtype)
        if name in ("where", "masked"):
            a, b = rs[1], rs[2]
            return (min(a[0], b[0]), max(a[1], b[1]))
        if name in ("maximum", "minimum"):
            pick = max if name == "maximum" else min
            return (pick(rs[0][0], rs[1][0]), pick(rs[0][1], rs[1][1]))
        if name in ("floordiv", "remainder") and rs[1][0] == rs[1][1] and rs[1][0] > 0:
            d = int(rs[1][0])
            return _floordiv(rs[0], d) if name == "floordiv" else _modulo(rs[0], d)
        return _dtype_range(dtype)


def fold_ranges(body: Value, env: Mapping[sympy.Symbol, Interval]) -> Value:
    """``body`` with the comparisons its value ranges decide replaced by constants
    (and the selects, masks, ands and ors on them reduced); ``body`` itself when
    nothing folds."""
    return _Folder(env).fold(body)[0]
