"""Benchmark stoker-capture against torch.compile(backend="aot_eager"), side by side.

On each model (an MLP, a small GPT block, a small CNN with BatchNorm):

* first-call compile time: stoker's capture + partition + wrap
  (`stoker_capture.aot_module`, first forward + backward) vs
  `torch.compile(backend="aot_eager")` (Dynamo + torch's AOT autograd),
  with `torch._dynamo.reset()` between models;
* steady per-call time (forward + backward) of eager, stoker and aot_eager,
  and the overhead of each over eager;
* saved-activation bytes (saved tensors that are not inputs) of
  `min_cut_partition`, `default_partition` and torch's own min-cut
  partitioner, all on stoker's joint graph of the model.

    python -m stoker._internal.bench.benchmarks.capture [--json PATH] [--iters N] [--models mlp,gpt,cnn]

``--pipeline gpt-m`` instead times stoker's own stages on one model of the GPU
suite (`stoker._internal.bench.suite`; any entry name): state + capture of the
joint graph, min-cut partition, then stoker-triton's prepare, lower, schedule,
codegen and load for the forward and the backward graph (no GPU needed: the
kernels are generated, not run).  Each of ``--repeat`` runs is a fresh process
that first compiles the tiny version of the same model (imports and one-time
tables paid there); the table shows the fastest run per stage, wall and CPU
seconds, and the issue-12 total (capture + partition + lowering + codegen,
without load).

    python -m stoker._internal.bench.benchmarks.capture --pipeline gpt-m [--repeat 3] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, d: int = 256, hidden: int = 512, out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))  # type: ignore[no-any-return]


class GPTBlock(nn.Module):
    """One pre-norm transformer block with causal self-attention."""

    def __init__(self, d: int = 128, heads: int = 4, block: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.tril(torch.ones(block, block, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)  # type: ignore[index]
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))  # type: ignore[no-any-return]


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1, stride=2)
        self.b2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return self.fc(x.mean(dim=(2, 3)))  # type: ignore[no-any-return]


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "mlp": lambda: (MLP(), torch.randn(32, 256)),
    "gpt": lambda: (GPTBlock(), torch.randn(4, 64, 128)),
    "cnn": lambda: (CNN(), torch.randn(8, 3, 32, 32)),
}


# --------------------------------------------------------------------------- timing


def _step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    fn(x).sum().backward()  # type: ignore[no-untyped-call]


def _time_first(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    _step(fn, x)
    return time.perf_counter() - t0


def _time_steady(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int) -> float:
    for _ in range(3):
        _step(fn, x)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _step(fn, x)
        samples.append(time.perf_counter() - t0)
    # the minimum: the machine is shared, and noise only ever adds time
    return min(samples)


def _stoker_aot_module() -> Callable[..., Any] | None:
    import stoker_capture

    return getattr(stoker_capture, "aot_module", None)


def warm_up() -> None:
    """Pay one-time costs (imports, first make_fx, Dynamo's first frame) outside the timings."""
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    aot_module = _stoker_aot_module()
    if aot_module is not None:
        with contextlib.suppress(Exception):
            _step(aot_module(copy.deepcopy(model)), x)
    torch._dynamo.reset()
    with contextlib.suppress(Exception):
        _step(torch.compile(copy.deepcopy(model), backend="aot_eager"), x)
    torch._dynamo.reset()


def bench_compile(name: str, iters: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, x = MODELS[name]()
    row: dict[str, Any] = {"model": name}
    row["eager_ms"] = 1e3 * _time_steady(model, x, iters)

    aot_module = _stoker_aot_module()
    if aot_module is None:
        row["stoker_error"] = "stoker_capture.aot_module is not available"
    else:
        try:
            compiled = aot_module(copy.deepcopy(model))
            row["stoker_first_s"] = _time_first(compiled, x)
            row["stoker_ms"] = 1e3 * _time_steady(compiled, x, iters)
        except Exception as e:  # reported in the table
            row["stoker_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"

    torch._dynamo.reset()
    try:
        tc = torch.compile(copy.deepcopy(model), backend="aot_eager")
        row["aot_eager_first_s"] = _time_first(tc, x)
        row["aot_eager_ms"] = 1e3 * _time_steady(tc, x, iters)
    except Exception as e:  # reported in the table
        row["aot_eager_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    torch._dynamo.reset()
    return row


# --------------------------------------------------------------------------- saved bytes


def joint_graph(name: str) -> tuple[torch.fx.GraphModule, int]:
    """stoker's stage-1 joint graph of the model."""
    import stoker_capture

    torch.manual_seed(0)
    model, x = MODELS[name]()
    cfg = stoker_capture.AOTConfig(mode="joint", dynamic="static")
    with contextlib.ExitStack() as stack:
        state = stoker_capture.create_aot_state(model, (x,), None, cfg, stack)
        graph = stoker_capture.aot_stage1_graph_capture(state)
    return graph.gm, graph.num_fw_outputs


def torch_min_cut_bytes(gm: torch.fx.GraphModule, num_fw_outputs: int) -> int | None:
    """Saved-activation bytes of torch's own min-cut partitioner on the same joint graph.

    stoker's packages never import torch's partitioner; the comparison is stoker-capture's
    test helper (``tests/partition_compare.py``, where tests may import it), loaded from
    the checkout beside this package. None where there is no checkout (an installed
    stoker): the column then reads n/a."""
    import importlib.util

    path = (
        pathlib.Path(__file__).resolve().parents[6]
        / "stoker-capture"
        / "tests"
        / "partition_compare.py"
    )
    spec = importlib.util.spec_from_file_location("stoker_partition_compare", path)
    if not path.exists() or spec is None or spec.loader is None:
        return None
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    saved: int = helper.torch_min_cut_saved_bytes(gm, num_fw_outputs)
    return saved


def bench_bytes(name: str) -> dict[str, Any]:
    from stoker_capture._internal.partition.core import default_partition
    from stoker_capture._internal.partition.mincut import min_cut_partition

    row: dict[str, Any] = {"model": name}
    try:
        t0 = time.perf_counter()
        gm, n = joint_graph(name)
        row["capture_ms"] = 1e3 * (time.perf_counter() - t0)
    except Exception as e:  # reported in the table
        row["error"] = f"capture: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return row
    t0 = time.perf_counter()
    d = default_partition(gm, num_fw_outputs=n)
    row["default_partition_ms"] = 1e3 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    m = min_cut_partition(gm, num_fw_outputs=n)
    row["min_cut_partition_ms"] = 1e3 * (time.perf_counter() - t0)
    row["default_bytes"] = d.saved_bytes
    row["min_cut_bytes"] = m.saved_bytes
    row["min_cut_recomputed"] = len(m.recomputed)
    row["budget_bytes"] = {
        str(b): min_cut_partition(gm, num_fw_outputs=n, memory_budget=b).saved_bytes
        for b in BUDGETS
    }
    t0 = time.perf_counter()
    row["torch_min_cut_bytes"] = torch_min_cut_bytes(gm, n)
    took = 1e3 * (time.perf_counter() - t0)
    row["torch_min_cut_ms"] = None if row["torch_min_cut_bytes"] is None else took
    return row


BUDGETS = (0.0, 0.25, 0.5, 0.75, 1.0)

# --------------------------------------------------------------------------- table


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "n/a"


def print_tables(compile_rows: list[dict[str, Any]], byte_rows: list[dict[str, Any]]) -> None:
    print("\nfirst call (forward+backward, includes compilation), seconds")
    print(f"{'model':<6} {'stoker':>9} {'aot_eager':>10} {'ratio':>7}")
    for r in compile_rows:
        s, a = r.get("stoker_first_s"), r.get("aot_eager_first_s")
        ratio = s / a if isinstance(s, float) and isinstance(a, float) else None
        print(f"{r['model']:<6} {_f(s, '9.3f')} {_f(a, '10.3f')} {_f(ratio, '7.2f')}")
    print("\nsteady forward+backward per call (best of --iters), ms (overhead over eager)")
    print(f"{'model':<6} {'eager':>8} {'stoker':>16} {'aot_eager':>16}")
    for r in compile_rows:
        e = r["eager_ms"]
        cells = []
        for k in ("stoker_ms", "aot_eager_ms"):
            v = r.get(k)
            cells.append(f"{v:7.3f} ({v - e:+6.3f})" if isinstance(v, float) else "n/a")
        print(f"{r['model']:<6} {e:8.3f} {cells[0]:>16} {cells[1]:>16}")
    for r in compile_rows:
        for k in ("stoker_error", "aot_eager_error"):
            if k in r:
                print(f"  {r['model']}: {k}: {r[k]}")
    print("\nsaved activation bytes (not counting saved inputs), stoker's joint graph")
    print(f"{'model':<6} {'default':>10} {'min_cut':>10} {'torch min-cut':>14} {'recomputed':>11}")
    for r in byte_rows:
        if "error" in r:
            print(f"{r['model']:<6} {r['error']}")
            continue
        print(
            f"{r['model']:<6} {r['default_bytes']:>10} {r['min_cut_bytes']:>10} "
            f"{_f(r['torch_min_cut_bytes'], '>14')} {r['min_cut_recomputed']:>11}"
        )
    print("\nmin_cut saved activation bytes by memory_budget")
    print(f"{'model':<6} " + " ".join(f"{b:>10}" for b in BUDGETS))
    for r in byte_rows:
        if "error" not in r:
            cells = " ".join(f"{r['budget_bytes'][str(b)]:>10}" for b in BUDGETS)  # type: ignore[assignment]
            print(f"{r['model']:<6} {cells}")
    print("\nstage times on the same joint graph, ms")
    print(f"{'model':<6} {'capture':>9} {'default':>9} {'min_cut':>9} {'torch min-cut':>14}")
    for r in byte_rows:
        if "error" not in r:
            print(
                f"{r['model']:<6} {r['capture_ms']:9.1f} {r['default_partition_ms']:9.1f} "
                f"{r['min_cut_partition_ms']:9.1f} {_f(r['torch_min_cut_ms'], '14.1f')}"
            )


# --------------------------------------------------------------------------- pipeline

# (stage, what it covers); the triton stages run once for the forward, once for the backward
PIPELINE_STAGES = (
    ("state", "fake inputs, forward metadata (create_aot_state)"),
    ("capture", "joint graph (aot_stage1_graph_capture)"),
    ("partition", "min_cut_partition"),
    ("prepare", "stoker-triton: fake inputs, decompositions"),
    ("lower", "aten -> loop IR"),
    ("schedule", "fusion"),
    ("codegen", "Triton sources + wrapper"),
    ("load", "kernel modules + wrapper imported (not counted in the target)"),
)
_TARGET_STAGES = ("state", "capture", "partition", "prepare", "lower", "schedule", "codegen")


def pipeline_once(name: str, smoke: bool) -> dict[str, dict[str, float]]:
    """Seconds (wall and CPU) per stage of one compile of suite entry ``name``."""
    import stoker_capture
    import stoker_triton
    from stoker._internal.bench.suite import get_entry
    from stoker_capture._internal.stages.compile import example_inputs

    entry = get_entry(name)
    torch.manual_seed(0)
    size = entry.sized(smoke)
    model = entry.build(size)
    args, _ = entry.batch(size, torch.Generator().manual_seed(0))
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def timed(stage: str, fn: Callable[[], Any]) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall[stage] = wall.get(stage, 0.0) + time.perf_counter() - t0
        cpu[stage] = cpu.get(stage, 0.0) + time.process_time() - c0
        return out

    cfg = stoker_capture.AOTConfig(mode="joint", dynamic="static")
    cast = (
        torch.autocast("cpu", dtype=entry.autocast) if entry.autocast else contextlib.nullcontext()
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(cast)
        state = timed(
            "state", lambda: stoker_capture.create_aot_state(model, args, None, cfg, stack)
        )
        graph = timed("capture", lambda: stoker_capture.aot_stage1_graph_capture(state))
        n = graph.num_fw_outputs
        part = timed(
            "partition", lambda: stoker_capture.min_cut_partition(graph.gm, num_fw_outputs=n)
        )
        with stoker_capture.autocast_off(), state.ctx.tracing():
            for gm in (part.fw, part.bw):
                report = stoker_triton.compile_graph(gm, example_inputs(gm)).report  # type: ignore[attr-defined]
                for kind, ms in (("wall", report.timings_ms), ("cpu", report.cpu_ms)):
                    acc = wall if kind == "wall" else cpu
                    for stage, v in ms.items():
                        acc[stage] = acc.get(stage, 0.0) + v / 1e3
    return {"wall": wall, "cpu": cpu}


def _pipeline_worker(name: str, smoke: bool) -> None:
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["STOKER_CACHE_DIR"] = cache  # a cold kernel cache for `load`
        pipeline_once(name, smoke=True)  # imports, one-time tables
        print(json.dumps(pipeline_once(name, smoke=smoke)))


def bench_pipeline(name: str, repeat: int, smoke: bool = False) -> dict[str, Any]:
    """The fastest of ``repeat`` fresh processes, per stage."""
    import subprocess

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")
    env.setdefault("STOKER_TRITON_CHECK_TARGETS", "")  # no sm_90 cross-compile in `load`
    # every stage measured: a compiled-graph cache hit (the warm-up compiled the same
    # graphs in --smoke) would skip lower, schedule and codegen
    env["STOKER_TRITON_GRAPH_CACHE"] = "0"
    runs = []
    for _ in range(repeat):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "stoker._internal.bench.benchmarks.capture",
                "--pipeline-worker",
                name,
                *(["--smoke"] if smoke else []),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            raise SystemExit(f"pipeline worker failed:\n{out.stderr[-4000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = {
        kind: {st: min(r[kind].get(st, 0.0) for r in runs) for st, _ in PIPELINE_STAGES}
        for kind in ("wall", "cpu")
    }
    return {"model": name, "smoke": smoke, "repeat": repeat, "best": best, "runs": runs}


def print_pipeline(row: dict[str, Any]) -> None:
    best = row["best"]
    print(f"\nstoker's stages on {row['model']} (fastest of {row['repeat']} processes), seconds")
    print(f"{'stage':<10} {'wall':>7} {'cpu':>7}  what")
    for st, what in PIPELINE_STAGES:
        print(f"{st:<10} {best['wall'][st]:7.2f} {best['cpu'][st]:7.2f}  {what}")
    for label, stages in (
        ("target", _TARGET_STAGES),
        ("all", tuple(st for st, _ in PIPELINE_STAGES)),
    ):
        w = sum(best["wall"][s] for s in stages)
        c = sum(best["cpu"][s] for s in stages)
        note = (
            "capture + partition + lowering + codegen (target: <= 3 s)"
            if label == "target"
            else "with load"
        )
        print(f"{label:<10} {w:7.2f} {c:7.2f}  {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--iters", type=int, default=30, help="timed steady-state calls")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--pipeline", metavar="MODEL", help="time stoker's stages on a suite model")
    ap.add_argument("--repeat", type=int, default=3, help="processes for --pipeline")
    ap.add_argument("--smoke", action="store_true", help="--pipeline at the tiny size (tests)")
    ap.add_argument("--pipeline-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pipeline_worker:
        _pipeline_worker(args.pipeline_worker, args.smoke)
        return 0
    if args.pipeline:
        row = bench_pipeline(args.pipeline, args.repeat, args.smoke)
        print_pipeline(row)
        if args.json:
            pathlib.Path(args.json).write_text(
                json.dumps({"torch": torch.__version__, "pipeline": row}, indent=1)
            )
        return 0
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    warm_up()
    compile_rows = [bench_compile(n, args.iters) for n in names]
    byte_rows = [bench_bytes(n) for n in names]
    print_tables(compile_rows, byte_rows)
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                {"torch": torch.__version__, "compile": compile_rows, "bytes": byte_rows}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
