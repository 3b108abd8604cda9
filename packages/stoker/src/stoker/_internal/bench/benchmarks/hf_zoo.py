"""Hugging Face architectures trained through stoker: step time and parity with eager.

    python -m stoker._internal.bench.benchmarks.hf_zoo [--models gpt2,bert,...]
        [--threads 1|2|1,2] [--backends eager,c,inductor] [--steps 5] [--rounds 7]
        [--parity-only] [--check] [--json PATH]

Thirty architectures of the installed ``transformers`` (`ZOO`), each built from its
config class with random weights (nothing is downloaded) at a tiny size: hidden 64,
2 layers, 4 heads (2 key/value heads where the model groups them), intermediate 128,
vocabulary 128, sequence 32, batch 4, dropout off. Causal LMs train on their own
shifted loss (``labels=input_ids``), masked LMs on random labels at every position,
seq2seq models (T5, BART) on ``decoder_input_ids`` and labels, ViT on 32×32 images
and class labels: always the model's own loss (``labels=``).

Backends: ``eager``; ``aten`` and ``c``, `stoker.compile` with the aten executor and
with C kernels; ``inductor``, ``torch.compile`` (Inductor's C++ backend on the CPU).
Every model runs in its own fresh process with empty cache folders and a timeout
(``--timeout``), so a model that fails to compile, hangs or diverges is a row with
its error, never the end of the run.

Timing (the default): per model and thread count, each backend trains the same
weights on the same batch side by side (forward, loss, backward, AdamW); the steady
step is the median over ``--rounds`` interleaved rounds of ``--steps`` steps. The
table has the step of each backend, stoker ÷ eager and stoker ÷ Inductor (stoker is
``c``, or ``aten`` when ``c`` is not asked for), their geomeans, and the parity of the
first step's loss and gradients with eager's (the largest absolute difference).

``--parity-only``: no timing; one process per model trains ``--steps`` (default 3)
SGD steps with each backend in turn (caches reset between backends) and compares the
loss and every parameter's gradient at every step with eager's: a tensor passes when
its largest difference is at most ``atol + rtol × its largest eager magnitude``
(``--rtol 1e-4 --atol 1e-5``: fp32 round-off through two layers). It also records
whether ``c`` is bit-identical to ``aten`` (losses and gradients). ``--check`` exits 1
when a model fails.

Architectures left out: none. Every architecture tried builds offline and trains in
eager: GPT-2, GPT-Neo, GPT-J, GPT-NeoX, OPT, BLOOM, Llama, Mistral, Mixtral (4
experts, 2 per token), Qwen2, Qwen3, Phi, Phi-3, Gemma, Gemma2, StableLM, Falcon,
CodeGen, OLMo, BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ALBERT, ELECTRA, DeBERTa-v2,
MPNet, T5, BART, ViT. An architecture added later that cannot build offline or that
eager fails on goes in `EXCLUDED` with its reason (counted, never run).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import write_json

H, L, NH, KV, FF, V, S, BATCH = 64, 2, 4, 2, 128, 128, 32, 4
D = H // NH  # head size


@dataclass(frozen=True)
class Arch:
    """A transformers model: its config and model classes, what it trains on
    (``clm`` causal LM, ``mlm`` masked LM, ``s2s`` seq2seq, ``img`` image
    classification) and the config's fields."""

    config: str
    model: str
    kind: str
    fields: dict[str, Any]


# fmt: off
ZOO: dict[str, Arch] = {
    "gpt2": Arch("GPT2Config", "GPT2LMHeadModel", "clm", dict(n_embd=H,n_layer=L,n_head=NH,n_positions=S,n_inner=FF,vocab_size=V,bos_token_id=0,eos_token_id=0,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0)),
    "gpt_neo": Arch("GPTNeoConfig", "GPTNeoForCausalLM", "clm", dict(hidden_size=H,num_layers=L,num_heads=NH,attention_types=[[["global","local"],1]],window_size=16,max_position_embeddings=S,intermediate_size=FF,vocab_size=V,bos_token_id=0,eos_token_id=0,embed_dropout=0.0,attention_dropout=0.0,resid_dropout=0.0)),
    "gptj": Arch("GPTJConfig", "GPTJForCausalLM", "clm", dict(n_embd=H,n_layer=L,n_head=NH,n_positions=S,rotary_dim=D//2,n_inner=FF,vocab_size=V,bos_token_id=0,eos_token_id=0,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0)),
    "gpt_neox": Arch("GPTNeoXConfig", "GPTNeoXForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,rotary_pct=0.5,bos_token_id=0,eos_token_id=0,hidden_dropout=0.0,attention_dropout=0.0)),
    "opt": Arch("OPTConfig", "OPTForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,ffn_dim=FF,vocab_size=V,max_position_embeddings=S,word_embed_proj_dim=H,dropout=0.0,attention_dropout=0.0,activation_dropout=0.0)),
    "bloom": Arch("BloomConfig", "BloomForCausalLM", "clm", dict(hidden_size=H,n_layer=L,n_head=NH,vocab_size=V,hidden_dropout=0.0,attention_dropout=0.0)),
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,bos_token_id=0,eos_token_id=0)),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,sliding_window=None,bos_token_id=0,eos_token_id=0)),
    "mixtral": Arch("MixtralConfig", "MixtralForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,num_local_experts=4,num_experts_per_tok=2,sliding_window=None,bos_token_id=0,eos_token_id=0)),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,bos_token_id=0,eos_token_id=0)),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,head_dim=D,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,bos_token_id=0,eos_token_id=0)),
    "phi": Arch("PhiConfig", "PhiForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,partial_rotary_factor=0.5,resid_pdrop=0.0,embd_pdrop=0.0,attention_dropout=0.0,bos_token_id=0,eos_token_id=0)),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,original_max_position_embeddings=S,pad_token_id=0,bos_token_id=0,eos_token_id=0,resid_pdrop=0.0,embd_pdrop=0.0,attention_dropout=0.0)),
    "gemma": Arch("GemmaConfig", "GemmaForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,head_dim=D,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,pad_token_id=0,bos_token_id=0,eos_token_id=0)),
    "gemma2": Arch("Gemma2Config", "Gemma2ForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,head_dim=D,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,sliding_window=16,query_pre_attn_scalar=D,pad_token_id=0,bos_token_id=0,eos_token_id=0)),
    "stablelm": Arch("StableLmConfig", "StableLmForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,partial_rotary_factor=0.5,hidden_dropout=0.0,attention_dropout=0.0,bos_token_id=0,eos_token_id=0)),
    "falcon": Arch("FalconConfig", "FalconForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,vocab_size=V,max_position_embeddings=S,hidden_dropout=0.0,attention_dropout=0.0,bos_token_id=0,eos_token_id=0)),
    "codegen": Arch("CodeGenConfig", "CodeGenForCausalLM", "clm", dict(n_embd=H,n_layer=L,n_head=NH,n_positions=S,n_ctx=S,rotary_dim=D//2,n_inner=FF,vocab_size=V,bos_token_id=0,eos_token_id=0,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0)),
    "olmo": Arch("OlmoConfig", "OlmoForCausalLM", "clm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,num_key_value_heads=KV,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,pad_token_id=0,bos_token_id=0,eos_token_id=0)),
    "bert": Arch("BertConfig", "BertForMaskedLM", "mlm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0)),
    "roberta": Arch("RobertaConfig", "RobertaForMaskedLM", "mlm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,vocab_size=V,max_position_embeddings=S+2,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0)),
    "xlm_roberta": Arch("XLMRobertaConfig", "XLMRobertaForMaskedLM", "mlm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,vocab_size=V,max_position_embeddings=S+2,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0)),
    "distilbert": Arch("DistilBertConfig", "DistilBertForMaskedLM", "mlm", dict(dim=H,n_layers=L,n_heads=NH,hidden_dim=FF,vocab_size=V,max_position_embeddings=S,dropout=0.0,attention_dropout=0.0)),
    "albert": Arch("AlbertConfig", "AlbertForMaskedLM", "mlm", dict(embedding_size=32,hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0,classifier_dropout_prob=0.0,pad_token_id=0,bos_token_id=0,eos_token_id=0)),
    "electra": Arch("ElectraConfig", "ElectraForMaskedLM", "mlm", dict(embedding_size=32,hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0)),
    "deberta_v2": Arch("DebertaV2Config", "DebertaV2ForMaskedLM", "mlm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,vocab_size=V,max_position_embeddings=S,relative_attention=True,position_buckets=16,max_relative_positions=S,pos_att_type=["p2c","c2p"],hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0)),
    "mpnet": Arch("MPNetConfig", "MPNetForMaskedLM", "mlm", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,vocab_size=V,max_position_embeddings=S+2,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0)),
    "t5": Arch("T5Config", "T5ForConditionalGeneration", "s2s", dict(d_model=H,d_kv=D,d_ff=FF,num_layers=L,num_decoder_layers=L,num_heads=NH,vocab_size=V,dropout_rate=0.0,decoder_start_token_id=0,pad_token_id=0,eos_token_id=1)),
    "bart": Arch("BartConfig", "BartForConditionalGeneration", "s2s", dict(d_model=H,encoder_layers=L,decoder_layers=L,encoder_attention_heads=NH,decoder_attention_heads=NH,encoder_ffn_dim=FF,decoder_ffn_dim=FF,vocab_size=V,max_position_embeddings=S,dropout=0.0,attention_dropout=0.0,activation_dropout=0.0,pad_token_id=1,bos_token_id=0,eos_token_id=2,decoder_start_token_id=2)),
    "vit": Arch("ViTConfig", "ViTForImageClassification", "img", dict(hidden_size=H,num_hidden_layers=L,num_attention_heads=NH,intermediate_size=FF,image_size=32,patch_size=8,num_channels=3,num_labels=10,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0)),
}
# fmt: on

# name: why it is not run (an architecture that cannot build offline, or that eager
# itself fails on); none today.
EXCLUDED: dict[str, str] = {}

BACKENDS = ("eager", "aten", "c", "inductor")
STOKER_BACKENDS = ("aten", "c")
DEFAULT_BACKENDS = ("eager", "c", "inductor")

# Extra models and backends by name, for the tests: a model is ``() -> (module,
# inputs)`` whose ``module(**inputs)`` returns the loss (or an object with ``.loss``);
# a backend is ``module -> callable``.
EXTRA_MODELS: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {}
EXTRA_BACKENDS: dict[str, Callable[[Any], Any]] = {}


def build(name: str) -> tuple[Any, dict[str, Any]]:
    """``(model, inputs)`` of ``name``: fresh weights (seed 0) and a batch (seed 0)."""
    import torch

    torch.manual_seed(0)
    if name in EXTRA_MODELS:
        return EXTRA_MODELS[name]()
    import transformers  # type: ignore[import-not-found]

    arch = ZOO[name]
    model = getattr(transformers, arch.model)(getattr(transformers, arch.config)(**arch.fields))
    gen = torch.Generator().manual_seed(0)
    if arch.kind == "img":
        return model, {
            "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen),
            "labels": torch.randint(0, 10, (BATCH,), generator=gen),
        }
    ids = torch.randint(3, V, (BATCH, S), generator=gen)  # past the special tokens
    if arch.kind == "clm":
        return model, {"input_ids": ids, "labels": ids.clone()}
    inputs = {"input_ids": ids, "labels": torch.randint(3, V, (BATCH, S), generator=gen)}
    if arch.kind == "s2s":
        inputs["decoder_input_ids"] = torch.randint(3, V, (BATCH, S), generator=gen)
    return model, inputs


def compile_for(backend: str, model: Any) -> Any:
    """What a training step calls for ``backend``."""
    if backend == "eager":
        return model
    if backend in STOKER_BACKENDS:
        import stoker

        return stoker.compile(model, backend=backend)
    if backend == "inductor":
        import torch

        return torch.compile(model)
    return EXTRA_BACKENDS[backend](model)


def _reset() -> None:
    """Forget every compiled graph (Dynamo's and stoker's) before the next backend."""
    import torch._dynamo

    torch._dynamo.reset()
    if "stoker" in sys.modules:
        import stoker

        stoker.reset()


def _loss(fn: Any, inputs: dict[str, Any]) -> Any:
    out = fn(**inputs)
    return out.loss if hasattr(out, "loss") else out


def _grads(model: Any) -> dict[str, Any]:
    return {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }


def _error(e: BaseException) -> str:
    """The exception and where it was raised, short enough for a table cell."""
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return (tb[-1].strip() + " | " + "".join(tb[-3:-1]).strip().replace("\n", " "))[-1500:]


def train(
    name: str, backend: str, model: Any, inputs: dict[str, Any], steps: int, lr: float
) -> dict[str, Any]:
    """``steps`` SGD steps of ``model`` through ``backend``: the loss and every
    parameter's gradient at each step."""
    import torch

    import stoker

    fn = compile_for(backend, model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses: list[Any] = []
    grads: list[dict[str, Any]] = []
    with stoker.autograd_enabled(backend in STOKER_BACKENDS):
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = _loss(fn, inputs)
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append(_grads(model))
            opt.step()
    return {"losses": losses, "grads": grads, "stats": compiled_stats(fn)}


def compiled_stats(fn: Any) -> dict[str, Any]:
    """What stoker compiled for ``fn`` (from its report): Dynamo graphs, graph breaks,
    compiled-autograd backward segments, kernels, ops run through aten without a
    lowering; nothing for another backend."""
    rep = getattr(fn, "stoker_report", None)
    if rep is None:
        return {}
    forward = list(getattr(rep, "compiles", []))
    backward = list(getattr(rep, "autograd_kernels", []))
    return {
        "graphs": len(forward),
        "graph_breaks": len(getattr(rep, "graph_breaks", [])),
        "backward_segments": len(backward),
        "kernels": sum(len(c.kernels) for c in forward + backward),
        "fallbacks": sum(len(c.fallbacks) for c in forward + backward),
        "compile_errors": sum(1 for c in forward + backward if c.error),
        "fallback_ops": sorted({str(f)[:80] for c in forward + backward for f in c.fallbacks}),
    }


def _diff(a: Any, b: Any) -> tuple[float, float]:
    """(largest |a - b|, largest |b|) of two tensors; a missing gradient is zeros."""
    import torch

    if a is None and b is None:
        return 0.0, 0.0
    if a is None or b is None:
        t = b if a is None else a
        return float(t.abs().max()) if t.numel() else 0.0, 0.0
    if a.shape != b.shape:
        return math.inf, 0.0
    if a.numel() == 0:
        return 0.0, 0.0
    a64, b64 = a.double(), b.double()
    d = (a64 - b64).abs()
    # NaN anywhere but in the same place in both is a difference
    both_nan = torch.isnan(a64) & torch.isnan(b64)
    d = torch.where(both_nan, torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return float(d.max()), float(b64.abs().nan_to_num(0.0).max())


def _excess(diff: float, tol: float) -> float:
    """``diff`` in units of ``tol`` (a zero tolerance: any difference is infinitely over)."""
    if tol > 0:
        return diff / tol
    return math.inf if diff > 0 else 0.0


def compare(got: dict[str, Any], want: dict[str, Any], rtol: float, atol: float) -> dict[str, Any]:
    """``got`` against ``want`` (records of `train`): the largest difference of the
    losses and of the gradients, the worst tensor, and whether every tensor is within
    ``atol + rtol × its largest magnitude``."""
    worst = ("", 0.0)  # (tensor, difference over its tolerance)
    loss_diff = grad_diff = 0.0
    compared = 0
    ok = len(got["losses"]) == len(want["losses"]) and len(got["grads"]) == len(want["grads"])
    for step, (lg, lw) in enumerate(zip(got["losses"], want["losses"], strict=False)):
        d, scale = _diff(lg, lw)
        loss_diff = max(loss_diff, d)
        compared += 1
        excess = _excess(d, atol + rtol * scale)
        if excess > worst[1]:
            worst = (f"loss@{step}", excess)
    for step, (gg, gw) in enumerate(zip(got["grads"], want["grads"], strict=False)):
        if set(gg) != set(gw):
            ok = False
        for n in gw:
            d, scale = _diff(gg.get(n), gw[n])
            grad_diff = max(grad_diff, d)
            compared += 1
            excess = _excess(d, atol + rtol * scale)
            if excess > worst[1]:
                worst = (f"{n}@{step}", excess)
    ok = ok and compared > 0 and worst[1] <= 1.0
    return {
        "ok": ok,
        "loss_diff": loss_diff,
        "grad_diff": grad_diff,
        "max_diff": max(loss_diff, grad_diff),
        "compared": compared,
        "worst": worst[0],
        "worst_over_tol": worst[1],
    }


def identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit for bit the same losses and gradients."""
    import torch

    def same(x: Any, y: Any) -> bool:
        if x is None or y is None:
            return x is None and y is None
        return bool(torch.equal(x, y)) or bool(
            x.shape == y.shape
            and torch.equal(x.isnan(), y.isnan())
            and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))
        )

    if len(a["losses"]) != len(b["losses"]):
        return False
    if not all(same(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)):
        return False
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        if set(ga) != set(gb) or not all(same(ga[n], gb[n]) for n in ga):
            return False
    return True


def parity_worker(
    name: str, backends: list[str], steps: int, rtol: float, atol: float, lr: float = 0.05
) -> dict[str, Any]:
    """One model trained by each backend in turn, each compared with eager."""
    base, inputs = build(name)
    records: dict[str, dict[str, Any]] = {}
    row: dict[str, Any] = {"case": name, "arch": name}
    for b in ["eager", *(b for b in backends if b != "eager")]:
        _reset()
        t0 = time.perf_counter()
        try:
            records[b] = train(name, b, copy.deepcopy(base), inputs, steps, lr)
        except Exception as e:  # a backend that fails is this row's error, not the run's
            row[f"{b}_error"] = _error(e)
        row[f"{b}_s"] = time.perf_counter() - t0
        for k, v in records.get(b, {}).get("stats", {}).items():
            row[f"{b}_{k}"] = v
    if "eager" in records:
        row["loss"] = float(records["eager"]["losses"][-1])
        for b, rec in records.items():
            if b != "eager":
                for k, v in compare(rec, records["eager"], rtol, atol).items():
                    row[f"{b}_{k}"] = v
    if "aten" in records and "c" in records:
        row["c_bitwise_aten"] = identical(records["c"], records["aten"])
    others = [b for b in backends if b != "eager"]
    row["passed"] = "eager" in records and all(row.get(f"{b}_ok") is True for b in others)
    return row


def timing_worker(
    name: str,
    threads: int,
    steps: int,
    rounds: int,
    backends: list[str],
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> dict[str, Any]:
    """One model, every backend side by side in this process: interleaved steady rounds,
    and the first step's loss and gradients compared with eager's."""
    import torch

    import stoker

    torch.set_num_threads(threads)
    base, inputs = build(name)
    row: dict[str, Any] = {"case": f"{name} {threads}T", "arch": name, "threads": threads}
    runs: dict[str, Callable[[], None]] = {}
    first: dict[str, dict[str, Any]] = {}
    for b in backends:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(
            fn: Any, model: Any = model, opt: Any = opt, b: str = b, keep: bool = False
        ) -> None:
            with stoker.autograd_enabled(b in STOKER_BACKENDS):
                opt.zero_grad(set_to_none=True)
                loss = _loss(fn, inputs)
                loss.backward()
                if keep:
                    first[b] = {"losses": [loss.detach().clone()], "grads": [_grads(model)]}
                opt.step()

        try:
            fn = compile_for(b, model)
            t0 = time.perf_counter()
            step(fn, keep=True)
            step(fn)
            row[f"{b}_first_two_s"] = time.perf_counter() - t0
        except Exception as e:
            row[f"{b}_error"] = _error(e)
            continue
        runs[b] = functools.partial(step, fn)
    steady: dict[str, list[float]] = {b: [] for b in runs}
    for _ in range(rounds):
        for b, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            steady[b].append((time.perf_counter() - t0) / steps)
    for b, times in steady.items():
        if times:
            row[f"{b}_ms"] = statistics.median(times) * 1e3
            row[f"{b}_min_ms"] = min(times) * 1e3
    if "eager" in first:
        for b, rec in first.items():
            if b != "eager":
                c = compare(rec, first["eager"], rtol, atol)
                row[f"{b}_max_diff"] = c["max_diff"]
                row[f"{b}_ok"] = c["ok"]
    row["passed"] = all(f"{b}_error" not in row for b in backends) and all(
        row.get(f"{b}_ok", True) for b in backends
    )
    return row


def _run(name: str, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """One model in a fresh process with empty caches; its row, or its error."""
    with tempfile.TemporaryDirectory(prefix="stoker-hf-zoo-") as caches:
        env = dict(os.environ)
        env["STOKER_CACHE_DIR"] = os.path.join(caches, "stoker")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
        env["OMP_NUM_THREADS"] = str(threads)
        env["HF_HUB_OFFLINE"] = "1"
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        env.pop("TRITON_INTERPRET", None)
        cmd = [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            __spec__.name if __spec__ else "stoker._internal.bench.benchmarks.hf_zoo",
            "--worker",
            name,
            "--threads",
            str(threads),
            "--steps",
            str(args.steps),
            "--rounds",
            str(args.rounds),
            "--backends",
            ",".join(args.backends),
            "--rtol",
            str(args.rtol),
            "--atol",
            str(args.atol),
        ] + (["--parity-only"] if args.parity_only else [])
        base: dict[str, Any] = {"case": name if args.parity_only else f"{name} {threads}T"}
        base.update(arch=name, passed=False)
        if not args.parity_only:
            base["threads"] = threads
        t0 = time.perf_counter()
        try:
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {**base, "error": f"timed out after {args.timeout:.0f} s"}
        wall = time.perf_counter() - t0
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            tail = done.stderr.strip().splitlines()
            return {**base, "error": f"exit {done.returncode}: " + " | ".join(tail[-3:])[-1500:]}
        return {**json.loads(lines[-1]), "wall_s": wall}


def stoker_backend(backends: list[str]) -> str | None:
    return "c" if "c" in backends else "aten" if "aten" in backends else None


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(rows: list[dict[str, Any]], backends: list[str], parity_only: bool) -> dict[str, Any]:
    """Ratios per row (timing), their geomeans and the counts."""
    s = stoker_backend(backends)
    out: dict[str, Any] = {"case": "summary"}
    if not parity_only and s:
        for r in rows:
            if f"{s}_ms" in r and r.get("eager_ms"):
                r["stoker_over_eager"] = r[f"{s}_ms"] / r["eager_ms"]
            if f"{s}_ms" in r and r.get("inductor_ms"):
                r["stoker_over_inductor"] = r[f"{s}_ms"] / r["inductor_ms"]
        for threads in sorted({r.get("threads", 0) for r in rows}):
            for k in ("stoker_over_eager", "stoker_over_inductor"):
                g = geomean([r[k] for r in rows if r.get("threads") == threads and k in r])
                if g is not None:
                    out[f"geomean_{k}_{threads}T"] = g
    out["passed"] = sum(1 for r in rows if r.get("passed"))
    out["failed"] = sum(1 for r in rows if not r.get("passed"))
    out["excluded"] = len(EXCLUDED)
    if "aten" in backends and "c" in backends and parity_only:
        out["c_bitwise_aten"] = sum(1 for r in rows if r.get("c_bitwise_aten"))
    return out


def _why(r: dict[str, Any], backends: list[str]) -> str:
    if "error" in r:
        return str(r["error"]).splitlines()[0][:200]
    for b in backends:
        if f"{b}_error" in r:
            return f"{b}: {r[f'{b}_error'][:200]}"
    for b in backends:
        if r.get(f"{b}_ok") is False:
            return f"{b}: worst {r.get(f'{b}_worst', '?')} ({r.get(f'{b}_worst_over_tol', 0):.3g}× tol)"
    return ""


def table(
    rows: list[dict[str, Any]], summary: dict[str, Any], backends: list[str], parity_only: bool
) -> str:
    """The markdown table of the rows and the summary."""

    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

    others = [b for b in backends if b != "eager"]
    lines: list[str] = []
    if parity_only:
        head = ["model", *(f"{b}: max diff" for b in others)]
        if "aten" in backends and "c" in backends:
            head.append("c ≡ aten")
        if "c" in backends:
            head.append("c: graphs / breaks / kernels / fallbacks")
        head += ["passed", "why not"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [r["arch"], *(f(r.get(f"{b}_max_diff"), "{:.2e}") for b in others)]
            if "aten" in backends and "c" in backends:
                same = r.get("c_bitwise_aten")
                cells.append("-" if same is None else "yes" if same else "no")
            if "c" in backends:
                stats = ("graphs", "graph_breaks", "kernels", "fallbacks")
                cells.append(" / ".join(str(r.get(f"c_{k}", "-")) for k in stats))
            cells += ["yes" if r.get("passed") else "**no**", _why(r, backends)]
            lines.append("| " + " | ".join(cells) + " |")
    else:
        s = stoker_backend(backends)
        head = ["model", "threads", *(f"{b} ms" for b in backends)]
        head += ["stoker ÷ eager", "stoker ÷ Inductor", "parity (max diff)", "why not"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [r["arch"], str(r.get("threads", "")), *(f(r.get(f"{b}_ms")) for b in backends)]
            cells += [f(r.get("stoker_over_eager")), f(r.get("stoker_over_inductor"))]
            cells += [f(r.get(f"{s}_max_diff"), "{:.2e}"), _why(r, backends)]
            lines.append("| " + " | ".join(cells) + " |")
        for k, v in summary.items():
            if k.startswith("geomean_"):
                lines.append(f"{k}: {v:.3f}")
    lines.append(
        f"passed {summary['passed']}, failed {summary['failed']}, excluded {summary['excluded']}"
        + (
            f"; c bit-identical to aten: {summary['c_bitwise_aten']}"
            if "c_bitwise_aten" in summary
            else ""
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="", help="comma-separated (default: all of ZOO)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--backends", default="")
    p.add_argument("--steps", type=int, default=0, help="timing: 5 per round; parity: 3")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--parity-only", action="store_true")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--check", action="store_true", help="exit 1 when a model fails")
    p.add_argument("--timeout", type=float, default=900, help="seconds per model process")
    p.add_argument("--json", default="")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    default = ("eager", "aten", "c") if args.parity_only else DEFAULT_BACKENDS
    args.backends = [b for b in args.backends.split(",") if b] or list(default)
    args.steps = args.steps or (3 if args.parity_only else 5)
    bad = set(args.backends) - set(BACKENDS) - set(EXTRA_BACKENDS)
    if bad:
        p.error(f"--backends: unknown {sorted(bad)}; choose from {', '.join(BACKENDS)}")
    if args.worker:
        if args.parity_only:
            row = parity_worker(args.worker, args.backends, args.steps, args.rtol, args.atol)
        else:
            row = timing_worker(
                args.worker,
                int(args.threads),
                args.steps,
                args.rounds,
                args.backends,
                args.rtol,
                args.atol,
            )
        print(json.dumps(row, default=str))
        return 0
    models = [m for m in args.models.split(",") if m] or list(ZOO)
    unknown = [m for m in models if m not in ZOO and m not in EXTRA_MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(ZOO)}")
    threads = [int(t) for t in args.threads.split(",") if t]
    if args.parity_only:
        threads = threads[:1]
    rows: list[dict[str, Any]] = []
    for t in threads:
        for name in models:
            row = _run(name, t, args)
            rows.append(row)
            why = _why(row, args.backends)
            took = f"{row.get('wall_s', 0.0):5.1f} s"
            verdict = "passed" if row.get("passed") else "FAILED"
            print(f"{row['case']:16s} {took}  {verdict} {why}", flush=True)
            write_json(args.json, rows)  # so far: a run stopped midway keeps its rows
    summary = summarize(rows, args.backends, args.parity_only)
    print(table(rows, summary, args.backends, args.parity_only), flush=True)
    write_json(args.json, [*rows, summary])
    return 1 if args.check and summary["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
