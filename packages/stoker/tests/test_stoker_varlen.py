"""A new sequence length every step (padding-free batches): ``stoker.compile``'s default
(automatic dynamic) compiles the forward and compiled autograd's backward once static,
once more symbolic at the second length, and never after; each step's loss and
gradients match eager's (docs/benchmarks.md, "A new sequence length every step")."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

import stoker
import stoker_autograd
from stoker._internal.bench.models import GPT, GPTConfig, lm_loss

LENGTHS = (5, 7, 9, 11, 13, 7)  # five new lengths, then one seen before


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    stoker.reset()
    yield
    stoker.reset()


def _counts(compiled: torch.nn.Module) -> tuple[int, int, int]:
    """(forward graphs, backward captures, backward graphs compiled) so far; a backward
    graph another test of this process left in the warm-start cache is loaded instead
    of compiled (a disk hit), which counts the same here."""
    st = stoker_autograd.stats()
    return len(compiled.stoker_report.compiles), st["captures"], st["compiles"] + st["disk_hits"]


@pytest.mark.parametrize(
    "backend", ["aten", pytest.param("c", marks=pytest.mark.slow)]
)  # c: two cold C builds of the kernels, about ten seconds
def test_new_length_every_step_compiles_at_the_first_two_then_never(backend: str) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=32, n_layer=1, n_head=2, n_embd=16)
    eager = GPT(cfg)
    model = copy.deepcopy(eager)
    compiled = stoker.compile(model, backend=backend)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    gen = torch.Generator().manual_seed(0)
    after: list[tuple[int, int, int]] = []
    for t in LENGTHS:
        seq = torch.randint(0, cfg.vocab_size, (3, t + 1), generator=gen)
        losses = []
        for m, fn, opt in ((eager, eager, opts[0]), (model, compiled, opts[1])):
            opt.zero_grad(set_to_none=True)
            with stoker.autograd_enabled(m is model):
                loss = lm_loss(fn(seq[:, :-1]), seq[:, 1:])
                loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
        for (name, pe), pc in zip(eager.named_parameters(), model.parameters(), strict=True):
            assert pe.grad is not None and pc.grad is not None, name
            torch.testing.assert_close(pc.grad, pe.grad, atol=1e-5, rtol=1e-4, msg=name)
        for opt in opts:
            opt.step()
        after.append(_counts(compiled))
    # static at the first length, symbolic at the second, nothing after
    assert after[0] == (1, 1, 1), after
    assert after[1] == (2, 2, 2), after
    assert all(a == after[1] for a in after[2:]), after
    st = stoker_autograd.stats()
    assert st["fallbacks"] == 0 and st["recompiles"] == 0, st
    reasons = [r.reason for r in compiled.stoker_report.recompiles]
    assert len(reasons) == 1 and "idx" in reasons[0] and "index 1" in reasons[0], reasons
    assert compiled.stoker_report.compiles[-1].executor == backend
