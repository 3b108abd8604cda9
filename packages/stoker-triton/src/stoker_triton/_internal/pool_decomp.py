"""Max pooling in ops the rule table lowers, for torches whose decomposition table
lacks it (torch 2.11, the GPU machine's, has none for ``max_pool{2,3}d_with_indices``
or ``max_pool2d_with_indices_backward``; torch 2.13 has its own, which
`pipeline.decomposition_table` prefers).

The forward pads with a value below every input, gathers each window with
broadcast ``arange`` indices (one ``index``), and takes ``max`` over the window:
the first maximum in the window's row-major order, as aten's kernels pick it. A
channels-last input's windows are reduced in ``(N, H, W, C)`` order, and the
result is its channels-last NCHW view.
The index is the flat position in the unpadded input plane, as aten returns it.
The backward scatter-adds each output gradient at its index (float32
accumulation for half types, since overlapping windows add up), into NCHW rows, or
along the plane of an ``(N, H*W, C)`` buffer for a channels-last input, which it
keeps channels-last.

This room imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _per_dim(v: int | Sequence[int], n: int, default: Sequence[int] | None = None) -> list[int]:
    if isinstance(v, int):
        return [v] * n
    if not v:
        assert default is not None, "an empty size needs a default"
        return list(default)
    return list(v) * n if len(v) == 1 else list(v)


def _output_size(size: int, k: int, pad: int, stride: int, dilation: int, ceil: bool) -> int:
    """aten's pooling output size (``pooling_output_shape``)."""
    span = size + 2 * pad - dilation * (k - 1) - 1
    out = (span + (stride - 1 if ceil else 0)) // stride + 1
    if ceil and (out - 1) * stride >= size + pad:
        out -= 1  # the last window must start inside the input or its left padding
    return out


def _lowest(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``x`` in a dtype with a value below all of its own, and that value."""
    if x.dtype.is_floating_point:
        return x, -math.inf
    if x.dtype == torch.bool:
        return x.to(torch.int32), -1.0
    info = torch.iinfo(x.dtype)
    if info.bits < 64:
        return x.to(torch.int64), float(info.min - 1)
    return x, float(info.min)  # int64: a tie with the fill can only pick a padded place


def max_pool_nd_with_indices(
    x: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    ks = _per_dim(kernel_size, n)
    st = _per_dim(stride, n, ks)
    pa = _per_dim(padding, n)
    di = _per_dim(dilation, n)
    batched = x.ndim == n + 2
    if not batched:
        x = x.unsqueeze(0)
    sizes = [int(s) for s in x.shape[-n:]]
    outs = [_output_size(sizes[d], ks[d], pa[d], st[d], di[d], ceil_mode) for d in range(n)]
    work, fill = _lowest(x)
    pads: list[int] = []
    for d in reversed(range(n)):  # F.pad: last dim first
        reach = (outs[d] - 1) * st[d] + (ks[d] - 1) * di[d] + 1
        pads += [pa[d], max(reach - sizes[d] - pa[d], 0)]
    padded = F.pad(work, pads, value=fill)
    # window element (o, k) of dim d sits at o * stride + k * dilation of the padded dim;
    # the index of dim d spans positions 2d (outputs) and 2d + 1 (kernel) of 2n
    index: list[torch.Tensor] = []
    for d in range(n):
        at = torch.arange(outs[d], device=x.device).unsqueeze(1) * st[d]
        at = at + torch.arange(ks[d], device=x.device).unsqueeze(0) * di[d]
        shape = [1] * (2 * n)
        shape[2 * d], shape[2 * d + 1] = outs[d], ks[d]
        index.append(at.reshape(shape))
    where: tuple[Any, ...] = (..., *index)
    windows = padded[where]  # (N, C, o0, k0, o1, k1, ...)
    if batched and _channels_last(x):
        # channels-last in, channels-last out: reduce (N, o0, o1, C) rows, walked in
        # memory order, and view them as NCHW (eager's max-pool keeps the layout too)
        order = [0, *(2 + 2 * d for d in range(n)), 1, *(3 + 2 * d for d in range(n))]
        nhwc = windows.permute(order).reshape(windows.shape[0], *outs, windows.shape[1], -1)
        values, local = nhwc.max(dim=-1)
        back = [0, n + 1, *range(1, n + 1)]
        values, local = values.permute(back), local.permute(back)
    else:
        order = [0, 1, *(2 + 2 * d for d in range(n)), *(3 + 2 * d for d in range(n))]
        windows = windows.permute(order).reshape(*windows.shape[:2], *outs, -1)
        values, local = windows.max(dim=-1)
    # the window's flat position -> each dim's offset -> the unpadded input's flat index
    flat: torch.Tensor | None = None
    rest = local
    for d in range(n):
        inner = math.prod(ks[d + 1 :])
        k = rest // inner
        rest = rest - k * inner
        shape = [1] * (2 + n)
        shape[2 + d] = outs[d]
        o = torch.arange(outs[d], device=x.device).reshape(shape)
        coord = o * st[d] + k * di[d] - pa[d]
        flat = coord if flat is None else flat * sizes[d] + coord
    assert flat is not None
    values = values.to(x.dtype)
    if not batched:
        return values.squeeze(0), flat.squeeze(0)
    return values, flat


def _with_indices(n: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``aten.max_pool{n}d_with_indices`` with aten's defaults."""

    def decomposition(
        x: torch.Tensor,
        kernel_size: Sequence[int],
        stride: Sequence[int] = (),
        padding: Sequence[int] = (0,),
        dilation: Sequence[int] = (1,),
        ceil_mode: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return max_pool_nd_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode, n)

    return decomposition


def _channels_last(x: torch.Tensor) -> bool:
    return (
        x.ndim == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    )


def max_pool2d_with_indices_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices: torch.Tensor,
) -> torch.Tensor:
    acc = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    if _channels_last(x):  # along the plane of (N, H*W, C): the result stays channels-last
        n, c, h, w = (int(s) for s in x.shape)
        out = torch.zeros(n, h * w, c, dtype=acc, device=grad.device)
        idx = indices.permute(0, 2, 3, 1).reshape(n, -1, c)
        g = grad.permute(0, 2, 3, 1).reshape(n, -1, c).to(acc)
        out = out.scatter_add(1, idx, g)
        return out.reshape(n, h, w, c).permute(0, 3, 1, 2).to(grad.dtype)
    plane = math.prod(int(s) for s in x.shape[-2:])
    rows = math.prod(int(s) for s in x.shape[:-2])
    out = torch.zeros(rows, plane, dtype=acc, device=grad.device)
    out = out.scatter_add(1, indices.reshape(rows, -1), grad.reshape(rows, -1).to(acc))
    return out.reshape(x.shape).to(grad.dtype)


def channels_last_pooling(op: Any, fallback: Callable[..., Any]) -> Callable[..., Any]:
    """This module's decomposition of ``op`` (the 2-d max-pool or its backward) for a
    channels-last input, which keeps its layout: the forward reduces ``(N, H, W, C)``
    rows and the backward scatters along the plane of an ``(N, H*W, C)`` buffer, so the
    ops around them walk them in memory order (torch's decompositions compute NCHW
    rows).  Any other layout goes to ``fallback`` (torch's decomposition)."""
    own = OWN[op]

    def decomposition(*args: Any, **kwargs: Any) -> Any:
        x = args[1] if op is aten.max_pool2d_with_indices_backward.default else args[0]
        pick = own if _channels_last(x) else fallback
        return pick(*args, **kwargs)

    return decomposition


OWN: dict[Any, Callable[..., Any]] = {
    aten.max_pool2d_with_indices.default: _with_indices(2),
    aten.max_pool3d_with_indices.default: _with_indices(3),
    aten.max_pool2d_with_indices_backward.default: max_pool2d_with_indices_backward,
}
