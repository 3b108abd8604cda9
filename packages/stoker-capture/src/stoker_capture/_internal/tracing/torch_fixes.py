"""Corrections to torch decompositions that give wrong numbers, in force while a pipeline
traces (each entered on the pipeline's ExitStack, undone when it closes).

A decomposition registered with ``py_impl(DispatchKey.Autograd)`` runs in every trace with
the Python dispatcher on (``make_fx``), before the decomposition table is consulted, so the
fix replaces that kernel (and clears the op's dispatch cache) rather than editing the table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._C import DispatchKey


def multilabel_margin_loss_forward(input: Any, target: Any, reduction: int) -> tuple[Any, Any]:
    """``aten.multilabel_margin_loss_forward`` as eager computes it.

    torch's decomposition (2.11 to 2.13 at least) sums the hinge over *every* target slot,
    reading the slots after the first ``-1`` as class 0; eager stops at the first ``-1``.
    Here the slots past it are masked out of the sum.  Returns (loss, is_target)."""
    in_shape = input.shape
    x = input if input.dim() == 2 else input.reshape(1, -1)  # atleast_2d
    t = target if target.dim() == 2 else target.reshape(1, -1)
    dim = x.shape[1]
    idx = torch.arange(dim, device=t.device)
    end = torch.amin(torch.where(t == -1, idx, dim), dim=-1, keepdim=True)
    valid = idx < end  # (N, dim): target slots before the first -1
    is_target = torch.any(idx == torch.where(valid, t, -1).unsqueeze(-1), dim=1)  # (N, dim)
    picked = torch.gather(x, -1, torch.where(valid, t, 0))  # x[n, t[n, j]]
    # z[n, j, i] = max(0, 1 - x[n, t[n, j]] + x[n, i]) / dim over valid j, non-target i
    z = (1.0 - picked.unsqueeze(-1) + x.unsqueeze(1)).clamp_min(0) / dim
    z = torch.where(valid.unsqueeze(-1) & ~is_target.unsqueeze(1), z, 0)
    per_sample = z.sum(dim=(1, 2))
    if reduction == 1:  # mean
        loss = per_sample.mean()
    elif reduction == 2:  # sum
        loss = per_sample.sum()
    else:
        loss = per_sample if len(in_shape) == 2 else per_sample.reshape(())
    return loss, is_target.to(x.dtype).reshape(target.shape)


_FIXES: dict[Any, Any] = {
    torch.ops.aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward,
}


@contextlib.contextmanager
def torch_decompositions_fixed() -> Iterator[None]:
    """While tracing: the corrected decompositions in `_FIXES` replace torch's
    Autograd-key kernels for their ops."""
    saved = {op: op.py_kernels.get(DispatchKey.Autograd) for op in _FIXES}
    for op, fn in _FIXES.items():
        op.py_kernels[DispatchKey.Autograd] = fn
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, old in saved.items():
            if old is None:
                op.py_kernels.pop(DispatchKey.Autograd, None)
            else:
                op.py_kernels[DispatchKey.Autograd] = old
            op._dispatch_cache.clear()
