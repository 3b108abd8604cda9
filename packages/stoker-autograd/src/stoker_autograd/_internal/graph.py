"""What every stage knows about a captured backward graph (the bottom of the stages).

A captured graph takes five lists, `PLACEHOLDERS`; a `Position` names one integer
of its inputs (a size of an input tensor, a lifted size, an int scalar, a size of
what an unpack hook returned).  `graph_module` makes a graph a module without
generating its code yet, `fake_tensor` builds a fake tensor of given metadata
directly, and `check_sizes` is the call a retraced graph makes after each opaque
call (a hook, a custom backward) to check the size of what it returned.

This module imports no other stage: capture, the passes, retrace, segments, the
disk cache and the runtime all import it (`stoker_autograd._internal`'s docstring
has the order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule

PLACEHOLDERS = ("inputs", "sizes", "scalars", "hooks", "packed_data")
"""The captured graph's placeholders, in order: the engine calls it with these lists."""

Position = tuple[int, int, int]  # (0 inputs | 1 sizes | 2 scalars | 3 unpacked, index, dim or -1)


def graph_module(root: torch.nn.Module, graph: fx.Graph, name: str) -> fx.GraphModule:
    """A GraphModule whose Python code is generated on its first call or print, not now:
    a backward replayed by segments, or loaded from the disk cache, never needs it
    (~0.1 ms per node)."""
    return _LazyGraphModule(root, graph, name)


def fake_tensor(
    fake_mode: FakeTensorMode,
    size: Sequence[int],
    stride: Sequence[int],
    offset: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A fake tensor of this metadata, built directly (~0.02 ms; through the fake
    mode's dispatch ~2 ms): a meta tensor wrapped with its device."""
    if offset:  # a view into a storage that holds all of it
        span = 0 if 0 in size else 1 + sum((n - 1) * st for n, st in zip(size, stride))
        base = torch.empty(offset + span, dtype=dtype, device="meta")
        meta = base.as_strided(size, stride, offset)
    else:
        meta = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    return FakeTensor(fake_mode, meta, torch.device(device))


def contiguous_strides(size: Sequence[int]) -> list[int]:
    """The strides of a contiguous tensor of ``size``."""
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(int(n), 1)
    return strides[::-1]


def check_sizes(t: torch.Tensor | None, expected: Sequence[int], what: str) -> torch.Tensor | None:
    """An opaque call's result must have the sizes the compiled graph was traced for."""
    if t is not None and tuple(t.shape) != tuple(expected):
        raise RuntimeError(
            f"stoker-autograd: {what} returned a tensor of size {tuple(t.shape)}, but the "
            f"compiled backward was traced for {tuple(expected)}. Hooks and custom backwards "
            "must return gradients of the size eager autograd expects."
        )
    return t
