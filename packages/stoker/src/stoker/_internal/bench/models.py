"""The shared model zoo: small models that the demo, the benchmarks and the
integration tests train.

Every entry is a `ModelSpec`: how to build the module, how to make a batch of
a given size, and the loss.  Nothing is downloaded; the `transformers` entries
(tiny GPT-2, BERT and Llama configs with random weights) appear only when
`transformers` is importable.

>>> spec = get_model("mlp")
>>> model = spec.build()
>>> inputs, target = spec.batch(8, torch.Generator().manual_seed(0))
>>> loss = spec.loss(model(*inputs), target)
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """Linear → GELU blocks with a LayerNorm, for classification."""

    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 10, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = d_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- GPT


@dataclass(frozen=True)
class GPTConfig:
    """A nanoGPT-style decoder; the defaults train in seconds on a CPU."""

    vocab_size: int = 65  # characters of the bundled text fit in 65
    block_size: int = 32  # longest sequence
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0  # keep 0.0 for parity tests: dropout draws random numbers
    tie_weights: bool = False  # tie the token embedding and the LM head, as nanoGPT does


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        hs = c // self.n_head
        q = q.view(b, t, self.n_head, hs).transpose(1, 2)
        k = k.view(b, t, self.n_head, hs).transpose(1, 2)
        v = v.view(b, t, self.n_head, hs).transpose(1, 2)
        # Written out (not scaled_dot_product_attention) so every backend sees plain aten ops.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask: torch.Tensor = self.mask  # type: ignore[assignment]
        att = att.masked_fill(~mask[:, :, :t, :t], float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """A small GPT: token + position embeddings, pre-LN blocks, an LM head; returns logits."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # type: ignore[no-any-return]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# ----------------------------------------------------------------------------- CNN


class SmallCNN(nn.Module):
    """conv-BN-ReLU ×2, max-pool, global average pool, linear: BatchNorm updates buffers."""

    def __init__(self, channels: int = 3, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = x.mean(dim=(2, 3))
        return self.head(x)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- the zoo

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """One zoo entry: ``build(**overrides)``, ``batch(n, generator)``, ``loss(out, target)``."""

    name: str
    description: str
    build_fn: Callable[..., nn.Module]
    batch_fn: Callable[[int, torch.Generator, dict[str, Any]], Batch]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    defaults: dict[str, Any] = field(default_factory=dict)  # build arguments
    bench_batch: int = 8  # batch size the benchmarks use on a CPU

    def build(
        self, device: str | torch.device = "cpu", seed: int = 0, **overrides: Any
    ) -> nn.Module:
        """A fresh model with deterministic weights (``seed``) on ``device``."""
        torch.manual_seed(seed)
        model = self.build_fn(**{**self.defaults, **overrides})
        return model.to(device)

    def batch(
        self, n: int, gen: torch.Generator, device: str | torch.device = "cpu", **overrides: Any
    ) -> Batch:
        """``(inputs, target)`` with batch size ``n``, drawn from ``gen`` (on the CPU)."""
        inputs, target = self.batch_fn(n, gen, {**self.defaults, **overrides})
        return tuple(t.to(device) for t in inputs), target.to(device)


def _mlp_batch(n: int, gen: torch.Generator, cfg: dict[str, Any]) -> Batch:
    x = torch.randn(n, cfg.get("d_in", 32), generator=gen)
    return (x,), torch.randint(0, cfg.get("d_out", 10), (n,), generator=gen)


def _gpt_build(**kw: Any) -> nn.Module:
    return GPT(GPTConfig(**kw))


def _gpt_batch(n: int, gen: torch.Generator, cfg: dict[str, Any]) -> Batch:
    c = GPTConfig(**cfg)
    seq = torch.randint(0, c.vocab_size, (n, c.block_size + 1), generator=gen)
    return (seq[:, :-1],), seq[:, 1:]


def _cnn_batch(n: int, gen: torch.Generator, cfg: dict[str, Any]) -> Batch:
    x = torch.randn(n, cfg.get("channels", 3), 16, 16, generator=gen)
    return (x,), torch.randint(0, cfg.get("classes", 10), (n,), generator=gen)


def _ce(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


def hf_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """`lm_loss` of a transformers model's logits (``out.logits``, or the first of a tuple)."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    return lm_loss(logits, target)


# kind: (config class, model class, {config field: size key}, fixed fields: no dropout)
_HF: dict[str, tuple[str, str, dict[str, str], dict[str, Any]]] = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "n_embd": "hidden",
            "n_layer": "layers",
            "n_head": "heads",
            "n_positions": "seq",
            "vocab_size": "vocab",
        },
        # token ids inside the tiny vocabulary (the defaults, GPT-2's 50256, warn)
        {
            "bos_token_id": 0,
            "eos_token_id": 0,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        {
            "hidden_size": "hidden",
            "num_hidden_layers": "layers",
            "num_attention_heads": "heads",
            "intermediate_size": "intermediate",
            "vocab_size": "vocab",
            "max_position_embeddings": "seq",
        },
        {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "hidden_size": "hidden",
            "num_hidden_layers": "layers",
            "num_attention_heads": "heads",
            "num_key_value_heads": "kv_heads",
            "intermediate_size": "intermediate",
            "vocab_size": "vocab",
            "max_position_embeddings": "seq",
        },
        {},
    ),
}


def hf_model(kind: str, **size: int) -> nn.Module:
    """A random-weight transformers model, nothing downloaded: ``gpt2`` (GPT2LMHeadModel),
    ``bert`` (BertForMaskedLM) or ``llama`` (LlamaForCausalLM), of ``size``: hidden,
    layers, heads, seq (positions), vocab; bert and llama also intermediate, llama
    kv_heads (other keys are ignored).  Dropout is off."""
    import transformers  # type: ignore[import-not-found]

    config, model, fields, fixed = _HF[kind]
    cfg = getattr(transformers, config)(**{f: size[k] for f, k in fields.items()}, **fixed)
    return getattr(transformers, model)(cfg)  # type: ignore[no-any-return]


def _hf_specs() -> list[ModelSpec]:
    """Tiny random-weight configs of transformers' GPT-2, BERT and Llama (no download)."""
    if importlib.util.find_spec("transformers") is None:
        return []

    def build(kind: str) -> Callable[..., nn.Module]:
        tiny = {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 2, "intermediate": 128}
        return lambda **kw: hf_model(kind, **tiny, seq=64, vocab=kw["vocab"])

    def tokens(n: int, gen: torch.Generator, cfg: dict[str, Any]) -> Batch:
        seq = torch.randint(0, cfg["vocab"], (n, cfg["seq"] + 1), generator=gen)
        return (seq[:, :-1],), seq[:, 1:]

    d = {"vocab": 128, "seq": 32}
    return [
        ModelSpec(
            "hf-gpt2", "transformers GPT-2, 2 layers, d=64", build("gpt2"), tokens, hf_loss, d
        ),
        ModelSpec(
            "hf-bert",
            "transformers BERT (MLM head), 2 layers, d=64",
            build("bert"),
            tokens,
            hf_loss,
            d,
        ),
        ModelSpec(
            "hf-llama", "transformers Llama, 2 layers, d=64", build("llama"), tokens, hf_loss, d
        ),
    ]


def model_zoo() -> dict[str, ModelSpec]:
    """Every available model by name: mlp, gpt, cnn (+ hf-gpt2, hf-bert, hf-llama)."""
    specs = [
        ModelSpec(
            "mlp",
            "3×(Linear+GELU), LayerNorm, Linear; 32→64→10",
            MLP,
            _mlp_batch,
            _ce,
            {"d_in": 32, "hidden": 64, "d_out": 10, "depth": 3},
            bench_batch=64,
        ),
        ModelSpec(
            "gpt",
            "nanoGPT-style, 2 layers, 2 heads, d=64, T=32",
            _gpt_build,
            _gpt_batch,
            lm_loss,
            {},
            bench_batch=8,
        ),
        ModelSpec(
            "cnn",
            "conv-BN-ReLU ×2, pools, linear; 3×16×16",
            SmallCNN,
            _cnn_batch,
            _ce,
            {"channels": 3, "width": 8, "classes": 10},
            bench_batch=16,
        ),
        *_hf_specs(),
    ]
    return {s.name: s for s in specs}


def get_model(name: str) -> ModelSpec:
    """The zoo entry ``name``; a clear error listing what exists otherwise."""
    zoo = model_zoo()
    if name not in zoo:
        hint = " (install `transformers` for the hf-* models)" if name.startswith("hf-") else ""
        raise KeyError(f"no model {name!r} in stoker's zoo; available: {', '.join(zoo)}{hint}")
    return zoo[name]
