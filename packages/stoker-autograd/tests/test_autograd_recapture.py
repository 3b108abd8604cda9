"""Why a backward was captured again (`stoker_autograd.recapture_reasons()`): each
capture's autograd nodes against the closest earlier capture's, with parameters by
the names `name_parameters` gave them; gradients still match eager's."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import stoker_autograd
from stoker_autograd._internal.recapture import why


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(x)))  # type: ignore[no-any-return]


def _step(m: nn.Module, x: torch.Tensor) -> list[torch.Tensor | None]:
    m(x).pow(2).sum().backward()
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def _close(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None)
        or (x is not None and y is not None and torch.allclose(x, y, rtol=1e-5, atol=1e-6))
        for x, y in zip(a, b, strict=True)
    )


def test_a_recapture_names_the_parameters_and_what_changed() -> None:
    torch.manual_seed(0)
    eager = Net()
    model = copy.deepcopy(eager)
    stoker_autograd.name_parameters(model)
    xs = [torch.randn(4, 6) for _ in range(3)]
    with stoker_autograd.enable():
        got = [_step(model, xs[0]), _step(model, xs[1])]  # .grad None, then set
        model.head.requires_grad_(False)  # a frozen layer: no accumulate-grad for it
        got.append(_step(model, xs[2]))
    want = [_step(eager, xs[0]), _step(eager, xs[1])]
    eager.head.requires_grad_(False)
    want.append(_step(eager, xs[2]))
    assert all(_close(g, w) for g, w in zip(got, want, strict=True))

    reasons = stoker_autograd.recapture_reasons()
    assert stoker_autograd.stats()["captures"] == 3
    assert len(reasons) == 2, reasons
    assert "AccumulateGrad of fc1.weight: .grad None -> .grad set" in reasons[0], reasons
    assert "no longer: AccumulateGrad of head.weight" in reasons[1], reasons
    assert "fc1" not in reasons[1], reasons  # fc1's accumulate is what it was: not named


def test_an_unnamed_parameter_is_named_by_its_shape() -> None:
    torch.manual_seed(0)
    model = Net()
    with stoker_autograd.enable():
        _step(model, torch.randn(4, 6))
        _step(model, torch.randn(4, 6))
    (reason,) = stoker_autograd.recapture_reasons()
    assert "AccumulateGrad of a parameter of shape (8, 6): .grad None -> .grad set" in reason


def test_another_backward_is_not_a_recapture() -> None:
    torch.manual_seed(0)
    a, b = Net(), nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 1))
    with stoker_autograd.enable():
        a(torch.randn(4, 6)).sum().backward()
        b(torch.randn(2, 2, 6)).sum().backward()
    assert stoker_autograd.stats()["captures"] == 2
    assert stoker_autograd.recapture_reasons() == []


def test_why_aligns_nodes_by_kind() -> None:
    root = ["GraphRoot", "SumBackward0", "CompiledFunction_0Backward"]
    first = [*root, "AccumulateGrad of w [.grad None]", "AccumulateGrad of b [.grad None]"]
    assert why([], first) is None
    assert why([first], list(first)) is not None  # same nodes: the key held other values
    later = [*root, "AccumulateGrad of w [.grad set]", "AccumulateGrad of b [.grad None]"]
    assert why([first], later) == "AccumulateGrad of w: .grad None -> .grad set"
    other = ["GraphRoot", "MeanBackward0", "ConvolutionBackward0", "AccumulateGrad of c"]
    assert why([first], other) is None  # too unlike: a new backward
    recompiled = ["GraphRoot", "SumBackward0", "CompiledFunction_1Backward", first[3]]
    assert why([first], recompiled) == (
        "CompiledFunction_0Backward -> CompiledFunction_1Backward; "
        "no longer: AccumulateGrad of b [.grad None]"
    )
