"""timm image models trained through ``stoker.compile`` against eager: a ResNet and a
ViT at 32x32 (small enough for the CPU), a few AdamW steps on fresh random batches,
comparing the loss, every gradient and every parameter and buffer after each step.

timm imports torchvision (``torchvision.ops.misc``, its transforms), and only its
Python parts.  PyPI's torchvision for torch 2.13 is a CUDA build whose C extension
cannot load beside the CPU torch, and its import then stops at
``register_fake("torchvision::nms")`` ("operator torchvision::nms does not exist").
The test sessions therefore install torchvision with ``--no-deps`` into a folder of
its own (``STOKER_TEST_TORCHVISION``; docs/contributing.md), out of the way of every
other test (transformers imports torchvision whenever it can find it), and
`_import_timm` puts that folder on ``sys.path`` in this process only, importing
torchvision without its fake-op registrations when its C ops are missing.  Where
torchvision's C ops load (a CUDA torch, a CPU torchvision) it is imported as it is.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import stoker
import stoker_autograd

# name -> timm.create_model keywords: 10 classes, 32x32 inputs
MODELS: dict[str, dict[str, Any]] = {
    "resnet18": {},
    "vit_tiny_patch16_224": {"img_size": 32, "patch_size": 8},
}


def _import_timm() -> Any:
    """timm, with torchvision's Python parts (see the module docstring); skips, saying
    how to install them, where timm or torchvision is absent."""
    extra = os.environ.get("STOKER_TEST_TORCHVISION", "")
    if extra and extra not in sys.path:
        sys.path.append(extra)
    missing = [m for m in ("timm", "torchvision") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"needs {' and '.join(missing)} (nox installs them for integration; by hand: "
            "docs/contributing.md, 'timm and torchvision')"
        )
    try:
        importlib.import_module("torchvision")
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        # The C extension did not load, so the ops that torchvision's fake-tensor
        # registrations name do not exist; timm calls none of them.  Import it again
        # with that one module stubbed.
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        stub = types.ModuleType("torchvision._meta_registrations")
        stub.__doc__ = "stubbed by the test: torchvision's C ops are not loaded"
        sys.modules[stub.__name__] = stub
        importlib.import_module("torchvision")
    return importlib.import_module("timm")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_timm_model_trains_like_eager(name: str) -> None:
    timm = _import_timm()
    torch.manual_seed(0)
    eager = timm.create_model(name, num_classes=10, **MODELS[name])
    model = copy.deepcopy(eager)
    compiled = stoker.compile(model)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, eps=1e-6)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    gen = torch.Generator().manual_seed(1)
    before = stoker_autograd.stats()
    for step in range(3):
        x = torch.randn(4, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (4,), generator=gen)
        with stoker.autograd_enabled(False):  # eager's own engine
            loss_e = F.cross_entropy(eager(x), y)
            opt_e.zero_grad(set_to_none=True)
            loss_e.backward()
        loss_c = F.cross_entropy(compiled(x), y)
        opt_c.zero_grad(set_to_none=True)
        loss_c.backward()
        where = f"{name}, step {step}"
        torch.testing.assert_close(
            loss_c, loss_e, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"loss, {w}: {m}"
        )
        for (pname, pe), pc in zip(eager.named_parameters(), model.parameters(), strict=True):
            assert pc.grad is not None and pe.grad is not None, f"{pname}: no gradient, {where}"
            # (after the first step the two models' parameters differ in their last bits,
            # batch norm's statistics with them: an absolute tolerance that follows the
            # gradient's own scale)
            torch.testing.assert_close(
                pc.grad,
                pe.grad,
                rtol=1e-3,
                atol=max(1e-4, 3e-3 * float(pe.grad.abs().max())),
                msg=lambda m, p=pname, w=where: f"grad of {p}, {w}: {m}",
            )
        opt_e.step()
        opt_c.step()
        # AdamW's first steps divide each gradient by its own size: a gradient near zero
        # that differs in its last bits (a batch-norm sum over N*H*W in another order)
        # moves its parameter by up to a few tenths of lr (1e-3) apart from eager's
        for (pname, pe), pc in zip(eager.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(
                pc, pe, rtol=1e-4, atol=3e-4, msg=lambda m, p=pname, w=where: f"{p}, {w}: {m}"
            )
        for (bname, be), bc in zip(eager.named_buffers(), model.buffers(), strict=True):
            torch.testing.assert_close(
                bc, be, rtol=1e-4, atol=1e-5, msg=lambda m, b=bname, w=where: f"{b}, {w}: {m}"
            )
        # each step starts from eager's weights: fused kernels sum in another order, and
        # AdamW would carry those last bits from step to step (the drift, not the gradients,
        # is what grew); the steps still check that the compiled step writes in place
        with torch.no_grad():
            for pe, pc in zip(eager.parameters(), model.parameters(), strict=True):
                pc.copy_(pe)
            for be, bc in zip(eager.buffers(), model.buffers(), strict=True):
                bc.copy_(be)
    after = stoker_autograd.stats()
    report = compiled.stoker_report
    # one forward graph, compiled once; the backward captured once, then replayed
    assert report.n_graphs == 1 and not report.recompiles, report.summary()
    assert after["captures"] - before["captures"] == 1, (before, after)
    assert after["cache_hits"] - before["cache_hits"] == 2, (before, after)
    assert after["fallbacks"] == before["fallbacks"], (before, after)
