"""stoker.compile under DDP and FSDP2 on 2 CPU ranks (gloo), against eager, in real
process groups.  One spawned 2-rank job runs every case (distributed_script.py) and
the tests assert on what rank 0 wrote; the job is bounded in time.  The ``gpu`` test
runs the same code with NCCL on one GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

GLOO = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not built into this torch",
)

# every test reads the one 2-rank job per group (`_run`, cached per process): started
# first and together, they stay in one xdist worker's share, which runs the job once
pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("distributed_script.py")
FP32 = 1e-5  # relative, on losses and on every parameter after 4 SGD steps
BF16 = 2e-2
GPU = 1e-4  # Triton kernels against cuBLAS and CUDA eager: other summation orders


@cache
def _run(group: str, tmp: str) -> dict[str, Any]:
    out = Path(tmp) / f"{group}.json"
    env = {**os.environ, "STOKER_CACHE_DIR": tmp, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT), group, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert out.exists(), p.stdout[-3000:] + p.stderr[-5000:]
    results: dict[str, Any] = json.loads(out.read_text())
    failed = {k: v["exception"] for k, v in results.items() if "exception" in v}
    assert not failed, failed
    assert p.returncode == 0, p.stderr[-5000:]
    return results


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("distributed"))


def _assert_parity(name: str, r: dict[str, Any], tol: float = FP32) -> None:
    assert r["loss_rel"] < tol, (name, r["eager_losses"], r["losses"])
    assert r["param_rel"] < tol, (name, r["param_rel"])


def _assert_steady(name: str, r: dict[str, Any]) -> None:
    """No backward captured after step 2, and (sizes change every step) one
    automatic-dynamic recompile at most, in step 3; nothing compiled in step 4
    (the GPT too: its ids are slices ``seq[:, :-1]``, symbolic like dense inputs)."""
    a2, a3, end = r["after2"], r["after3"], r["end"]
    assert end["captures"] == a2["captures"], (name, a2, end)
    assert end["fallbacks"] == 0 and end["dynamo_recompiles"] == a2["dynamo_recompiles"]
    per_capture = end["captures"]  # no_sync: the backward with and without .grad differ
    assert a3["compiles"] - a2["compiles"] <= per_capture, (name, a2, a3)
    assert a3["recompiles"] - a2["recompiles"] <= per_capture, (name, a2, a3)
    assert end == {**a3, "cache_hits": end["cache_hits"]}, (name, a3, end)


DDP_PARITY = ["ddp_mlp_outer_25mb", "ddp_mlp_inner_small_no_sync", "ddp_gpt_outer_small"]


@GLOO
def test_ddp_both_compile_orders_bucket_sizes_and_no_sync_match_eager(tmp_dir: str) -> None:
    res = _run("gloo", tmp_dir)
    for name in DDP_PARITY:
        r = res[name]
        _assert_parity(name, r)
        _assert_steady(name, r)
        assert r["mode"] == "stoker_reducer", name
        assert r["graphs_after1"] >= 1, name  # the forward was compiled, not run eagerly
    assert res["ddp_mlp_outer_25mb"]["buckets"] == 1
    assert res["ddp_mlp_inner_small_no_sync"]["buckets"] >= 2
    assert res["ddp_gpt_outer_small"]["buckets"] > 3
    # no_sync(): 2 backwards per step, one reduction (of the accumulated gradients) per step
    r = res["ddp_mlp_inner_small_no_sync"]
    assert len(r["losses"]) == 8 and len(r["collectives"]) == 4
    assert all(len(step) == r["buckets"] for step in r["collectives"][1:])


@GLOO
def test_ddp_buckets_are_reduced_during_the_backward(tmp_dir: str) -> None:
    """Each bucket's all-reduce starts from the hook of its last gradient (the only one
    hooked after the rebuild), in the captured graph before the backward compute of
    earlier layers (which it overlaps).  After the
    first step the buckets follow the order the gradients became ready (DDP's rebuild):
    the MLP registers its LayerNorm last, so the first guess was out of order."""
    for name in ("ddp_mlp_inner_small_no_sync", "ddp_gpt_outer_small"):
        r = _run("gloo", tmp_dir)[name]
        n = r["n_params"]
        for step in r["collectives"]:
            assert sum(params for _b, _ready, params in step) == n  # every gradient, once
        for step in r["collectives"][1:]:
            readies = [ready for _bucket, ready, _params in step]
            assert [b for b, _, _ in step] == list(range(len(step)))  # buckets in DDP's order
            assert readies == sorted(readies) and readies[-1] == n
            assert readies[0] < n  # the first bucket left before the last gradient existed
        # after the rebuild only each bucket's last gradient is hooked (a cut per bucket)
        hooks = [s for s in r["graph_positions"] if s["kind"] == "post_acc_grad_hook"]
        assert len(hooks) == r["buckets"], name
        first = hooks[0]  # the hook that started bucket 0
        assert first["compute_after"] > 0, (name, first)


@GLOO
def test_ddp_without_compiled_autograd_splits_the_graph_at_buckets(tmp_dir: str) -> None:
    """compiled_autograd=False keeps DDP's C++ reducer; the graph splits at its (small)
    buckets, which Dynamo's own splitter refuses (its first bucket would be 1 MiB)."""
    r = _run("gloo", tmp_dir)["ddp_mlp_outer_small_no_ca"]
    _assert_parity("ddp_mlp_outer_small_no_ca", r)
    assert r["mode"] == "ddp_optimizer" and r["collectives"] == []
    assert r["graphs_after1"] >= 2  # DDPOptimizer's pieces; this MLP is one graph unsplit


FSDP_FP32 = ["fsdp2_mlp_reshard_marks", "fsdp2_mlp_no_reshard", "fsdp2_gpt_reshard_ckpt"]


@GLOO
def test_fsdp2_matches_eager_with_collectives_in_eager_order(tmp_dir: str) -> None:
    """Per-layer + root fully_shard, reshard_after_forward True and False, activation
    checkpointing: parameters and losses as eager FSDP2, and every all-gather and
    reduce-scatter issued in eager's order, between the same backward markers."""
    res = _run("gloo", tmp_dir)
    for name in FSDP_FP32:
        r = res[name]
        _assert_parity(name, r)
        _assert_steady(name, r)
        assert r["log"] == r["eager_log"], name
        assert any(e.startswith("reduce_scatter") for e in r["log"])
    log = res["fsdp2_mlp_reshard_marks"]["log"]
    assert "mark:after-tanh" in log and log.index("mark:after-tanh") < log.index("mark:after-norm")
    # reduce-scatters of the last layer are issued before the marker of the layer below
    first_rs = next(i for i, e in enumerate(log) if e.startswith("reduce_scatter"))
    assert first_rs < log.index("mark:after-tanh")
    sites = res["fsdp2_mlp_reshard_marks"]["graph_positions"]
    post = [s for s in sites if "RegisterPostBackwardFunction" in s["kind"]]
    assert post and post[0]["compute_after"] > 0  # a reduce-scatter that overlaps compute


@GLOO
def test_fsdp2_mixed_precision_bf16_params_fp32_reduce(tmp_dir: str) -> None:
    r = _run("gloo", tmp_dir)["fsdp2_mlp_bf16_params_fp32_reduce"]
    _assert_parity("fsdp2_mlp_bf16_params_fp32_reduce", r, BF16)
    _assert_steady("fsdp2_mlp_bf16_params_fp32_reduce", r)
    assert r["log"] == r["eager_log"]


@GLOO
def test_fsdp2_collectives_per_step_are_eagers_and_sit_where_eager_issues_them(
    tmp_dir: str,
) -> None:
    """The report's collectives per step (recorded at c10d's ProcessGroup): under stoker
    each step issues eager FSDP2's all-gathers and reduce-scatters, of the same sizes and
    dtypes, in the same phase and order.  In the compiled backward each reduce-scatter
    comes from RegisterPostBackwardFunction's backward (the layer's gradients are done)
    or from the final callbacks (the root, and the first layer, whose input needs no
    gradient), in graph order, the first with backward compute after it to overlap."""
    res = _run("gloo", tmp_dir)
    for name in [*FSDP_FP32, "fsdp2_mlp_bf16_params_fp32_reduce"]:
        r = res[name]
        assert r["steps"] == r["steps_eager"] and len(r["steps"]) == 4, name
        assert all(r["compiled"]), name  # every step's backward ran through stoker-autograd
        for step, sites in zip(r["steps"], r["sites"], strict=True):
            kinds = Counter((kind, phase) for kind, _n, _dtype, phase in step)
            assert kinds[("reduce_scatter", "backward")] == r["fsdp_groups"], (name, kinds)
            assert kinds[("all_gather", "forward")] == r["fsdp_groups"], (name, kinds)
            regathered = kinds[("all_gather", "backward")]  # reshard_after_forward
            assert regathered == (0 if "no_reshard" in name else r["fsdp_groups"]), name
            rs = [site for (kind, *_), site in zip(step, sites) if kind == "reduce_scatter"]
            assert all(
                s["kind"] in ("backward of RegisterPostBackwardFunction", "final callbacks")
                for s in rs
            ), (name, rs)
            at = [s["at"] for (_k, *_r, phase), s in zip(step, sites) if phase == "backward"]
            assert at == sorted(at) and None not in at, (name, at)  # issued in graph order
            assert rs[0]["kind"] != "final callbacks" and rs[0]["compute_after"] > 0, name
        summary = r["summary"]["last_compiled"]
        assert summary["counts"]["reduce_scatter"] == {"backward": r["fsdp_groups"]}


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available(),
    reason="needs a CUDA GPU and a torch with NCCL",
)
def test_nccl_one_gpu_runs_the_same_ddp_and_fsdp2_code(tmp_dir: str) -> None:
    """The CPU cases' code on one GPU rank with NCCL (world size 1: the collectives run,
    reducing nothing): parity with eager CUDA, no recapture after step 2, the stoker
    reducer for DDP, eager FSDP2's collectives per step."""
    res = _run("nccl", tmp_dir)
    for name, r in res.items():
        # bf16 parameters: fused Triton kernels round once where eager rounds per op
        _assert_parity(name, r, BF16 if "bf16" in name else GPU)
        _assert_steady(name, r)
        if name.startswith("ddp_"):
            assert r["mode"] == "stoker_reducer", name
            assert all(len(step) == r["buckets"] for step in r["collectives"][1:]), name
        else:
            assert r["steps"] == r["steps_eager"] and all(r["compiled"]), name
