"""Small training situations for the sweep (`test_stoker_sweep_training.py`).

Each case trains an eager model and a ``stoker.compile``'d deep copy side by side for a
few optimizer steps on fresh random inputs, and compares forward outputs, losses and
every parameter gradient.  A case is a model builder, a batch maker and a *step*: how
the loss is turned into gradients (``backward()``, ``autograd.grad``, accumulation ...).
Importable by name so the interpreter tests can run cases in a fresh process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import stoker

Batch = tuple[Any, ...]  # tensors (and Python scalars passed to the model)
# step(model, params, batch) -> (forward outputs to compare, grads by parameter name)
Step = Callable[[Callable[..., Any], dict[str, nn.Parameter], Batch], tuple[Any, dict[str, Any]]]


def _outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _outputs(o)]
    return []


def _close(got: torch.Tensor, want: torch.Tensor, what: str, bf16: bool) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not want.is_floating_point():  # ids, masks, counters: exact
        assert torch.equal(got, want), f"{what}: {got} != {want}"
    elif bf16:  # relative to the tensor's largest magnitude (see test_stoker_autocast.py)
        scale = float(want.abs().max()) or 1.0
        err = float((got.float() - want.float()).abs().max())
        assert err <= 2e-2 * scale, f"{what}: max error {err:.3g} > 2e-2 * {scale:.3g}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


@dataclass
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], Batch]
    step: Step
    batch_sizes: Sequence[int] = (4, 4, 4)
    bf16: bool = False
    compile_kw: dict[str, Any] = field(default_factory=dict)
    # modes where a zero gradient may stand for eager's None (a documented difference)
    zero_for_none: tuple[str, ...] = ()
    # how the model is compiled, given the mode's options (default: stoker.compile)
    compiler: Callable[..., Any] | None = None
    optimizer: str = "sgd"  # "sgd" (SGD + momentum) or "adamw"


# How the compiled model's backward runs: through stoker-autograd (the default), with
# compiled autograd off at compile time, or paused around the backward (the AOT backward
# then runs as torch's autograd.Function: with static sizes compiled at its first call).
MODES: dict[str, tuple[dict[str, Any], bool]] = {
    "ca": ({}, True),
    "no_ca": ({"compiled_autograd": False}, False),
    "ca_paused": ({}, False),
}


_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


def run_case(case: Case, backend: str = "aten", mode: str = "ca") -> Any:
    """Train eager and compiled copies with the case's optimizer; compare every step.
    Returns the compiled model."""
    compile_kw, autograd_on = MODES[mode]
    torch.manual_seed(0)
    eager = case.build()
    torch.manual_seed(0)  # built again, not deep-copied: hooks must close over their own model
    model = case.build()
    compile_fn = case.compiler or stoker.compile
    compiled = compile_fn(model, backend=backend, **case.compile_kw, **compile_kw)
    pe = dict(eager.named_parameters())
    # (a part compiled on its own is reached through its `_orig_mod`)
    pc = {k.replace("_orig_mod.", ""): p for k, p in model.named_parameters()}
    opt_e, opt_c = (_OPTIMIZERS[case.optimizer](list(p.values())) for p in (pe, pc))
    gen = torch.Generator().manual_seed(1)
    for i, n in enumerate(case.batch_sizes):
        batch = case.batch(n, gen)
        batch_c = tuple(
            t.clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in batch
        )
        with stoker.autograd_enabled(False):
            opt_e.zero_grad(set_to_none=True)
            out_e, grads_e = case.step(eager, pe, batch)
        opt_c.zero_grad(set_to_none=True)
        with stoker.autograd_enabled(autograd_on) if mode == "ca_paused" else nullcontext():
            out_c, grads_c = case.step(compiled, pc, batch_c)
        where = f"step {i} (batch {n})"
        oe, oc = _outputs(out_e), _outputs(out_c)
        assert len(oe) == len(oc), (where, len(oe), len(oc))
        for k, (a, b) in enumerate(zip(oc, oe)):
            _close(a.detach(), b.detach(), f"output {k}, {where}", case.bf16)
        assert grads_c.keys() == grads_e.keys(), where
        for name, ge in grads_e.items():
            gc = grads_c[name]
            if ge is None and gc is not None and mode in case.zero_for_none:
                assert not gc.any(), f"grad of {name}, {where}: {gc} where eager has None"
                continue
            assert (gc is None) == (ge is None), f"grad of {name}, {where}: {gc} vs {ge}"
            if ge is not None:
                _close(gc, ge, f"grad of {name}, {where}", case.bf16)
        opt_e.step()
        opt_c.step()
        for (name, a), b in zip(model.named_buffers(), eager.buffers()):
            _close(a, b, f"buffer {name} after {where}", case.bf16)
    return compiled


def dot_grads(params: dict[str, nn.Parameter]) -> dict[str, Any]:
    return {k: (None if p.grad is None else p.grad.clone()) for k, p in params.items()}


def backward_step(model: Callable[..., Any], params: dict[str, nn.Parameter], b: Batch) -> Any:
    out = model(*b[:-1])
    loss = F.mse_loss(out, b[-1])
    loss.backward()
    return (out, loss), dot_grads(params)


class MLP(nn.Module):
    def __init__(self, d: int = 8, h: int = 16, o: int = 4) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def mlp_batch(n: int, gen: torch.Generator) -> Batch:
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)
