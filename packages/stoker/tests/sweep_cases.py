"""Small training situations for the sweep (`test_stoker_sweep_training.py`).

Each case trains an eager model and a ``stoker.compile``'d deep copy side by side for a
few optimizer steps on fresh random inputs, and compares forward outputs, losses,
every parameter gradient, and the buffers and parameters after each step.  ``run_case(..., device="cuda", backend="triton")`` runs the
same case on a GPU with stoker's Triton executor (`test_stoker_sweep_gpu.py`): models
and batches moved there, TF32 off on both sides.  A case is a model builder, a batch maker and a *step*: how
the loss is turned into gradients (``backward()``, ``autograd.grad``, accumulation ...).
Importable by name so the interpreter tests can run cases in a fresh process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
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


# fp32 tolerances (rtol, atol) by device.  CUDA: Triton's fused kernels reduce in another
# order than ATen's, and the difference grows over the optimizer steps; matmuls and convs
# run with TF32 off (`_fp32_matmuls`), so the error stays fp32's: a few times CPU's bound,
# far below what a wrong kernel gives.
_FP32_TOL: dict[str, tuple[float, float]] = {"cpu": (1e-4, 1e-5), "cuda": (3e-4, 3e-5)}


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
        rtol, atol = _FP32_TOL[want.device.type]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@dataclass
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], Batch]
    step: Step
    batch_sizes: Sequence[int] = (4, 4, 4)
    bf16: bool = False
    compile_kw: dict[str, Any] = field(default_factory=dict)
    # how the model is compiled, given the mode's options (default: stoker.compile)
    compiler: Callable[..., Any] | None = None
    optimizer: str = "sgd"  # a key of _OPTIMIZERS: "sgd" (SGD + momentum), "adamw", "adamw_eps"


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
    # AdamW scales a step to about lr whatever the gradient's size, so a parameter whose
    # exact gradient is 0 (an attention key bias, a bias before a norm) would step by
    # lr * sign(rounding noise), differently on each side; eps damps steps of tiny gradients
    "adamw_eps": lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-3),
}


def to_device(batch: Batch, device: str) -> Batch:
    """The batch's tensors on `device` (strides, storage offset, view-ness and requires_grad
    kept); Python values as they are.  On the CPU the batch itself (the CPU sweep's path)."""
    if torch.device(device).type == "cpu":
        return batch
    return tuple(_moved(t, device) if isinstance(t, torch.Tensor) else t for t in batch)


def _moved(t: torch.Tensor, device: str) -> torch.Tensor:
    if t._base is None:  # a fresh tensor is dense: `.to` keeps its strides
        return t.to(device).requires_grad_(t.requires_grad)
    # a view (transposed, expanded, sliced with an offset): its whole storage moved, the
    # same view taken there (`.to` would make a non-dense one contiguous)
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size()
    flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (n,), (1,))
    view: torch.Tensor = flat.to(device).as_strided(t.shape, t.stride(), t.storage_offset())
    return view.requires_grad_(t.requires_grad)


@contextmanager
def _fp32_matmuls(device: str) -> Iterator[None]:
    """TF32 off for CUDA matmuls and cuDNN convs (cuDNN's default is on) while a case runs:
    eager and stoker both then compute in fp32 (stoker's Triton kernels leave matmuls and
    convs to ATen), so fp32 tolerances fit."""
    if torch.device(device).type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def run_case(case: Case, backend: str = "aten", mode: str = "ca", device: str = "cpu") -> Any:
    """Train eager and compiled copies with the case's optimizer on `device`; compare every
    step.  Batches are drawn on the CPU (the same numbers on every device) and moved.
    Returns the compiled model."""
    with _fp32_matmuls(device):
        return _run_case(case, backend, mode, device)


def _run_case(case: Case, backend: str, mode: str, device: str) -> Any:
    compile_kw, autograd_on = MODES[mode]
    torch.manual_seed(0)
    eager = case.build().to(device)
    torch.manual_seed(0)  # built again, not deep-copied: hooks must close over their own model
    model = case.build().to(device)
    compile_fn = case.compiler or stoker.compile
    compiled = compile_fn(model, backend=backend, **case.compile_kw, **compile_kw)
    pe = dict(eager.named_parameters())
    # (a part compiled on its own is reached through its `_orig_mod`)
    pc = {k.replace("_orig_mod.", ""): p for k, p in model.named_parameters()}
    opt_e, opt_c = (_OPTIMIZERS[case.optimizer](list(p.values())) for p in (pe, pc))
    gen = torch.Generator().manual_seed(1)
    for i, n in enumerate(case.batch_sizes):
        batch = to_device(case.batch(n, gen), device)
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
            assert (gc is None) == (ge is None), f"grad of {name}, {where}: {gc} vs {ge}"
            if ge is not None:
                _close(gc, ge, f"grad of {name}, {where}", case.bf16)
        opt_e.step()
        opt_c.step()
        for (name, a), b in zip(model.named_buffers(), eager.buffers()):
            _close(a, b, f"buffer {name} after {where}", case.bf16)
        for name, p in pe.items():
            _close(pc[name].detach(), p.detach(), f"parameter {name} after {where}", case.bf16)
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
