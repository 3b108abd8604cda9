"""Registration with torch's engine hook, cache hygiene, fallbacks and errors."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import stoker_autograd

hook = torch._C._dynamo.compiled_autograd


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_on_off_restores_what_was_registered_before() -> None:
    def other_factory() -> Any:
        raise AssertionError("never called in this test")

    hook.set_autograd_compiler(other_factory, False)
    try:
        stoker_autograd.on()
        assert stoker_autograd.is_enabled()
        stoker_autograd.off()
        prior, prior_dynamic = hook.set_autograd_compiler(None, False)
        assert prior is other_factory and prior_dynamic is False
    finally:
        hook.set_autograd_compiler(None, False)
    with pytest.raises(RuntimeError, match="without a matching on"):
        stoker_autograd.off()


def test_another_config_clears_the_engine_cache_before_its_backward_with_a_reason() -> None:
    m = _mlp()
    with stoker_autograd.enable():
        m(torch.randn(3, 4)).sum().backward()
        assert not hook.is_cache_empty()
        with stoker_autograd.enable(dynamic=False):
            assert not hook.is_cache_empty()  # entering clears nothing
            m(torch.randn(3, 4)).sum().backward()  # compiled for another config: cleared
        assert not hook.is_cache_empty()  # leaving clears nothing either
        m(torch.randn(3, 4)).sum().backward()  # back to the first config: cleared again
    assert not stoker_autograd.is_enabled()
    assert stoker_autograd.stats()["captures"] == 3
    reasons = stoker_autograd.recapture_reasons()
    assert len(reasons) == 2, reasons
    # the second backward differs anyway (.grad is set now); the third is the second's
    assert ".grad None -> .grad set" in reasons[0], reasons
    assert "cache was cleared before it: compiled for another dynamic True -> False" in reasons[0]
    assert "cache was cleared (compiled for another dynamic False -> True)" in reasons[1]
    # the hook is set only while a compiled backward runs
    prior, _ = hook.set_autograd_compiler(None, False)
    assert prior is None


def test_disabled_block_runs_eager_and_keeps_the_cache() -> None:
    m = _mlp()
    with stoker_autograd.enable():
        m(torch.randn(3, 4)).sum().backward()
        with stoker_autograd.disabled():
            m(torch.randn(3, 4)).sum().backward()
        m.zero_grad()
        m(torch.randn(3, 4)).sum().backward()
    st = stoker_autograd.stats()
    # the eager backward in between neither captured nor replayed anything
    assert st["captures"] == 1 and st["cache_hits"] == 1, st
    assert st["eager_runs"] == 1 and st["compiles"] == 1, st


def test_compiler_failure_warns_once_and_gradients_stay_right() -> None:
    def broken(gm: Any, example_inputs: Any) -> Any:
        raise ValueError("boom")

    m = _mlp()
    x = torch.randn(3, 4)
    expected = torch.autograd.grad(m(x).sum(), list(m.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stoker_autograd.enable(compiler=broken):
            for _ in range(3):
                m.zero_grad()
                m(x).sum().backward()
                for p, e in zip(m.parameters(), expected):
                    torch.testing.assert_close(p.grad, e)
    msgs = [str(w.message) for w in caught if "stoker-autograd" in str(w.message)]
    assert len(msgs) == 1 and "boom" in msgs[0], msgs
    st = stoker_autograd.stats()
    assert st["eager_runs"] == 3 and st["fallbacks"] == 2 and st["compiles"] == 0, st


def test_custom_compiler_sees_only_aten_segments() -> None:
    seen: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(gm)
        return gm

    m = _mlp()
    for p in m.parameters():
        p.register_hook(lambda g: g * 2)
    x = torch.randn(3, 4)
    expected = torch.autograd.grad(m(x).sum(), list(m.parameters()))
    with stoker_autograd.enable(compiler=record):
        for _ in range(3):
            m.zero_grad()
            m(x).sum().backward()
            for p, e in zip(m.parameters(), expected):
                torch.testing.assert_close(p.grad, e)
    assert seen
    for gm in seen:
        for n in gm.graph.nodes:
            if n.op == "call_function":
                assert isinstance(n.target, torch._ops.OpOverload) or n.target.__module__ in (
                    "_operator",
                    "operator",
                ), n.format_node()


def test_hook_returning_wrong_size_is_an_error_not_a_wrong_gradient() -> None:
    m = _mlp()
    m[2].weight.register_hook(lambda g: g[:1])
    with stoker_autograd.enable(), pytest.raises(RuntimeError):
        for _ in range(2):
            m.zero_grad()
            m(torch.randn(3, 4)).sum().backward()


def test_create_graph_backward_is_differentiable() -> None:
    """create_graph=True: the captured graph is differentiable in eager order too."""
    x = torch.randn(5, requires_grad=True)
    with stoker_autograd.enable():
        y = (x**3).sum()
        (gx,) = torch.autograd.grad(y, [x], create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), [x])
    torch.testing.assert_close(ggx, 6 * x.detach())


def test_hook_that_runs_its_own_backward() -> None:
    """A hook calling backward runs it on the eager engine (the hook is off meanwhile)."""
    m = _mlp()
    x = torch.randn(3, 4)
    expected = torch.autograd.grad(m(x).sum(), list(m.parameters()))
    side: list[torch.Tensor] = []

    def hook(g: torch.Tensor) -> torch.Tensor:
        z = torch.arange(3.0, requires_grad=True)
        with torch.enable_grad():
            (z * z).sum().backward()
        assert z.grad is not None
        side.append(z.grad.clone())
        return g

    with stoker_autograd.enable():
        for _ in range(3):
            m.zero_grad()
            h = m(x)
            h.register_hook(hook)
            h.sum().backward()
            for p, e in zip(m.parameters(), expected):
                torch.testing.assert_close(p.grad, e)
    assert len(side) == 3 and all(torch.equal(s, torch.arange(3.0) * 2) for s in side)
    assert stoker_autograd.stats()["captures"] == 1


def test_queue_callback_runs_at_the_end_of_a_compiled_backward() -> None:
    """Callbacks a hook queues run once, after every gradient is accumulated, also the
    ones a callback queues and those of a nested eager backward (FSDP2's root
    post-backward and DDP's finalisation are such callbacks)."""
    engine = torch.autograd.variable.Variable._execution_engine
    m = _mlp()
    x = torch.randn(3, 4)
    events: list[str] = []

    def last() -> None:
        events.append("chained")

    def callback() -> None:
        events.append("callback" if all(p.grad is not None for p in m.parameters()) else "early")
        torch.autograd.variable.Variable._execution_engine.queue_callback(last)

    def hook(g: torch.Tensor) -> torch.Tensor:
        torch.autograd.variable.Variable._execution_engine.queue_callback(callback)
        z = torch.ones(2, requires_grad=True)
        z.register_hook(lambda gz: engine.queue_callback(lambda: events.append("nested")) or gz)
        with torch.enable_grad():
            (z * 2).sum().backward()
        return g

    with stoker_autograd.enable():
        for step in range(2):
            m.zero_grad(set_to_none=True)
            h = m(x)
            h.register_hook(hook)
            h.sum().backward()
            assert events == ["nested", "callback", "chained"], (step, events)
            events.clear()
    assert torch.autograd.variable.Variable._execution_engine is engine
    assert stoker_autograd.stats()["captures"] == 1


def test_on_backward_start_runs_before_each_compiled_backward_and_cuts_nothing() -> None:
    """Called once per compiled backward, in its graph task, before any gradient is
    accumulated; a callback it queues runs at the graph's end; no segment added."""
    m = _mlp()
    x = torch.randn(3, 4)
    events: list[tuple[str, bool]] = []

    def start() -> None:
        task = torch._C._current_graph_task_id()
        events.append(("start", task != -1 and all(p.grad is None for p in m.parameters())))
        torch.autograd.variable.Variable._execution_engine.queue_callback(
            lambda: events.append(("end", all(p.grad is not None for p in m.parameters())))
        )

    handle = stoker_autograd.on_backward_start(start)
    try:
        with stoker_autograd.enable(compiler=lambda gm, ex: gm):
            for _ in range(3):
                m.zero_grad(set_to_none=True)
                m(x).sum().backward()
                assert events == [("start", True), ("end", True)], events
                events.clear()
            handle.remove()
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        assert events == []
    finally:
        handle.remove()
    st = stoker_autograd.stats()
    assert st["captures"] == 1 and st["segments"] == st["compiles"] == 1


def test_skip_compile_leaves_the_graph_uncompiled_until_it_is_replayed() -> None:
    """A hook that asks `skip_compile` in the first run: nothing is compiled after it;
    the graph replayed anyway runs uncompiled once more and is compiled then."""
    m = _mlp()
    x = torch.randn(3, 4)
    expected = torch.autograd.grad(m(x).sum(), list(m.parameters()))
    skip = [True]

    def hook(p: torch.Tensor) -> None:
        if skip[0]:
            stoker_autograd.skip_compile()

    m[0].weight.register_post_accumulate_grad_hook(hook)
    counts = []
    with stoker_autograd.enable(compiler=lambda gm, ex: gm):
        for _ in range(3):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
            for p, e in zip(m.parameters(), expected, strict=True):
                torch.testing.assert_close(p.grad, e)
            st = stoker_autograd.stats()
            counts.append((st["captures"], st["eager_runs"], st["compiles"]))
            skip[0] = False
    assert counts == [(1, 1, 0), (1, 2, 1), (1, 2, 1)]
