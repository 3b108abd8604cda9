"""Helpers the generated wrapper calls: input layouts, buffer prototypes, random seeds."""

from __future__ import annotations

from typing import Any

import torch


def check_layout(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """The generated kernels index inputs with the strides seen at compile
    time; an input with other strides is copied into that layout (correct,
    slower) rather than read wrongly."""
    ts = t.stride()
    if ts == stride:
        return t
    for n, a, b in zip(size, ts, stride):
        if n > 1 and a != b:
            if any(s == 0 and m > 1 for s, m in zip(stride, size)):
                raise ValueError(
                    f"stoker-triton: an input was compiled as an expanded view (strides {stride}) "
                    f"and now arrives with strides {ts}; the kernels cannot read it. "
                    "Recompile for this layout (or pass a contiguous tensor to both)."
                )
            out = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
            out.copy_(t)
            return out
    return t


def ensure_layout(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """An extern result in the layout later kernels were generated for."""
    return check_layout(t, size, stride)


def prototype(dtype: torch.dtype, device: torch.device) -> Any:
    """An empty real tensor whose ``new_empty_strided(size, stride)`` allocates the
    wrapper's buffers of `dtype` on `device` (cheaper per call than `torch.empty_strided`
    with keyword arguments). Made outside any fake or dispatch mode: a wrapper may be
    loaded while a compiler traces (Dynamo's fake mode), and its buffers are real. On a
    device this process cannot use (a graph compiled for fake CUDA inputs on a CPU
    machine) a stand-in that allocates by `torch.empty_strided` when called."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        try:
            return torch.empty(0, dtype=dtype, device=device)
        except (RuntimeError, AssertionError):  # no such device here (now)
            return _Deferred(dtype, device)


class _Deferred:
    """A prototype on a device unusable when the wrapper was loaded: each allocation
    asks for the device again (and fails, as `empty_strided` would, if it still is)."""

    __slots__ = ("device", "dtype")

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device

    def new_empty_strided(self, size: Any, stride: Any) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=self.dtype, device=self.device)


def new_seed() -> int:
    """A seed per call from torch's CPU generator: reproducible under torch.manual_seed.

    Always odd and above 1: Triton specializes an integer argument equal to 1 or
    divisible by 16, so seeds of one kind keep every launch on one compiled binary
    (the one the precompile built with `PRECOMPILE_SEED`)."""
    return 2 * int(torch.randint(1, 2**30 - 1, (), dtype=torch.int64).item()) + 1


PRECOMPILE_SEED = 12345  # an odd seed: the specialization every `new_seed()` has
