"""Anomaly mode under stoker_autograd: NaN checks per autograd node, as eager's engine.

Under ``torch.autograd.detect_anomaly()`` eager raises ``Function 'X' returned nan
values in its ith output.`` at the first node whose outputs (after its post-hooks)
hold a NaN.  stoker checks the same nodes with the same message, with ``backward()``
and ``torch.autograd.grad``, whether the engine captured the graph with anomaly mode
on or replays one captured without it; with anomaly mode off nothing is checked.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

import stoker_autograd


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Aa]nomaly.*")
        yield


class NanBackward(torch.autograd.Function):
    """``2 x``, whose backward returns NaN where ``ctx.bad`` says."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bad: bool) -> torch.Tensor:
        ctx.bad = bad
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g * (float("nan") if ctx.bad else 2.0), None


def _custom(bad: bool) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    x = torch.randn(4, requires_grad=True)
    return lambda: NanBackward.apply(x.sin(), bad).sum(), [x]


def _custom_on_a_leaf(bad: bool) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    """The NaN goes straight into the leaf's accumulate-grad: no node after it."""
    x = torch.randn(4, requires_grad=True)
    return lambda: NanBackward.apply(x, bad).sum(), [x]


def _division(bad: bool) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    """``x / w`` at 0 / 0: DivBackward0's gradient for ``w`` (its output 1) is NaN."""
    x = (torch.zeros(4) if bad else torch.randn(4)).requires_grad_(True)
    w = (torch.zeros(4) if bad else torch.rand(4) + 1).requires_grad_(True)
    return lambda: (x.exp() / w).sum() if not bad else (x / w).sum(), [x, w]


_MAKERS = {"custom": _custom, "custom-leaf": _custom_on_a_leaf, "division": _division}


def _outcome(
    make: Callable[[bool], tuple[Callable[[], torch.Tensor], list[torch.Tensor]]],
    api: str,
    compiled: bool,
    anomaly: bool,
    bad: bool = True,
) -> tuple[str | None, list[torch.Tensor | None]]:
    torch.manual_seed(0)
    loss, leaves = make(bad)
    error = None
    ctx = stoker_autograd.enable() if compiled else torch.enable_grad()
    grads: list[torch.Tensor | None] = []
    try:
        with ctx, torch.autograd.set_detect_anomaly(anomaly):
            if api == "grad":
                grads = list(torch.autograd.grad(loss(), leaves))
            else:
                loss().backward()
                grads = [x.grad for x in leaves]
    except RuntimeError as e:
        error = str(e).splitlines()[0]
    return error, grads


@pytest.mark.parametrize("api", ["backward", "grad"])
@pytest.mark.parametrize("case", ["custom", "custom-leaf", "division"])
def test_nan_raises_eager_error(case: str, api: str) -> None:
    eager, _ = _outcome(_MAKERS[case], api, compiled=False, anomaly=True)
    got, _ = _outcome(_MAKERS[case], api, compiled=True, anomaly=True)
    expected = {
        "custom": "Function 'NanBackwardBackward' returned nan values in its 0th output.",
        "custom-leaf": "Function 'NanBackwardBackward' returned nan values in its 0th output.",
        "division": "Function 'DivBackward0' returned nan values in its 1th output.",
    }[case]
    assert eager == expected
    assert got == eager


@pytest.mark.parametrize("api", ["backward", "grad"])
@pytest.mark.parametrize("case", ["custom", "division"])
def test_anomaly_off_changes_nothing(case: str, api: str) -> None:
    """Without anomaly mode the NaN reaches the gradients in both, with no error."""
    eager, eager_grads = _outcome(_MAKERS[case], api, compiled=False, anomaly=False)
    got, grads = _outcome(_MAKERS[case], api, compiled=True, anomaly=False)
    assert eager is None and got is None
    for e, g in zip(eager_grads, grads, strict=True):
        assert e is not None and g is not None
        torch.testing.assert_close(g, e, equal_nan=True)
    assert any(bool(torch.isnan(g).any()) for g in grads if g is not None)


def test_a_graph_captured_without_anomaly_is_checked_when_replayed_with_it() -> None:
    """The engine's cache replays a graph captured (and compiled) without anomaly mode:
    with anomaly mode on later, the replay checks, and raises eager's error; with it
    off again the compiled graph runs, unchecked, as before."""
    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=True)
    with stoker_autograd.enable() as session:
        for _ in range(2):  # capture, then the compiled graph
            x.grad = None
            NanBackward.apply(x.sin(), False).sum().backward()
        st = stoker_autograd.stats()
        assert st["captures"] == 1 and st["compiles"] == 1, st
        x.grad = None
        with torch.autograd.detect_anomaly(), pytest.raises(RuntimeError) as err:
            NanBackward.apply(x.sin(), True).sum().backward()
        assert (
            str(err.value)
            == "Function 'NanBackwardBackward' returned nan values in its 0th output."
        )
        x.grad = None
        NanBackward.apply(x.sin(), True).sum().backward()  # anomaly off: no check
        assert x.grad is not None and bool(torch.isnan(x.grad).all())
    st = stoker_autograd.stats()
    assert st["captures"] == 1 and st["compiles"] == 1 and st["cache_hits"] == 3, st
    assert len(session.graphs[0].variants) == 1


def test_a_graph_captured_with_anomaly_runs_compiled_without_it() -> None:
    """Captured under anomaly mode, the same graph later compiles and runs without
    checks: anomaly mode leaves nothing in the graph."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(m)
    with stoker_autograd.enable() as session:
        for step in range(4):
            m.zero_grad()
            ref.zero_grad()
            x = torch.randn(3, 4)
            with torch.autograd.set_detect_anomaly(step == 0):
                m(x).pow(2).sum().backward()
            with stoker_autograd.disabled():
                ref(x).pow(2).sum().backward()
            for p, q in zip(m.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
    st = stoker_autograd.stats()
    assert st["captures"] == 1 and st["compiles"] == 1 and st["cache_hits"] == 3, st
    assert len(session.graphs[0].variants) == 1


def test_the_check_follows_post_hooks_as_in_eager() -> None:
    """Eager checks a node's outputs after its post-hooks: a post-hook that replaces
    the NaN prevents the error; without it the node's NaN raises."""

    def run(compiled: bool, clean: bool) -> tuple[str | None, torch.Tensor | None]:
        torch.manual_seed(0)
        x = torch.randn(4, requires_grad=True)
        y = NanBackward.apply(x * 3, True)
        if clean:
            y.grad_fn.register_hook(lambda gi, go: tuple(torch.nan_to_num(g) for g in gi))  # type: ignore[union-attr]
        try:
            with stoker_autograd.enable() if compiled else torch.enable_grad():
                with torch.autograd.detect_anomaly():
                    y.sum().backward()
        except RuntimeError as e:
            return str(e).splitlines()[0], None
        return None, x.grad

    for clean in (False, True):
        (e_err, e_grad), (s_err, s_grad) = run(False, clean), run(True, clean)
        assert s_err == e_err
        if clean:
            assert e_err is None and e_grad is not None and s_grad is not None
            torch.testing.assert_close(s_grad, e_grad)
        else:
            assert e_err == "Function 'NanBackwardBackward' returned nan values in its 0th output."


@pytest.mark.parametrize("how", ["stoker", "aot_eager"])
def test_nan_in_a_compiled_model_names_its_backward(how: str) -> None:
    """A compiled forward's backward is one autograd node in eager (stoker's inlined AOT
    backward, torch.compile's proxied CompiledFunction): the NaN it returns is reported
    with that node's name and output index, as eager reports it."""
    stoker_capture = pytest.importorskip("stoker_capture")

    class Div(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x / self.w).sum()

    torch.manual_seed(0)
    torch._dynamo.reset()
    m = Div()
    cm = stoker_capture.aot_module(m) if how == "stoker" else torch.compile(m, backend=how)
    x = torch.zeros(4, requires_grad=True)
    errors = []
    for compiled in (False, True):
        loss = cm(x)  # the forward outside anomaly mode: only the backward is checked
        try:
            with stoker_autograd.enable() if compiled else torch.enable_grad():
                with torch.autograd.detect_anomaly():
                    loss.backward()
        except RuntimeError as e:
            errors.append(str(e).splitlines()[0])
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert errors[0].startswith("Function 'CompiledFunction") and "in its 0th output" in errors[0]
