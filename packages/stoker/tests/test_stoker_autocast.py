"""Training under CPU bf16 autocast through ``stoker.compile`` and ``backend="stoker"``.

Reference: eager with the forward inside ``torch.autocast("cpu", dtype=torch.bfloat16)``
and the backward outside it.  The model has an fp32 region inside the autocast
region (a rotary embedding under ``autocast(enabled=False)``, as HF Llama), which
a compiled graph run under autocast again would compute in bf16.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from interpret_script import run_interpreted

import stoker


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, and within 1e-2 of the largest magnitude (2.5 bf16 ulps of it).

    Element-wise bf16 tolerances would hide a whole tensor off by a bf16 rounding when
    its values are small (gradients of a mean loss); this scales to the tensor.
    """
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    scale = float(want.abs().max()) or 1.0
    err = float((got - want).abs().max())
    assert err <= 1e-2 * scale, f"{what}: max error {err:.3g} > 1e-2 * max |eager| ({scale:.3g})"


@pytest.fixture(autouse=True)
def fresh_stoker() -> Iterator[None]:
    stoker.reset()
    yield
    stoker.reset()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class AttnBlock(nn.Module):
    """LayerNorm, attention with a rotary embedding computed in fp32, sinusoidal position
    features from the same fp32 angles, an MLP, a head."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 4)
        self.pos_proj = nn.Linear(2 * self.hd, d)
        inv = 1.0 / (100.0 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rotary(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", enabled=False):  # fp32 angles, as HF Llama
            freqs = (self.inv_freq[:, None].float() @ pos[None, :].float()).T
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        cos, sin = self.rotary(pos)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        x = x + self.pos_proj(torch.cat((cos, sin), dim=-1))
        x = x + self.mlp(self.ln2(x))
        return self.head(x).float().mean(1)


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 6, 16, generator=gen)
    pos = torch.arange(6) + 200  # far positions: bf16 angles would be off by ~0.5
    return x, pos, torch.randint(0, 4, (3,), generator=gen)


def _train(model: nn.Module, fwd: Callable[..., Any], steps: int = 3) -> list[dict[str, Any]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    log = []
    for _ in range(steps):
        x, pos, y = _batch(gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fwd(x, pos)
            loss = F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        log.append({"out": out.detach(), "loss": loss.detach(), "grads": grads, "params": params})
    return log


@pytest.mark.parametrize("how", ["stoker.compile", "torch.compile"])
def test_training_under_bf16_autocast_matches_eager(how: str) -> None:
    torch.manual_seed(0)
    eager = AttnBlock()
    model = copy.deepcopy(eager)
    compiled = (
        stoker.compile(model) if how == "stoker.compile" else torch.compile(model, backend="stoker")
    )
    with stoker.autograd_enabled(False):
        want = _train(eager, eager)
    got = _train(model, compiled)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_bf16_close(g["out"], w["out"], f"output, step {step}")
        assert_bf16_close(g["loss"], w["loss"], f"loss, step {step}")
        assert g["grads"].keys() == w["grads"].keys()
        for n in w["grads"]:
            assert g["grads"][n].dtype == torch.float32, n
            assert_bf16_close(g["grads"][n], w["grads"][n], f"grad of {n}, step {step}")
        for n in w["params"]:
            assert_bf16_close(g["params"][n], w["params"][n], f"{n} after SGD, step {step}")


def mixed(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The issue's fp32 region between two autocast matmuls."""
    h = x @ w
    with torch.autocast("cpu", enabled=False):
        r = torch.cos(h.float() @ w.float())
    return r, r @ w


@pytest.mark.parametrize("how", ["stoker.compile", "torch.compile"])
def test_same_compiled_fn_inside_and_outside_autocast(how: str) -> None:
    compiled = (
        stoker.compile(mixed) if how == "stoker.compile" else torch.compile(mixed, backend="stoker")
    )
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(8, 8, generator=gen) * 0.3
    contexts: list[Callable[[], Any]] = [
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        lambda: torch.autocast("cpu", enabled=False),
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        lambda: torch.autocast("cpu", dtype=torch.float16),
    ]
    for ctx in contexts:
        with ctx():
            got, want = compiled(x, w), mixed(x, w)
        for g, e in zip(got, want):
            assert g.dtype == e.dtype, (g.dtype, e.dtype)
            torch.testing.assert_close(g, e, atol=3e-2, rtol=3e-2)


_INTERPRET_REPRO = """
import torch, stoker
def f(a, b):
    with torch.autocast("cpu", enabled=False):
        return torch.cos(a.float() @ b.float())
a, b = torch.randn(8, 8), torch.randn(8, 8)
with torch.autocast("cpu", dtype=torch.bfloat16):
    e = f(a, b)
    c = torch.compile(f, backend=stoker.backend.with_options(backend="interpret"))(a, b)
assert c.dtype == e.dtype == torch.float32, (c.dtype, e.dtype)
torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_issue_repro_with_triton_kernels_under_the_interpreter() -> None:
    """``tl.cos`` refused the bf16 value autocast made of the fp32 region's matmul."""
    pytest.importorskip("triton")
    run_interpreted(_INTERPRET_REPRO)
