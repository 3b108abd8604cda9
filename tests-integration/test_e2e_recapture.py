"""No needless recaptures: a custom Function's Python attributes on ``ctx`` are read live.

The backward of a custom ``autograd.Function`` reads ``ctx.scale``, a float that
changes every step. Compiled autograd's cache key does not include Python
attributes on ``ctx`` (the opaque backward call reads them at run time), so the
backward is captured once and replayed, with gradients that match eager each step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import stoker
import stoker_autograd


class ScaledCube(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x**3 * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return g * 3 * x**2 * ctx.scale, None


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return ScaledCube.apply(self.lin(x), scale).tanh()


def _steps(where: str, dynamic: bool | None) -> list[dict[str, int]]:
    """Train 5 steps with a new scale each; grads checked against eager every step.

    ``where``: the Function inside the compiled model, or applied eagerly to the
    output of a compiled ``nn.Linear``."""
    torch.manual_seed(0)
    model, ref = Model(), Model()
    ref.load_state_dict(model.state_dict())
    if where == "inside":
        compiled = stoker.compile(model, backend="aten", dynamic=dynamic)
        run = lambda m, x, s: m(x, s)  # noqa: E731
    else:
        compiled = stoker.compile(model.lin, backend="aten", dynamic=dynamic)
        run = lambda m, x, s: ScaledCube.apply(m(x), s).tanh()  # noqa: E731
    stats = []
    for i in range(5):
        x, scale = torch.randn(3, 6), 0.5 + 0.37 * i
        model.zero_grad()
        run(compiled, x, scale).pow(2).sum().backward()
        stats.append(stoker_autograd.stats())
        ref.zero_grad()
        with stoker.autograd_enabled(False):
            run(ref if where == "inside" else ref.lin, x, scale).pow(2).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    return stats


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_changing_ctx_float_is_captured_once(where: str) -> None:
    stoker.reset()
    try:
        stats = _steps(where, dynamic=True)
    finally:
        stoker.reset()
    assert stats[0]["captures"] == stats[-1]["captures"] == 1, stats
    assert stats[-1]["cache_hits"] == 4, stats


def test_a_float_that_becomes_dynamic_compiles_once_more() -> None:
    # Automatic dynamic (the default): the second scale recompiles the forward with a
    # symbolic float (the backward re-reads it from the saved 0-d input), after which
    # nothing is captured or compiled again.
    stoker.reset()
    try:
        stats = _steps("inside", dynamic=None)
    finally:
        stoker.reset()
    assert stats[1]["captures"] == stats[-1]["captures"] <= 2, stats
