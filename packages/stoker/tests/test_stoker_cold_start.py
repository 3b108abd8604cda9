"""What a cold first step compiles (the target: a cold first step <= 0.5x Inductor's).

With compiled autograd on (`stoker.compile`'s default), the first ``backward()``
inlines stoker-capture's AOT backward *graph* into the graph it captures and
compiles that: the AOT backward's own compiled version was built at lowering
time and never launched (gpt-m: 47 kernels lowered, generated, loaded and
compiled by the workers for nothing).  It is now compiled at its first call,
which only a backward outside compiled autograd makes, with static sizes and
symbolic ones alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import stoker
from stoker._internal.api import backend


@pytest.fixture
def aot_compiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[str]]:
    """The graphs stoker-capture hands the backend's compiler: "forward" / "backward"."""
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))  # cold: nothing from disk
    seen: list[str] = []
    call = backend._RecordingCompiler.__call__

    def counted(self: Any, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(backend._stage_of(gm))
        return call(self, gm, example_inputs)

    monkeypatch.setattr(backend._RecordingCompiler, "__call__", counted)
    stoker.reset()
    yield seen
    stoker.reset()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 3)
    )


def _train(compiled_autograd: bool, dynamic: bool | None, sizes: list[int]) -> None:
    m, ref = _model(), _model()
    c = stoker.compile(m, compiled_autograd=compiled_autograd, dynamic=dynamic)
    for n in sizes:  # fresh inputs each step; gradients against eager's
        x = torch.randn(n, 6)
        m.zero_grad()
        ref.zero_grad()
        out = c(x)
        torch.testing.assert_close(out, ref(x))
        (out * out).sum().backward()
        (ref(x) ** 2).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def _kinds(seen: list[str]) -> list[str]:
    return ["backward" if "backward" in s else "forward" for s in seen]


def test_compiled_autograd_compiles_no_aot_backward(aot_compiles: list[str]) -> None:
    _train(compiled_autograd=True, dynamic=None, sizes=[4, 4, 4])
    assert _kinds(aot_compiles) == ["forward"], aot_compiles


def test_without_compiled_autograd_the_backward_compiles_at_lowering(
    aot_compiles: list[str],
) -> None:
    _train(compiled_autograd=False, dynamic=None, sizes=[4, 4])
    assert _kinds(aot_compiles) == ["forward", "backward"], aot_compiles


def test_a_backward_outside_compiled_autograd_compiles_it_at_its_first_call(
    aot_compiles: list[str],
) -> None:
    m, ref = _model(), _model()
    c = stoker.compile(m)
    x = torch.randn(4, 6)
    assert _kinds(aot_compiles) == []
    with stoker.autograd_enabled(False):  # the engine calls the AOT backward itself
        c(x).sum().backward()
    assert _kinds(aot_compiles) == ["forward", "backward"], aot_compiles
    ref(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_dynamic_shapes_compile_no_aot_backward_either(aot_compiles: list[str]) -> None:
    """Symbolic sizes (``dynamic=True``, or automatic dynamic's recompile at a second
    size) defer the AOT backward too: a new sequence length every step paid a third of
    its one recompile building the AOT backward's kernels for nothing."""
    _train(compiled_autograd=True, dynamic=True, sizes=[4, 5])
    assert _kinds(aot_compiles) == ["forward"], aot_compiles
    aot_compiles.clear()
    _train(compiled_autograd=True, dynamic=None, sizes=[4, 5, 7])
    assert _kinds(aot_compiles) == ["forward", "forward"], aot_compiles


def test_a_dynamic_backward_outside_compiled_autograd_compiles_at_its_first_call(
    aot_compiles: list[str],
) -> None:
    """The late compile of a symbolic backward: compiled (no new guard needed) or, where
    it would need one, run uncompiled with a warning; either way eager's gradients."""
    m, ref = _model(), _model()
    c = stoker.compile(m, dynamic=True)
    for n in (4, 5, 7):
        x = torch.randn(n, 6)
        m.zero_grad()
        ref.zero_grad()
        with stoker.autograd_enabled(False):  # the engine calls the AOT backward itself
            (c(x) ** 2).sum().backward()
        (ref(x) ** 2).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert _kinds(aot_compiles) == ["forward", "backward"], aot_compiles
