"""The GPU lap (`tools/gpu_lap.py`, `bash tools/gpu_check.sh lap`) must run the one time a
GPU is lent: its dry run takes every step's code path on the CPU, and the pieces that only
mean something on a GPU (profile grouping, Inductor's metadata, the pairing, the time
budget) are checked here on data of known answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_lap  # noqa: E402
import lap_profile  # noqa: E402


def test_kernels_are_grouped_by_name_and_kind_per_step():
    events = [
        ("stoker_per_abc", 30.0),
        ("stoker_per_abc", 10.0),
        ("triton_per_fused_native_layer_norm_0", 8.0),
        ("sm90_xmma_gemm_f32f32_tf32f32", 100.0),
        ("void at::native::multi_tensor_apply_kernel<...>", 20.0),
        ("Memset (Device)", 1.0),
        ("void at::native::vectorized_elementwise_kernel<...>", 4.0),
    ]
    got = lap_profile.group_kernels(events, steps=2)
    by = {k["name"]: k for k in got["kernels"]}
    assert by["stoker_per_abc"]["ms_per_step"] == pytest.approx(0.020)
    assert by["stoker_per_abc"]["calls_per_step"] == 1.0
    assert got["kernels"][0]["name"].startswith("sm90_xmma")  # largest first
    kinds = got["gpu_ms_by_kind"]
    assert kinds["matmul"] == pytest.approx(0.050)
    assert kinds["optimizer"] == pytest.approx(0.010)
    assert kinds["inductor"] == pytest.approx(0.004)
    assert kinds["copy"] == pytest.approx(0.0005) and kinds["aten"] == pytest.approx(0.002)
    assert got["gpu_ms_per_step"] == pytest.approx(sum(kinds.values()))


INDUCTOR_SOURCE = '''
# kernel path: /tmp/x/ab/cab.py
# Topologically Sorted Source Nodes: [x, layer_norm], Original ATen: [aten.add, aten.native_layer_norm]
# Source node to ATen node mapping:
triton_per_fused_add_native_layer_norm_0 = async_compile.triton('triton_per_fused_add_native_layer_norm_0', """
@triton.jit
def triton_per_fused_add_native_layer_norm_0(in_ptr0, ...):
    pass
""")

# kernel path: /tmp/x/cd/ccd.py
# Topologically Sorted Source Nodes: [softmax], Original ATen: [aten._softmax]
triton_per_fused__softmax_1 = async_compile.triton('triton_per_fused__softmax_1', """
""")
'''


def test_inductor_kernels_are_read_with_their_aten_ops():
    got = lap_profile.parse_inductor_source(INDUCTOR_SOURCE)
    assert got == {
        "triton_per_fused_add_native_layer_norm_0": {
            "origins": ["aten.add", "aten.native_layer_norm"]
        },
        "triton_per_fused__softmax_1": {"origins": ["aten._softmax"]},
    }


def test_each_stoker_kernel_is_paired_with_the_inductor_kernel_of_its_ops():
    stoker = {
        "kernels": [
            {
                "name": "stoker_per_1",
                "kind": "stoker",
                "ms_per_step": 0.3,
                "calls_per_step": 4,
                "origins": ["aten.native_layer_norm", "aten.add", "aten.view"],
            },
            {
                "name": "stoker_per_2",
                "kind": "stoker",
                "ms_per_step": 0.2,
                "calls_per_step": 4,
                "origins": ["aten._softmax", "aten.mul", "aten.permute"],
            },
            {
                "name": "stoker_pw_3",
                "kind": "stoker",
                "ms_per_step": 0.1,
                "calls_per_step": 1,
                "origins": ["aten.embedding_dense_backward"],
            },
        ]
    }
    inductor = {
        "kernels": [
            {"name": "triton_a", "kind": "inductor", "ms_per_step": 0.1, "calls_per_step": 4,
             "origins": ["aten.add", "aten.native_layer_norm"], "bytes": 1000},
            {"name": "triton_b", "kind": "inductor", "ms_per_step": 0.05, "calls_per_step": 4,
             "origins": ["aten._softmax", "aten.mul", "aten.where"]},
            {"name": "sm90_gemm", "kind": "matmul", "ms_per_step": 1.0, "calls_per_step": 8},
        ]
    }  # fmt: skip
    rows = {r["stoker"]: r for r in lap_profile.pair_kernels(stoker, inductor)}
    assert rows["stoker_per_1"]["inductor"] == "triton_a"
    assert rows["stoker_per_1"]["similarity"] == 1.0  # views aside
    assert rows["stoker_per_1"]["inductor_bytes"] == 1000
    assert rows["stoker_per_2"]["inductor"] == "triton_b"
    assert rows["stoker_per_2"]["similarity"] == pytest.approx(2 / 3, abs=1e-3)
    assert rows["stoker_pw_3"]["inductor"] is None  # nothing in common: no partner
    text = lap_profile.pairs_text(list(rows.values()))
    assert "stoker_per_1" in text and "triton_a" in text


def test_grad_layout_tells_a_gradient_laid_out_unlike_its_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    model(torch.randn(3, 8)).sum().backward()
    got = lap_profile.grad_layout(model)
    assert got["with_grad"] == 4 and got["all_like_params"] and got["shared_storages"] == 0
    w = model[0].weight
    w.grad = torch.randn(8, 4).t()  # a transposed view: what the optimizer should not get
    got = lap_profile.grad_layout(model)
    row = next(r for r in got["rows"] if r["name"] == "0.weight")
    assert not row["same_strides"] and row["view"] and not got["all_like_params"]


def _lap(tmp_path: Path, budget: float) -> gpu_lap.Lap:
    return gpu_lap.Lap(
        out=str(tmp_path),
        logs=str(tmp_path),
        deadline=time.monotonic() + budget,
        dry_run=True,
        jobs=1,
        steps=1,
        models=(),
        only=(),
    )


def test_a_job_past_its_limit_is_killed_and_one_without_time_is_skipped(tmp_path, monkeypatch):
    # jobs of a few seconds here (the tool skips those under 10 s): the test waits
    # out the hanging job's limit
    monkeypatch.setattr(gpu_lap, "MIN_JOB_S", 1.0)
    lap = _lap(tmp_path, budget=60)
    seen: dict[str, tuple[int | None, str]] = {}

    def job(name: str, code: str, cap: float) -> gpu_lap.Job:
        def done(rc: int | None, out: str) -> None:
            seen[name] = (rc, out)

        cmd = [sys.executable, "-c", code]
        return gpu_lap.Job(name, cmd, dict(os.environ), cap, str(tmp_path / f"{name}.log"), done)

    t0 = time.monotonic()
    gpu_lap.run_jobs(
        [job("hangs", "import time; time.sleep(600)", 2), job("quick", "print('{}')", 30)],
        lap,
        parallel=2,
    )
    assert time.monotonic() - t0 < 40
    assert seen["hangs"][0] is None and "killed" in seen["hangs"][1]
    assert seen["quick"] == (0, "{}\n")
    late = _lap(tmp_path, budget=gpu_lap.RESERVE_S + gpu_lap.MIN_JOB_S / 2)
    gpu_lap.run_jobs([job("late", "print(1)", 30)], late, parallel=1)
    assert seen["late"][0] is None and "skipped" in seen["late"][1]


def test_one_measurement_at_a_time_on_the_kept_cores(tmp_path, monkeypatch):
    import threading

    path = str(tmp_path / "gpu.lock")
    cpu = min(os.sched_getaffinity(0))
    monkeypatch.setenv("STOKER_LAP_TIMED_CPUS", str(cpu))
    before = os.sched_getaffinity(0)
    from stoker._internal.bench.gpulock import GpuLock

    first, second = GpuLock(path), GpuLock(path)
    inside: list[set[int]] = []
    with first():
        inside.append(os.sched_getaffinity(0))
        t = threading.Thread(target=lambda: second().__enter__())
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # the second measurement waits for the first
    t.join(10)
    assert not t.is_alive() and second.waited_s >= 0.4
    assert inside == [{cpu}] and os.sched_getaffinity(0) == before  # pinned, then restored


def test_tests_output_is_counted_as_it_comes():
    out = "\n".join(
        [
            "tests/test_a.py::test_one PASSED [ 10%]",
            "[gw1] [ 20%] FAILED tests/test_a.py::test_two",
            "tests/test_b.py::test_three SKIPPED (no GPU) [ 30%]",
            "E   AssertionError: 1 != 2",
        ]
    )
    got = gpu_lap.parse_tests(out)
    assert got["counts"] == {"PASSED": 1, "FAILED": 1, "SKIPPED": 1}
    assert got["failed"] == ["tests/test_a.py::test_two"]


@pytest.mark.slow
def test_the_dry_run_takes_every_step_on_the_cpu(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_lap.py"),
            "--dry-run",
            "--models",
            "gpt-m",
            "--only",
            "env,suite,tests",
            "--budget",
            "900",
            "--out",
            str(out),
            "--logs",
            str(logs),
        ],
        capture_output=True,
        text=True,
        timeout=1000,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "lap.json").read_text())
    rows = {r["backend"]: r for r in doc["rows"] if r["model"] == "gpt-m"}
    assert set(rows) == {"eager", "stoker"}, doc["rows"]
    for r in rows.values():
        assert "error" not in r and r["steady_ms"] > 0 and r["warm_first_step_s"] > 0
    assert rows["stoker"]["loss_rel"] < 1e-4  # parity against eager's run
    prof = json.loads((out / "profile-gpt-m-stoker.json").read_text())
    assert prof["kernels"] and prof["grads"]["with_grad"] > 0
    # the stoker kernels this process compiled, with the aten ops each fused
    metas = [m for m in prof["meta"].values() if "origins" in m]
    assert metas and any("aten.native_layer_norm" in m["origins"] for m in metas)
    assert prof["grads"]["all_like_params"], prof["grads"]
    assert (out / "pairs-gpt-m.txt").exists() and (out / "summary.md").exists()
    assert doc["tests"]["counts"].get("PASSED", 0) > 0 and not doc["tests"]["failed"]
