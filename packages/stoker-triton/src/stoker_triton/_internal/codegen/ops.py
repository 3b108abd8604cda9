"""The Triton half of the pointwise table and the printers codegen shares.

`OPS` maps each IR op name (`ir.POINTWISE_OPS`) to its Triton expression;
`PRELUDE` holds the @triton.jit helpers every kernel module defines once;
`IndexPrinter` prints sympy index arithmetic as Triton integer code.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sympy.printing.str import StrPrinter
from torch.utils._sympy.functions import CleanDiv, FloorDiv, Mod, ModularIndexing, PythonMod

from ..ir import POINTWISE_OPS, Const, Expr

TL_DTYPE = {
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.int8: "tl.int8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}

# float32 -> bfloat16, rounded to nearest even. `_to_bf16_bits` rounds on the
# bits, which gives the same values everywhere: Triton's interpreter truncates
# a plain `.to(tl.bfloat16)` (one ulp off half the time), so there `_to_bf16`
# is the bit version; a GPU rounds natively. Integer sources always take the
# bit version: Triton 3.6's LLVM lowers `sitofp i1 -> bfloat` (what a
# float32 conversion of a {-1, 0} select folds into) to +1 instead of -1.
PRELUDE_BF16 = {
    "native": """
@triton.jit
def _to_bf16(x):
    return x.to(tl.bfloat16)
""",
    "interpret": """
@triton.jit
def _to_bf16(x):
    return _to_bf16_bits(x)
""",
}

# Helpers every kernel module defines once (plain @triton.jit functions).
PRELUDE = """
@triton.jit
def _to_bf16_bits(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    r = bits.to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r).to(tl.bfloat16)


@triton.jit
def _f2i32(x):
    # float -> int32 as CUDA's cvt.rzi.s32: toward zero, saturated, NaN -> 0
    hi = x >= 2147483648.0
    lo = x < -2147483648.0
    r = tl.where(hi | lo | (x != x), 0.0, x).to(tl.int32)
    return tl.where(hi, 2147483647, tl.where(lo, -2147483647 - 1, r))


@triton.jit
def _f2i64(x):
    # float -> int64 as eager CUDA: toward zero, saturated, and NaN -> INT64_MIN
    # (measured on an H100; the int32 conversion gives 0 for NaN)
    hi = x >= 9223372036854775808.0
    lo = (x < -9223372036854775808.0) | (x != x)
    r = tl.where(hi | lo, 0.0, x).to(tl.int64)
    return tl.where(hi, 9223372036854775807, tl.where(lo, -9223372036854775807 - 1, r))


@triton.jit
def _prod_combine(a, b):
    return a * b


@triton.jit
def _max_nan(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _min_nan(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def _welford_combine(mean_1, m2_1, w_1, mean_2, m2_2, w_2):
    delta = mean_2 - mean_1
    w = w_1 + w_2
    frac = tl.where(w == 0.0, 0.0, w_2 / tl.where(w == 0.0, 1.0, w))
    return mean_1 + delta * frac, m2_1 + m2_2 + delta * delta * w_1 * frac, w


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _log1p(x):
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _expm1(x):
    u = tl.exp(x)
    um1 = u - 1.0
    return tl.where(u == 1.0, x, tl.where(um1 == -1.0, -1.0, um1 * x / tl.log(tl.where(u == 1.0, 2.0, u))))


@triton.jit
def _floordiv_int(a, b):
    q = a // b
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)


@triton.jit
def _remainder_int(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _remainder_float(a, b):
    r = a - b * tl.floor(a / b)
    return r


@triton.jit
def _fmod_float(a, b):
    q = a / b
    q = tl.where(q < 0, tl.ceil(q), tl.floor(q))
    return a - b * q


@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def _round(x):
    # nearbyint: half to even, exact for every x (`floor(x + 0.5)` is not: the
    # sum rounds for large x and for 0.49999997). `x` itself is never added to
    # or subtracted from, so no FMA contraction can skip the rounding of a
    # product `x` (round.decimals rounds `x * 10**d`, eager rounds it first).
    r = tl.floor(x)
    h = r + 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((x > h) | ((x == h) & odd), r + 1.0, r)
    return tl.where(r == 0.0, x * 0.0, r)  # a zero keeps the sign of x


@triton.jit
def _pow(a, b):
    b = b + tl.zeros_like(a)
    ab = tl.abs(a)
    r = tl.exp(b * tl.log(ab))
    bi = tl.floor(b)
    is_int = bi == b
    odd = is_int & ((bi - 2.0 * tl.floor(bi * 0.5)) != 0.0)
    r = tl.where((a < 0) & odd, -r, r)
    r = tl.where((a < 0) & (~is_int), float("nan"), r)
    r = tl.where(b == 0.0, 1.0, r)
    return r


@triton.jit
def _pow_int(a, b):
    r = tl.zeros_like(a) + 1
    base = a
    e = b + tl.zeros_like(a)
    for _ in tl.static_range(63):
        r = tl.where((e & 1) != 0, r * base, r)
        base = base * base
        e = e >> 1
    return r
"""


def _f(template: str) -> Callable[[Sequence[str], Sequence[torch.dtype], torch.dtype], str]:
    return lambda a, dts, out: template.format(*a)


def _float_or_int(
    f_tpl: str, i_tpl: str
) -> Callable[[Sequence[str], Sequence[torch.dtype], torch.dtype], str]:
    def gen(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
        is_float = any(d.is_floating_point for d in dts)
        return (f_tpl if is_float else i_tpl).format(*a)

    return gen


def is_literal(code: str) -> bool:
    """A Python literal (a `Const`), not a block variable."""
    return code[:1].isdigit() or code.startswith(("-", "float("))


# float -> integer, as eager's CUDA kernels do it (c10::convert): a C++
# static_cast to int32/int64 (saturates; NaN -> 0 / INT64_MIN), int8/int16
# wrap through int32, uint8 wraps through int64 (c10's
# static_cast_with_inter_type<uint8_t>: -3.5 -> 253). Emitted explicitly:
# Triton's own `.to(tl.int8)` saturates to the int16 range on a GPU (and LLVM
# treats out-of-range values as poison), and the interpreter follows NumPy.
FLOAT_TO_INT = {
    torch.int64: "_f2i64({})",
    torch.int32: "_f2i32({})",
    torch.int16: "_f2i32({}).to(tl.int16)",
    torch.int8: "_f2i32({}).to(tl.int8)",
    torch.uint8: "_f2i64({}).to(tl.uint8)",
}


def _cast(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    """`to`: every conversion as eager's (see FLOAT_TO_INT and PRELUDE_BF16)."""
    if out == torch.bool:
        return f"({a[0]} != 0)"
    src = dts[0] if dts else None
    x = a[0]
    if src is not None and src.is_floating_point and out in FLOAT_TO_INT:
        if src in (torch.float16, torch.bfloat16):
            x = f"{x}.to(tl.float32)"
        return FLOAT_TO_INT[out].format(x)
    if out == torch.bfloat16 and src != torch.bfloat16:
        # through float32, as eager does (c10::BFloat16 is built from a float)
        if src == torch.float32:
            return f"_to_bf16({x})"
        if src is not None and not src.is_floating_point:
            return f"_to_bf16_bits({x}.to(tl.float32))"
        return f"_to_bf16({x}.to(tl.float32))"
    if out == torch.float16 and src not in (None, torch.float32, torch.bfloat16):
        # integers and float64 -> half through float32, as eager does (c10::Half
        # is built from a float: float64 rounds twice)
        return f"{x}.to(tl.float32).to({TL_DTYPE[out]})"
    return f"{x}.to({TL_DTYPE[out]})"


_SIGN_BITS = {
    torch.float64: "tl.int64",
    torch.float32: "tl.int32",
    torch.float16: "tl.int16",
    torch.bfloat16: "tl.int16",
}


def _signbit(x: str, dt: torch.dtype) -> str:
    """The sign bit, so -0.0 and -nan count as negative (as eager's signbit)."""
    if dt in _SIGN_BITS:
        return f"({x}.to({_SIGN_BITS[dt]}, bitcast=True) < 0)"
    return f"({x} < 0)"


def _copysign(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    if is_literal(a[1]):  # a Python scalar: its sign is known now
        value = float(a[1].removeprefix("float(").removesuffix(")").strip("'"))
        negative = math.copysign(1.0, value) < 0
        return f"(-tl.abs({a[0]}))" if negative else f"tl.abs({a[0]})"
    return f"tl.where({_signbit(a[1], dts[1])}, -tl.abs({a[0]}), tl.abs({a[0]}))"


def _sign(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    # eager: (0 < x) - (x < 0), so NaN and -0.0 give 0. Floats select float
    # constants: converting the integer select to bfloat16 is what Triton 3.6
    # miscompiles (see PRELUDE_BF16).
    x = a[0]
    if dts[0].is_floating_point:
        return f"tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, 0.0)).to({x}.dtype)"
    return f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({x}.dtype)"


def _maxmin(
    fn: str, cmp: str
) -> Callable[[Sequence[str], Sequence[torch.dtype], torch.dtype], str]:
    def gen(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
        if out.is_floating_point:  # torch propagates NaN
            return f"tl.where(({a[0]} {cmp} {a[1]}) | ({a[0]} != {a[0]}), {a[0]}, {a[1]})"
        return f"{fn}({a[0]}, {a[1]})"

    return gen


# IR op -> Triton expression (the codegen half of the pointwise table).
OPS: dict[str, Callable[[Sequence[str], Sequence[torch.dtype], torch.dtype], str]] = {
    "identity": _f("{0}"),
    "add": _f("({0} + {1})"),
    "sub": _f("({0} - {1})"),
    "mul": _f("({0} * {1})"),
    "truediv": _f("({0} / {1})"),
    # IEEE division (`/` on float32 is div.full.f32 on a GPU, within 2 ulp)
    "div_rn": lambda a, dts, out: (
        f"tl.math.div_rn({a[0]}, {a[1]})" if out == torch.float32 else f"({a[0]} / {a[1]})"
    ),
    "truncdiv": _float_or_int("_trunc({0} / {1})", "({0} // {1})"),
    "floordiv": _float_or_int("tl.floor({0} / {1})", "_floordiv_int({0}, {1})"),
    "remainder": _float_or_int("_remainder_float({0}, {1})", "_remainder_int({0}, {1})"),
    "fmod": _float_or_int("_fmod_float({0}, {1})", "({0} % {1})"),
    "neg": _f("(-{0})"),
    "abs": _f("tl.abs({0})"),
    "exp": _f("tl.exp({0})"),
    "exp2": _f("tl.exp2({0})"),
    "expm1": _f("_expm1({0})"),
    "log": _f("tl.log({0})"),
    "log2": _f("tl.log2({0})"),
    "log10": _f("(tl.log({0}) * 0.4342944819032518)"),
    "log1p": _f("_log1p({0})"),
    "sqrt": _f("tl.sqrt({0})"),
    "rsqrt": _f("tl.rsqrt({0})"),
    "sin": _f("tl.sin({0})"),
    "cos": _f("tl.cos({0})"),
    "tan": _f("(tl.sin({0}) / tl.cos({0}))"),
    "sinh": _f("((tl.exp({0}) - tl.exp(-{0})) * 0.5)"),
    "cosh": _f("((tl.exp({0}) + tl.exp(-{0})) * 0.5)"),
    "tanh": _f("_tanh({0})"),
    "sigmoid": _f("(1.0 / (1.0 + tl.exp(-{0})))"),
    "erf": _f("tl.math.erf({0})"),
    "erfc": _f("(1.0 - tl.math.erf({0}))"),
    "reciprocal": _f("(1.0 / {0})"),
    "floor": _f("tl.floor({0})"),
    "ceil": _f("tl.ceil({0})"),
    "trunc": _f("_trunc({0})"),
    "round": _f("_round({0})"),
    "sign": _sign,
    "relu": _f("tl.where({0} > 0, {0}, 0).to({0}.dtype)"),
    "bitwise_not": lambda a, dts, out: f"({a[0]} == 0)" if out == torch.bool else f"(~{a[0]})",
    "logical_not": _f("({0} == 0)"),
    "isnan": _f("({0} != {0})"),
    "isinf": _f("(tl.abs({0}) == float('inf'))"),
    "isfinite": _f("(tl.abs({0}) < float('inf'))"),
    "signbit": lambda a, dts, out: _signbit(a[0], dts[0]),
    "maximum": _maxmin("tl.maximum", ">"),
    "minimum": _maxmin("tl.minimum", "<"),
    "fmax": _f("tl.maximum({0}, {1})"),
    "fmin": _f("tl.minimum({0}, {1})"),
    "atan2": _f("None"),  # not in the interpreter's math: rule falls back
    "hypot": _f("tl.sqrt({0} * {0} + {1} * {1})"),
    "copysign": _copysign,
    "bitwise_and": _f("({0} & {1})"),
    "bitwise_or": _f("({0} | {1})"),
    "bitwise_xor": _f("({0} ^ {1})"),
    "lshift": _f("({0} << {1})"),
    "rshift": _f("({0} >> {1})"),
    "logical_and": _f("(({0} != 0) & ({1} != 0))"),
    "logical_or": _f("(({0} != 0) | ({1} != 0))"),
    "logical_xor": _f("(({0} != 0) ^ ({1} != 0))"),
    "eq": _f("({0} == {1})"),
    "ne": _f("({0} != {1})"),
    "lt": _f("({0} < {1})"),
    "le": _f("({0} <= {1})"),
    "gt": _f("({0} > {1})"),
    "ge": _f("({0} >= {1})"),
    "where": _f("tl.where({0}, {1}, {2})"),
    "pow": lambda a, dts, out: _float_or_int("_pow({0}, {1})", "_pow_int({0}, {1})")(
        [f"({a[1]} * 0 + {a[0]})" if is_literal(a[0]) else a[0], a[1]], dts, out
    ),
    "to": _cast,
}
del OPS["atan2"]
assert set(OPS) | {"masked"} == POINTWISE_OPS, set(OPS) ^ POINTWISE_OPS


class IndexPrinter(StrPrinter):  # type: ignore[misc]
    """sympy index expressions as Triton integer arithmetic (all operands >= 0)."""

    # Every operand of // and % is parenthesized: a symbolic divisor prints as a
    # product (``2*s0``), and ``x % 2*s0`` parses as ``(x % 2)*s0``.
    def _operand(self, e: Any) -> str:
        text = str(self._print(e))
        return text if e.is_Atom else f"({text})"

    def _print_FloorDiv(self, e: Any) -> str:
        return f"({self._operand(e.args[0])} // {self._operand(e.args[1])})"

    def _print_CleanDiv(self, e: Any) -> str:
        return self._print_FloorDiv(e)

    def _print_ModularIndexing(self, e: Any) -> str:
        base, div, mod = e.args
        b = self._operand(base) if div == 1 else f"({self._operand(base)} // {self._operand(div)})"
        return f"({b} % {self._operand(mod)})"

    def _print_Mod(self, e: Any) -> str:
        return f"({self._operand(e.args[0])} % {self._operand(e.args[1])})"

    _print_PythonMod = _print_Mod

    def _print_Pow(self, e: Any, rational: bool = False) -> str:
        base, exp = e.args
        if exp.is_Integer and exp > 0:
            return "(" + " * ".join([self._print(base)] * int(exp)) + ")"
        raise ValueError(f"cannot print index {e}")

    def _fold(self, fn: str, e: Any) -> str:
        """``fn(fn(a, b), c)`` of ``e``'s arguments."""
        a = [self._print(x) for x in e.args]
        out = a[0]
        for x in a[1:]:
            out = f"{fn}({out}, {x})"
        return str(out)

    def _print_Max(self, e: Any) -> str:
        return self._fold("tl.maximum", e)

    def _print_Min(self, e: Any) -> str:
        return self._fold("tl.minimum", e)


_printer = IndexPrinter()
_ = (CleanDiv, FloorDiv, Mod, ModularIndexing, PythonMod)


@functools.lru_cache(maxsize=1 << 16)
def print_index(e: Expr) -> str:
    """Python/Triton text of an index expression (memoized: printing sorts terms, slowly)."""
    return str(_printer.doprint(e))


def literal(v: Const) -> str:
    x = v.value
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, float):
        if math.isnan(x):
            return "float('nan')"
        if math.isinf(x):
            return "float('inf')" if x > 0 else "float('-inf')"
        return repr(x)
    return repr(int(x))
