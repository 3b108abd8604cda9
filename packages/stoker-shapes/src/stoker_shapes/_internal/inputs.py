"""What a `ShapeContext` records of each input it fakeified (its ``inputs`` list).

`context` builds these; `guards.build_guard_set` reads them to write the guards.
Both import this module, neither imports the other's way back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor

from .source import Source


@dataclass(slots=True)
class TensorInput:
    """A fakeified tensor input: where it came from and what it looked like."""

    source: Source
    fake: FakeTensor
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    sizes: tuple[sympy.Expr | int, ...]  # int when static, expr over symbols when dynamic
    strides: tuple[sympy.Expr | int, ...]
    storage_offset: sympy.Expr | int
    is_view: bool
    storage_key: int  # identifies the real storage, for aliasing between inputs
    is_param: bool = False  # a parameter or buffer (static by default, no alias guards)
    is_param_type: bool = False  # the value is a torch.nn.Parameter (its exact type is guarded)


@dataclass(slots=True)
class ScalarInput:
    """A Python int/float input: a constant (static) or a symbol (dynamic)."""

    source: Source
    value: int | float
    expr: sympy.Expr | None  # None when specialized


@dataclass(slots=True)
class ConstantInput:
    """A non-tensor value the trace specialized on (bool, None, str, dtype, ...)."""

    source: Source
    value: Any


@dataclass(slots=True)
class ContainerInput:
    """A list/tuple/dict along the way to the leaves: its type and length are guarded."""

    source: Source
    kind: type
    keys: tuple[Any, ...]
