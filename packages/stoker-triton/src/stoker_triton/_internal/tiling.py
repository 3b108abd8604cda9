"""How a reduction walks memory: *inner* (the reduced dim is the contiguous one:
`x.sum(-1)`) or *outer* (the kept dim is: `x.sum(0)`), and the split of long
outer reductions with few outputs into two reductions (Inductor's split
reduction). docs/triton.md, "Reduction tiling", has the rules and numbers.

A kernel's tile is `[XBLOCK, RBLOCK]`; Triton lays it out along whichever dim
the loads are contiguous in, so an outer reduction reads coalesced when
XBLOCK spans enough contiguous elements (the launcher's outer configs) and
an inner one when RBLOCK does.

Also the row-major split of a flat index into a node's index variables
(`decompose`, `flat_vars`), which lowering's split and the scheduler share.
Imports only the IR (`ir.py`): lowering and the scheduler both import this.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import sympy
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from .ir import Expr, IndexValue, Load, Op, Rand, Value, contiguous_strides, index_var

# The GPU the split is sized for (H100: 132 SMs, 2048 threads each); the split
# only has to give the device enough programs, so a close guess suffices.
NUM_SM = 132
THREADS_PER_SM = 2048
# Split an outer reduction only when it has fewer outputs than this (two
# 32-wide blocks per SM cover the device without a split) ...
SPLIT_MAX_OUTPUTS = 2 * NUM_SM * 32
# ... and at least this many reduced elements per output.
SPLIT_MIN_RNUMEL = 1024
# An inner reduction's partials reduce at least this many elements each, and
# only reductions with at most this many outputs split: a full reduction
# (`x.sum()`, a gradient norm) must, while splitting a few long softmax or
# norm rows would cut their one kernel into five (a program per row keeps
# the row's statistics and its output in one kernel, at fewer programs).
INNER_SPLIT_MIN_CHUNK = 2048
INNER_SPLIT_MAX_OUTPUTS = 32
# Reduction types whose partial results combine with the same reduction.
SPLITTABLE = frozenset({"sum", "prod", "max", "min", "any", "all"})


@functools.lru_cache(maxsize=4096)  # a model's layers repeat their indices (sympy.expand)
def strides(index: Expr, x: sympy.Symbol, r: sympy.Symbol) -> tuple[Expr, Expr]:
    """The steps of a flat `index` when `x` and when `r` advance by one (at 0)."""
    at = {x: 0, r: 0}
    base = index.xreplace(at)
    sx = sympy.expand(index.xreplace({x: 1, r: 0}) - base)
    sr = sympy.expand(index.xreplace({x: 0, r: 1}) - base)
    return sx, sr


def is_outer(indices: Iterable[Expr], x: sympy.Symbol, r: sympy.Symbol) -> bool:
    """True when most full-size loads (their index moves with both `x` and `r`;
    a per-row or per-column vector read beside them does not count) step by
    one along `x` and not along `r`. Ties, unknown strides and no full-size
    load: inner."""
    outer = inner = 0
    for e in indices:
        sx, sr = strides(e, x, r)
        if sx == 0 or sr == 0:
            continue
        if sx == 1 and sr != 1:
            outer += 1
        else:
            inner += 1
    return outer > inner


def split_factor(xnumel: Expr, rnumel: Expr, outer: bool) -> int:
    """How many partial reductions a reduction of `xnumel` outputs over `rnumel`
    elements is split into (1: no split); static sizes only. Outer reductions
    follow Inductor's outer split (`choices.reduction_split_factor`): enough
    128-output programs of 8 warps to fill the device, each partial at least 32
    rows. Inner ones split only with at most INNER_SPLIT_MAX_OUTPUTS outputs
    (`x.sum()`): about 8 programs per SM, each partial at least 2048 elements. The factor is
    rounded down to a divisor of `rnumel`, so every partial is whole."""
    if not (xnumel.is_number and rnumel.is_number):
        return 1
    x, r = int(xnumel), int(rnumel)
    if outer:
        if x >= SPLIT_MAX_OUTPUTS or r < SPLIT_MIN_RNUMEL:
            return 1
        target_blocks = -(-(NUM_SM * THREADS_PER_SM // 256) // -(-x // 128))
        if r * x < 32 * NUM_SM * THREADS_PER_SM:
            chunk = 32 * 4
        else:
            chunk = max(-(-r // (4 * target_blocks)), 32) * 4
        want = min(r // 32, -(-r // chunk))
    else:
        if x > INNER_SPLIT_MAX_OUTPUTS or r < 8 * INNER_SPLIT_MIN_CHUNK:
            return 1
        want = min(r // INNER_SPLIT_MIN_CHUNK, -(-8 * NUM_SM // x))
    want = max(want, 1)
    return max(d for d in range(1, want + 1) if r % d == 0)


def subs_index(v: Value, mapping: dict[sympy.Symbol, Expr]) -> Value:
    """`v` with index variables replaced in every index expression (loads,
    index values, random offsets, indirect bindings)."""
    memo: dict[int, Value] = {}

    def go(u: Value) -> Value:
        hit = memo.get(id(u))
        if hit is not None:
            return hit
        out: Value
        if isinstance(u, Load):
            ind = tuple((s, go(b)) for s, b in u.indirect)
            out = Load(u.buf, u.index.xreplace(mapping), u.dtype, ind)
        elif isinstance(u, IndexValue):
            ind = tuple((s, go(b)) for s, b in u.indirect)
            out = IndexValue(u.expr.xreplace(mapping), u.dtype, ind)
        elif isinstance(u, Rand):
            out = Rand(u.kind, u.stream, u.offset.xreplace(mapping), u.dtype)
        elif isinstance(u, Op):
            out = Op(u.name, [go(a) for a in u.args], u.dtype)
        else:
            out = u
        memo[id(u)] = out
        return out

    return go(v)


def decompose(flat: Expr, sizes: Sequence[Expr]) -> list[Expr]:
    """Row-major index variables of `sizes` from a flat index."""
    strides = contiguous_strides(sizes)
    out: list[Expr] = []
    for k, (s, st) in enumerate(zip(sizes, strides)):
        if s == 1:
            out.append(sympy.Integer(0))
        elif k == 0:
            out.append(FloorDiv(flat, st))
        else:
            out.append(ModularIndexing(flat, st, s))
    return out


def memory_order(sizes: Sequence[Expr], strides: Sequence[Expr]) -> tuple[int, ...] | None:
    """The dims of a dense layout from largest stride to smallest (the loop order that
    walks it in memory order: channels-last NCHW is (0, 2, 3, 1)); None where that is
    row-major (nothing to reorder), the layout is not dense (a slice, an expanded view)
    or a size or stride is symbolic.  Size-1 dims keep their place among the others."""
    if len(sizes) < 2 or not all(isinstance(e, int | sympy.Integer) for e in (*sizes, *strides)):
        return None
    size, stride = [int(e) for e in sizes], [int(e) for e in strides]
    big = sorted((d for d in range(len(size)) if size[d] != 1), key=lambda d: (-stride[d], d))
    expected = 1
    for d in reversed(big):
        if stride[d] != expected:
            return None
        expected *= size[d]
    if big == sorted(big):
        return None
    slots = iter(big)
    order = tuple(d if size[d] == 1 else next(slots) for d in range(len(size)))
    return order


def flat_vars(prefix: str, sizes: Sequence[Expr], flat: Expr) -> dict[sympy.Symbol, Expr]:
    """`prefix0, prefix1, ...` of `sizes` (row-major) in terms of one flat index."""
    return {index_var(prefix, k): e for k, e in enumerate(decompose(flat, sizes))}
