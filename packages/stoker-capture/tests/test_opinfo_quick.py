"""Quick OpInfo subset for CI: common ops through `stoker_capture.aot_function`.

Same harness as the full sweep (tools/opinfo_sweep.py, loaded by path):
forward outputs and input gradients compared with eager on the op's first
samples (float32, CPU).  The full sweep is `nox -s opinfo`.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys
from types import ModuleType
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]

QUICK_OPS = [
    "add", "sub", "mul", "div.no_rounding_mode", "neg", "exp", "log", "sin", "tanh",
    "sigmoid", "abs", "sqrt", "rsqrt", "pow", "clamp", "where", "sum", "mean", "amax",
    "var", "cumsum", "softmax", "log_softmax", "matmul", "mm", "bmm", "addmm",
    "nn.functional.linear", "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu",
    "nn.functional.layer_norm", "nn.functional.conv2d", "nn.functional.cross_entropy",
    "nn.functional.embedding", "nn.functional.max_pool2d", "cat", "stack", "transpose",
    "permute", "reshape", "view", "expand", "index_select", "gather", "squeeze", "unsqueeze",
    "split", "flatten", "t",
]  # fmt: skip


@functools.cache
def harness() -> ModuleType:
    path = ROOT / "tools" / "opinfo_sweep.py"
    spec = importlib.util.spec_from_file_location("stoker_opinfo_sweep", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def ops_by_key() -> dict[str, Any]:
    h = harness()
    return {h.op_key(op): op for op in h.load_ops(QUICK_OPS)}


@pytest.mark.parametrize("name", QUICK_OPS)
def test_opinfo_quick(name: str) -> None:
    h = harness()
    import stoker_capture

    op = ops_by_key().get(name)
    assert op is not None, f"{name} is not a float32 CPU OpInfo in this torch"
    res = h.run_op(op, h.stoker_compile(), max_samples=2)
    if res.status == "xfail":
        pytest.xfail(res.reason)  # reason from tools/opinfo_expected.py
    assert res.status in ("pass", "xpass"), f"{name}: {res.status}: {res.error or res.reason}"
    assert res.samples > 0
    assert stoker_capture.aot_function is not None
