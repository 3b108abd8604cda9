"""Whole-block reductions and scans for Triton's interpreter, in the test runs.

Triton's interpreter runs ``tl.reduce`` and ``tl.associative_scan`` with a
combine function of their own (stoker's NaN-propagating ``_max_nan`` /
``_min_nan``, ``_prod_combine``, ``_welford_combine``: every float max, min,
prod and variance) one element at a time: a Python-level call of the combine
function per element of the block, each running its ``tl`` ops on 0-d arrays.
A softmax over a 64 x 1000 block made 64,000 such calls; one test of a
32 x 5000 reduction spent 290 of its 300 s there.

`install` replaces the two loops with ones that call the combine function on
whole slices of the block:

* a reduction combines neighbours pairwise, ``combine(x[0::2], x[1::2])``, until
  one element is left along the axis (about log2(n) calls). Triton requires a
  combine function to be associative, and a GPU reduces as a tree too; the
  left operand always comes from the lower index, so a combine that is
  associative but not commutative (an index tie-break) gives what the element
  loop gives. Rounding may differ from the element loop's left fold, as a
  GPU's differs;
* a scan keeps the element loop's order exactly: one call per position along
  the axis, on the whole slice across the other dimensions.

`install` also gives an older interpreter (Triton 3.6, the GPU machine's, as
``nox -s compat`` runs it) two builder methods later Tritons fixed: bfloat16
constants (``get_bf16``, missing there: every ``tl.full`` in bfloat16 failed)
and an unsigned type's all-ones value (it built ``-1``, which NumPy 2 refuses
in an unsigned array: every ``~x`` on uint8 failed).

The kernels are the same; only how the interpreter evaluates these ops
changes. The root conftest installs it when the tests run kernels under the
interpreter (``TRITON_INTERPRET=1``), in the test processes and, through
this folder's `sitecustomize`, in every Python process they start;
``STOKER_TEST_SLOW_REDUCE=1`` keeps Triton's own loops. It is a test aid, not
part of any package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np


def _combine(op: Any, left: list[Any], right: list[Any], dtypes: list[Any]) -> list[Any]:
    """``op.combine_fn`` on two tuples of arrays of one shape, as arrays of the inputs' dtypes."""
    a = [op.to_tensor(x, dt) for x, dt in zip(left, dtypes, strict=True)]
    b = [op.to_tensor(x, dt) for x, dt in zip(right, dtypes, strict=True)]
    out = op.combine_fn.fn(*a, *b)
    shape = left[0].shape
    arrays = []
    for r, x in zip(out if isinstance(out, tuple) else (out,), left, strict=True):
        arr = np.asarray(r.handle.data if hasattr(r, "handle") else r)
        # a 0-d operand comes back as a 1-element block: the same value
        arr = arr.reshape(shape) if arr.size == x.size else np.broadcast_to(arr, shape)
        arrays.append(arr.astype(x.dtype))
    return arrays


def _generic_reduce(self: Any, input: Any) -> list[Any]:
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    dtypes = [arg.dtype for arg in input]
    cur = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
    n = cur[0].shape[0]
    if n == 0:  # what the element loop leaves: zeros
        cur = [np.zeros((1, *c.shape[1:]), dtype=c.dtype) for c in cur]
    while n > 1:
        pairs = n // 2
        merged = _combine(
            self,
            [c[0 : 2 * pairs : 2] for c in cur],
            [c[1 : 2 * pairs : 2] for c in cur],
            dtypes,
        )
        if n % 2:  # the last element waits for the next round, still last
            merged = [np.concatenate([m, c[n - 1 : n]]) for m, c in zip(merged, cur, strict=True)]
        cur = merged
        n = cur[0].shape[0]
    ret = []
    for c, dt in zip(cur, dtypes, strict=True):
        data: Any = c[0]
        if self.keep_dims:
            if original_axis is not None:
                data = np.expand_dims(data, axis)
            else:
                for _ in range(len(input[0].handle.data.shape)):
                    data = np.expand_dims(data, 0)
        elif original_axis is None:
            data = data.item()
        ret.append(self.to_tensor(data, dt))
    return ret


def _generic_scan(self: Any, input: Any) -> list[Any]:
    dtypes = [arg.dtype for arg in input]
    data = [np.moveaxis(arg.handle.data, self.axis, 0) for arg in input]
    out = [np.empty_like(d) for d in data]
    if data[0].shape[0]:
        for o, d in zip(out, data, strict=True):
            o[0] = d[0]
        for k in range(1, data[0].shape[0]):
            acc = _combine(self, [o[k - 1] for o in out], [d[k] for d in data], dtypes)
            for o, a in zip(out, acc, strict=True):
                o[k] = a
    return [
        self.to_tensor(np.ascontiguousarray(np.moveaxis(o, 0, self.axis)), dt)
        for o, dt in zip(out, dtypes, strict=True)
    ]


_generic_reduce.whole_block = True  # type: ignore[attr-defined]
_generic_scan.whole_block = True  # type: ignore[attr-defined]
ORIGINAL: dict[str, Any] = {}  # Triton's own loops, once `install` replaced them


def _backport_builder(interpreter: Any) -> None:
    """The two builder methods of later Tritons' interpreters (module docstring)."""
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if builder is None or handle is None or np_dtype is None:
        return
    if not hasattr(builder, "get_bf16"):
        import triton.language as tl

        def get_bf16(self: Any, value: float) -> Any:
            return self.create_fp_trunc(self.get_fp32(value), tl.bfloat16)

        builder.get_bf16 = get_bf16
    ones = builder.get_all_ones_value
    if not getattr(ones, "unsigned_max", False):

        def get_all_ones_value(self: Any, type: Any) -> Any:
            np_type = np_dtype(type)
            if np.issubdtype(np_type, np.unsignedinteger):
                return handle(np.full(1, np.iinfo(np_type).max, dtype=np_type), type.scalar)
            return ones(self, type)

        get_all_ones_value.unsigned_max = True  # type: ignore[attr-defined]
        builder.get_all_ones_value = get_all_ones_value


def install() -> bool:
    """Patch Triton's interpreter (if this Triton has the loops it replaces)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    _backport_builder(interpreter)
    reduce_ops = getattr(interpreter, "ReduceOps", None)
    scan_ops = getattr(interpreter, "ScanOps", None)
    if not hasattr(reduce_ops, "generic_reduce") or not hasattr(scan_ops, "generic_scan"):
        return False
    if getattr(reduce_ops.generic_reduce, "whole_block", False):  # type: ignore[union-attr]
        return True  # installed before (by this module or another copy of it)
    ORIGINAL["reduce"] = reduce_ops.generic_reduce  # type: ignore[union-attr]
    ORIGINAL["scan"] = scan_ops.generic_scan  # type: ignore[union-attr]
    reduce_ops.generic_reduce = _generic_reduce  # type: ignore[union-attr]
    scan_ops.generic_scan = _generic_scan  # type: ignore[union-attr]
    return True


@contextlib.contextmanager
def triton_own_loops() -> Iterator[None]:
    """Triton's element loops while inside (to compare against them)."""
    from triton.runtime import interpreter

    assert ORIGINAL, "install() first"
    mine = interpreter.ReduceOps.generic_reduce, interpreter.ScanOps.generic_scan
    interpreter.ReduceOps.generic_reduce = ORIGINAL["reduce"]
    interpreter.ScanOps.generic_scan = ORIGINAL["scan"]
    try:
        yield
    finally:
        interpreter.ReduceOps.generic_reduce, interpreter.ScanOps.generic_scan = mine
