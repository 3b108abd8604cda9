"""A backward captured again names what changed, with parameters by their module path
(from Dynamo's sources): through ``torch.compile(backend="stoker")`` and in the
report; gradients match eager's."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

import stoker
import stoker_autograd
from stoker._internal.api.compile_api import last_report


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    stoker.reset()
    yield
    stoker.reset()


def test_recapture_reasons_name_parameters_by_module_path() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="stoker")
    for step in range(3):
        if step == 2:  # freeze the head: its accumulate-grads leave the backward
            for m in (eager, model):
                m[2].requires_grad_(False)
        x = torch.randn(4, 6)
        compiled(x).pow(2).mean().backward()
        with stoker.autograd_enabled(False):  # eager's engine (the switch is process-wide)
            eager(x).pow(2).mean().backward()
        for pe, pc in zip(eager.parameters(), model.parameters(), strict=True):
            assert (pe.grad is None) == (pc.grad is None)
            if pe.grad is not None:
                torch.testing.assert_close(pc.grad, pe.grad, atol=1e-6, rtol=1e-5)
    reasons = stoker_autograd.recapture_reasons()
    assert len(reasons) == 2, reasons
    assert "AccumulateGrad of 2.weight: .grad None -> .grad set" in reasons[0], reasons
    assert "no longer: AccumulateGrad of 2.weight" in reasons[1], reasons


def test_the_report_lists_recapture_reasons() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    compiled = stoker.compile(model)
    for _ in range(2):
        compiled(torch.randn(4, 6)).sum().backward()
    rep = last_report()
    assert rep is not None
    html = rep.to_html()
    assert "backward captured again (compiled autograd)" in html
    assert "AccumulateGrad of 2.weight: .grad None -&gt; .grad set" in html
