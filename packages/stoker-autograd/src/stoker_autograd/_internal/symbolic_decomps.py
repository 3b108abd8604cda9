"""Decompositions of the aten backward ops whose fake kernel rejects symbolic sizes.

A built-in node's functional backward calls its aten backward op with the node's
saved sizes.  In a symbolic retrace those sizes are a Python list mixing ints and
SymInts; torch 2.13 has no Python meta kernel for the upsample backwards below, and
their C++ meta kernel reads the list as ``int[]``: ``isIntList() INTERNAL ASSERT
FAILED ... Expected IntList but got GenericList`` (plain ``make_fx(...,
tracing_mode="symbolic")`` fails the same way).  So while any size is symbolic the
retrace decomposes them here into core aten (``index_add`` of the gradient into
zeros, one spatial dim at a time, with the forward's source indices and weights);
with static sizes the op is recorded as it is (NotImplemented: the proxy mode's
usual path).

Every upsample is separable: ``y = (A_1 (x) ... (x) A_n) x`` with one tap matrix per
spatial dim, so its backward applies each ``A_d^T`` in turn.  A tap matrix is a
list of ``(source index, weight)`` pairs over the output positions of that dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

aten = torch.ops.aten

Taps = list[tuple[torch.Tensor, torch.Tensor | None]]  # (source index, weight or None = 1)
_CUBIC_A = -0.75  # as aten's UpSample.h


def _scale(isize: Any, osize: Any, align_corners: bool, scale: float | None) -> Any:
    """``area_pixel_compute_scale``: source positions per output position."""
    if align_corners:
        return (isize - 1) / (osize - 1) if osize > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else isize / osize


def _positions(osize: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.arange(osize, device=device).to(dtype)


def _nearest(exact: bool) -> Callable[..., Taps]:
    def taps(isize: Any, osize: Any, scale: float | None, dt: torch.dtype, dev: Any) -> Taps:
        s = _scale(isize, osize, False, scale)
        offset = 0.5 if exact else 0.0
        idx = ((_positions(osize, dt, dev) + offset) * s).to(torch.int64).clamp(max=isize - 1)
        return [(idx, None)]

    return taps


def _linear(
    isize: Any, osize: Any, align_corners: bool, scale: float | None, dt: torch.dtype, dev: Any
) -> Taps:
    s = _scale(isize, osize, align_corners, scale)
    i = _positions(osize, dt, dev)
    src = (i * s if align_corners else (i + 0.5) * s - 0.5).clamp(min=0.0)
    x0 = src.to(torch.int64)
    lam = (src - x0).clamp(0.0, 1.0)
    return [(x0.clamp(max=isize - 1), 1.0 - lam), ((x0 + 1).clamp(max=isize - 1), lam)]


def _cubic(
    isize: Any, osize: Any, align_corners: bool, scale: float | None, dt: torch.dtype, dev: Any
) -> Taps:
    s = _scale(isize, osize, align_corners, scale)
    i = _positions(osize, dt, dev)
    src = i * s if align_corners else (i + 0.5) * s - 0.5
    x0 = src.floor()
    t = (src - x0).clamp(0.0, 1.0)
    a = _CUBIC_A

    def near(x: torch.Tensor) -> torch.Tensor:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = [far(t + 1), near(t), near(1 - t), far(2 - t)]
    base = x0.to(torch.int64)
    return [((base + k - 1).clamp(0, isize - 1), w) for k, w in enumerate(weights)]


def _transpose(
    grad: torch.Tensor, input_size: Sequence[Any], per_dim: Callable[[int, Any], Taps]
) -> torch.Tensor:
    """``grad`` through every ``A_d^T``: spatial dim ``d`` shrinks from output to input size."""
    out_dtype = grad.dtype
    dt = torch.float64 if out_dtype == torch.float64 else torch.float32  # aten's opmath
    g = grad.to(dt)
    n = len(input_size) - 2
    for d in range(n):
        dim = 2 + d
        shape = list(g.shape)
        shape[dim] = input_size[dim]
        acc = g.new_zeros(shape)
        view = [1] * g.dim()
        view[dim] = -1
        for idx, w in per_dim(d, dt):
            acc = acc.index_add(dim, idx, g if w is None else g * w.reshape(view))
        g = acc
    return g.to(out_dtype)


def _scales_at(scales: Sequence[float | None], d: int) -> float | None:
    return scales[d] if d < len(scales) else None


def _upsample_backward(taps: Callable[..., Taps], align: bool) -> Callable[..., Any]:
    """The backward of an upsample whose per-dim taps are `taps`; `align`: the op
    takes `align_corners` before its scales (linear, bicubic), else scales only."""

    def bwd(
        grad: torch.Tensor, output_size: Sequence[Any], input_size: Sequence[Any], *rest: Any
    ) -> Any:
        if _static(output_size, input_size):
            return NotImplemented
        lead, scales = (rest[:1], rest[1:]) if align else ((), rest)
        off = len(input_size) - len(output_size)
        return _transpose(
            grad,
            input_size,
            lambda d, dt: taps(
                input_size[off + d], output_size[d], *lead, _scales_at(scales, d), dt, grad.device
            ),
        )

    return bwd


def _static(*sizes: Sequence[Any]) -> bool:
    return all(isinstance(s, int) for size in sizes for s in size)


SYMBOLIC_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.upsample_nearest1d_backward.default: _upsample_backward(_nearest(False), align=False),
    aten._upsample_nearest_exact1d_backward.default: _upsample_backward(
        _nearest(True), align=False
    ),
    aten.upsample_nearest3d_backward.default: _upsample_backward(_nearest(False), align=False),
    aten._upsample_nearest_exact3d_backward.default: _upsample_backward(
        _nearest(True), align=False
    ),
    aten.upsample_linear1d_backward.default: _upsample_backward(_linear, align=True),
    aten.upsample_bilinear2d_backward.default: _upsample_backward(_linear, align=True),
    aten.upsample_trilinear3d_backward.default: _upsample_backward(_linear, align=True),
    aten.upsample_bicubic2d_backward.default: _upsample_backward(_cubic, align=True),
}
"""aten op -> decomposition used only while one of its sizes is symbolic."""


def _strided_only(decomp: Callable[..., Any]) -> Callable[..., Any]:
    """``decomp`` for a strided tensor; a sparse one keeps the op (NotImplemented: the
    proxy mode's usual path).  torch decomposes ``detach``/``lift``/``lift_fresh`` into
    ``alias``, which fake tensors cannot run on a sparse tensor (``Cannot access storage
    of SparseTensorImpl``): a sparse gradient under ``create_graph=True`` (an
    ``nn.Embedding(sparse=True)``) is detached on its way."""

    def fn(x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.layout != torch.strided:
            return NotImplemented
        return decomp(x, *args, **kwargs)

    return fn


@functools.cache
def retrace_table() -> dict[Any, Callable[..., Any]]:
    """stoker-capture's table for backward graphs (core aten, the fused backward ops it
    keeps whole left out) plus `SYMBOLIC_DECOMPOSITIONS` (built once); the
    decompositions into ``alias`` only for strided tensors (`_strided_only`)."""
    from stoker_capture._internal.stages.capture import joint_table

    table = {**joint_table(), **SYMBOLIC_DECOMPOSITIONS}
    for op in (aten.detach.default, aten.lift.default, aten.lift_fresh.default):
        if op in table:
            table[op] = _strided_only(table[op])
    return table
