"""Functionalization helpers: run a function on functional tensors, read what it mutated.

`FunctionalTensorMode` (with the python dispatcher) turns every in-place and
view op into functional ops; mutated inputs are read back as new values, which
the captured graph returns and the runtime writes back (``copy_``).

Error checks torch registers as ordered side effects (torch 2.13 registers
``aten._linalg_check_errors``, which raises when a linalg op failed, e.g. on a
singular matrix) would need an effect token threaded through the graph.  They
return nothing and mutate nothing, so `functionalized` records them as plain
calls instead; `keep_node` keeps them through dead-code elimination, so the
compiled graph still raises where eager raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

# Ops that only raise on bad input: no outputs, no mutation; traced as plain calls
# and never dead-code eliminated.
ERROR_CHECK_OPS: frozenset[object] = frozenset({torch.ops.aten._linalg_check_errors.default})


def keep_node(n: fx.Node) -> bool:
    """Whether dead-code elimination and CSE must leave `n` alone: side effects
    (torch's own notion) and the error checks above (not effectful in torch 2.11)."""
    return n.is_impure() or (n.op == "call_function" and n.target in ERROR_CHECK_OPS)


class _StokerFunctionalMode(FunctionalTensorMode):  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode.__init_subclass__ is untyped
    """FunctionalTensorMode that records `ERROR_CHECK_OPS` as plain calls instead of
    effect-token ``with_effects`` calls (torch 2.13 marks them ORDERED effects; the
    captured graph has no token input to thread)."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        if func in ERROR_CHECK_OPS:
            # what handle_effects does, minus the token: unwrap and redispatch to
            # the modes below (fake / proxy), which record and run the check
            args, kwargs = torch.utils._pytree.tree_map_only(
                FunctionalTensor, FunctionalTensor.from_functional, (args, kwargs or {})
            )
            return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def functionalized() -> Iterator[FunctionalTensorMode]:
    """Enter functionalization (and the python dispatcher it needs)."""
    # Exclude the C++ Functionalize key above us: FunctionalTensorMode does the work.
    disable_above = torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
    )
    mode = _StokerFunctionalMode()
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
