"""Half precision, in one table: what float16/bfloat16 values compute in, and where they round.

Eager's rule, in its CUDA kernels and its CPU kernels alike: an aten op loads
its half inputs, computes in float32 (`at::opmath_type`), and rounds its
result once when it stores it. Every aten op's output is materialized, so a
chain `cos(x) * 2` on bfloat16 rounds after `cos` and again after `mul`.
Reductions accumulate in float32 and round the result once. Composite ops that
eager runs as one kernel (gelu, silu, softplus, layer norm, softmax...) reach
stoker decomposed *with* their upcasts (`_to_copy` to float32 and back), so
the graph already says where eager rounds.

stoker follows the graph node by node, and fusing nodes into one kernel
changes nothing about it:

1. a node's half inputs are widened to its compute dtype (`OPMATH`); an
   input of another dtype (a 0-dim float32 tensor in a bfloat16 op) is first
   converted to the op's dtype, as TensorIterator does (`pointwise.operand`);
2. the node computes there: never on half values (Triton's math functions
   take float32/float64 only, and half arithmetic would round each step);
3. the result is cast to the node's dtype: rounded once, where eager stores.

Inductor instead keeps fused intermediates in float32 (its
`emulate_precision_casts=False`), which rounds less often than eager. stoker
rounds exactly where eager does, so compiled half-precision results are
eager's up to the last-bit differences of the math functions themselves.

`verify_program` (debug mode) checks rule 2 on every lowered program: an IR
op with a half result or half operands must be one of `EXACT_IN_HALF`.
"""

from __future__ import annotations

from typing import Any

import torch

HALF = (torch.float16, torch.bfloat16)

# storage dtype -> the dtype pointwise arithmetic runs in (eager's opmath_type)
OPMATH: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
}

# result dtype -> the dtype a reduction accumulates in (sum, mean, var, prod,
# max/min, softmax's sums, norms: eager's acc_type on CUDA)
ACCUMULATE: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
}

# IR ops whose result is exact on half values (they select, compare or flip a
# sign bit; they never round): the only ops that may see half operands.
# Every other op computes in OPMATH.
EXACT_IN_HALF = frozenset(
    """identity to where masked neg abs maximum minimum eq ne lt le gt ge isnan isinf
    isfinite signbit logical_not logical_and logical_or logical_xor""".split()
)


def scalar_operand(
    value: bool | int | float, dtype: torch.dtype, device: str
) -> bool | int | float:
    """A Python number added to or subtracted from a `dtype` tensor, as eager
    uses it. On the CPU, TensorIterator casts it to the op's dtype and add's
    kernel computes with that rounded value: `x + 0.01` on bfloat16 adds
    bfloat16(0.01). On CUDA, add's kernel reads the original scalar in opmath
    (`iter.original_scalar_value<opmath_t>`): it adds float32(0.01), as the
    H100 showed (the half-cast value left 0.4-0.8% of elements 1 ulp off).
    (mul and div read the original scalar on both.)"""
    if device == "cuda":
        return value
    if dtype in HALF and isinstance(value, int | float) and not isinstance(value, bool):
        return float(torch.tensor(value, dtype=dtype))
    return value


def cuda_scalar_reciprocal(value: Any, dtype: torch.dtype) -> float | None:
    """`x / value` for a Python number `value` on a CUDA tensor of (common)
    floating `dtype`, as eager's CUDA kernel computes it: `x * inv` with
    ``inv = opmath(1) / opmath(value)`` (`div_true_kernel_cuda`: a CPU scalar
    divisor becomes a multiplication by its reciprocal, which can differ from
    true division in the last bit). The scalar is not rounded to a half
    `dtype` first: on an H100, the half-cast reciprocal left 34-40% of
    elements off, float32's matched all. None where eager divides."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not dtype.is_floating_point:
        return None
    op = opmath(dtype)
    b = torch.tensor(float(value), dtype=torch.float64).to(op)
    return float(torch.ones((), dtype=op) / b)


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic on `dtype` values runs in."""
    return OPMATH.get(dtype, dtype)


def accumulate(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction producing `dtype` accumulates in."""
    return ACCUMULATE.get(dtype, dtype)
