"""Behaviours that PyTorch's own compiled-autograd tests check, kept here for CI.

PyTorch's ``test/inductor/test_compiled_autograd.py`` runs against stoker-autograd
through ``tools/torch_ca_tests.py`` (docs/autograd.md, "PyTorch's compiled-autograd
tests"); that file is not in this repository.  What it found is pinned here: a C++
``autograd::Function`` whose backward may not be traced stays a call in a compiled
backward (it made the whole graph fall back to the eager computation), and where
stoker does what eager does instead of what torch's compiled autograd does (anomaly
mode with a NaN ``.grad`` already set, a graph break in a custom backward that queued
a callback, dispatch and torch-function modes), eager is the reference.
"""

from __future__ import annotations

import functools
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import stoker_autograd
from stoker_autograd._internal import ops


@functools.cache
def _non_traceable_op() -> Any:
    """``stoker_test_cpp.non_traceable_scale``: ``x * w * 2`` through a C++
    ``autograd::Function`` (is_traceable false).  Built once per machine (torch keeps the
    build in its extensions directory and rebuilds only when the source changes)."""
    from torch.utils.cpp_extension import load

    load(
        name="stoker_test_cpp_non_traceable",
        sources=[str(Path(__file__).parent / "cpp" / "non_traceable.cpp")],
        is_python_module=False,
        extra_cflags=["-O0"],
    )
    return torch.ops.stoker_test_cpp.non_traceable_scale


def _needs_a_cpp_toolchain() -> None:
    from torch.utils.cpp_extension import is_ninja_available

    if shutil.which("c++") is None or not is_ninja_available():
        pytest.skip("building the C++ autograd::Function needs a C++ compiler and ninja")


@pytest.mark.slow
def test_a_cpp_function_that_may_not_be_traced_stays_a_call_in_a_compiled_backward() -> None:
    """The retrace re-emits the C++ node as a call with a size check after it (its
    outputs take the sizes of the engine's ``validate_outputs`` that follows), so the
    graph compiles, also with symbolic sizes, and a compiler gets only the aten runs
    around the call.  Before, the retrace refused it and the whole graph ran
    uncompiled with a warning."""
    _needs_a_cpp_toolchain()
    op = _non_traceable_op()
    seen: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(gm)
        return gm

    torch.manual_seed(0)
    w = torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "runs uncompiled" fallback
        for n in (4, 4, 6, 8, 5):
            x = torch.randn(n, 3, requires_grad=True)
            ref = x.detach().clone().requires_grad_(True)
            (op(ref, w).sin() * ref).sum().backward()
            with stoker_autograd.enable(compiler=record):
                (op(x, w).sin() * x).sum().backward()
            assert x.grad is not None and ref.grad is not None
            torch.testing.assert_close(x.grad, ref.grad)
    stats = stoker_autograd.stats()
    assert stats["fallbacks"] == 0, stats
    assert stats["compiles"] == 2 and stats["recompiles"] == 1, stats  # static, then symbolic
    assert stats["captures"] == 1, stats
    assert seen
    for gm in seen:  # the C++ backward is never inside a compiled segment
        for node in gm.graph.nodes:
            assert not isinstance(node.target, ops.BoundBackward), node.format_node()


def test_anomaly_mode_with_a_nan_grad_already_set_runs_as_eager() -> None:
    """Eager checks what autograd nodes return, not what ``.grad`` held before: a NaN
    ``.grad`` accumulates without an error (torch's compiled autograd refuses it:
    "already having NaN gradient. This is not supported.")."""

    def run(compiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        a = torch.randn(5, 5, requires_grad=True)
        a.grad = torch.full((5, 5), float("nan"))
        a.grad[0, 0] = 1.0
        b = torch.randn(5, 5)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Aa]nomaly.*")
            with torch.autograd.detect_anomaly():
                loss = torch.matmul(a, b).sum()
                if compiled:
                    with stoker_autograd.enable():
                        loss.backward()
                else:
                    loss.backward()
        assert a.grad is not None
        return a.grad

    torch.testing.assert_close(run(True), run(False), equal_nan=True)


def test_a_custom_backward_that_queues_a_callback_and_breaks_dynamos_graph() -> None:
    """``torch._dynamo.graph_break()`` in a custom backward is an ordinary call under
    stoker (its backward runs as Python, never traced by Dynamo): the callback it
    queued runs once, at the backward's end, as in eager (torch's compiled autograd
    raises unless its Dynamo graph is whole)."""
    called: list[str] = []

    class QueuesACallback(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 3

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: called.append("end"))
            torch._dynamo.graph_break()
            return grad * 3

    a = torch.rand(3, 3, requires_grad=True)
    with stoker_autograd.enable():
        for step in range(2):
            a.grad = None
            QueuesACallback.apply(a.sin()).sum().backward()
            assert called == ["end"] * (step + 1)
            assert a.grad is not None
            torch.testing.assert_close(a.grad, 3 * a.detach().cos())
    assert stoker_autograd.stats()["captures"] == 1


class _Loss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(out)
        return out.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        (saved,) = ctx.saved_tensors
        return torch.ones_like(saved) * grad_output


def _calls_under(mode_cls: type, compiled: bool) -> tuple[list[str], torch.Tensor]:
    """The functions (a torch-function mode) or ops (a dispatch mode) one backward
    calls, and the gradient."""
    calls: list[str] = []

    class Logging(mode_cls):  # type: ignore[misc, valid-type]
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            calls.append(str(func.__name__))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    x = torch.randn(2, 2, requires_grad=True)
    y, z = torch.randn(2, 2), torch.randn(2, 2)
    with Logging():
        loss = _Loss.apply(x * y * z)
        calls.clear()
        if compiled:
            with stoker_autograd.enable():
                loss.backward()
        else:
            loss.backward()
    assert x.grad is not None
    return calls, x.grad


@pytest.mark.parametrize(
    "mode", [TorchFunctionMode, TorchDispatchMode], ids=["function", "dispatch"]
)
def test_a_backward_under_a_mode_calls_what_eager_calls(mode: type) -> None:
    """Under a dispatch mode the backward runs on the eager engine (the engine's
    compiled path refuses modes): the mode sees eager's ops.  A torch-function mode
    sees the one ``backward`` call, as in eager (torch's compiled autograd adds its
    own ``_set_multithreading_enabled`` calls around it)."""
    eager_calls, eager_grad = _calls_under(mode, compiled=False)
    calls, grad = _calls_under(mode, compiled=True)
    assert calls == eager_calls
    assert calls  # the mode saw the backward at all
    torch.testing.assert_close(grad, eager_grad)


def test_double_backward_through_a_torch_compiled_forward_raises_eagers_error() -> None:
    """A ``create_graph`` backward through a forward ``torch.compile`` compiled with an
    AOT backend leaves torch's double-backward stub in the graph, whose
    ``_compiled_autograd_key`` cannot be read (its ctx has no ``symints``); the engine
    asks for it before anything runs.  That backward runs on the eager engine, which
    raises eager's error (before: an ``AttributeError`` from the engine's cache
    lookup)."""

    def second_grad(compiled: bool) -> str:
        torch._dynamo.reset()
        x = torch.tensor(2.0, requires_grad=True)
        f = torch.compile(lambda t: t**3, backend="aot_eager")
        ctx = stoker_autograd.enable() if compiled else torch.enable_grad()
        with ctx:
            (first,) = torch.autograd.grad(f(x), x, create_graph=True)
            torch.testing.assert_close(first, torch.tensor(12.0))  # 3 x^2
            with pytest.raises(RuntimeError) as error:
                torch.autograd.grad(first, x, create_graph=True)
        return str(error.value)

    eager = second_grad(False)
    assert "does not currently support double backward" in eager
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert second_grad(True) == eager
