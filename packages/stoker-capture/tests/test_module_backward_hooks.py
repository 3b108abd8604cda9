"""Module backward hooks under `aot_module`: the module's own run at every backward
with eager's gradients; one that would run only while tracing raises."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from stoker_capture import UnsupportedError, aot_module


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc1(x))
        return self.fc2(h), h.sum(-1)


Log = list[tuple[str, list[torch.Tensor | None]]]


def _hooks(log: Log) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def full(m: nn.Module, gi: tuple[Any, ...], go: tuple[Any, ...]) -> tuple[Any, ...]:
        log.append(("full", [g if g is None else g.clone() for g in (*gi, *go)]))
        return tuple(None if g is None else g * 0.5 for g in gi)  # changes x.grad

    def pre(m: nn.Module, go: tuple[Any, ...]) -> tuple[Any, ...]:
        log.append(("pre", [g if g is None else g.clone() for g in go]))
        return tuple(None if g is None else g * 3.0 for g in go)  # changes every grad

    return full, pre


def _run(model: nn.Module, fn: Callable[..., Any], log: Log, steps: int = 3) -> list[Any]:
    out: list[Any] = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(4 + step % 2, 6, requires_grad=True)  # a new batch size recompiles
        a, b = fn(x)
        log.append(("step", []))
        (a.pow(2).sum() + b.sum()).backward()
        out += [a.detach(), b.detach(), x.grad]
        out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
    return out


def _assert_same(got: Any, want: Any) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, tuple):  # a log entry
            assert g[0] == w[0]
            _assert_same(g[1], w[1])
        elif w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_modules_own_backward_hooks_run_at_every_backward_with_eagers_grads() -> None:
    torch.manual_seed(0)
    eager = Net()
    model = copy.deepcopy(eager)
    want_log: Log = []
    got_log: Log = []
    for m, log in ((eager, want_log), (model, got_log)):
        full, pre = _hooks(log)
        m.register_full_backward_hook(full)
        m.register_full_backward_pre_hook(pre)
    want = _run(eager, eager, want_log)
    got = _run(model, aot_module(model), got_log)
    _assert_same(got, want)
    assert [k for k, _ in got_log] == ["step", "pre", "full"] * 3
    _assert_same(got_log, want_log)


def test_a_removed_hook_no_longer_runs_and_a_global_hook_runs_on_a_leaf_module() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(5, 2)
    compiled = aot_module(lin)
    log: list[str] = []
    handle = lin.register_full_backward_hook(lambda m, gi, go: log.append("own") or None)
    compiled(torch.randn(3, 5, requires_grad=True)).sum().backward()
    assert log == ["own"]
    handle.remove()
    compiled(torch.randn(3, 5, requires_grad=True)).sum().backward()
    assert log == ["own"]
    g = nn.modules.module.register_module_full_backward_hook(
        lambda m, gi, go: log.append("global") or None
    )
    try:
        compiled(torch.randn(3, 5, requires_grad=True)).sum().backward()
    finally:
        g.remove()
    assert log == ["own", "global"]
    compiled(torch.randn(3, 5, requires_grad=True)).sum().backward()
    assert log == ["own", "global"]


def test_a_submodule_backward_hook_raises_naming_it_even_when_added_after_compiling() -> None:
    torch.manual_seed(0)
    model = Net()
    compiled = aot_module(model)
    x = torch.randn(4, 6)
    compiled(x)[0].sum().backward()  # compiled without hooks
    handle = model.fc2.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(UnsupportedError, match=r"submodule 'fc2' \(Linear\) has a backward hook"):
        compiled(x)
    with torch.no_grad():  # no backward: nothing to run, nothing to refuse
        torch.testing.assert_close(compiled(x)[0], model(x)[0])
    handle.remove()
    compiled(x)[0].sum().backward()  # the hookless graph again
    model.fc1.register_full_backward_pre_hook(lambda m, go: None)
    with pytest.raises(UnsupportedError, match="submodule 'fc1'"):
        aot_module(model)(x)


@pytest.mark.parametrize("kind", ["non-full", "global", "forward-pre"])
def test_hooks_that_cannot_run_at_backward_raise_and_say_why(kind: str) -> None:
    torch.manual_seed(0)
    model = Net()
    handles = []
    if kind == "non-full":
        handles.append(model.register_backward_hook(lambda m, gi, go: None))
        match = "non-full backward hook"
    elif kind == "global":
        handles.append(nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None))
        match = "global module backward hook"
    else:
        handles.append(model.register_full_backward_hook(lambda m, gi, go: None))
        handles.append(model.register_forward_pre_hook(lambda m, args: None))
        match = "both forward pre-hooks and backward hooks"
    try:
        with pytest.raises(UnsupportedError, match=match):
            aot_module(model)(torch.randn(4, 6))
    finally:
        for h in handles:
            h.remove()
