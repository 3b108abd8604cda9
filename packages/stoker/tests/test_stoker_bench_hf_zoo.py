"""`stoker bench hf_zoo`'s parity check: it must compare, and catch a wrong gradient.

The whole zoo runs in the benchmark (docs/benchmarks.md; its smoke size, stoker's C
backend on two architectures, in tests-integration/test_tools_smoke.py); here a tiny
model goes through the same worker in this process, trained by eager, by a second
eager copy (which must pass) and by backends that are wrong on purpose.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from stoker._internal.bench.benchmarks import hf_zoo


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.b(torch.tanh(self.a(x))), labels)


def _tiny() -> tuple[Any, dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=gen)
    return _Tiny(), {"x": x, "labels": torch.randint(0, 4, (6,), generator=gen)}


def _same(model: nn.Module) -> nn.Module:
    return model


def _perturbed(model: nn.Module) -> nn.Module:
    """A backend whose gradient of one weight is off by 1e-3 (a hook on the parameter)."""
    p = model.get_parameter("b.weight")
    p.register_hook(lambda g: g + 1e-3)
    return model


def _loss_off(model: nn.Module) -> Any:
    return lambda **kw: model(**kw) * (1 + 1e-3)


def _raises(model: nn.Module) -> Any:
    def fn(**kw: Any) -> Any:
        raise RuntimeError("no kernel for this op")

    return fn


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(hf_zoo.EXTRA_MODELS, "tiny", _tiny)
    for name, fn in {
        "same": _same,
        "perturbed": _perturbed,
        "loss_off": _loss_off,
        "raises": _raises,
    }.items():
        monkeypatch.setitem(hf_zoo.EXTRA_BACKENDS, name, fn)


def test_parity_passes_a_copy_and_fails_a_perturbed_gradient(tiny: None) -> None:
    row = hf_zoo.parity_worker("tiny", ["eager", "same", "perturbed"], 3, 1e-4, 1e-5)
    # 3 losses + 3 steps x 4 parameters, each compared
    assert row["same_compared"] == row["perturbed_compared"] == 15
    assert row["same_ok"] is True and row["same_max_diff"] == 0.0, row
    assert row["perturbed_ok"] is False and row["passed"] is False, row
    assert row["perturbed_worst"].startswith("b.weight@"), row
    assert row["perturbed_grad_diff"] == pytest.approx(1e-3, rel=1e-3), row
    assert "perturbed: worst b.weight@" in hf_zoo._why(row, ["eager", "same", "perturbed"])


def test_parity_fails_a_wrong_loss_and_a_backend_that_raises(tiny: None) -> None:
    row = hf_zoo.parity_worker("tiny", ["eager", "loss_off", "raises"], 2, 1e-4, 1e-5)
    assert row["loss_off_ok"] is False and row["loss_off_worst"].startswith("loss@"), row
    assert "no kernel for this op" in row["raises_error"] and "raises_ok" not in row, row
    assert row["passed"] is False


def test_compare_needs_something_to_compare() -> None:
    empty = {"losses": [], "grads": []}
    assert hf_zoo.compare(empty, empty, 1e-4, 1e-5)["ok"] is False
    t = torch.ones(3)
    one = {"losses": [t.sum()], "grads": [{"w": t}]}
    assert hf_zoo.compare(one, one, 0.0, 0.0)["ok"] is True
    nan = {"losses": [t.sum()], "grads": [{"w": torch.tensor([1.0, float("nan"), 1.0])}]}
    assert hf_zoo.compare(nan, one, 1e-4, 1e-5)["ok"] is False
    assert hf_zoo.identical(one, one) and not hf_zoo.identical(nan, one)


def test_zoo_names_classes_of_the_installed_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    missing = [
        n
        for n, a in hf_zoo.ZOO.items()
        if not (hasattr(transformers, a.config) and hasattr(transformers, a.model))
    ]
    assert not missing, missing
    assert len(hf_zoo.ZOO) >= 28 and not set(hf_zoo.ZOO) & set(hf_zoo.EXCLUDED)
