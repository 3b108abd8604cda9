"""The GPU model suite: the configurations of the first H100 run, side by side.

``stoker bench --suite gpu`` (= ``stoker bench gpu``) trains
six training configurations measured on an H100 (docs/benchmarks.md)
(forward + backward + AdamW, fp32 or bf16 autocast) and the small,
launch-bound forward + backward table, with every backend of
`SUITE_BACKENDS`.  ``--smoke`` runs the same code at tiny sizes on whatever
device there is, so the script cannot rot on a machine without a GPU.

Each (configuration, backend) runs in a fresh process (`bench.worker`), which
reports the first step, the steady median, peak memory, kernels per step and
its loss curve and final parameters; the driver compares those with eager's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .models import GPT, Batch, GPTConfig, SmallCNN, hf_loss, hf_model, lm_loss

# Backend name -> how the worker wraps the model (see `wrap_model`).
SUITE_BACKENDS = ("eager", "inductor", "inductor-ro", "stoker", "stoker-ro")


# ----------------------------------------------------------------------------- models


class WideMLP(nn.Module):
    """mlp-l: d→4d GELU → LayerNorm → 4d SiLU → d (an MSE regression)."""

    def __init__(self, d: int = 1024) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.ln = nn.LayerNorm(4 * d)
        self.fc2 = nn.Linear(4 * d, 4 * d)
        self.fc3 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(F.gelu(self.fc1(x)))
        return self.fc3(F.silu(self.fc2(h)))  # type: ignore[no-any-return]


class ConvNet(nn.Module):
    """cnn-m: 3×(conv3×3 + BatchNorm) with ReLU / SiLU / GELU, max-pools, a linear head."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        chans = [3, width, 2 * width, 4 * width]
        self.convs = nn.ModuleList(
            nn.Conv2d(chans[i], chans[i + 1], 3, padding=1, bias=False) for i in range(3)
        )
        self.bns = nn.ModuleList(nn.BatchNorm2d(c) for c in chans[1:])
        self.acts: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (F.relu, F.silu, F.gelu)
        self.head = nn.Linear(chans[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            x = self.acts[i](bn(conv(x)))
            if i < 2:
                x = F.max_pool2d(x, 2)
        return self.head(x.mean(dim=(2, 3)))  # type: ignore[no-any-return]


def _tokens(n: int, seq: int, vocab: int, gen: torch.Generator) -> Batch:
    s = torch.randint(0, vocab, (n, seq + 1), generator=gen)
    return (s[:, :-1],), s[:, 1:]


# ----------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class SuiteEntry:
    """One configuration: a model of a fixed size, its batch, precision and step kind."""

    name: str
    description: str
    build: Callable[[dict[str, int]], nn.Module]
    batch: Callable[[dict[str, int], torch.Generator], Batch]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    size: dict[str, int]  # the full size (the H100 measurements')
    smoke: dict[str, int]  # the same model, tiny (``--smoke``)
    autocast: torch.dtype | None = None  # bf16 autocast around forward + loss
    optimizer: bool = True  # AdamW step (the model table) or forward + backward only
    table: str = "models"  # "models" or "small"

    def sized(self, smoke: bool) -> dict[str, int]:
        return self.smoke if smoke else self.size


def _gpt(s: dict[str, int]) -> nn.Module:
    cfg = GPTConfig(
        vocab_size=s["vocab"],
        block_size=s["seq"],
        n_layer=s["layers"],
        n_head=s["heads"],
        n_embd=s["hidden"],
        tie_weights=bool(s.get("tie", 0)),
    )
    return GPT(cfg)


def _token_batch(s: dict[str, int], gen: torch.Generator) -> Batch:
    return _tokens(s["batch"], s["seq"], s["vocab"], gen)


def _image_batch(s: dict[str, int], gen: torch.Generator) -> Batch:
    x = torch.randn(s["batch"], 3, s["image"], s["image"], generator=gen)
    return (x,), torch.randint(0, 10, (s["batch"],), generator=gen)


def _mlp_batch(s: dict[str, int], gen: torch.Generator) -> Batch:
    x = torch.randn(s["batch"], s["d"], generator=gen)
    return (x,), torch.randn(s["batch"], s["d"], generator=gen)


def _ce(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), target)


def _mse(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target)


_GPT_M = {"vocab": 8192, "seq": 256, "layers": 4, "heads": 4, "hidden": 512, "tie": 1, "batch": 16}
_GPT_S = {"vocab": 64, "seq": 16, "layers": 1, "heads": 2, "hidden": 32, "tie": 1, "batch": 2}
_LLAMA_M = {
    "vocab": 4096,
    "seq": 128,
    "layers": 4,
    "hidden": 256,
    "heads": 8,
    "kv_heads": 4,
    "intermediate": 688,
    "batch": 8,
}
_LLAMA_S = {
    "vocab": 64,
    "seq": 8,
    "layers": 1,
    "hidden": 32,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 64,
    "batch": 2,
}
_GPT2_M = {"vocab": 4096, "seq": 128, "layers": 4, "hidden": 256, "heads": 8, "batch": 8}
_GPT2_S = {"vocab": 64, "seq": 8, "layers": 1, "hidden": 32, "heads": 2, "batch": 2}

SUITE: tuple[SuiteEntry, ...] = (
    SuiteEntry(
        "gpt-m",
        "4 pre-LN blocks, d=512, 4 heads, T=256, batch 16, vocab 8192, tied head, fp32",
        _gpt,
        _token_batch,
        lm_loss,
        _GPT_M,
        _GPT_S,
    ),
    SuiteEntry(
        "gpt-m-bf16",
        "gpt-m under bf16 autocast",
        _gpt,
        _token_batch,
        lm_loss,
        _GPT_M,
        _GPT_S,
        autocast=torch.bfloat16,
    ),
    SuiteEntry(
        "hf-llama",
        "LlamaForCausalLM, 4 layers, hidden 256, 8 heads, 4 kv heads, ffn 688, vocab 4096, 8×128",
        lambda s: hf_model("llama", **s),
        _token_batch,
        hf_loss,
        _LLAMA_M,
        _LLAMA_S,
    ),
    SuiteEntry(
        "hf-gpt2",
        "GPT2LMHeadModel, 4 layers, 256 wide, 8 heads, vocab 4096, 8×128",
        lambda s: hf_model("gpt2", **s),
        _token_batch,
        hf_loss,
        _GPT2_M,
        _GPT2_S,
    ),
    SuiteEntry(
        "mlp-l",
        "1024→4096 GELU → LayerNorm → 4096 SiLU → 1024, MSE, batch 512",
        lambda s: WideMLP(s["d"]),
        _mlp_batch,
        _mse,
        {"d": 1024, "batch": 512},
        {"d": 16, "batch": 8},
    ),
    SuiteEntry(
        "cnn-m-bf16",
        "3×(conv3×3 + BatchNorm) ReLU/SiLU/GELU, max-pools, 64×64 images, batch 64, bf16 autocast",
        lambda s: ConvNet(s["width"]),
        _image_batch,
        _ce,
        {"width": 32, "image": 64, "batch": 64},
        {"width": 4, "image": 8, "batch": 2},
        autocast=torch.bfloat16,
    ),
    # The small, launch-bound table: forward + backward only.
    SuiteEntry(
        "tiny-gpt",
        "2 blocks, d=64, T=32, batch 4 (forward + backward)",
        _gpt,
        _token_batch,
        lm_loss,
        {"vocab": 65, "seq": 32, "layers": 2, "heads": 2, "hidden": 64, "batch": 4},
        {"vocab": 16, "seq": 8, "layers": 1, "heads": 2, "hidden": 16, "batch": 2},
        optimizer=False,
        table="small",
    ),
    SuiteEntry(
        "small-cnn",
        "conv-BN-ReLU ×2, pools, linear; 3×16×16, batch 16 (forward + backward)",
        lambda s: SmallCNN(width=s["width"]),
        _image_batch,
        _ce,
        {"width": 8, "image": 16, "batch": 16},
        {"width": 4, "image": 8, "batch": 2},
        optimizer=False,
        table="small",
    ),
    SuiteEntry(
        "tiny-llama",
        "Llama, 2 layers, hidden 32 (forward + backward)",
        lambda s: hf_model("llama", **s),
        _token_batch,
        hf_loss,
        {**_LLAMA_S, "layers": 2, "seq": 32, "batch": 4},
        _LLAMA_S,
        optimizer=False,
        table="small",
    ),
)


def get_entry(name: str) -> SuiteEntry:
    for e in SUITE:
        if e.name == name:
            return e
    raise KeyError(f"no suite entry {name!r}; available: {', '.join(e.name for e in SUITE)}")


def wrap_model(model: nn.Module, backend: str) -> Any:
    """The model as each suite backend runs it."""
    if backend == "eager":
        return model
    if backend in ("inductor", "inductor-ro"):
        mode = "reduce-overhead" if backend == "inductor-ro" else None
        return torch.compile(model, mode=mode)
    if backend in ("stoker", "stoker-ro"):
        import stoker

        if backend == "stoker-ro":
            return stoker.compile(model, mode="reduce-overhead")
        return stoker.compile(model)
    raise ValueError(f"unknown suite backend {backend!r}; choose from {', '.join(SUITE_BACKENDS)}")


def count_device_kernels(step: Callable[[], object]) -> int | None:
    """Kernels one ``step()`` launches on the GPU (profiler events), or None on a CPU."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    from ..report.kineto import quiet_profile

    with quiet_profile(profile(activities=[ProfilerActivity.CUDA])) as prof:
        step()
        torch.cuda.synchronize()
    return sum(
        1
        for e in prof.events()
        if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))
    )


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(|b|, tiny): the parity measure of the suite."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare_runs(run: dict[str, Any], eager: dict[str, Any]) -> dict[str, float]:
    """Loss-curve and final-parameter differences of ``run`` against the eager run."""
    out: dict[str, float] = {}
    la, lb = run.get("losses"), eager.get("losses")
    if la and lb and len(la) == len(lb):
        out["loss_rel"] = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(la, lb))
    pa, pb = run.get("params_path"), eager.get("params_path")
    if pa and pb:
        sa = torch.load(pa, map_location="cpu")
        sb = torch.load(pb, map_location="cpu")
        out["params_rel"] = max((rel_diff(sa[k], sb[k]) for k in sb if k in sa), default=math.nan)
    return out
