"""The prepare stage's per-node decompositions: one trace per (op, input metadata), inlined
into every node that matches, with the same results as eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import check

from stoker_triton._internal import pipeline

aten = torch.ops.aten


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every decomposition `decompose` traces (the op's node target is not passed: the
    decomposition function is recorded)."""
    seen: list[Any] = []
    real = pipeline._trace_decomposition

    def counting(decomp: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(decomp)
        return real(decomp, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_trace_decomposition", counting)
    return seen


def test_layers_with_the_same_metadata_share_one_trace(traces: list[Any]) -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for _ in range(3):  # three layer norms on the same sizes: one trace
            x = F.layer_norm(x, (8,), w, b) * 2 + 1
        return F.layer_norm(x[:, :4], (4,), w[:4], b[:4])  # other sizes: a trace of its own

    check(f, torch.randn(5, 8), torch.randn(8), torch.randn(8))
    assert len(traces) == 2, traces


def test_one_value_object_at_two_positions_is_traced_as_two_inputs(traces: list[Any]) -> None:
    # The layer norms of p and q share a trace, so their inlined outputs w and b share
    # one fake value object; layer_norm(x, w, b) must still read w and b, not b twice.
    def f(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> Any:
        w = F.layer_norm(p, (8,))
        b = F.layer_norm(q, (8,))
        return (
            F.layer_norm(x, (8,), w, b),
            F.layer_norm(x, (8,), b, w),
            F.layer_norm(x, (8,), w, w),
        )

    check(f, torch.randn(4, 8), torch.randn(8), torch.randn(8))
    # p and q: one trace; (w, b) and (b, w): one; (w, w), one input twice: its own
    assert len(traces) == 3, traces
