"""The C half of the pointwise table and the printers the C emitter shares.

`C_OPS` maps each IR op name (`ir.POINTWISE_OPS`, `masked` aside: the emitter
guards its loads) to a C expression, as `ops.OPS` does for Triton. Values live in
their compute type (`CTYPE`): float16 and bfloat16 values are floats holding a
value of that precision (math in float32, rounded where the IR says so: a `to`
or an op whose own dtype is half), stored in their 16-bit storage (`STORAGE`).
Semantics follow eager PyTorch on the CPU (c10's scalar code): NaN propagates
through max/min, integer division floors as Python's, float remainder keeps the
divisor's sign, float-to-integer conversions are C's (what eager compiles to).
`PRELUDE` holds the static inline helpers every kernel file starts with;
`CIndexPrinter` prints sympy index arithmetic as C (every operand is >= 0, so
C's truncating `/` and `%` are Python's `//` and `%`).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..ir import POINTWISE_OPS, Const, Expr
from .ops import IndexPrinter

# The C type a value of each dtype is computed in.
CTYPE = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "float",
    torch.bfloat16: "float",
    torch.int8: "int8_t",
    torch.int16: "int16_t",
    torch.int32: "int32_t",
    torch.int64: "int64_t",
    torch.uint8: "uint8_t",
    torch.bool: "bool",
}
# The C type a buffer of each dtype is stored in (bool as bytes: gcc does not vectorize a
# loop that loads `bool` and stores float)
STORAGE = {**CTYPE, torch.float16: "_Float16", torch.bfloat16: "uint16_t", torch.bool: "uint8_t"}
HALF = (torch.float16, torch.bfloat16)

PRELUDE = r"""#include <stdint.h>
#include <stdbool.h>
#include <math.h>
#include <string.h>

#if defined(STOKER_MVEC) && defined(__x86_64__) && defined(__GLIBC__)
/* glibc's libmvec: the vectorizer calls its 4- and 8-lane forms instead of libm per lane */
#pragma omp declare simd notinbranch
float sinf(float);
#pragma omp declare simd notinbranch
float cosf(float);
#pragma omp declare simd notinbranch
float powf(float, float);
#pragma omp declare simd notinbranch
double sin(double);
#pragma omp declare simd notinbranch
double cos(double);
#pragma omp declare simd notinbranch
double exp(double);
#pragma omp declare simd notinbranch
double log(double);
#pragma omp declare simd notinbranch
double pow(double, double);
#if __GLIBC_PREREQ(2, 35)
#pragma omp declare simd notinbranch
float tanf(float);
#pragma omp declare simd notinbranch
float asinf(float);
#pragma omp declare simd notinbranch
float acosf(float);
#pragma omp declare simd notinbranch
float atanf(float);
#pragma omp declare simd notinbranch
float atan2f(float, float);
#pragma omp declare simd notinbranch
float sinhf(float);
#pragma omp declare simd notinbranch
float coshf(float);
#pragma omp declare simd notinbranch
float asinhf(float);
#pragma omp declare simd notinbranch
float acoshf(float);
#pragma omp declare simd notinbranch
float atanhf(float);
#pragma omp declare simd notinbranch
float expm1f(float);
#pragma omp declare simd notinbranch
float exp2f(float);
#pragma omp declare simd notinbranch
float log1pf(float);
#pragma omp declare simd notinbranch
float log2f(float);
#pragma omp declare simd notinbranch
float log10f(float);
#pragma omp declare simd notinbranch
float erfcf(float);
#endif
#endif

/* lanes of a long simd loop (`simdlen(ST_WIDE)`): 512-bit vectors where there are */
#if defined(__AVX512F__)
#define ST_WIDE 16
#else
#define ST_WIDE 8
#endif

#define ST_MIN(a, b) ((a) < (b) ? (a) : (b))
#define ST_MAX(a, b) ((a) > (b) ? (a) : (b))

static inline float st_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t st_f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return (uint16_t)((u >> 16) | 0x40);  /* a quiet NaN, its sign kept */
    u += 0x7FFF + ((u >> 16) & 1);  /* round to nearest even */
    return (uint16_t)(u >> 16);
}
static inline float st_round_bf16(float f) { return st_bf16_to_f32(st_f32_to_bf16(f)); }
static inline float st_round_f16(float f) { return (float)(_Float16)f; }

/* integer division and remainder as Python's (floor), no trap on 0 or MIN / -1 */
#define ST_INT_OPS(T, S)                                                            \
static inline T st_floordiv_##S(T a, T b) {                                         \
    if (b == 0) return 0;                                                           \
    if (b == -1) return (T)(0 - (uint64_t)a);                                       \
    T q = a / b; T r = a - q * b;                                                   \
    return (r != 0 && ((r < 0) != (b < 0))) ? q - 1 : q;                            \
}                                                                                   \
static inline T st_truncdiv_##S(T a, T b) {                                         \
    if (b == 0) return 0;                                                           \
    if (b == -1) return (T)(0 - (uint64_t)a);                                       \
    return a / b;                                                                   \
}                                                                                   \
static inline T st_remainder_##S(T a, T b) {                                        \
    if (b == 0 || b == -1) return 0;                                                \
    T r = a % b;                                                                    \
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;                            \
}                                                                                   \
static inline T st_fmod_##S(T a, T b) {                                             \
    if (b == 0 || b == -1) return 0;                                                \
    return a % b;                                                                   \
}                                                                                   \
static inline T st_pow_##S(T a, T b) {                                              \
    if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);             \
    T r = 1;                                                                        \
    while (b) { if (b & 1) r = (T)(r * a); a = (T)(a * a); b >>= 1; }               \
    return r;                                                                       \
}                                                                                   \
static inline T st_lshift_##S(T a, T b) {                                           \
    return (b < 0 || b >= (T)(8 * sizeof(T))) ? 0 : (T)((uint64_t)a << b);          \
}                                                                                   \
static inline T st_rshift_##S(T a, T b) {                                           \
    return (b < 0 || b >= (T)(8 * sizeof(T))) ? (a < 0 ? -1 : 0) : (T)(a >> b);     \
}
ST_INT_OPS(int8_t, i8)
ST_INT_OPS(int16_t, i16)
ST_INT_OPS(int32_t, i32)
ST_INT_OPS(int64_t, i64)
ST_INT_OPS(uint8_t, u8)

/* float floor division and remainder as c10's (div_floor_floating, remainder) */
#define ST_FLOAT_OPS(T, F)                                                          \
static inline T st_floordiv_##F(T a, T b) {                                         \
    if (b == 0) return a / b;                                                       \
    T mod = fmod##F(a, b);                                                          \
    T div = (a - mod) / b;                                                          \
    if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;                               \
    T fl;                                                                           \
    if (div != 0) { fl = floor##F(div); if (div - fl > (T)0.5) fl += 1; }           \
    else fl = copysign##F((T)0, a / b);                                             \
    return fl;                                                                      \
}                                                                                   \
static inline T st_remainder_##F(T a, T b) {                                        \
    T mod = fmod##F(a, b);                                                          \
    return (mod != 0 && ((b < 0) != (mod < 0))) ? mod + b : mod;                    \
}
ST_FLOAT_OPS(float, f)
ST_FLOAT_OPS(double, )

/* float32 exp, log, tanh and erf written out (Cephes' polynomials; Eigen's rational
   erf): `omp declare simd` and inlined, so a loop that calls them vectorizes, and a
   value is the same bits wherever it is computed (a vector loop, its scalar tail, a
   loop that does not vectorize): a kernel that computes a value again, where another
   stored it, compares equal (max's backward counts the elements equal to the max).
   Their polynomials step with fused multiply-adds where the target has them (one
   rounding a step, vector and scalar alike: ~15% faster exp and erf than a multiply
   and an add, which `-ffp-contract=off` keeps apart elsewhere); elsewhere, a multiply
   and an add, so a build never calls libm's software fmaf */
#if defined(__FMA__) || defined(__aarch64__)
#define ST_FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define ST_FMA(a, b, c) ((a) * (b) + (c))
#endif
static inline float st_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t st_as_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* exp below -87.3365 (a subnormal result, at most 1.2e-38) is 0, computed from 0: subnormal
   arithmetic runs a hundred times slower, and a softmax's masked elements would take it */
#pragma omp declare simd notinbranch
static inline float st_expf(float x) {
    float xc = x > 88.72283935546875f ? 88.72283935546875f : x;
    xc = xc < -87.33654022216797f ? 0.0f : xc;
    float n = __builtin_rintf(xc * 1.44269504088896341f);
    float r = ST_FMA(n, -0.693359375f, xc);
    r = ST_FMA(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = ST_FMA(p, r, 1.3981999507e-3f);
    p = ST_FMA(p, r, 8.3334519073e-3f);
    p = ST_FMA(p, r, 4.1665795894e-2f);
    p = ST_FMA(p, r, 1.6666665459e-1f);
    p = ST_FMA(p, r, 5.0000001201e-1f);
    p = ST_FMA(p, r * r, r) + 1.0f;
    int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1;
    float y = p * st_as_float((uint32_t)(n1 + 127) << 23) * st_as_float((uint32_t)(n2 + 127) << 23);
    y = x > 88.72283935546875f ? INFINITY : y;
    y = x < -87.33654022216797f ? 0.0f : y;
    return x != x ? x : y;
}

#pragma omp declare simd notinbranch
static inline float st_logf(float x) {
    int sub = x < 1.17549435e-38f;  /* subnormal (or <= 0: handled below) */
    float xs = sub ? x * 8388608.0f : x;
    uint32_t u = st_as_bits(xs);
    float e = (float)((int32_t)((u >> 23) & 0xff) - 126) - (sub ? 23.0f : 0.0f);
    float m = st_as_float((u & 0x007fffffu) | 0x3f000000u);  /* [0.5, 1) */
    int lo = m < 0.707106781186547524f;
    e = lo ? e - 1.0f : e;
    m = lo ? m + m - 1.0f : m - 1.0f;
    float z = m * m;
    float y = 7.0376836292e-2f;
    y = ST_FMA(y, m, -1.1514610310e-1f);
    y = ST_FMA(y, m, 1.1676998740e-1f);
    y = ST_FMA(y, m, -1.2420140846e-1f);
    y = ST_FMA(y, m, 1.4249322787e-1f);
    y = ST_FMA(y, m, -1.6668057665e-1f);
    y = ST_FMA(y, m, 2.0000714765e-1f);
    y = ST_FMA(y, m, -2.4999993993e-1f);
    y = ST_FMA(y, m, 3.3333331174e-1f);
    y = y * m * z;
    y = ST_FMA(-2.12194440e-4f, e, y);
    y = ST_FMA(-0.5f, z, y);
    float r = m + y;
    r = ST_FMA(0.693359375f, e, r);
    r = x == INFINITY ? x : r;
    r = x == 0.0f ? -INFINITY : r;
    return (x < 0.0f || x != x) ? NAN : r;
}

#pragma omp declare simd notinbranch
static inline float st_tanhf(float x) {
    float a = x < 0.0f ? -x : x;
    float z = x * x;
    float s = -5.70498872745e-3f;
    s = ST_FMA(s, z, 2.06390887954e-2f);
    s = ST_FMA(s, z, -5.37397155531e-2f);
    s = ST_FMA(s, z, 1.33314422036e-1f);
    s = ST_FMA(s, z, -3.33332819422e-1f);
    s = ST_FMA(s * z, x, x);
    float l = 1.0f - 2.0f / (st_expf(a + a) + 1.0f);
    l = a > 9.0f ? 1.0f : l;
    l = x < 0.0f ? -l : l;
    float r = a < 0.625f ? s : l;
    return x != x ? x : r;
}

#pragma omp declare simd notinbranch
static inline float st_erff(float x) {
    float c = x > 4.0f ? 4.0f : (x < -4.0f ? -4.0f : x);
    float x2 = c * c;
    float p = -2.72614225801306e-10f;
    p = ST_FMA(p, x2, 2.77068142495902e-08f);
    p = ST_FMA(p, x2, -2.10102402082508e-06f);
    p = ST_FMA(p, x2, -5.69250639462346e-05f);
    p = ST_FMA(p, x2, -7.34990630326855e-04f);
    p = ST_FMA(p, x2, -2.95459980854025e-03f);
    p = ST_FMA(p, x2, -1.60960333262415e-02f);
    p = p * c;
    float q = -1.45660718464996e-05f;
    q = ST_FMA(q, x2, -2.13374055278905e-04f);
    q = ST_FMA(q, x2, -1.68282697438203e-03f);
    q = ST_FMA(q, x2, -7.37332916720468e-03f);
    q = ST_FMA(q, x2, -1.42647390514189e-02f);
    float r = p / q;
    return x != x ? x : r;
}

/* Philox 4x32-10 on (offset, 0, 0, 0) under the 64-bit key `seed`, as tl.rand and
   tl.randn compute it: uniform [0, 1) from the first word, a normal from the first
   two (Box-Muller) */
static inline void st_philox(uint64_t seed, uint32_t offset, uint32_t *o0, uint32_t *o1) {
    uint32_t c0 = offset, c1 = 0, c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int i = 0; i < 10; i++) {
        uint64_t pa = (uint64_t)0xD2511F53u * c0, pb = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(pb >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(pa >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)pb; c3 = (uint32_t)pa; c0 = n0; c2 = n2;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    *o0 = c0; *o1 = c1;
}
static inline float st_uniform(uint32_t u) {
    int32_t x = (int32_t)u;
    x = x < 0 ? -x - 1 : x;
    return (float)x * 4.6566127342e-10f;
}
static inline float st_rand(uint64_t seed, uint32_t offset) {
    uint32_t a, b; st_philox(seed, offset, &a, &b); return st_uniform(a);
}
static inline float st_randn(uint64_t seed, uint32_t offset) {
    uint32_t a, b; st_philox(seed, offset, &a, &b);
    float u1 = st_uniform(a), u2 = st_uniform(b);
    u1 = u1 > 1.0e-7f ? u1 : 1.0e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.283185307179586f * u2);
}
"""

_INT_SUFFIX = {
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "u8",
}

Gen = Callable[[Sequence[str], Sequence[torch.dtype], torch.dtype], str]


def _is_double(dts: Sequence[torch.dtype], out: torch.dtype) -> bool:
    return out == torch.float64 or any(d == torch.float64 for d in dts)


def _is_float(dts: Sequence[torch.dtype], out: torch.dtype) -> bool:
    return out.is_floating_point or any(d.is_floating_point for d in dts)


# float32 functions of the prelude (vectorizing, the same bits in every loop); the rest
# are libm's (`namef`), whose calls keep their loop scalar, so they too give one value
OWN_FLOAT_MATH = {"exp": "st_expf", "log": "st_logf", "tanh": "st_tanhf", "erf": "st_erff"}


def _math(name: str, nargs: int = 1) -> Gen:
    """A libm function: `namef` (or the prelude's own) on float values, `name` on double."""

    def gen(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
        if _is_double(dts, out):
            fn = name
        else:
            fn = OWN_FLOAT_MATH.get(name, f"{name}f")
        return f"{fn}({', '.join(a[:nargs])})"

    return gen


def _f(template: str) -> Gen:
    return lambda a, dts, out: template.format(*a)


def _fi(f_tpl: str, i_tpl: str) -> Gen:
    """Float and integer forms; `{F}` is libm's float suffix, `{S}` the integer helper's."""

    def gen(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
        if _is_float(dts, out):
            return f_tpl.format(*a, F="" if _is_double(dts, out) else "f")
        dt = out if out != torch.bool else (dts[0] if dts else torch.int64)
        return i_tpl.format(*a, S=_INT_SUFFIX.get(dt, "i64"))

    return gen


def cast(x: str, src: torch.dtype | None, out: torch.dtype) -> str:
    """`x` (a value of `src`) converted to `out`, as eager's CPU kernels convert."""
    if out == torch.bool:
        return f"({x} != 0)"
    if out == torch.bfloat16:
        return x if src == torch.bfloat16 else f"st_round_bf16((float)({x}))"
    if out == torch.float16:
        return x if src == torch.float16 else f"st_round_f16((float)({x}))"
    if out == torch.uint8 and src is not None and src.is_floating_point:
        return f"(uint8_t)(int64_t)({x})"  # c10: through int64 (-3.5 -> 253)
    return f"({CTYPE[out]})({x})"


def _to(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    return cast(a[0], dts[0] if dts else None, out)


def _maxmin(cmp: str) -> Gen:
    def gen(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
        if out.is_floating_point:  # NaN propagates, as in eager
            return f"((({a[0]}) {cmp} ({a[1]}) || ({a[0]}) != ({a[0]})) ? ({a[0]}) : ({a[1]}))"
        return f"((({a[0]}) {cmp} ({a[1]})) ? ({a[0]}) : ({a[1]}))"

    return gen


def _sign(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    t = CTYPE[out]
    return f"({t})((({a[0]}) > 0) - (({a[0]}) < 0))"


def _signbit(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    return f"(signbit({a[0]}) != 0)" if dts[0].is_floating_point else f"(({a[0]}) < 0)"


def _relu(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    t = CTYPE[out]
    if out.is_floating_point:
        return f"((({a[0]}) > 0 || ({a[0]}) != ({a[0]})) ? ({a[0]}) : ({t})0)"
    return f"((({a[0]}) > 0) ? ({a[0]}) : ({t})0)"


def _copysign(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    fn = "copysign" if _is_double(dts, out) else "copysignf"
    return f"{fn}({a[0]}, {a[1]})"


def _pow(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    if _is_float(dts, out):
        fn = "pow" if _is_double(dts, out) else "powf"
        return f"{fn}({a[0]}, {a[1]})"
    return f"st_pow_{_INT_SUFFIX.get(out, 'i64')}({a[0]}, {a[1]})"


def _bitwise_not(a: Sequence[str], dts: Sequence[torch.dtype], out: torch.dtype) -> str:
    if out == torch.bool:
        return f"(!({a[0]}))"
    return f"({CTYPE[out]})(~({a[0]}))"


C_OPS: dict[str, Gen] = {
    "identity": _f("({0})"),
    "add": _f("(({0}) + ({1}))"),
    "sub": _f("(({0}) - ({1}))"),
    "mul": _f("(({0}) * ({1}))"),
    "truediv": _f("(({0}) / ({1}))"),
    "div_rn": _f("(({0}) / ({1}))"),
    "truncdiv": _fi("trunc{F}(({0}) / ({1}))", "st_truncdiv_{S}({0}, {1})"),
    "floordiv": _fi("st_floordiv_{F}({0}, {1})", "st_floordiv_{S}({0}, {1})"),
    "remainder": _fi("st_remainder_{F}({0}, {1})", "st_remainder_{S}({0}, {1})"),
    "fmod": _fi("fmod{F}({0}, {1})", "st_fmod_{S}({0}, {1})"),
    "neg": _f("(-({0}))"),
    "abs": _fi("fabs{F}({0})", "(({0}) < 0 ? -({0}) : ({0}))"),
    "exp": _math("exp"),
    "exp2": _math("exp2"),
    "expm1": _math("expm1"),
    "log": _math("log"),
    "log2": _math("log2"),
    "log10": _math("log10"),
    "log1p": _math("log1p"),
    "sqrt": _math("sqrt"),
    "rsqrt": _fi("(1 / sqrt{F}({0}))", "(1 / sqrt({0}))"),
    "sin": _math("sin"),
    "cos": _math("cos"),
    "tan": _math("tan"),
    "sinh": _math("sinh"),
    "cosh": _math("cosh"),
    "tanh": _math("tanh"),
    "sigmoid": lambda a, dts, out: (
        f"(1 / (1 + exp(-({a[0]}))))"
        if _is_double(dts, out) or not _is_float(dts, out)
        else f"(1.0f / (1.0f + st_expf(-({a[0]}))))"
    ),
    "erf": _math("erf"),
    "erfc": _math("erfc"),
    "reciprocal": _f("(1 / ({0}))"),
    "floor": _fi("floor{F}({0})", "({0})"),
    "ceil": _fi("ceil{F}({0})", "({0})"),
    "trunc": _fi("trunc{F}({0})", "({0})"),
    "round": _fi("nearbyint{F}({0})", "({0})"),
    "sign": _sign,
    "relu": _relu,
    "bitwise_not": _bitwise_not,
    "logical_not": _f("(({0}) == 0)"),
    "isnan": _f("(({0}) != ({0}))"),
    "isinf": _fi("(fabs{F}({0}) == INFINITY)", "0"),
    "isfinite": _fi("(fabs{F}({0}) < INFINITY)", "1"),
    "signbit": _signbit,
    "maximum": _maxmin(">"),
    "minimum": _maxmin("<"),
    "fmax": _fi("fmax{F}({0}, {1})", "ST_MAX({0}, {1})"),
    "fmin": _fi("fmin{F}({0}, {1})", "ST_MIN({0}, {1})"),
    "hypot": _math("hypot", 2),
    "copysign": _copysign,
    "bitwise_and": _f("(({0}) & ({1}))"),
    "bitwise_or": _f("(({0}) | ({1}))"),
    "bitwise_xor": _f("(({0}) ^ ({1}))"),
    "lshift": _fi("0", "st_lshift_{S}({0}, {1})"),
    "rshift": _fi("0", "st_rshift_{S}({0}, {1})"),
    "logical_and": _f("((({0}) != 0) && (({1}) != 0))"),
    "logical_or": _f("((({0}) != 0) || (({1}) != 0))"),
    "logical_xor": _f("((({0}) != 0) != (({1}) != 0))"),
    "eq": _f("(({0}) == ({1}))"),
    "ne": _f("(({0}) != ({1}))"),
    "lt": _f("(({0}) < ({1}))"),
    "le": _f("(({0}) <= ({1}))"),
    "gt": _f("(({0}) > ({1}))"),
    "ge": _f("(({0}) >= ({1}))"),
    "where": _f("(({0}) ? ({1}) : ({2}))"),
    "pow": _pow,
    "to": _to,
}
assert set(C_OPS) | {"masked"} == POINTWISE_OPS, set(C_OPS) ^ POINTWISE_OPS


def literal(v: Const) -> str:
    """A constant in its C compute type (half constants as the float they round to)."""
    x, dt = v.value, v.dtype
    if dt == torch.bool or isinstance(x, bool):
        return f"(({CTYPE[dt]}){1 if x else 0})"
    if dt.is_floating_point:
        f = float(x)
        if dt in HALF:
            f = float(torch.tensor(f, dtype=dt).float().item())
        suffix = "" if dt == torch.float64 else "f"
        if math.isnan(f):
            return f"(({CTYPE[dt]})NAN)"
        if math.isinf(f):
            return f"(({CTYPE[dt]})INFINITY)" if f > 0 else f"(-({CTYPE[dt]})INFINITY)"
        if dt != torch.float64:
            f = struct.unpack("f", struct.pack("f", f))[0]  # exactly the float eager holds
        text = float.hex(f)  # exact: no decimal rounding on the way
        return f"(({CTYPE[dt]}){text}{suffix})" if f >= 0 else f"(-({CTYPE[dt]}){text[1:]}{suffix})"
    i = int(x)
    if i == -(2**63):
        return "INT64_MIN"
    return f"(({CTYPE[dt]}){i}LL)"


class CIndexPrinter(IndexPrinter):
    """sympy index expressions as C int64 arithmetic (all operands >= 0)."""

    # (not StrPrinter's `_sympystr`: torch's FloorDiv prints itself as Python's `//`)
    printmethod = "_stoker_c_print"

    def _print_FloorDiv(self, e: Any) -> str:
        return f"({self._operand(e.args[0])} / {self._operand(e.args[1])})"

    def _print_ModularIndexing(self, e: Any) -> str:
        base, div, mod = e.args
        b = self._operand(base) if div == 1 else f"({self._operand(base)} / {self._operand(div)})"
        return f"({b} % {self._operand(mod)})"

    def _print_Integer(self, e: Any) -> str:
        return f"{int(e)}LL" if abs(int(e)) >= 2**31 else str(int(e))

    def _print_Max(self, e: Any) -> str:
        return self._fold("ST_MAX", e)

    def _print_Min(self, e: Any) -> str:
        return self._fold("ST_MIN", e)


class CFloatPrinter(CIndexPrinter):
    """A float expression of symbols (a SymFloat's value): rationals as doubles."""

    def _print_Rational(self, e: Any) -> str:
        return f"({float(e.p)!r} / {float(e.q)!r})"

    def _print_Integer(self, e: Any) -> str:
        return repr(float(int(e)))

    def _print_Float(self, e: Any) -> str:
        return repr(float(e))

    def _print_Symbol(self, e: Any) -> str:
        return f"((double){e.name})"


_printer = CIndexPrinter()
_fprinter = CFloatPrinter()


@functools.lru_cache(maxsize=1 << 16)
def c_index(e: Expr) -> str:
    """C text of an integer index expression (memoized)."""
    return str(_printer.doprint(e))


@functools.lru_cache(maxsize=1 << 12)
def c_float(e: Expr) -> str:
    """C text of a float expression of symbols (memoized)."""
    return str(_fprinter.doprint(e))
