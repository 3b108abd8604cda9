"""Helpers: run a function eagerly and compiled on fresh random inputs, compare all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree


def clone_inputs(args: Sequence[Any]) -> list[Any]:
    """Independent copies (same requires_grad, leaves stay leaves)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            c = a.detach().clone()
            c.requires_grad_(a.requires_grad)
            out.append(c)
        else:
            out.append(a)
    return out


def grads_of(outs: Any, leaves: Sequence[torch.Tensor], seed: int = 0) -> list[Any]:
    """Gradients of a random projection of every output that requires grad."""
    gen = torch.Generator().manual_seed(seed)
    flat = [o for o in pytree.tree_leaves(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not flat:
        return [None] * len(leaves)
    terms = [(o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in flat]
    # a complex output contributes the real part of its projection (a real loss)
    loss = sum(t.real if t.is_complex() else t for t in terms)
    return list(torch.autograd.grad(loss, list(leaves), allow_unused=True))


def assert_same(a: Any, b: Any, **tol: Any) -> None:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), (x, y)
            torch.testing.assert_close(x, y, **tol)
            assert x.requires_grad == y.requires_grad, (x.requires_grad, y.requires_grad)
        else:
            assert x == y, (x, y)


def check_fn(
    fn: Callable[..., Any],
    compiled: Callable[..., Any],
    make_args: Callable[[], list[Any]],
    **tol: Any,
) -> None:
    """Outputs, mutated inputs and gradients of every grad-requiring input vs eager."""
    args = make_args()
    a_eager, a_comp = clone_inputs(args), clone_inputs(args)
    # gradients with respect to the leaves as passed (not to mutated inputs' new versions)
    le = [a for a in a_eager if isinstance(a, torch.Tensor) and a.requires_grad]
    lc = [a for a in a_comp if isinstance(a, torch.Tensor) and a.requires_grad]
    out_e = fn(*a_eager)
    out_c = compiled(*a_comp)
    assert_same(out_c, out_e, **tol)
    assert_same(a_comp, a_eager, **tol)  # input mutations written back
    if le:
        assert_same(grads_of(out_c, lc), grads_of(out_e, le), **tol)
