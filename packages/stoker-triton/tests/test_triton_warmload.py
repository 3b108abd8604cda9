"""Warm kernel loads (`runtime/warmload.py`): a second process that finds a graph in
the compiled-graph cache launches every kernel from the binary the first process
recorded, making no `JITFunction` and calling none of Triton's binder or compiler.

Both processes run Triton's real launch path on the stand-in sm_90 driver
(`stoker_triton._internal.fakegpu`), sharing one stoker and one Triton cache. Each
reports its counters and what every launch passed to the launcher; the warm
process must pass exactly what the cold one passed (the same binary's packed
metadata, grid and arguments)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from triton_helpers import run_on_fake_gpu

from stoker_triton._internal.runtime import warmload

_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
import triton.compiler
from triton.runtime.jit import JITFunction

from stoker_triton import compile_graph
from stoker_triton._internal.fakegpu import install
from stoker_triton._internal.runtime import warmload

fake = install(record=True)
counts = {"jit": 0, "run": 0, "compile": 0}
_init, _run, _compile = JITFunction.__init__, JITFunction.run, triton.compiler.compile
def init(self, *a, **k):
    counts["jit"] += 1
    _init(self, *a, **k)
def run(self, *a, **k):
    counts["run"] += 1
    return _run(self, *a, **k)
def comp(*a, **k):
    counts["compile"] += 1
    return _compile(*a, **k)
JITFunction.__init__, JITFunction.run, triton.compiler.compile = init, run, comp


def f(x, b, w):
    y = (x * 2 + b).relu()
    return y.sum(0), torch.softmax(y @ w, -1), (x.half() * 3).float()


torch.manual_seed(0)
args = torch.randn(32, 64), torch.randn(64), torch.randn(64, 16)
g = compile_graph(make_fx(f, decomposition_table=core_aten_decompositions())(*args), list(args))
g(*args)
g(*args)  # the lean path again
def arg(a):  # a pointer: a tensor through the binder, its address on the lean path
    return "ptr" if isinstance(a, torch.Tensor) or (type(a) is int and a > 1 << 40) else a


seen = [[list(l[:3]), str(l[4]), str(l[5]), [arg(a) for a in l[9:]]] for l in fake.launches]
print("RESULT", json.dumps({"counts": counts, "warm": warmload.stats, "cache": g.report.cache,
                            "kernels": len(g.report.kernels), "launches": seen}))
"""


def _run(tmp_path: Path, role: str) -> dict[str, Any]:
    out = run_on_fake_gpu(tmp_path, _SCRIPT, role, name="warm", triton_cache="triton")
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    res: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return res


def test_a_warm_process_launches_recorded_binaries_without_triton_jit(tmp_path: Path) -> None:
    cold = _run(tmp_path, "cold")
    n = cold["kernels"]
    assert n >= 2 and cold["cache"] == "miss (new key)", cold
    assert cold["counts"]["compile"] == n and cold["warm"].get("records") == n, cold
    warm = _run(tmp_path, "warm")
    assert warm["cache"] == "hit" and warm["kernels"] == n, warm
    # zero JITFunctions made (kernel modules not imported), no binder, no Triton compile
    assert warm["counts"] == {"jit": 0, "run": 0, "compile": 0}, warm
    assert warm["warm"] == {"hits": n}, warm
    # the same binaries (packed metadata), grids and arguments as the cold process launched
    assert warm["launches"] == cold["launches"], (warm["launches"], cold["launches"])


def test_records_of_another_environment_are_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cold = _run(tmp_path, "cold")
    n = cold["kernels"]
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "stoker"))
    store = warmload.store()
    paths = list(store.dir.iterdir())
    assert len(paths) == n
    for p in paths:  # as if made under another Triton, target or environment variable
        data = json.loads(store.get(p.stem) or b"")
        data["env"] = data["env"].replace('"target": "', '"target": "other ')
        store.put(p.stem, json.dumps(data).encode())
    warm = _run(tmp_path, "warm")
    assert warm["cache"] == "hit" and "hits" not in warm["warm"], warm
    assert warm["warm"]["misses: another Triton, target or environment"] == n, warm
    # the plain path: kernel modules imported, Triton's binder finds its cached binaries
    assert warm["counts"]["jit"] > 0 and warm["counts"]["run"] == n, warm
    assert warm["launches"] == cold["launches"]


def test_a_record_s_launch_kind_separates_what_spec_key_separates() -> None:
    t = torch.empty(64)
    args = [
        *((v,) for v in (1, 16, 17, 2**31, 2**31 + 1, 2**63, 2**63 + 1, True, 1.0)),
        (t,),
        (t[1:],),
        (t.half(),),
    ]
    cfg = (1024, 1, 4)
    texts = {warmload.spec_text(a, cfg) for a in args}
    assert len(texts) == len(args) and None not in texts, texts
    assert warmload.spec_text((t,), cfg) != warmload.spec_text((t,), (512, 1, 4))  # the config
    assert warmload.spec_text((t,), cfg) == warmload.spec_text((torch.empty(8),), cfg)
    assert warmload.spec_text((None,), cfg) is None  # no record: the plain path decides


def test_a_binary_gone_from_triton_s_cache_is_compiled_again(tmp_path: Path) -> None:
    import shutil

    cold = _run(tmp_path, "cold")
    n = cold["kernels"]
    shutil.rmtree(tmp_path / "triton")  # Triton's cache emptied; stoker's records remain
    warm = _run(tmp_path, "warm")
    assert warm["cache"] == "hit" and "hits" not in warm["warm"], warm
    assert warm["warm"]["misses: binary not in Triton's cache"] == n, warm
    # the plain path: modules imported, every kernel compiled again (and recorded again)
    assert warm["counts"]["jit"] > 0 and warm["counts"]["compile"] == n, warm
    assert warm["warm"]["records"] == n, warm
    assert warm["launches"] == cold["launches"]
