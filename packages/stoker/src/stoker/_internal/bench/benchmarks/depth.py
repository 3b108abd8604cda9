"""Does a cold compile grow with depth? A tiny GPT of 2 and of 8 identical blocks, by stage.

    python -m stoker._internal.bench.benchmarks.depth [--layers 2,8] [--repeat 3] [--workers 0] [--json FILE]
    python -m stoker._internal.bench.benchmarks.depth --profile OUT.prof --layers 8 --repeat 1   # cProfile the compile
    python -m stoker._internal.bench.benchmarks.depth --tree /tmp/main   # and a checkout of main, alternating

Each (repeat, depth) is a new process with empty ``STOKER_CACHE_DIR`` / ``TRITON_CACHE_DIR``
that trains the GPU suite's tiny GPT (d=64, T=32, batch 4, forward + backward) with the
number of blocks asked for, through `stoker.compile` on Triton's *real* launch path: the
stand-in sm_90 driver (`stoker_triton._internal.fakegpu`, as `warm.py` uses it) and, as
on a GPU, compile workers that build every kernel for sm_90 with ptxas (so kernel compiles
count). Depths alternate within a repeat, so each ratio compares processes run side by side.

Steps run until the step is steady (``--steps``, default 4: the first compiles the forward
and records the backward, the second launches the compiled-autograd backward for the first
time; the last is the steady step). Measured, in CPU seconds (the machine is shared and
its wall times swing; wall is given beside):

- **cold extra**: the steps before the steady one, less as many steady steps, less
  Dynamo's own time (its `_compile` less stoker's backend inside it), plus the compile
  workers' CPU (the kernel compiles): the baseline figure;
- stoker's stages, each summed over those steps: capture (the forward's fake run and joint
  trace, compiled autograd's retrace), partition, and stoker-triton's prepare, lower,
  schedule, codegen and load (`report.cpu_ms` of every `compile_graph` call), and kernel
  compile (the workers' CPU);
- Dynamo's own time, reported apart: it grows with depth in every backend;
- counts: `compile_graph` calls and their kernels, distinct kernel modules stored (one
  compile each), compiles the workers ran, and regions reused (`stoker_triton` stats).

The summary gives min / median / max over the repeats of each depth and of the ratio
depth / first depth, each ratio taken within one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

# stage -> (module, attribute path); timed per outermost call, CPU and wall of this process
STAGES: dict[str, tuple[str, str]] = {
    "dynamo": ("torch._dynamo.convert_frame", "_compile"),
    "stoker backend": ("stoker._internal.api.backend", "StokerBackend.__call__"),
    "capture: state": ("stoker_capture._internal.api", "create_aot_state"),
    "capture: joint trace": ("stoker_capture._internal.api", "aot_stage1_graph_capture"),
    "partition": ("stoker_capture", "min_cut_partition"),
    "compile_graph": ("stoker_triton._internal.pipeline", "compile_graph_impl"),
    "compiled autograd: first run (eager)": ("stoker_autograd._internal.runtime", "_Recorder.run"),
    "capture: compiled autograd retrace": ("stoker_autograd._internal.runtime", "retrace"),
    "compiled autograd: compile": (
        "stoker_autograd._internal.runtime",
        "CompiledBackward._compiled",
    ),
    "wait for workers": ("stoker_triton._internal.runtime.launcher", "Launcher._await_precompile"),
}
TRITON_STAGES = ("prepare", "cache", "lower", "schedule", "codegen", "load")
# what the summary adds up as stoker's own stages (CPU s)
OWN = (
    "capture: state",
    "capture: joint trace",
    "capture: compiled autograd retrace",
    "partition",
    *(f"triton: {s}" for s in TRITON_STAGES),
    "kernel compile (workers)",
)


def _wrap(table: dict[str, tuple[str, str]]) -> dict[str, list[float]]:
    """Wrap each function of `table` with a timer: stage -> [calls, wall s, CPU s]."""
    from .warm import _wrap_stages

    times: dict[str, list[float]] = _wrap_stages(table)[0]
    return times


def _worker(
    layers: int, steps: int, workers: int, smoke: bool, profile: str | None
) -> dict[str, Any]:
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    # one torch thread: OpenMP's idle threads spin and count as CPU time (up to a second
    # of a steady step here, while the compile workers held the other core)
    torch.set_num_threads(1)
    import stoker
    from stoker._internal.bench.suite import get_entry

    from .warm import stand_in
    from .workers import _tree_cpu

    stand_in()
    from stoker_triton._internal import pipeline, runtime
    from stoker_triton._internal.compile import xcompile

    def gpu_target(device: Any) -> tuple[str, Any, int] | None:
        return ("cuda", 90, 32)

    # as on a GPU: workers
    runtime.native_target = pipeline.native_target = gpu_target  # type: ignore[attr-defined]
    if workers:
        xcompile.cpu_count = lambda: workers
    times = _wrap(STAGES)
    graphs: list[dict[str, Any]] = []
    impl = pipeline.compile_graph_impl

    def counted(*a: Any, **k: Any) -> Any:
        out = impl(*a, **k)
        rep = out.report
        graphs.append({"kernels": len(rep.kernels), "cache": rep.cache, "cpu_ms": dict(rep.cpu_ms)})
        return out

    pipeline.compile_graph_impl = counted
    entry = get_entry("tiny-gpt")
    size = dict(entry.sized(smoke))
    size["layers"] = layers
    torch.manual_seed(0)
    net = entry.build(size)
    inputs, target = entry.batch(size, torch.Generator().manual_seed(0))
    fn = stoker.compile(net)

    def step() -> None:
        loss = entry.loss(fn(*inputs), target)
        loss.backward()  # type: ignore[no-untyped-call]
        for p in net.parameters():
            p.grad = None

    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile(time.process_time)
    per_step: list[dict[str, Any]] = []
    snap_prev = {k: list(v) for k, v in times.items()}
    n_graphs = 0
    for i in range(steps):
        w0, c0, t0 = time.perf_counter(), time.process_time(), _tree_cpu()
        if prof is not None and i < steps - 1:
            prof.runcall(step)
        else:
            step()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        tree = _tree_cpu() - t0
        stages = {
            k: [a - b for a, b in zip(v, snap_prev[k])] for k, v in times.items() if k in snap_prev
        }
        snap_prev = {k: list(v) for k, v in times.items()}
        tri: dict[str, float] = {s: 0.0 for s in TRITON_STAGES}
        for g in graphs[n_graphs:]:
            for s, ms in g["cpu_ms"].items():
                tri[s] = tri.get(s, 0.0) + ms / 1e3
        per_step.append(
            {
                "wall": wall,
                "cpu": cpu,
                "workers cpu": max(0.0, tree - cpu),
                "stages": stages,
                "triton": tri,
                "graphs": graphs[n_graphs:],
            }
        )
        n_graphs = len(graphs)
    if prof is not None and profile:
        prof.dump_stats(profile)
    if os.environ.get("BENCH_DEPTH_TREE"):  # each descendant's CPU (where the workers' goes)
        _print_tree()
    kdir = os.path.join(os.environ.get("STOKER_CACHE_DIR", ""), "triton", "kernels")
    from stoker_triton._internal import graphcache

    regions = getattr(pipeline, "region_stats", None)
    return {
        "layers": layers,
        "steps": per_step,
        "kernel modules stored": len(os.listdir(kdir)) if os.path.isdir(kdir) else 0,
        "worker compiles": xcompile.compiled_count,
        "graph cache": dict(getattr(graphcache, "stats", {}) or {}),
        "regions": dict(regions) if isinstance(regions, dict) else None,
    }


def _print_tree() -> None:
    tck = os.sysconf("SC_CLK_TCK")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline") as f:
                cmd = f.read().replace("\0", " ")[:100]
        except OSError:
            continue
        if int(fields[1]) == os.getpid() or int(fields[1]) in _kids():
            cpu = [int(v) / tck for v in fields[11:15]]
            print(
                f"pid {d} ppid {fields[1]} utime {cpu[0]:.2f} stime {cpu[1]:.2f} "
                f"children {cpu[2]:.2f}+{cpu[3]:.2f} {cmd}",
                file=sys.stderr,
            )


def _kids() -> set[int]:
    out: set[int] = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        out.add(int(d))
            except OSError:
                pass
    return out


def summarize(run: dict[str, Any]) -> dict[str, float]:
    """One process's figures: CPU seconds of each stage over the steps before the steady one."""
    steps = run["steps"]
    cold, steady = steps[:-1], steps[-1]
    row: dict[str, float] = {}

    def stage(name: str, col: int = 2) -> float:
        return sum(s["stages"].get(name, [0, 0.0, 0.0])[col] for s in cold)  # type: ignore[no-any-return]

    dynamo_own = stage("dynamo") - stage("stoker backend")
    dynamo_own_wall = stage("dynamo", 1) - stage("stoker backend", 1)
    workers = sum(s["workers cpu"] for s in steps)
    extra_cpu = sum(s["cpu"] for s in cold) - len(cold) * steady["cpu"]
    extra_wall = sum(s["wall"] for s in cold) - len(cold) * steady["wall"]
    row["cold extra (CPU, incl. workers)"] = extra_cpu - dynamo_own + workers
    row["cold extra (wall)"] = extra_wall - dynamo_own_wall
    for name in (
        "capture: state",
        "capture: joint trace",
        "capture: compiled autograd retrace",
        "partition",
    ):
        row[name] = stage(name)
    for s in TRITON_STAGES:
        row[f"triton: {s}"] = sum(st["triton"].get(s, 0.0) for st in cold)
    row["kernel compile (workers)"] = workers
    row["stoker's stages (sum)"] = sum(row[k] for k in OWN)
    row["dynamo (own)"] = dynamo_own
    row["compiled autograd: first run (eager)"] = stage("compiled autograd: first run (eager)")
    row["wait for workers (wall)"] = stage("wait for workers", 1)
    row["steady step (CPU)"] = steady["cpu"]
    row["compile_graph kernels"] = sum(g["kernels"] for s in cold for g in s["graphs"])
    row["kernel modules stored"] = run["kernel modules stored"]
    row["worker compiles"] = run["worker compiles"]
    return row


def _pythonpath(tree: str) -> str:
    """PYTHONPATH for another checkout's packages (`--tree`, e.g. a `git archive` of main)."""
    pk = os.path.join(tree, "packages")
    return os.pathsep.join(os.path.join(pk, d, "src") for d in sorted(os.listdir(pk)))


def _run(layers: int, a: argparse.Namespace, tree: str | None = None) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="stoker-depth-")
    env = {
        **os.environ,
        **({"PYTHONPATH": _pythonpath(tree)} if tree else {}),
        "TRITON_INTERPRET": "0",
        "STOKER_TRITON_CHECK_TARGETS": "",
        "STOKER_CACHE_DIR": os.path.join(root, "stoker"),
        "TRITON_CACHE_DIR": os.path.join(root, "triton"),
    }
    cmd = [
        sys.executable,
        "-W",
        "ignore",
        "-m",
        "stoker._internal.bench.benchmarks.depth",
        "--worker",
        "--layers",
        str(layers),
    ]
    cmd += ["--steps", str(a.steps), "--workers", str(a.workers)]
    cmd += [*(["--smoke"] if a.smoke else []), *(["--profile", a.profile] if a.profile else [])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_depth worker ({layers} layers) failed:\n{p.stderr[-4000:]}")
    who = f" ({tree})" if tree else ""
    print(f"  {layers} layers{who}: {time.perf_counter() - t0:.1f} s wall", file=sys.stderr)
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def _fmt(xs: list[float]) -> str:
    if not xs:
        return ""
    return f"{min(xs):7.2f} {statistics.median(xs):7.2f} {max(xs):7.2f}"


def report(runs: list[list[dict[str, Any]]], depths: list[int]) -> str:
    """The table: per depth min/median/max over repeats; per other depth its ratio to the first."""
    rows = [[summarize(r) for r in rep] for rep in runs]  # [repeat][depth]
    names = list(rows[0][0])
    head = f"  {'CPU s (min median max over ' + str(len(runs)) + ' repeats)':46s}"
    head += "".join(f" {str(d) + ' blocks':>23s}" for d in depths)
    head += "".join(f" {'ratio ' + str(d) + '/' + str(depths[0]):>23s}" for d in depths[1:])
    lines = [head]
    for n in names:
        cols = [_fmt([rep[j][n] for rep in rows]) for j in range(len(depths))]
        ratios = []
        for j in range(1, len(depths)):
            rs = [rep[j][n] / rep[0][n] for rep in rows if rep[0][n] > 0]
            ratios.append(_fmt(rs))
        lines.append(f"  {n:46s}" + "".join(f" {c:>23s}" for c in cols + ratios))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="2,8", help="depths to compare, the first is the base")
    ap.add_argument("--repeat", type=int, default=3, help="processes per depth")
    ap.add_argument("--steps", type=int, default=4, help="steps per process; the last is steady")
    ap.add_argument("--workers", type=int, default=0, help="compile workers (0: one per CPU)")
    ap.add_argument("--smoke", action="store_true", help="the tiny GPT at its smoke size")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", help="write the raw per-process results here")
    ap.add_argument(
        "--tree",
        help="also run another checkout (its packages/*/src), alternating with this one; "
        "its own copy of this module runs there (a checkout from before the harness lacks it)",
    )
    ap.add_argument("--profile", help="cProfile the steps before the steady one into this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    depths = [int(x) for x in a.layers.split(",")]
    if a.worker:
        print(json.dumps(_worker(depths[0], a.steps, a.workers, a.smoke, a.profile)))
        return 0
    trees: list[tuple[str, str | None]] = [("this checkout", None)]
    if a.tree:
        trees.append((f"--tree {a.tree}", a.tree))
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name, _ in trees}
    for r in range(a.repeat):  # each repeat runs every tree and depth, side by side
        print(f"repeat {r + 1}/{a.repeat}", file=sys.stderr)
        for name, tree in trees:
            runs[name].append([_run(d, a, tree) for d in depths])
    for name, _ in trees:
        print(
            f"{name}: tiny GPT, {' vs '.join(map(str, depths))} blocks, cold first steps "
            "(CPU s unless said)"
        )
        print(report(runs[name], depths))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
