"""Gradient accumulation over micro-batches, with and without non-reentrant activation
checkpointing, through ``stoker.compile`` against eager: every micro-batch's gradients
and the parameters after each optimizer step match, and nothing compiles after the
second micro-batch.

With compiled autograd a backward into empty ``.grad`` (the first micro-batch after
``zero_grad()``) and one that adds to ``.grad`` (the others) are two structures: two
captures, each compiled once (or loaded from the disk cache), then replayed from the
in-memory cache for every later micro-batch and step."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

import stoker
import stoker_autograd

STEPS, MICRO = 3, 4
# stoker_autograd.stats() counters that move only when a backward is captured or compiled
# (compiled here or loaded from the disk cache), never when one is replayed
COMPILE_STATS = ("captures", "compiles", "recompiles", "disk_hits", "disk_misses", "fallbacks")


@pytest.fixture(autouse=True)
def fresh_stoker() -> Iterator[None]:
    stoker.reset()
    yield
    stoker.reset()


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Two residual MLP blocks; each under non-reentrant checkpointing if asked."""

    def __init__(self, checkpoint: bool) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = ckpt.checkpoint(b, h, use_reentrant=False) if self.checkpoint else b(h)
        return self.out(h)


@pytest.mark.parametrize("compiled_autograd", [True, False], ids=["ca", "no_ca"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_accumulation_matches_eager_and_compiles_nothing_after_the_second_micro_batch(
    checkpoint: bool, compiled_autograd: bool
) -> None:
    torch.manual_seed(0)
    eager = Net(checkpoint)
    model = copy.deepcopy(eager)
    compiled = stoker.compile(model, compiled_autograd=compiled_autograd)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    after_second: dict[str, int] | None = None
    for step in range(STEPS):
        opt_e.zero_grad(set_to_none=True)
        opt_c.zero_grad(set_to_none=True)
        for micro in range(MICRO):
            x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
            with stoker.autograd_enabled(False):
                loss_e = F.mse_loss(eager(x), y) / MICRO
                loss_e.backward()
            loss_c = F.mse_loss(compiled(x), y) / MICRO
            loss_c.backward()
            where = f"step {step}, micro-batch {micro}"
            torch.testing.assert_close(
                loss_c, loss_e, msg=lambda m, where=where: f"loss, {where}: {m}"
            )
            for (name, pe), pc in zip(eager.named_parameters(), model.parameters(), strict=True):
                assert pe.grad is not None and pc.grad is not None, (name, where)
                torch.testing.assert_close(
                    pc.grad,
                    pe.grad,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=lambda m, name=name, where=where: f"{name}, {where}: {m}",
                )
            if (step, micro) == (0, 1):
                after_second = stoker_autograd.stats()
        opt_e.step()
        opt_c.step()
        for (name, pe), pc in zip(eager.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(
                pc, pe, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )

    assert after_second is not None
    end = stoker_autograd.stats()
    moved = {k: (after_second[k], end[k]) for k in COMPILE_STATS if after_second[k] != end[k]}
    assert not moved, f"compiled after the second micro-batch: {moved}"
    if compiled_autograd:
        # into empty .grad, then adding to .grad: two captures, each compiled or loaded once
        assert end["captures"] == 2 and end["fallbacks"] == 0, end
        assert end["compiles"] + end["disk_hits"] == 2, end
        assert end["cache_hits"] == STEPS * MICRO - 2, end
        (why,) = stoker_autograd.recapture_reasons()
        assert ".grad None -> .grad set" in why, why
    else:
        assert end["captures"] == 0, end  # the AOT backward, compiled once at its first call
    report = stoker.last_report()
    assert report is not None
    # one forward graph (checkpointing stays inside it), never compiled again
    assert report.n_graphs == 1 and not report.recompiles, report.summary()


def _saved_activation_bytes(checkpoint: bool) -> tuple[int, list[str]]:
    torch.manual_seed(0)
    model = Net(checkpoint)
    compiled = stoker.compile(model)
    F.mse_loss(compiled(torch.randn(6, 8)), torch.randn(6, 4)).backward()
    (record,) = [c.partition for c in compiled.stoker_report.compiles if c.partition is not None]
    activations = [s for s in record.saved if not s.name.startswith("primals")]
    return sum(s.nbytes for s in activations), record.recomputed


def test_checkpointed_blocks_save_only_their_inputs_for_the_backward() -> None:
    """The checkpoint tags reach stoker's partitioner through Dynamo and the capture: each
    block's input (6 x 16 floats) is all that crosses to the backward, its matmuls and
    layer norm run again there; without checkpointing their activations are saved."""
    plain, _ = _saved_activation_bytes(False)
    checkpointed, recomputed = _saved_activation_bytes(True)
    assert checkpointed == 2 * 6 * 16 * 4, (checkpointed, recomputed)
    assert checkpointed < plain / 4, (checkpointed, plain)
    assert any(r.startswith("addmm") for r in recomputed), recomputed
    assert any(r.startswith("native_layer_norm") for r in recomputed), recomputed
