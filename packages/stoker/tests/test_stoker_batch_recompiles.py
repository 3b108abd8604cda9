"""A new batch size costs stoker-autograd one backward recompile, then none
(docs/autograd.md), through ``stoker.compile`` on the zoo models; grads match eager."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import stoker
import stoker_autograd
from stoker._internal.bench.models import get_model

CONFIGS: dict[str, dict[str, Any]] = {"gpt": {"block_size": 8}, "mlp": {}}


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    stoker.reset()
    yield
    stoker.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batches_3_5_7_9_compile_the_backward_once_more_then_never(name: str) -> None:
    """The GPT's batches are slices (``seq[:, :-1]``); its backward used to recompile
    at every new batch size (``batch x T`` guarded as a constant)."""
    spec = get_model(name)
    eager = spec.build(**CONFIGS[name])
    model = copy.deepcopy(eager)
    compiled = stoker.compile(model)
    gen = torch.Generator().manual_seed(0)
    after: list[dict[str, int]] = []
    for n in (3, 5, 7, 9):
        inputs, target = spec.batch(n, gen, **CONFIGS[name])
        for m, fn in ((eager, eager), (model, compiled)):
            m.zero_grad()
            spec.loss(fn(*inputs), target).backward()
        for pe, pc in zip(eager.parameters(), model.parameters(), strict=True):
            assert pe.grad is not None and pc.grad is not None
            torch.testing.assert_close(pc.grad, pe.grad, atol=1e-5, rtol=1e-4)
        after.append(dict(stoker_autograd.stats()))
    end = after[-1]
    assert end["fallbacks"] == 0, end
    # Per captured backward: one static compile, one symbolic recompile, then none.
    assert end["compiles"] <= 2 * end["captures"], after
    assert end["recompiles"] <= end["captures"], after
    assert end == {**after[2], "cache_hits": end["cache_hits"]}, after  # batch 9: nothing new


@pytest.mark.slow
def test_gpt_batch_and_sequence_length_varying_together_stay_compiled() -> None:
    """Static (sliced) ids next to symbolic activations made the retrace fail on a
    ``batch x T`` view ("tgt_bound ... not a subset of src_bound") and fall back."""
    spec = get_model("gpt")
    eager = spec.build(block_size=16, n_layer=1, n_embd=32)
    model = copy.deepcopy(eager)
    compiled = stoker.compile(model)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        for b, t in ((3, 4), (3, 6), (5, 8), (7, 10)):
            seq = torch.randint(0, 65, (b, t + 1), generator=gen)
            for m, fn in ((eager, eager), (model, compiled)):
                m.zero_grad()
                spec.loss(fn(seq[:, :-1]), seq[:, 1:]).backward()
            for pe, pc in zip(eager.parameters(), model.parameters(), strict=True):
                assert pe.grad is not None and pc.grad is not None
                torch.testing.assert_close(pc.grad, pe.grad, atol=1e-5, rtol=1e-4)
    st = stoker_autograd.stats()
    assert st["fallbacks"] == 0 and st["recompiles"] <= st["captures"], st


@pytest.mark.slow
@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic", "automatic"])
def test_gpt_batch_varying_at_length_10_keeps_the_backward_compiled(how: str) -> None:
    """The backward views the gradient of the head's ``batch x 10`` rows back to
    ``(batch, 10, C)``: the retrace solves ``rows == 10*batch``, which failed while a Dim
    without max was bounded by 2**62 (``tgt_bound=VR[20, 4611686018427388160] not a subset
    of src_bound=...``) and the backward fell back to eager, whatever Dynamo's forward
    was told (``dynamic=True``, ``mark_dynamic`` with a range, automatic)."""
    spec = get_model("gpt")
    eager = spec.build(block_size=16, n_layer=1, n_embd=32)
    model = copy.deepcopy(eager)
    compiled = stoker.compile(model, dynamic=True if how == "dynamic=True" else None)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        for b in (2, 3, 5, 4):
            seq = torch.randint(0, 65, (b, 11), generator=gen)
            ids = seq[:, :-1]
            if how == "mark_dynamic":
                ids = ids.clone()
                torch._dynamo.mark_dynamic(ids, 0, min=2, max=64)
            eager.zero_grad()
            model.zero_grad()
            with stoker.autograd_enabled(False):  # the eager engine
                spec.loss(eager(ids), seq[:, 1:]).backward()
            spec.loss(compiled(ids), seq[:, 1:]).backward()
            for pe, pc in zip(eager.parameters(), model.parameters(), strict=True):
                assert pe.grad is not None and pc.grad is not None
                torch.testing.assert_close(pc.grad, pe.grad, atol=1e-5, rtol=1e-4)
    st = stoker_autograd.stats()
    # a symbolic forward from the start: one capture, whose backward compiles once, with
    # the sizes the forward held symbolic symbolic (before: static, then again symbolic).
    # Automatic: Dynamo's forward recompiles at batch 3 (another AOT Function: another
    # capture); each capture's backward compiles once, as its forward (static, symbolic)
    want = (2, 2, 0, 2) if how == "automatic" else (1, 1, 0, 3)
    got = tuple(st[k] for k in ("captures", "compiles", "recompiles", "cache_hits"))
    assert got == want and st["fallbacks"] == 0, st
