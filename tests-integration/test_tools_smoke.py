"""Every benchmark of `stoker bench` must not rot on machines without a GPU: each runs
through the harness at its smoke size (tiny models, Triton's interpreter or the
stand-in sm_90 driver), and its table or JSON is read. A benchmark without a test of
its own here is run by `test_every_other_benchmark_runs_at_its_smoke_size`."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stoker._internal.bench.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[1]


def _bench(
    name: str, tmp_path: Path, *extra: str, timeout: int = 600, **env: str
) -> tuple[str, Any]:
    """``stoker bench NAME --smoke [-- extra]`` (``env`` added to the environment), which
    must exit 0: the benchmark's stdout and the JSON it wrote (``raw`` in the harness's)."""
    out = tmp_path / f"bench-{name}.json"
    cmd = [sys.executable, "-m", "stoker.cli", "bench", name, "--smoke", "--json", str(out)]
    proc = subprocess.run(
        cmd + (["--", *extra] if extra else []),
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    entry = doc["benchmarks"][name]
    assert entry["status"] == "ok" and (tmp_path / f"bench-{name}.md").exists(), entry
    assert doc["machine"]["torch"] and doc["rows"], doc["rows"]
    return entry.get("stdout", proc.stdout), entry["raw"]


def test_bench_triton_smoke_prints_every_case(tmp_path):
    stdout, _ = _bench("triton", tmp_path)
    cases = (
        "pointwise x*2+1 -> sin",
        "pointwise a+b broadcast",
        "reduction sum(-1)",
        "reduction sum(0)",
        "softmax(-1)",
        "layernorm",
        "layernorm+gelu",
        "log_softmax(-1)",
        "rmsnorm",
        "softmax backward",
        "layernorm backward",
        "rmsnorm backward",
    )
    rows = {ln[:28].strip(): ln for ln in stdout.splitlines() if ln[:28].strip() in cases}
    assert set(rows) == set(cases), stdout
    # fusion: each case one kernel (softmax, layernorm+gelu included), but layernorm's
    # backward, whose weight and bias gradients reduce over the outer dim in their own
    # split kernel(s)
    kernels = {c: int(ln[28:36]) for c, ln in rows.items()}
    assert all(k == 1 for c, k in kernels.items() if c != "layernorm backward"), stdout
    assert 2 <= kernels["layernorm backward"] <= 3, stdout


@pytest.mark.parametrize("name", ["workers", "workers_cold"])
def test_bench_workers_compiles_the_batch_through_forked_workers(tmp_path, name):
    # the compile workers' benchmark (docs/benchmarks.md): every kernel of its batch
    # compiles for sm_90 through the zygote's forks, and the cold start reaches its launches
    stdout, _ = _bench(name, tmp_path)
    row = [ln for ln in stdout.splitlines() if ln.startswith("| fork | 2 | pyc |")]
    assert len(row) == 1, stdout
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    if name == "workers_cold":
        assert int(cells[3]) >= 20 and all(float(c) > 0 for c in cells[4:]), row
    else:
        # every kernel of the batch compiled (how many the block makes is the code
        # generator's business: identical kernels are generated once)
        done, total = (int(x) for x in cells[3].split("/"))
        assert done == total >= 20, row


def test_bench_capture_pipeline_smoke_times_every_stage(tmp_path):
    """``stoker bench capture_pipeline``: the per-stage compile times, here on the tiny
    GPT so the mode cannot rot."""
    stdout, raw = _bench("capture_pipeline", tmp_path)
    best = raw["pipeline"]["best"]
    stages = ("state", "capture", "partition", "prepare", "lower", "schedule", "codegen", "load")
    for kind in ("wall", "cpu"):
        assert all(best[kind][st] > 0 for st in stages), best
    assert "target" in stdout and "codegen" in stdout, stdout


def _suite_entries() -> list[str]:
    from stoker._internal.bench.suite import SUITE

    return [e.name for e in SUITE]


# one test per entry (two cold processes each, eager then stoker): the fourteen used to
# run one after another in one test, on one core, the suite's longest by far
@pytest.mark.slow
@pytest.mark.parametrize("entry", _suite_entries())
def test_bench_gpu_suite_smoke_runs_every_configuration(tmp_path, entry):
    """``stoker bench --suite gpu --smoke --models <entry>``: every entry of the H100
    suite trains at tiny sizes (one cold process each), eager and stoker, and the driver
    fills in parity against eager."""
    out = tmp_path / "suite.json"
    cmd = [sys.executable, "-m", "stoker.cli", "bench", "--suite", "gpu", "--smoke"]
    proc = subprocess.run(
        [*cmd, "--models", entry, "--json", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "STOKER_CACHE_DIR": str(tmp_path / "cache")},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["benchmarks"]["gpu"]["raw"]
    assert {r["case"] for r in doc["rows"]} == {f"{entry} eager", f"{entry} stoker"}
    assert [(r["model"], r["backend"]) for r in rows] == [(entry, "eager"), (entry, "stoker")]
    for r in rows:
        assert r["steady_ms"] > 0 and len(r["losses"]) == 3, r
        assert r["cpu_peak_mem"] > 0, r  # the CPU proxy of peak memory (allocation events)
        if r["backend"] == "stoker":
            # fp32 entries at fp32 tolerance; bf16-autocast entries at bf16's
            tol = 2e-2 if r["model"].endswith("bf16") else 1e-4
            assert r["loss_rel"] <= tol, r


def test_gpu_suite_is_the_h100_findings_configurations():
    """The suite trains exactly the six configurations of the first H100 run (plus the small
    forward+backward table): the numbers in docs/benchmarks.md compare like with like."""
    import torch

    from stoker._internal.bench.suite import SUITE

    models = {e.name: e for e in SUITE if e.table == "models"}
    assert set(models) == {"gpt-m", "gpt-m-bf16", "hf-llama", "hf-gpt2", "mlp-l", "cnn-m-bf16"}
    assert models["gpt-m"].size["hidden"] == 512 and models["gpt-m"].size["seq"] == 256
    assert models["hf-llama"].size["kv_heads"] == 4 and models["mlp-l"].size["batch"] == 512
    assert {n for n, e in models.items() if e.autocast is torch.bfloat16} == {
        "gpt-m-bf16",
        "cnn-m-bf16",
    }
    assert all(e.optimizer for e in models.values())
    assert {e.name for e in SUITE if e.table == "small"} == {"tiny-gpt", "small-cnn", "tiny-llama"}


def test_bench_ddp_smoke_counts_a_segment_per_bucket(tmp_path):
    """``stoker bench ddp``: 2 gloo ranks, eager DDP and stoker's reducer; after the
    bucket rebuild the backward has a hook (a cut) per bucket, not per parameter."""
    import re

    stdout, raw = _bench("ddp", tmp_path)
    assert raw[0]["buckets"] > 1 and raw[0]["stoker"]["median_ms"] > 0, raw
    m = re.search(
        r"(\d+) buckets, (\d+) params; the newest backward: (\d+) segments, (\d+) post-acc",
        stdout,
    )
    assert m is not None, stdout
    buckets, params, segments, hooks = map(int, m.groups())
    assert 1 < buckets < params and hooks == buckets, stdout
    assert segments in (buckets, buckets + 1), stdout
    assert "stoker " in stdout and "eager DDP " in stdout


def test_bench_warm_smoke_loads_every_kernel_without_triton_jit(tmp_path):
    """``stoker bench warm``: a warm start on Triton's real launch path (the stand-in
    sm_90 driver), here on the tiny GPT: the warm process hits every cache and launches
    every kernel from a recorded binary, with no JITFunction, no compile and no kernel
    module, and imports none of the modules only a cold start runs (partitioner, passes,
    lowering, code generation), each of which the cold process imports."""
    stdout, res = _bench("warm", tmp_path, timeout=900)
    assert "kernel modules load" in stdout, stdout
    cold, (warm,) = res["cold"], res["warm"]
    assert cold["counts"]["JITFunction"] > 0 and cold["counts"]["triton.compile"] > 0, cold
    assert warm["counts"]["JITFunction"] == 0 and warm["counts"]["triton.compile"] == 0, warm
    assert warm["summary"]["cache_misses"] == 0 and warm["summary"]["cache_hits"] >= 2, warm
    assert warm["autograd"]["disk_hits"] >= 1 and warm["autograd"]["compiles"] == 0, warm
    assert not [m for m in warm["stoker modules"] if m.startswith("stoker_triton_kernels_")]
    from stoker._internal.bench.benchmarks.warm import COLD_ONLY, cold_only

    assert cold_only(cold["stoker modules"]) == list(COLD_ONLY), "renamed? update COLD_ONLY"
    assert cold_only(warm["stoker modules"]) == [], warm["stoker modules"]
    assert res["detail"]["stages"]["first step (all)"] > 0, res["detail"]


def test_bench_warm_cold_smoke_breaks_down_a_cold_first_step(tmp_path):
    """``stoker bench warm_cold``: a cold first step by stage, with the precompile
    queued on compile workers as on a GPU: every launch loads what the workers built,
    and the AOT backward, which compiled autograd inlines, is not compiled."""
    stdout, (run,) = _bench("warm_cold", tmp_path, timeout=900)
    assert "wait for workers" in stdout and "compiled autograd: retrace" in stdout
    assert run["counts"]["Triton cache misses"] == 0, run["counts"]  # built by the workers
    assert [g["by"] for g in run["graphs"]] == ["capture", "compiled autograd"], run["graphs"]
    assert run["cold"]["first step (all)"][1] > 0


def test_bench_step_cpu_smoke_splits_a_steady_step_by_part(tmp_path):
    """``stoker bench step_cpu``: the steady step's CPU cost on Triton's real launch
    path (the stand-in sm_90 driver), on the tiny GPT: the timed steps compile nothing,
    and each part of the step (Dynamo, stoker's runtime, wrappers, launches, externs,
    compiled autograd) is reported."""
    _, res = _bench("step_cpu", tmp_path, timeout=900)
    assert res["timed_steps"] == {"compiles": 0, "eager_runs": 0, "fallbacks": 0}, res
    calls, parts = res["calls_per_step"], res["parts_us"]
    assert calls["forward: kernel launch"] > 0 and calls["backward: kernel launch"] > 0, calls
    for part in (
        "forward: Dynamo guards, frame entry",
        "forward: stoker forward runtime (CompiledFn)",
        "forward: graph wrapper (generated)",
        "backward: compiled autograd: scope decision, hook per call",
        "backward: compiled autograd: runtime_wrapper",
        "backward: compiled autograd: accumulate-grad",
        "backward: autograd engine (C++: cache lookup, graph walk)",
    ):
        assert part in parts, (part, sorted(parts))
    assert set(res["replayed_us_per_call"]) == {"kernel launch", "extern call"}, res
    assert res["step_us"] > 0 and res["eager_step_us"] > 0, res


def test_bench_demo_start_warm_process_loads_instead_of_compiling(tmp_path):
    """``stoker bench demo_start`` (the CPU warm-start target on the demo's GPT):
    the warm process loads the captured graph and compiled autograd's stored backward,
    and neither captures the joint graph again nor retraces the backward."""
    stdout, raw = _bench("demo_start", tmp_path, timeout=900)
    assert "warm first step / (2 x eager first step + load)" in stdout
    res = raw["aten"]
    cold, (warm,) = res["cold"], res["warm"]
    assert cold["calls"]["  compiled autograd: retrace"] >= 1, cold["calls"]
    assert warm["calls"]["  compiled autograd: retrace"] == 0, warm["calls"]
    assert warm["calls"]["  compiled autograd: stored backward load"] >= 1, warm["calls"]
    assert warm["summary"]["capture_cache_hits"] >= 1, warm["summary"]
    assert warm["summary"]["capture_cache_misses"] == 0, warm["summary"]
    assert warm["compiled first step"] > 0 and warm["eager first step"] > 0


def test_bench_demo_step_times_eager_and_stoker_side_by_side(tmp_path):
    """``stoker bench demo_step`` (the CPU step on the demo's GPT): alternating
    eager and stoker steps, a per-round row and the best-of line with their ratio."""
    import re

    stdout, raw = _bench("demo_step", tmp_path, timeout=900)
    assert raw["best"]["eager_ms"] > 0 and len(raw["rounds"]) == 1, raw
    best = re.search(r"best +eager ([\d.]+) ms +stoker ([\d.]+) ms +\(([\d.]+)x", stdout)
    assert best, stdout
    eager, stoker, ratio = map(float, best.groups())
    assert eager > 0 and stoker > 0 and abs(ratio - eager / stoker) < 0.01, stdout


def test_gpu_suite_backends_are_the_five_compared(monkeypatch):
    """eager, Inductor default and reduce-overhead, stoker plain and reduce-overhead: each
    suite backend reaches its compiler with its mode (the smoke run above trains eager and
    stoker; Inductor's CPU compiles are too slow for it)."""
    import torch

    import stoker
    from stoker._internal.bench import suite as bench_suite

    calls = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: calls.append(("inductor", kw)) or m)
    monkeypatch.setattr(stoker, "compile", lambda m, **kw: calls.append(("stoker", kw)) or m)
    assert bench_suite.SUITE_BACKENDS == ("eager", "inductor", "inductor-ro", "stoker", "stoker-ro")
    model = torch.nn.Linear(2, 2)
    for backend in bench_suite.SUITE_BACKENDS:
        assert bench_suite.wrap_model(model, backend) is model
    assert calls == [
        ("inductor", {"mode": None}),
        ("inductor", {"mode": "reduce-overhead"}),
        ("stoker", {}),
        ("stoker", {"mode": "reduce-overhead"}),
    ]


@pytest.mark.parametrize(
    ("name", "rows"),
    [
        ("launch", ("lean path (Launcher.go)", "JITFunction.run", "per stoker.compile call")),
        ("launch_replay", ("P params K outputs", "fixed +", "target: wrapper minus bare")),
    ],
)
def test_bench_launch_smoke_prints_every_row(tmp_path, name, rows):
    """``stoker bench launch``: the launch and per-call targets, measured with the
    stand-in sm_90 driver (the lean path must be on: the tool exits 1 otherwise);
    ``launch_replay``: the reduce-overhead wrapper with a stubbed replay (its every
    timed call must replay)."""
    stdout, _ = _bench(name, tmp_path)
    assert all(r in stdout for r in rows), stdout


# the benchmarks above read their own figures; traffic has tests-integration/test_bench_traffic.py
OWN_TESTS = {
    "triton",
    "workers",
    "workers_cold",
    "capture_pipeline",
    "gpu",
    "ddp",
    "warm",
    "warm_cold",
    "step_cpu",
    "demo_start",
    "demo_step",
    "launch",
    "launch_replay",
    "traffic",
}


# tens of seconds of CPU (depth: two cold processes whose workers compile every kernel
# for sm_90)
SLOW = {"depth"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
        for n in sorted(set(REGISTRY) - OWN_TESTS)
    ],
)
def test_every_other_benchmark_runs_at_its_smoke_size(tmp_path, name):
    """Every registered benchmark runs in the harness at its smoke size, exits 0 and
    leaves rows of figures (a new benchmark is run here until it has a test of its own)."""
    _, raw = _bench(name, tmp_path, timeout=900)
    assert raw is not None
