"""Shared fixtures: every test starts with no compiled graphs and compiled autograd off;
`train_and_compare` trains eager and compiled copies of a zoo model side by side.

Every run gets its own cache directory: entries an earlier run left in the default
one (``~/.cache/stoker``) would make cold compiles warm hits and change what the
tests count (compiled-autograd compiles, recompiles)."""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import stoker
from stoker._internal.bench.models import get_model

os.environ["STOKER_CACHE_DIR"] = tempfile.mkdtemp(prefix="stoker-integration-tests-")


@pytest.fixture(autouse=True)
def fresh_stoker() -> Iterator[None]:
    stoker.reset()
    torch.manual_seed(0)
    yield
    stoker.reset()


def _train_and_compare(
    name: str,
    compile_fn: Callable[[torch.nn.Module], Any],
    *,
    batch_sizes: Sequence[int] = (4, 4, 4),
    build: dict[str, Any] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    device: str = "cpu",
) -> Any:
    """Train eager and compiled copies with AdamW on the same batches; compare the loss
    and every parameter and buffer after each step.  Returns the compiled model."""
    spec = get_model(name)
    eager = spec.build(device=device, seed=0, **(build or {}))
    model = copy.deepcopy(eager)
    compiled = compile_fn(model)
    # eps=1e-6: Adam divides by |grad| + eps, so for a gradient near zero the default 1e-8
    # turns a rounding difference between two correct backwards into a visible step.
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, eps=1e-6)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    gen = torch.Generator().manual_seed(1)
    for step, n in enumerate(batch_sizes):
        inputs, target = spec.batch(n, gen, device, **(build or {}))
        with stoker.autograd_enabled(False):
            loss_e = spec.loss(eager(*inputs), target)
            opt_e.zero_grad(set_to_none=True)
            loss_e.backward()
        loss_c = spec.loss(compiled(*inputs), target)
        opt_c.zero_grad(set_to_none=True)
        loss_c.backward()
        where = f"{name}, step {step} (batch {n})"
        torch.testing.assert_close(
            loss_c, loss_e, rtol=rtol, atol=atol, msg=lambda m, where=where: f"loss, {where}: {m}"
        )
        for (pname, pe), pc in zip(eager.named_parameters(), model.parameters()):
            assert pc.grad is not None, f"{pname} got no gradient through stoker, {where}"
            torch.testing.assert_close(
                pc.grad,
                pe.grad,
                rtol=rtol * 10,
                atol=atol * 10,
                msg=lambda m, pname=pname, where=where: f"grad of {pname}, {where}: {m}",
            )
        opt_e.step()
        opt_c.step()
        for (pname, pe), pc in zip(eager.named_parameters(), model.parameters()):
            torch.testing.assert_close(
                pc,
                pe,
                rtol=rtol,
                atol=atol * 5,
                msg=lambda m, pname=pname, where=where: f"{pname} after AdamW, {where}: {m}",
            )
        for (bname, be), bc in zip(eager.named_buffers(), model.buffers()):
            torch.testing.assert_close(
                bc,
                be,
                rtol=rtol,
                atol=atol,
                msg=lambda m, bname=bname, where=where: f"buffer {bname}, {where}: {m}",
            )
    return compiled


@pytest.fixture
def train_and_compare() -> Callable[..., Any]:
    return _train_and_compare
