"""Compiled autograd stays in the scope the user chose.

A model stoker compiled (``torch.compile(backend="stoker")`` or ``stoker.compile``) has
its backward captured and compiled by stoker-autograd; an uncompiled model trained
beside it keeps the plain eager engine: no capture, no ``[stoker.autograd]`` line,
eager's gradients bit for bit and its hooks in eager's order.  ``autograd_enabled(True)``
widens the scope to every backward in the block, ``(False)`` pauses it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

import stoker
import stoker_autograd
from stoker_capture._internal.runtime import function as runtime_fn


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    stoker.reset()
    stoker.set_logs("autograd")
    yield
    stoker.set_logs("")
    stoker.reset()


def _hooked(model: nn.Module, log: list[str]) -> list[Any]:
    """Record the order of a tensor hook and a post-accumulate-grad hook on every
    parameter and a full backward hook on the module."""
    handles: list[Any] = []
    for name, p in model.named_parameters():
        handles.append(p.register_hook(lambda g, n=name: log.append(f"tensor {n}")))
        handles.append(
            p.register_post_accumulate_grad_hook(lambda t, n=name: log.append(f"acc {n}"))
        )
    handles.append(model.register_full_backward_hook(lambda *a: log.append("module")))
    return handles


def _eager_reference(
    model: nn.Module, xs: list[torch.Tensor]
) -> tuple[list[list[torch.Tensor]], list[str]]:
    """Gradients and hook order of ``model`` trained on ``xs`` with nothing of stoker on."""
    assert not stoker_autograd.is_enabled()
    log: list[str] = []
    handles = _hooked(model, log)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x in xs:
        opt.zero_grad()
        model(x.detach().requires_grad_()).pow(2).sum().backward()  # (the module hook fires)
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        opt.step()
    for h in handles:
        h.remove()
    return grads, log


def _compiled(kind: str, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    if kind == "torch.compile":
        return torch.compile(model, backend="stoker")  # type: ignore[return-value]
    return stoker.compile(model)


@pytest.mark.parametrize("kind", ["torch.compile", "stoker.compile"])
def test_an_uncompiled_model_beside_a_compiled_one_keeps_the_eager_engine(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 3))
    big = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    xs = [torch.randn(4, 3) for _ in range(4)]
    want, want_order = _eager_reference(copy.deepcopy(plain), xs)
    big_ref = copy.deepcopy(big)

    compiled = _compiled(kind, big)
    opt_c = torch.optim.SGD(big.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(big_ref.parameters(), lr=0.1)
    log: list[str] = []
    _hooked(plain, log)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    capsys.readouterr()
    for step, x in enumerate(xs):
        opt_c.zero_grad()
        loss_c = compiled(x).pow(2).sum()
        loss_c.backward()
        assert "[stoker.autograd]" in capsys.readouterr().err or step > 0
        # its backward ran: no stoker node left to backward (the router's O(1) check)
        assert runtime_fn.LIVE[0] == 0
        pending = None
        if step % 2:  # a compiled forward not backwarded yet: the router walks the graph
            pending = compiled(x).sum()
            assert runtime_fn.LIVE[0] > 0
        before = stoker_autograd.stats()
        opt.zero_grad()
        plain(x.detach().requires_grad_()).pow(2).sum().backward()
        assert stoker_autograd.stats() == before  # no capture, no replay, no compile
        del pending, loss_c
        assert "[stoker.autograd]" not in capsys.readouterr().err
        for p, g in zip(plain.parameters(), want[step], strict=True):
            assert torch.equal(p.grad, g)  # type: ignore[arg-type]
        opt.step()
        # the compiled model is still compiled, and right
        opt_r.zero_grad()
        big_ref(x).pow(2).sum().backward()
        for pc, pr in zip(big.parameters(), big_ref.parameters(), strict=True):
            torch.testing.assert_close(pc.grad, pr.grad, rtol=1e-5, atol=1e-6)
        opt_c.step()
        opt_r.step()
    assert log == want_order
    st = stoker_autograd.stats()
    assert st["captures"] >= 1 and st["cache_hits"] >= 1, st

    # opting in captures the eager model too
    with stoker.autograd_enabled(True):
        plain(xs[0].detach().requires_grad_()).pow(2).sum().backward()
    assert stoker_autograd.stats()["captures"] == st["captures"] + 1


def test_autograd_enabled_false_pauses_a_compiled_model_and_true_shares_its_graphs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    compiled = stoker.compile(model)
    x = torch.randn(4, 3)
    for _ in range(2):
        compiled(x).sum().backward()
    st = stoker_autograd.stats()
    with stoker.autograd_enabled(False):
        compiled(x).sum().backward()  # the AOT backward, on the eager engine
    assert stoker_autograd.stats() == st
    with stoker.autograd_enabled(True):  # the default's compiler: its cached graph replays
        compiled(x).sum().backward()
    after = stoker_autograd.stats()
    assert after["captures"] == st["captures"], after
    assert after["cache_hits"] == st["cache_hits"] + 1, after
    for _ in range(4):
        ref(x).sum().backward()
    for pc, pr in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pr.grad, rtol=1e-5, atol=1e-6)


def test_reset_inside_an_autograd_enabled_block_leaves_the_block_working() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    compiled = stoker.compile(model)
    x = torch.randn(5, 3)
    with stoker.autograd_enabled(True):
        compiled(x).sum().backward()
        stoker.reset()  # the default scope is gone, the block is not
        assert stoker_autograd.default_session() is None
        assert stoker_autograd.is_enabled()
        st = stoker_autograd.stats()
        compiled(x).sum().backward()  # compiled again (reset cleared Dynamo's cache too)
        assert stoker_autograd.stats()["captures"] == st["captures"] + 1
    assert stoker_autograd.default_session() is not None  # the backend turned it on again
    prior, _ = torch._C._dynamo.compiled_autograd.set_autograd_compiler(None, False)
    assert prior is None  # the hook is never left set
    for _ in range(2):
        ref(x).sum().backward()
    for pc, pr in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pr.grad, rtol=1e-5, atol=1e-6)


def test_backward_inside_a_function_the_stoker_backend_compiles_under_enable() -> None:
    """``.backward()`` in a ``torch.compile(fn, backend="stoker")`` while
    ``stoker_autograd.enable()`` is active: it runs in a Dynamo graph break, where stoker's
    engine callbacks must not be traced (compiling one with the stoker backend turned
    compiled autograd on again mid-capture, which freed the engine's cache entry being
    filled: ``vector::reserve`` / ``idx == result_len`` assertion)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 4), nn.Sigmoid())
    x = torch.randn(2, 4)

    def call_backward(loss: torch.Tensor) -> None:
        loss.backward()

    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    with stoker_autograd.enable():
        torch.compile(call_backward, backend="stoker")(model(x).sum())
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-6)
    assert stoker_autograd.stats()["captures"] == 1
    prior, _ = torch._C._dynamo.compiled_autograd.set_autograd_compiler(None, False)
    assert prior is None
