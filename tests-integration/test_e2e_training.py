"""End to end: training through stoker matches eager PyTorch, step by step.

Paths: `stoker.compile` (aten executor), ``torch.compile(backend="stoker")``
and, at tiny sizes, `stoker.compile(backend="interpret")` (Triton kernels under
the interpreter).  Also: varying batch sizes recompile at most once, and the
backward really runs through stoker-autograd (its counters move).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import stoker
import stoker_autograd


def _stats() -> dict[str, int]:
    return dict(stoker_autograd.stats())


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_stoker_compile_matches_eager(name: str, train_and_compare: Callable[..., Any]) -> None:
    before = _stats()
    compiled = train_and_compare(name, lambda m: stoker.compile(m, backend="aten"))
    after = _stats()
    rep = compiled.stoker_report
    assert rep.n_graphs >= 1 and all(c.error is None for c in rep.compiles)
    assert all(c.executor == "aten" for c in rep.compiles)
    # backward went through stoker-autograd: one capture, then replays from its cache
    assert after["captures"] > before["captures"], (before, after)
    assert after["captures"] + after["cache_hits"] - before["captures"] - before["cache_hits"] >= 3


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_torch_compile_backend_stoker_matches_eager(
    name: str, train_and_compare: Callable[..., Any]
) -> None:
    before = _stats()
    train_and_compare(name, lambda m: torch.compile(m, backend="stoker"))
    assert stoker.backend.report.n_graphs >= 1
    assert _stats()["captures"] > before["captures"], (
        "backend='stoker' did not engage stoker-autograd"
    )


def test_compiled_autograd_can_be_switched_off(train_and_compare: Callable[..., Any]) -> None:
    before = _stats()
    train_and_compare("mlp", lambda m: stoker.compile(m, compiled_autograd=False))
    after = _stats()
    assert after["captures"] == before["captures"] and after["cache_hits"] == before["cache_hits"]


def test_varying_batch_recompiles_at_most_once(train_and_compare: Callable[..., Any]) -> None:
    compiled = train_and_compare("mlp", lambda m: stoker.compile(m), batch_sizes=(4, 8, 6, 10, 3))
    rep = compiled.stoker_report
    assert len(rep.recompiles) <= 1, [r.reason for r in rep.recompiles]
    assert rep.n_graphs <= 2, [c.frame for c in rep.compiles]
    if rep.recompiles:  # automatic dynamic: the recompile says which size changed
        assert "size" in rep.recompiles[0].reason


def test_dynamic_true_compiles_once(train_and_compare: Callable[..., Any]) -> None:
    compiled = train_and_compare(
        "gpt", lambda m: stoker.compile(m, dynamic=True), batch_sizes=(2, 5, 3)
    )
    rep = compiled.stoker_report
    assert rep.n_graphs == 1 and not rep.recompiles
    shape_guards = [g for c in rep.compiles for g in c.guards if g.kind.startswith("shape")]
    assert shape_guards, "a dynamic batch should leave shape guards in the report"


_INTERPRET_SCRIPT = """
import copy, json, sys, torch, stoker, stoker_autograd
from stoker._internal.bench.models import get_model
spec = get_model(sys.argv[1])
b = json.loads(sys.argv[2])
ca = sys.argv[3] == "1"
model = spec.build(seed=0, **b)
eager = copy.deepcopy(model)
c = stoker.compile(model, backend="interpret", compiled_autograd=ca)
opt_c = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, eps=1e-6)
gen = torch.Generator().manual_seed(1)
worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
for step in range(2):
    inputs, target = spec.batch(4, gen, **b)
    with stoker.autograd_enabled(False):
        le = spec.loss(eager(*inputs), target); opt_e.zero_grad(); le.backward()
    lc = spec.loss(c(*inputs), target); opt_c.zero_grad(); lc.backward()
    worst["loss"] = max(worst["loss"], abs(float(lc) - float(le)))
    worst["grad"] = max([worst["grad"]] + [(p.grad - q.grad).abs().max().item()
                         for p, q in zip(model.parameters(), eager.parameters())])
    opt_c.step(); opt_e.step()
    worst["param"] = max([worst["param"]] + [(p - q).abs().max().item()
                          for p, q in zip(model.parameters(), eager.parameters())])
rep = c.stoker_report
print(json.dumps({"worst": worst, "executors": sorted({r.executor for r in rep.compiles}),
                  "kernels": rep.n_kernels, "autograd": stoker_autograd.stats()}))
"""


TINY = {
    "mlp": {"d_in": 8, "hidden": 16, "d_out": 4, "depth": 1},
    "gpt": {"vocab_size": 16, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16},
    "cnn": {"channels": 2, "width": 4, "classes": 3},
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "compiled_autograd"),
    [
        ("mlp", True),
        ("gpt", True),
        ("cnn", True),
        ("cnn", False),
        ("hf-gpt2", True),
        ("hf-llama", True),
    ],
    ids=["mlp", "gpt", "cnn", "cnn-aot-backward", "hf-gpt2", "hf-llama"],
)
def test_interpret_backend_tiny(name: str, compiled_autograd: bool, tmp_path: Path) -> None:
    """Triton kernels under the interpreter, at tiny sizes, forward and backward.

    In a fresh process: TRITON_INTERPRET=1 must be set before triton is first imported,
    which an earlier test in this process may already have done."""
    import importlib.util

    import stoker_triton

    assert hasattr(stoker_triton, "compile_graph"), "stoker-triton has no compile_graph yet"
    if name.startswith("hf-") and importlib.util.find_spec("transformers") is None:
        pytest.skip("the HF zoo entries need `transformers` (nox installs it for integration)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    # every kernel is also compiled for an H100 by Triton's real compiler (no GPU needed)
    env.setdefault("STOKER_TRITON_CHECK_TARGETS", "cuda:90")
    p = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-c",
            _INTERPRET_SCRIPT,
            name,
            json.dumps(TINY.get(name, {})),
            "1" if compiled_autograd else "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["executors"] == ["interpret"]
    assert res["kernels"] >= 1, "no Triton kernels were recorded"
    if compiled_autograd:
        assert res["autograd"]["captures"] >= 1 and res["autograd"]["compiles"] >= 1
    else:
        assert res["autograd"]["captures"] == 0
    assert res["worst"]["loss"] < 1e-5 and res["worst"]["grad"] < 1e-5, res["worst"]
    assert res["worst"]["param"] < 5e-5, res["worst"]


def test_memory_budget_reaches_the_partitioner() -> None:
    """memory_budget=0 recomputes what it may: it saves fewer bytes than memory_budget=1."""
    from stoker._internal.bench.models import get_model

    spec = get_model("mlp")
    saved: dict[float, int] = {}
    for budget in (0.0, 1.0):
        stoker.reset()
        c = stoker.compile(spec.build(), memory_budget=budget, compiled_autograd=False)
        inputs, target = spec.batch(8, torch.Generator().manual_seed(0))
        spec.loss(c(*inputs), target).backward()
        (rec,) = c.stoker_report.compiles
        assert rec.partition is not None and rec.partition.memory_budget == budget
        saved[budget] = rec.partition.saved_bytes
    assert saved[0.0] < saved[1.0], saved


def test_export_is_stoker_capture_export() -> None:
    import stoker_capture

    assert stoker.export is stoker_capture.export


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels on device)"
)
@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_triton_on_cuda_matches_eager(name: str, train_and_compare: Callable[..., Any]) -> None:
    compiled = train_and_compare(
        name, lambda m: stoker.compile(m), device="cuda", rtol=1e-3, atol=1e-4
    )
    rep = compiled.stoker_report
    assert all(c.executor == "triton" for c in rep.compiles)
    assert rep.n_kernels >= 1
