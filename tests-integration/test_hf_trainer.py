"""Hugging Face's ``Trainer`` on a stoker-compiled model, as docs/stoker.md shows it.

A tiny GPT-2 built from a config (no download) and an in-memory dataset: the model
compiled as a wrapper (``torch.compile(model, backend="stoker")``, handed to ``Trainer``
with ``remove_unused_columns=False``) or in place (``model.compile(backend="stoker")``)
logs eager's losses and ends with eager's parameters, its backward runs through
stoker-autograd, and its checkpoint loads into a plain model.  And
``TrainingArguments(torch_compile_backend="stoker")`` is refused by accelerate's fixed
list of backend names, with the error the docs quote.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import stoker
import stoker_autograd

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="Trainer needs `transformers` and `accelerate` (nox installs both for integration)",
)

STEPS = 4


def _dataset(n: int = 16, length: int = 8) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (n, length), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _args(out: Path, *, in_place: bool = False, **extra: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        # a compiled wrapper's forward shows no argument names, and Trainer would drop
        # every column of the dataset; a model compiled in place keeps its signature
        remove_unused_columns=in_place,
        **extra,
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_trainer_trains_a_compiled_model_like_eager(how: str, tmp_path: Path) -> None:
    """``torch.compile(model, backend="stoker")`` (a wrapper, as `stoker.compile` returns)
    and ``model.compile(backend="stoker")`` (in place: Trainer sees the model itself)."""
    from transformers import GPT2LMHeadModel, Trainer

    eager = _model()
    trainer = Trainer(model=eager, args=_args(tmp_path / "eager"), train_dataset=_dataset())
    trainer.train()
    want = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    model = _model()
    in_place = how == "Module.compile"
    if in_place:
        model.compile(backend="stoker")
        handed = model
    else:
        handed = torch.compile(model, backend="stoker")
    before = stoker_autograd.stats()
    args = _args(tmp_path / "compiled", in_place=in_place)
    trainer = Trainer(model=handed, args=args, train_dataset=_dataset())
    trainer.train()
    after = stoker_autograd.stats()
    got = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(
            pc, pe, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    # the forward was compiled by stoker and the backward went through stoker-autograd
    assert stoker.backend.report.n_graphs >= 1
    assert after["captures"] > before["captures"], (before, after)
    assert after["cache_hits"] > before["cache_hits"], (before, after)
    # the checkpoint loads into a plain model: Trainer saves a model compiled in place
    # itself; a wrapper's state dict names every weight `_orig_mod.`..., so save the
    # model that was compiled
    saved = tmp_path / "saved"
    if in_place:
        trainer.save_model(str(saved))
    else:
        model.save_pretrained(str(saved))
    loaded = GPT2LMHeadModel.from_pretrained(str(saved))
    for (name, pl), pc in zip(loaded.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(pl, pc, msg=lambda m, name=name: f"saved {name}: {m}")


def test_torch_compile_backend_stoker_in_training_arguments_is_refused(tmp_path: Path) -> None:
    """accelerate checks the name against its own enum of backends when Trainer builds
    its Accelerator; docs/stoker.md quotes this error and gives the one-line way round
    (``model.compile(backend="stoker")``, tested above)."""
    from transformers import Trainer

    args = _args(tmp_path, torch_compile_backend="stoker")
    with pytest.raises(ValueError, match="'STOKER' is not a valid DynamoBackend"):
        Trainer(model=_model(), args=args, train_dataset=_dataset())
