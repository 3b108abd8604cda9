"""`aot_module` / `aot_function` under ``torch.autograd.detect_anomaly()``: the joint
graph is traced outside anomaly mode, and the engine checks the compiled backward's
outputs at run time, as it checks eager's nodes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from stoker_capture import aot_function, aot_module


def _grads(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.parameters() if p.grad is not None]


def test_training_under_anomaly_mode_compiles_and_matches_eager() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))
    model = copy.deepcopy(eager)
    compiled = aot_module(model)
    for batch in (4, 5):  # the second batch size recompiles, under anomaly mode too
        x = torch.randn(batch, 6, requires_grad=True)
        xc = x.detach().clone().requires_grad_()
        with torch.autograd.detect_anomaly():
            want = eager(x)
            want.pow(2).sum().backward()
            got = compiled(xc)
            got.pow(2).sum().backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(xc.grad, x.grad)
        for g, w in zip(_grads(model), _grads(eager), strict=True):
            torch.testing.assert_close(g, w)
        eager.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)


def test_a_nan_in_the_backward_raises_as_eager_does() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x).sum()  # d/dx at -1: NaN

    compiled = aot_function(f)
    for fn in (f, compiled):
        x = torch.tensor([-1.0, 4.0], requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # anomaly mode's "Error detected in ..." warning
            with (
                torch.autograd.detect_anomaly(),
                pytest.raises(
                    RuntimeError, match=r"Function '\w+' returned nan values in its 0th output"
                ),
            ):
                fn(x).backward()
    x = torch.tensor([-1.0, 4.0], requires_grad=True)
    compiled(x).backward()  # outside anomaly mode: NaN, no error, as eager
    assert torch.isnan(x.grad[0]) and x.grad[1] == 0.25
