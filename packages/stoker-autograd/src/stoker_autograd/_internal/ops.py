"""The functions a captured backward graph calls, and the registry of bound backwards.

Every ``call_function`` node of a captured graph targets one of:

* a `BoundBackward` (a built-in node's functional backward, bound by the engine
  through ``bind_function``): pure, retraced into core aten;
* `call_backward` (a custom ``autograd.Function``'s Python backward, run with the
  real ``ctx``), `call_hook` (any Python hook, ``hook_type=`` says which kind),
  `accumulate_grad` (writes ``param.grad``), `call_cpp_tensor_pre_hooks`
  (``retain_grad``): opaque, kept as calls so their side effects happen every step;
* `copy_slices_prologue` / `copy_slices_epilogue` (``CopySlices``, in-place on a
  view): pure, retraced;
* ``operator.getitem`` and aten ops.

The engine binds a node type's functional backward once per process (across
``clear_cache()`` and compiler instances), so the registry is process-global.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import final_callbacks

HOOK_KINDS = (
    "tensor_pre_hook",
    "pre_hook",
    "post_hook",
    "post_acc_grad_hook",
    "unpack_hook",
)


class BoundBackward:
    """A built-in autograd node's functional backward: ``fn(grads, *saved) -> grads``."""

    __slots__ = ("__name__", "__qualname__", "fn", "is_custom_function", "is_traceable")

    def __init__(
        self, name: str, fn: Callable[..., Any], is_custom_function: bool, is_traceable: bool
    ) -> None:
        self.__name__ = name
        self.__qualname__ = name
        self.fn = fn
        self.is_custom_function = is_custom_function
        self.is_traceable = is_traceable

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"stoker_autograd.ops.{self.__name__}"


class _Registry:
    """Process-global: the engine calls ``bind_function`` once per node type per process."""

    def __init__(self) -> None:
        self._ops: dict[str, BoundBackward] = {}
        self._counts: dict[str, int] = {}

    def bind(
        self, name: str, fn: Callable[..., Any], is_custom_function: bool, is_traceable: bool
    ) -> str:
        if is_custom_function:  # C++ custom functions may share a name: make it unique
            base = "CppNode" + name
            n = self._counts.get(base, 0)
            self._counts[base] = n + 1
            name = f"{base}{n}"
        self._ops[name] = BoundBackward(name, fn, is_custom_function, is_traceable)
        return name

    def get(self, name: str) -> BoundBackward:
        op = self._ops.get(name)
        if op is None:
            raise RuntimeError(
                f"stoker-autograd: the engine asked for the functional backward {name!r}, "
                "which was bound to another compiled-autograd implementation in this process "
                "(torch binds each node type once per process). Use one compiled-autograd "
                "implementation per process: do not mix torch's compiled autograd with "
                "stoker_autograd.enable()."
            )
        return op

    def __contains__(self, name: str) -> bool:
        return name in self._ops


REGISTRY = _Registry()


# ----------------------------------------------------------------- opaque calls
class _BackwardCtx:
    """What a custom Function's ``backward`` sees as ``ctx``: the real ctx, with the
    saved tensors the engine unpacked (so saved-tensor hooks ran)."""

    def __init__(self, real: Any, saved_tensors: Sequence[torch.Tensor]) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "saved_tensors", tuple(saved_tensors))

    def __getattr__(self, name: str) -> Any:
        if name == "saved_variables":
            return self.saved_tensors
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)


# torch 2.13 added boxed_grads_call; on releases without it the flag means nothing.
_HAS_BOXED = hasattr(torch.autograd.Function, "boxed_grads_call")


def call_backward(
    ctx: Any,
    saved_tensors: Sequence[torch.Tensor],
    *grads: Any,
    undefined_leaves: Sequence[tuple[torch.Tensor, Sequence[int]]] = (),
) -> tuple[Any, ...]:
    """Run a custom ``autograd.Function``'s Python backward (or vjp) with its real ctx.

    ``undefined_leaves``: each leaf whose every gradient flows from the listed outputs
    alone (`passes.mark_undefined_leaves`); see `_keep_undefined`."""
    fwd_cls = ctx._forward_cls
    proxy_ctx = _BackwardCtx(ctx, saved_tensors)
    get_user_fn = getattr(ctx, "_get_user_fn", None)
    user_fn = get_user_fn() if get_user_fn is not None else fwd_cls.backward
    if _HAS_BOXED and getattr(fwd_cls, "boxed_grads_call", False):
        # Such Functions take their grads boxed in one list (and may free them).
        out = user_fn(proxy_ctx, list(grads))
    else:
        out = user_fn(proxy_ctx, *grads)
    if not isinstance(out, tuple):
        out = (out,)
    if any(g is None for g in out):
        if undefined_leaves:
            _keep_undefined(out, undefined_leaves)
        out = _zeros_for_none(ctx, out)
    return tuple(out)


def _keep_undefined(
    out: Sequence[Any], leaves: Sequence[tuple[torch.Tensor, Sequence[int]]]
) -> None:
    """Eager leaves ``.grad`` None when no defined gradient reaches the leaf; the graph
    will accumulate the zeros `_zeros_for_none` makes.  A leaf whose ``.grad`` is None
    now and whose outputs are all None gets ``.grad = None`` back when the backward ends
    (a callback queued on its graph task: the compiled backward runs it last)."""
    pending = [v for v, idx in leaves if v.grad is None and all(out[i] is None for i in idx)]
    if not pending:
        return

    def reset() -> None:
        for v in pending:
            v.grad = None

    torch.autograd.Variable._execution_engine.queue_callback(reset)


def _zeros_for_none(ctx: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """Zeros where a backward returned None for an input whose graph wants a gradient.

    A backward may return None for an input that requires grad ("no gradient"); eager's
    engine then skips the nodes that gradient would feed.  The captured graph was traced
    for a tensor there and reads one, so it gets zeros of the size, dtype and device the
    next node expects (its ``_input_metadata``): the same values (a leaf reached only
    this way keeps ``.grad`` None: `_keep_undefined`).
    """
    edges = ctx.next_functions
    out = list(grads)
    for i, g in enumerate(out):
        if g is not None or i >= len(edges) or edges[i][0] is None:
            continue
        fn, nr = edges[i]
        if type(fn).__name__ == "AccumulateGrad":
            continue  # `accumulate_grad` takes None (the leaf keeps its .grad, as in eager)
        meta = fn._input_metadata[nr]
        out[i] = torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
    return tuple(out)


def call_hook(hook: Callable[..., Any], *args: Any, hook_type: str) -> Any:
    """Run a Python hook; a hook returning None leaves its first argument unchanged."""
    result = hook(*args)
    if result is None:
        return args[0]
    if hook_type == "post_acc_grad_hook":
        raise RuntimeError("stoker-autograd: post-accumulate-grad hooks must return None")
    return result


def accumulate_grad(
    variable: torch.Tensor,
    variable_grad: torch.Tensor | None,
    grad: torch.Tensor | None,
    has_post_hooks: bool,
    may_steal: bool = False,
) -> torch.Tensor | None:
    """``variable.grad += grad`` as the eager engine's AccumulateGrad does it
    (``accumulateGrad`` in torch/csrc/autograd/functions/accumulate_grad.h, case by case).

    ``variable_grad`` is ``variable.grad`` when the engine passed it (torch 2.13);
    on torch 2.11 the engine does not, and the current ``.grad`` is read here.
    ``may_steal``: the graph proved ``grad`` is a fresh intermediate nobody else holds
    (eager's use-count test); without it the gradient is copied, which eager also does
    whenever someone else holds it.  Grad mode on means ``create_graph=True``: the new
    ``.grad`` keeps ``grad``'s history (out of place), as in eager.
    """
    if grad is None:
        return variable.grad
    current = variable.grad
    grad_mode = torch.is_grad_enabled()
    sparse = grad.is_sparse
    if current is None:
        if (
            not grad_mode
            and may_steal
            and grad.layout == torch.strided
            and variable.layout == torch.strided
            and not has_post_hooks
            and not grad._is_view()
            and grad.dtype == variable.dtype
            and obeys_layout_contract(grad, variable)
        ):
            new = grad.detach()  # case 1.1: steal a dense gradient
        elif (
            not grad_mode
            and may_steal
            and sparse
            and not has_post_hooks
            and grad._indices().is_contiguous()
            and grad._values().is_contiguous()
        ):  # case 1.2: a sparse gradient, shallow (its indices and values, not copied)
            new = torch.ops.aten._sparse_coo_tensor_unsafe.default(
                grad._indices(), grad._values(), list(grad.shape), dtype=grad.dtype
            )
        elif sparse or grad.layout != torch.strided or grad.is_nested or grad.is_mkldnn:
            new = grad.clone()  # cases 1.3, 1.4: sparse, nested, MKLDNN
        else:  # case 1.5: a copy that obeys the layout contract
            new = clone_obey_contract(grad, variable)
        variable.grad = new
    elif not grad_mode:
        if current.is_sparse and not sparse:
            variable.grad = grad + current  # case 2.1: add(sparse, dense) does not exist
        else:
            current.add_(grad)  # case 2.3: in place, .grad stays the same tensor
    elif current.is_sparse and not sparse:
        variable.grad = grad + current  # case 3.1
    else:
        variable.grad = current + grad  # case 3.2
    return variable.grad


def obeys_layout_contract(grad: torch.Tensor, variable: torch.Tensor) -> bool:
    """Eager's gradient layout contract (torch/csrc/autograd/utils/grad_layout_contract.h):
    a dense parameter's gradient has its strides (dims of size 1 aside, but not stride 0);
    any other parameter's is row-major contiguous."""
    if variable.is_nested or variable.layout != torch.strided:
        return False
    strides = grad.stride()
    if strides == variable.stride() and 0 not in strides and variable.is_contiguous():
        return True  # the common case, in three C calls: a contiguous parameter's twin
    if is_dense(variable):
        for n, gs, vs in zip(grad.shape, grad.stride(), variable.stride(), strict=True):
            if n != 1 and gs != vs:
                return False
            if n == 1 and gs == 0:
                return False
        return True
    return grad.is_contiguous()


def clone_obey_contract(grad: torch.Tensor, variable: torch.Tensor) -> torch.Tensor:
    """A copy of ``grad`` laid out as the contract says (differentiable: under
    ``create_graph`` it keeps ``grad``'s history, as eager's does)."""
    if variable.layout == torch.strided and not variable.is_nested and is_dense(variable):
        return grad.new_empty_strided(variable.size(), variable.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of ``t`` is contiguous."""
    if t.is_contiguous() or t.numel() == 0:
        return True
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d])):
        if t.shape[d] == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def call_cpp_tensor_pre_hooks(hook_id: int, grad: torch.Tensor) -> torch.Tensor:
    """``retain_grad`` and other C++ tensor pre-hooks, run by the engine's own registry."""
    out: torch.Tensor = torch._C._dynamo.compiled_autograd.call_cpp_tensor_pre_hooks(hook_id, grad)
    return out


def copy_slices_prologue(
    inputs: Sequence[torch.Tensor],
    base_sizes: Sequence[Any],
    base_strides: Sequence[Any],
    base_storage_offset: Any,
    view_sizes: Sequence[Any],
    view_strides: Sequence[Any],
    view_storage_offset: Any,
) -> list[torch.Tensor]:
    """First half of ``CopySlices`` (in-place op on a view): the grad of the base laid
    out like the base, the view's slice of it, and a contiguous copy of that slice.
    Written without in-place ops so the retraced graph stays functional."""
    grad = inputs[0]
    layout = grad.new_empty_strided(base_sizes, base_strides)
    result = torch.ops.aten.copy.default(layout, grad)
    grad_slice = result.as_strided(
        view_sizes, view_strides, view_storage_offset - base_storage_offset
    )
    return [result, grad_slice, grad_slice.clone(memory_format=torch.contiguous_format)]


def copy_slices_epilogue(
    needs_input_grad: Sequence[bool],
    result: torch.Tensor,
    res: Sequence[torch.Tensor | None],
    grad_slice: torch.Tensor,
) -> list[torch.Tensor | None]:
    """Second half of ``CopySlices``: the base's grad with the view's slice replaced by
    the grad the in-place op's backward computed (a scatter, not a write-through)."""
    grad_inputs: list[torch.Tensor | None] = [None] * len(needs_input_grad)
    for i, needed in enumerate(needs_input_grad):
        r = res[i]
        if not needed or r is None:
            continue
        if i == 0:
            grad_inputs[i] = torch.as_strided_scatter(
                result, r, grad_slice.size(), grad_slice.stride(), grad_slice.storage_offset()
            )
        else:
            grad_inputs[i] = r
    return grad_inputs


def exec_final_callbacks_stub() -> None:
    """The end of the backward: runs what ``queue_callback`` queued (see `final_callbacks`)."""
    final_callbacks.run_queued()


OPAQUE_TARGETS: frozenset[Any] = frozenset(
    {
        call_backward,
        call_hook,
        accumulate_grad,
        call_cpp_tensor_pre_hooks,
        exec_final_callbacks_stub,
    }
)
"""Targets with Python side effects: never traced into, never removed, never reordered freely."""

GETITEM = operator.getitem


def is_opaque(target: Any) -> bool:
    """True for calls the retrace keeps as calls (side effects, or not traceable)."""
    if target in OPAQUE_TARGETS:
        return True
    return isinstance(target, BoundBackward) and not target.is_traceable
