"""End to end: training through stoker matches eager PyTorch, step by step.

Paths: `stoker.compile` (aten executor), ``torch.compile(backend="stoker")``
and, at tiny sizes, `stoker.compile(backend="interpret")` (Triton kernels under
the interpreter).  Also: varying batch sizes recompile at most once, and the
backward really runs through stoker-autograd (its counters move).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import stoker
import stoker_autograd


def _stats() -> dict[str, int]:
    return dict(stoker_autograd.stats())


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_stoker_compile_matches_eager(name: str, train_and_compare: Callable[..., Any]) -> None:
    before = _stats()
    compiled = train_and_compare(name, lambda m: stoker.compile(m, backend="aten"))
    after = _stats()
    rep = compiled.stoker_report
    assert rep.n_graphs >= 1 and all(c.error is None for c in rep.compiles)
    assert all(c.executor == "aten" for c in rep.compiles)
    # backward went through stoker-autograd: one capture, then replays from its cache
    assert after["captures"] > before["captures"], (before, after)
    assert after["captures"] + after["cache_hits"] - before["captures"] - before["cache_hits"] >= 3


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_torch_compile_backend_stoker_matches_eager(
    name: str, train_and_compare: Callable[..., Any]
) -> None:
    before = _stats()
    train_and_compare(name, lambda m: torch.compile(m, backend="stoker"))
    assert stoker.backend.report.n_graphs >= 1
    assert _stats()["captures"] > before["captures"], (
        "backend='stoker' did not engage stoker-autograd"
    )


def test_compiled_autograd_can_be_switched_off(train_and_compare: Callable[..., Any]) -> None:
    before = _stats()
    train_and_compare("mlp", lambda m: stoker.compile(m, compiled_autograd=False))
    after = _stats()
    assert after["captures"] == before["captures"] and after["cache_hits"] == before["cache_hits"]


def test_varying_batch_recompiles_at_most_once(train_and_compare: Callable[..., Any]) -> None:
    compiled = train_and_compare("mlp", lambda m: stoker.compile(m), batch_sizes=(4, 8, 6, 10, 3))
    rep = compiled.stoker_report
    assert len(rep.recompiles) <= 1, [r.reason for r in rep.recompiles]
    assert rep.n_graphs <= 2, [c.frame for c in rep.compiles]
    if rep.recompiles:  # automatic dynamic: the recompile says which size changed
        assert "size" in rep.recompiles[0].reason


def test_dynamic_true_compiles_once(train_and_compare: Callable[..., Any]) -> None:
    compiled = train_and_compare(
        "gpt", lambda m: stoker.compile(m, dynamic=True), batch_sizes=(2, 5, 3)
    )
    rep = compiled.stoker_report
    assert rep.n_graphs == 1 and not rep.recompiles
    shape_guards = [g for c in rep.compiles for g in c.guards if g.kind.startswith("shape")]
    assert shape_guards, "a dynamic batch should leave shape guards in the report"


def test_interpret_backend_tiny_mlp(train_and_compare: Callable[..., Any]) -> None:
    """Triton kernels under the interpreter, at tiny sizes (needs stoker_triton.compile_graph)."""
    import stoker_triton

    assert hasattr(stoker_triton, "compile_graph"), "stoker-triton has no compile_graph yet"
    build = {"d_in": 8, "hidden": 16, "d_out": 4, "depth": 1}
    compiled = train_and_compare(
        "mlp",
        lambda m: stoker.compile(m, backend="interpret"),
        batch_sizes=(4, 4),
        build=build,
        rtol=1e-4,
        atol=1e-5,
    )
    rep = compiled.stoker_report
    assert all(c.executor == "interpret" for c in rep.compiles)
    assert rep.n_kernels >= 1, "no Triton kernels were recorded"
