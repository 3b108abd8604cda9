"""Cases that once left torch's engine hook in a bad state, to run in one process in any
order (``python scope_sequence_worker.py case,case,...``: prints ``ok <case>`` per case).

Each case checks its gradients against eager's and, at its end, that no block is open
and that the engine hook is unset (stoker sets it only while a compiled backward runs).
`test_autograd_scope_nesting.py` runs them in-process too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import stoker_autograd

_hook = torch._C._dynamo.compiled_autograd


def _close(a: Any, b: Any) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _settled() -> None:
    assert not stoker_autograd.is_enabled(), "a block is still open"
    prior = _hook.set_autograd_compiler(None, False)
    assert prior[0] is None, f"the engine hook was left set: {prior}"


def case_fake_dynamic() -> None:
    """A backward inside a ``torch.compile``d function (Dynamo's own fake mode traced it,
    the inputs marked dynamic), under ``enable()``."""
    torch._dynamo.reset()
    b = 8
    x = torch.rand(b, 16)
    y = torch.rand(b, 16, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)

    def f() -> tuple[torch.Tensor, torch.Tensor]:
        y.grad = None
        out = x + y
        out.sum().backward()
        assert y.grad is not None
        return out, y.grad

    want = [t.detach().clone() for t in f()]
    with stoker_autograd.enable():
        got = torch.compile(f, backend="eager")()
    for g, w in zip(got, want, strict=True):
        _close(g, w)
    _settled()


def case_fake_mode_backward() -> None:
    """A backward run under a fake mode that is not stoker's (a tracer's): the eager
    engine runs it on the fakes; nothing is captured."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = stoker_autograd.stats()["captures"]
    with stoker_autograd.enable(), FakeTensorMode():
        w = torch.randn(5, 3, requires_grad=True)
        loss = (torch.randn(4, 5) @ w).tanh().sum()
        loss.backward()
        assert w.grad is not None and tuple(w.grad.shape) == (5, 3)
    assert stoker_autograd.stats()["captures"] == before
    _settled()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def case_nested() -> None:
    """Nested blocks (another config inside, a `disabled()` inside that), each backward
    against eager's; then blocks closed out of order: an error, and a consistent state."""
    m, ref = _mlp(), _mlp()
    x = torch.randn(3, 4)

    def step(model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    want = step(ref)
    with stoker_autograd.enable():
        for g, w in zip(step(m), want, strict=True):
            _close(g, w)
        with stoker_autograd.enable(dynamic=False):
            for g, w in zip(step(m), want, strict=True):
                _close(g, w)
            with stoker_autograd.disabled():
                before = stoker_autograd.stats()
                for g, w in zip(step(m), want, strict=True):
                    _close(g, w)
                assert stoker_autograd.stats() == before
        for g, w in zip(step(m), want, strict=True):
            _close(g, w)

    outer, inner = stoker_autograd.enable(), stoker_autograd.enable(dynamic=False)
    outer.__enter__()
    inner.__enter__()
    try:
        outer.__exit__(None, None, None)
    except RuntimeError as e:
        assert "closed before enable()" in str(e), e
    else:
        raise AssertionError("closing the outer block first did not raise")
    assert stoker_autograd.is_enabled()  # the inner block is still open, and works
    for g, w in zip(step(m), want, strict=True):
        _close(g, w)
    inner.__exit__(None, None, None)
    _settled()


def case_no_nested() -> None:
    """A custom backward that runs a backward of its own, inside a compiled backward:
    the inner one runs on the eager engine ("no nested compiled autograd")."""
    inner_grads: list[torch.Tensor] = []

    def unrelated_autograd_call() -> None:
        a = torch.randn(20, 20, requires_grad=True)
        b = torch.randn(20, 20, requires_grad=True)
        torch.matmul(a, b).sum().backward()
        assert a.grad is not None
        _close(a.grad, b.detach().sum(1).expand(20, 20))
        inner_grads.append(a.grad)

    class MyFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            unrelated_autograd_call()
            return g

    torch._dynamo.reset()
    x = torch.randn(10, 10, requires_grad=True)
    loss = MyFn.apply(x).sum()
    before = stoker_autograd.stats()["captures"]
    with stoker_autograd.enable():
        torch.compile(lambda: loss.backward(create_graph=True), backend="eager")()
    assert stoker_autograd.stats()["captures"] == before + 1  # the outer one only
    assert len(inner_grads) == 1
    assert x.grad is not None
    _close(x.grad, torch.ones(10, 10))
    _settled()


def _turning_on_backend(calls: list[str]) -> Callable[..., Any]:
    """A Dynamo backend that does what stoker's does at its first compile: set the
    default scope (and ask for the cache to be cleared)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        calls.append(gm.code)
        stoker_autograd.set_default()
        stoker_autograd.clear_cache()
        return gm.forward

    return backend


def case_compiled_fn_backward() -> None:
    """``.backward()`` inside a ``torch.compile``d function while ``enable()`` is active,
    with a backend that turns stoker on: Dynamo must not trace stoker's engine callbacks
    (which would call the backend, which changed the engine's cache mid-capture)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 4), nn.Sigmoid())
    x = torch.randn(2, 4)

    def call_backward(loss: torch.Tensor) -> None:
        loss.backward()

    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    calls: list[str] = []
    try:
        with stoker_autograd.enable():
            torch.compile(call_backward, backend=_turning_on_backend(calls))(model(x).sum())
        for p, w in zip(model.parameters(), want, strict=True):
            _close(p.grad, w)
        assert stoker_autograd.stats()["captures"] >= 1
    finally:
        stoker_autograd.clear_default()
    _settled()


def case_misuse() -> None:
    """off() that would close another block, off() without on(), an exception inside a
    block: each leaves the state as the blocks really are."""
    with stoker_autograd.enable():
        try:
            stoker_autograd.off()
        except RuntimeError as e:
            assert "would close enable()" in str(e), e
        else:
            raise AssertionError("off() closed an enable() block")
        assert stoker_autograd.is_enabled()
    try:
        stoker_autograd.off()
    except RuntimeError as e:
        assert "without a matching on()" in str(e), e
    else:
        raise AssertionError("off() without on() did not raise")
    try:
        with stoker_autograd.enable():
            _mlp()(torch.randn(2, 4)).sum().backward()
            raise KeyError("inside the block")
    except KeyError:
        pass
    s = stoker_autograd.on()
    assert isinstance(s, stoker_autograd.Session)
    stoker_autograd.off()
    _settled()


CASES: dict[str, Callable[[], None]] = {
    "fake_dynamic": case_fake_dynamic,
    "fake_mode": case_fake_mode_backward,
    "nested": case_nested,
    "no_nested": case_no_nested,
    "compiled_fn": case_compiled_fn_backward,
    "misuse": case_misuse,
}


if __name__ == "__main__":
    for name in sys.argv[1].split(","):
        CASES[name]()
        print(f"ok {name}", flush=True)
