"""Functionalization helpers: run a function on functional tensors, read what it mutated.

`FunctionalTensorMode` (with the python dispatcher) turns every in-place and
view op into functional ops; mutated inputs are read back as new values, which
the captured graph returns and the runtime writes back (``copy_``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode


@contextlib.contextmanager
def functionalized() -> Iterator[FunctionalTensorMode]:
    """Enter functionalization (and the python dispatcher it needs)."""
    # Exclude the C++ Functionalize key above us: FunctionalTensorMode does the work.
    disable_above = torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
    )
    mode = FunctionalTensorMode()
    with disable_above, mode, enable_python_dispatcher():
        yield mode


def to_fun(x: Any) -> Any:
    """Wrap a tensor as a functional tensor (other values pass through)."""
    if isinstance(x, torch.Tensor) and not isinstance(x, FunctionalTensor):
        return FunctionalTensor.to_functional(x)
    return x


def from_fun(x: Any) -> Any:
    """Sync and unwrap a functional tensor (other values pass through)."""
    if isinstance(x, FunctionalTensor):
        torch._sync(x)  # type: ignore[attr-defined,no-untyped-call]
        return torch._from_functional_tensor(x.elem)
    return x


def has_data_mutation(f: Any) -> bool:
    if not isinstance(f, FunctionalTensor):
        return False
    torch._sync(f)  # type: ignore[attr-defined,no-untyped-call]
    return bool(torch._functionalize_has_data_mutation(f.elem))  # type: ignore[attr-defined]


def has_metadata_mutation(f: Any) -> bool:
    if not isinstance(f, FunctionalTensor):
        return False
    return bool(torch._functionalize_has_metadata_mutation(f.elem))


def storage_key(t: torch.Tensor) -> int:
    """An id of ``t``'s storage, equal for views of one storage (functional tensors too)."""
    return int(t.untyped_storage()._cdata)
