"""stoker's DDP reducer on 2 gloo ranks against eager DDP (DDP's C++ reducer), with AdamW:
one bucket, many small buckets, ``no_sync()`` accumulation, ``gradient_as_bucket_view``;
and after the bucket rebuild, a backward cut once per bucket (not once per parameter)
whose all-reduces still leave from the buckets' hooks.  One spawned job, bounded in time
(ddp_ranks_script.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="no gloo in this torch"
    ),
    # every test reads the one spawned job (`results`): started first and together,
    # they stay in one xdist worker's share, which runs the job once
    pytest.mark.slow,
]
SCRIPT = Path(__file__).with_name("ddp_ranks_script.py")
FP32 = 1e-5  # relative, per step, on every gradient and parameter


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ddp_ranks")
    out = tmp / "out.json"
    env = {**os.environ, "STOKER_CACHE_DIR": str(tmp), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.exists(), p.stdout[-3000:] + p.stderr[-5000:]
    res: dict[str, Any] = json.loads(out.read_text())
    failed = {k: v["exception"] for k, v in res.items() if "exception" in v}
    assert not failed, failed
    assert p.returncode == 0, p.stderr[-5000:]
    return res


@pytest.mark.parametrize(
    "case", ["one_bucket", "small_buckets", "small_buckets_no_sync", "bucket_view"]
)
def test_gradients_and_parameters_equal_eager_ddp(results: dict[str, Any], case: str) -> None:
    r = results[case]
    assert r["grad_rel"] < FP32 and r["param_rel"] < FP32, r
    # once per step, no_sync() included (the first step in DDP's first guess of buckets)
    assert len(r["reductions"]) == 4 and r["reductions"][1:] == [r["buckets"]] * 3
    if case == "one_bucket":
        assert r["buckets"] == 1
    else:
        assert 2 < r["buckets"] < r["n_params"]


@pytest.mark.parametrize(
    "case", ["one_bucket", "small_buckets", "small_buckets_no_sync", "bucket_view"]
)
def test_after_the_rebuild_one_cut_per_bucket_and_all_reduces_from_the_hooks(
    results: dict[str, Any], case: str
) -> None:
    """A hook per bucket (it was one per parameter), so buckets segments, plus one if
    compute follows the last hook; each all-reduce of the last step still started from
    its bucket's hook, inside the backward (not from the final callback)."""
    r = results[case]
    assert not r["counting"] and r["hooks"] == r["buckets"], r
    assert r["segments"] in (r["buckets"], r["buckets"] + 1), r
    assert r["last_step_sites"] == ["post_acc_grad_hook"] * r["buckets"], r
