"""A warm start on the CPU, by stage (issue 12: "a warm first step <= Inductor's warm").

    python tools/bench_warm.py [--model gpt-m] [--batch 2] [--repeat 3] [--keep DIR]

Two kinds of process train one step of a GPU-suite model (`stoker/_internal/bench/suite.py`)
with `stoker.compile`, through Triton's *real* launch path on the CPU: ``TRITON_INTERPRET=0``
and `stoker_triton._internal.fakegpu` (kernels cross-compiled for sm_90 with ptxas, written to
Triton's disk cache, "loaded" and "launched" by stubs). CPU tensors stand in for CUDA ones:
the stoker executor is forced to "triton" for them (`config.resolve_backend`), the one
workaround; the stub launches write nothing, so losses are garbage, not timed correctness.

1. a cold process fills STOKER_CACHE_DIR and TRITON_CACHE_DIR (a temp dir);
2. ``--repeat`` warm processes, each a new interpreter, time their first step under
   cProfile and report per stage (inclusive CPU seconds, min over the repeats); one more
   warm process runs under ``python -X importtime`` for the import list (``--imports``).

The stages (cProfile's cumulative time of the function that owns each; they nest, so
they do not add up): see `STAGES`. Counters: kernel modules loaded, `triton.jit`
JITFunctions made, Triton compiles (`triton.compile`), compiled-autograd FX graphs built.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

# stage -> (module file suffix, function name) whose cumulative time is the stage
STAGES: dict[str, tuple[str, str]] = {
    "process to end of first step": ("", "-"),  # CPU time of the whole process
    "first step (all)": ("bench_warm.py", "step"),
    "Dynamo (convert_frame)": ("convert_frame.py", "_compile"),
    "stoker backend": ("stoker/_internal/api/backend.py", "__call__"),
    "capture (stage 1, cache)": ("stoker_capture/_internal/dynamo.py", "backend"),
    "compiled-graph load (triton)": ("stoker_triton/_internal/graphcache.py", "load"),
    "kernel modules load": ("stoker_triton/_internal/runtime/modules.py", "load_stored"),
    "  triton.jit (JITFunction)": ("triton/runtime/jit.py", "jit"),
    "first launches (JITFunction.run)": ("triton/runtime/jit.py", "run"),
    "  Triton compile": ("triton/compiler/compiler.py", "compile"),
    "compiled autograd (end_capture)": ("stoker_autograd/_internal/capture.py", "end_capture"),
    "  autograd cache key": ("stoker_autograd/_internal/graphstore.py", "key"),
    "  autograd graph text": ("stoker_autograd/_internal/graphstore.py", "graph_text"),
    "backward (all)": ("torch/_tensor.py", "backward"),
    "optimizer step": ("torch/optim/optimizer.py", "wrapper"),
}


# A cold first step, by stage (`--cold`): each wraps the function(s) named and times
# their calls (wall and CPU of this process, inclusive, outermost call only): unlike
# cProfile's, these times are not inflated by the profiler, and waits count.
# stage -> (module, attribute path)
COLD_STAGES: dict[str, tuple[str, str]] = {
    "Dynamo (convert_frame._compile)": ("torch._dynamo.convert_frame", "_compile"),
    "stoker backend": ("stoker._internal.api.backend", "StokerBackend.__call__"),
    "  capture: state (fake forward)": ("stoker_capture._internal.api", "create_aot_state"),
    "  capture: joint trace (stage 1)": (
        "stoker_capture._internal.api",
        "aot_stage1_graph_capture",
    ),
    "  stage 2 (partition + compile fw, bw)": (
        "stoker_capture._internal.api",
        "aot_stage2_compile",
    ),
    "compile_graph (all graphs)": ("stoker_triton._internal.pipeline", "compile_graph_impl"),
    "forward run (compiled)": ("stoker_capture._internal.runtime_fn", "CompiledFunction.forward"),
    "backward (all)": ("torch", "Tensor.backward"),
    "  compiled autograd: first run (eager)": (
        "stoker_autograd._internal.runtime",
        "_Recorder.run",
    ),
    "  compiled autograd: retrace": ("stoker_autograd._internal.runtime", "retrace"),
    "  compiled autograd: compile": (
        "stoker_autograd._internal.runtime",
        "CompiledBackward._compiled",
    ),
    "wait for workers (first launches)": (
        "stoker_triton._internal.runtime.launcher",
        "Launcher._await_precompile",
    ),
    "Triton launches (JITFunction.run)": ("triton.runtime.jit", "JITFunction.run"),
    "  Triton compile in this process": ("triton.runtime.jit", "compile"),
    "cache writes (DiskCache.put)": ("stoker_shapes._internal.diskcache", "DiskCache.put"),
    "  binary records (warmload.record)": ("stoker_triton._internal.runtime.warmload", "record"),
    "optimizer step": ("torch.optim.adamw", "AdamW.step"),
}


def _wrap_stages(
    table: dict[str, tuple[str, str]],
) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """Wrap each function of `table` with a timer: stage -> [calls, wall s, CPU s];
    and each `compile_graph_impl` call's record (wall, CPU, its report's stages)."""
    import importlib

    times: dict[str, list[float]] = {}
    graphs: list[dict[str, Any]] = []
    for stage, (modname, attr) in table.items():
        try:
            owner: Any = importlib.import_module(modname)
            *parents, name = attr.split(".")
            for p in parents:
                owner = getattr(owner, p)
            fn = getattr(owner, name)
        except (ImportError, AttributeError) as e:
            print(f"bench_warm: stage {stage!r} not timed: {e}", file=sys.stderr)
            continue
        row = times[stage] = [0, 0.0, 0.0]
        setattr(owner, name, _timer(fn, row, graphs if name == "compile_graph_impl" else None))
    return times, graphs


def _timer(fn: Any, row: list[float], graphs: list[dict[str, Any]] | None) -> Any:
    import functools
    import traceback

    depth = [0]

    @functools.wraps(fn)
    def timed(*a: Any, **k: Any) -> Any:
        if depth[0]:
            return fn(*a, **k)
        depth[0] += 1
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            out = fn(*a, **k)
        finally:
            depth[0] -= 1
            w, c = time.perf_counter() - w0, time.process_time() - c0
            row[0] += 1
            row[1] += w
            row[2] += c
        if graphs is not None:
            rep = getattr(out, "report", None)
            stack = "".join(traceback.format_stack(limit=40))
            graphs.append(
                {
                    "by": "compiled autograd" if "stoker_autograd" in stack else "capture",
                    "wall": w,
                    "cpu": c,
                    "kernels": len(getattr(rep, "kernels", ()) or ()),
                    "cache": getattr(rep, "cache", None),
                    "stages_ms": dict(getattr(rep, "timings_ms", {}) or {}),
                }
            )
        return out

    return timed


def stand_in() -> None:
    """Triton's real launch path on the CPU: the stand-in sm_90 driver, and CPU tensors
    taking stoker's Triton executor (the one workaround: CUDA inputs would). Call with
    ``TRITON_INTERPRET=0`` set before triton is imported."""
    from stoker._internal import config
    from stoker._internal.api import backend
    from stoker_triton._internal.fakegpu import install

    install()
    config.resolve_backend = lambda requested, devices: "triton"
    if hasattr(backend, "resolve_backend"):
        backend.resolve_backend = config.resolve_backend


def _worker(
    model: str,
    batch: int | None,
    profile_out: str | None,
    steps: int,
    smoke: bool,
    cold: bool = False,
    workers: int = 0,
    profile: bool = True,
) -> dict[str, Any]:
    t_start = time.process_time()
    w_start = time.perf_counter()
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    t_torch = time.process_time()
    import stoker
    from stoker._internal.bench.suite import get_entry

    t_stoker = time.process_time()
    stand_in()
    cold_times: dict[str, list[float]] = {}
    graphs: list[dict[str, Any]] = []
    if cold:  # as on a GPU: compile workers, each kernel's compile queued as it loads
        from stoker_triton._internal import pipeline, runtime, xcompile

        def gpu_target(device: Any) -> tuple[str, Any, int] | None:
            return ("cuda", 90, 32)

        runtime.native_target = pipeline.native_target = gpu_target
        if workers:
            xcompile.cpu_count = lambda: workers

    counts = _count_calls()
    if cold:
        cold_times, graphs = _wrap_stages(COLD_STAGES)
    entry = get_entry(model)
    size = dict(entry.sized(smoke))
    if batch is not None:
        size["batch"] = batch
    torch.manual_seed(0)
    net = entry.build(size)
    inputs, target = entry.batch(size, torch.Generator().manual_seed(0))
    fn = stoker.compile(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step() -> None:
        loss = entry.loss(fn(*inputs), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    import cProfile
    import pstats

    before = dict(counts)
    prof = cProfile.Profile(time.process_time)
    t0, w0 = time.process_time(), time.perf_counter()
    prof.runcall(step) if profile else step()
    first, first_wall = time.process_time() - t0, time.perf_counter() - w0
    if not profile:
        prof.runcall(lambda: None)
    stats = pstats.Stats(prof)
    if profile_out:
        stats.dump_stats(profile_out)
    stages = {name: 0.0 for name in STAGES}
    for (file, _line, func), row in stats.stats.items():  # type: ignore[attr-defined]
        for name, (suffix, fname) in STAGES.items():
            if func == fname and file.replace(os.sep, "/").endswith(suffix):
                stages[name] += row[3]  # cumulative
    stages["first step (all)"] = first
    stages["process to end of first step"] = time.process_time()
    cold_rows = {k: list(v) for k, v in cold_times.items()}  # the first step's only
    n_graphs = len(graphs)
    cold_rows["first step (all)"] = [1, first_wall, first]
    if cold:  # distinct kernel sources the first step stored (one compile each)
        kdir = os.path.join(os.environ.get("STOKER_CACHE_DIR", ""), "triton", "kernels")
        counts["kernel modules stored"] = len(os.listdir(kdir)) if os.path.isdir(kdir) else 0
        before.setdefault("kernel modules stored", 0)
    cold_rows["process to end of first step"] = [
        1,
        time.perf_counter() - w_start,
        time.process_time(),
    ]
    for _ in range(steps - 1):  # the cold process: later steps compile what the first ran eagerly
        step()
    modules: dict[str, int] = {}
    for name in list(sys.modules):
        top = name.split(".")[0]
        modules[top] = modules.get(top, 0) + 1
    rep = getattr(fn, "stoker_report", None)
    import stoker_autograd

    return {
        "imports: torch": t_torch - t_start,
        "imports: stoker (+ triton)": t_stoker - t_torch,
        "stages": stages,
        "counts": {k: v - before[k] for k, v in counts.items()},  # in the first step
        "counts before": before,
        "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1])[:12]),
        "stoker modules": sorted(m for m in sys.modules if m.startswith("stoker")),
        "summary": rep.summary() if rep is not None else {},
        "autograd": stoker_autograd.stats(),
        "cold": cold_rows,
        "graphs": graphs[:n_graphs],
    }


def _count_calls() -> dict[str, int]:
    """Counters of JITFunctions made, Triton compiles and FX graphs of compiled autograd."""
    import triton
    from triton.runtime import jit

    counts = {
        "JITFunction": 0,
        "triton.compile": 0,
        "Triton cache misses": 0,
        "autograd FX graphs": 0,
    }

    def listener(**k: Any) -> None:  # a compile that found no binary in Triton's cache
        counts["Triton cache misses"] += not k.get("cache_hit", False)

    triton.knobs.compilation.listener = listener
    init = jit.JITFunction.__init__

    def counted_init(self: Any, *a: Any, **k: Any) -> None:
        counts["JITFunction"] += 1
        if os.environ.get("BENCH_WARM_WHO") and counts["JITFunction"] == 1:
            import traceback

            traceback.print_stack(file=sys.stderr)
        init(self, *a, **k)

    jit.JITFunction.__init__ = counted_init
    import triton.compiler.compiler as tcc

    comp = tcc.compile

    def counted_compile(*a: Any, **k: Any) -> Any:
        counts["triton.compile"] += 1
        return comp(*a, **k)

    tcc.compile = counted_compile
    triton.compile = counted_compile
    triton.compiler.compile = counted_compile  # what JITFunction's binder imports
    jit.compile = counted_compile
    try:
        from stoker_autograd._internal import capture

        gm = capture.graph_module

        def counted_gm(*a: Any, **k: Any) -> Any:
            counts["autograd FX graphs"] += 1
            return gm(*a, **k)

        capture.graph_module = counted_gm
    except (ImportError, AttributeError):
        pass
    return counts


def _run(
    env: dict[str, str], args: list[str], timeout: float, flags: tuple[str, ...] = ()
) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, *flags, "-W", "ignore", __file__, "--worker", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if p.returncode != 0:
        raise SystemExit(f"worker failed:\n{p.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def _imports(env: dict[str, str], args: list[str], top: int) -> list[tuple[float, str]]:
    """The slowest imports of a warm process (`-X importtime`, cumulative, seconds)."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-W", "ignore", __file__, "--worker", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    rows = []
    for line in p.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cum, name = line[len("import time:") :].split("|")
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        rows.append((int(cum) / 1e6, depth, name.strip()))
    # the modules imported directly by the program or by one of them (depth 0 and 1)
    return sorted(((s, "  " * d + n) for s, d, n in rows if d <= 1), reverse=True)[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-m")
    ap.add_argument("--batch", type=int, default=2, help="batch size (kernels do not change)")
    ap.add_argument("--smoke", action="store_true", help="the model at its tiny smoke size")
    ap.add_argument("--repeat", type=int, default=3, help="warm processes; the min is reported")
    ap.add_argument("--keep", help="cache directory to use and keep (default: a temp dir)")
    ap.add_argument("--imports", type=int, default=15, help="slowest imports to list (0: none)")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--warm-only", action="store_true", help="reuse the filled --keep directory")
    ap.add_argument(
        "--no-pyc",
        action="store_true",
        help="warm processes read no bytecode cache (as on the GPU image): imports compile sources",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="break down a cold first step instead: --repeat processes, each with empty caches",
    )
    ap.add_argument("--workers", type=int, default=0, help="--cold: compile workers (0: per CPU)")
    ap.add_argument(
        "--profile", action="store_true", help="--cold: also cProfile the step (CPU stages)"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        out = _worker(
            a.model, a.batch, a.profile_out, a.steps, a.smoke, a.cold, a.workers, a.profile
        )
        print(json.dumps(out))
        return 0
    if a.cold:
        return _cold_main(a)
    root = a.keep or tempfile.mkdtemp(prefix="stoker-warm-")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "STOKER_CACHE_DIR": os.path.join(root, "stoker"),
        "TRITON_CACHE_DIR": os.path.join(root, "triton"),
        "STOKER_TRITON_CHECK_TARGETS": "",
    }
    wargs = ["--model", a.model, "--batch", str(a.batch), *(["--smoke"] if a.smoke else [])]
    t0 = time.perf_counter()
    # two steps: the first backward runs the captured graph eagerly, the second compiles it
    cold = (
        _run(env, [*wargs, "--steps", "2"], 1800)
        if not a.warm_only
        else {"stages": {}, "counts": {}}
    )
    print(f"cold process: {time.perf_counter() - t0:.1f} s wall; caches in {root}")
    flags: tuple[str, ...] = ()
    if a.no_pyc:  # the GPU image: every module compiled from source in every process
        flags = ("-X", f"pycache_prefix={tempfile.mkdtemp(prefix='stoker-nopyc-')}")
    wenv = {**env, "PYTHONDONTWRITEBYTECODE": "1"} if a.no_pyc else env
    warms = [_run(wenv, wargs, 900, flags) for _ in range(a.repeat)]
    rows: dict[str, list[float]] = {}
    for w in warms:
        for k in ("imports: torch", "imports: stoker (+ triton)"):
            rows.setdefault(k, []).append(w[k])
        for k, v in w["stages"].items():
            rows.setdefault(k, []).append(v)
    pyc = ", no bytecode cache" if a.no_pyc else ""
    print(f"\nwarm first step of {a.model} (batch {a.batch}{pyc}), CPU s, min of {a.repeat}:")
    print(f"  {'stage':40s} {'cold':>8s} {'warm':>8s}")
    for k, vs in rows.items():
        c = cold.get(k, cold["stages"].get(k, 0.0))
        print(f"  {k:40s} {c:8.2f} {min(vs):8.2f}")
    print(f"  counts cold: {cold['counts']}")
    print(f"  counts warm: {warms[0]['counts']}")
    print(f"  modules of a warm process: {warms[0]['modules']}")
    s = warms[0]["summary"]
    print(
        "  warm caches: graphs",
        {
            k: s.get(k)
            for k in (
                "cache",
                "cache_hits",
                "cache_misses",
                "graph_cache_hits",
                "capture_cache_hits",
                "kernels",
            )
        },
        "autograd",
        {k: warms[0]["autograd"].get(k) for k in ("disk_hits", "compiles")},
    )
    if a.imports:
        print(
            f"\nslowest imports of a warm process (-X importtime, cumulative s, top {a.imports}):"
        )
        for sec, name in _imports(env, wargs, a.imports):
            print(f"  {sec:6.2f}  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cold": cold, "warm": warms}, f, indent=1)
    return 0


def _cold_main(a: argparse.Namespace) -> int:
    """`--cold`: where a cold first step's wall and CPU go (main process)."""
    wargs = ["--model", a.model, "--batch", str(a.batch), "--cold", "--workers", str(a.workers)]
    wargs += [*(["--smoke"] if a.smoke else []), *(["--profile"] if a.profile else [])]
    flags: tuple[str, ...] = ()
    env = {**os.environ, "TRITON_INTERPRET": "0", "STOKER_TRITON_CHECK_TARGETS": ""}
    if a.no_pyc:
        flags = ("-X", f"pycache_prefix={tempfile.mkdtemp(prefix='stoker-nopyc-')}")
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    runs = []
    for _ in range(a.repeat):
        root = tempfile.mkdtemp(prefix="stoker-cold-")
        env["STOKER_CACHE_DIR"] = os.path.join(root, "stoker")
        env["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
        t0 = time.perf_counter()
        runs.append(_run(env, wargs, 1800, flags))
        print(f"cold process: {time.perf_counter() - t0:.1f} s wall", file=sys.stderr)
        if not a.keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    pyc = ", no bytecode cache" if a.no_pyc else ""
    print(f"cold first step of {a.model} (batch {a.batch}{pyc}), min of {a.repeat} processes:")
    print(
        f"  {'stage (inclusive; indented: inside the one above)':52s} {'calls':>5s} "
        f"{'wall s':>7s} {'CPU s':>7s}"
    )
    print(
        f"  {'imports: torch (CPU)':52s} {'':5s} {'':7s} "
        f"{min(r['imports: torch'] for r in runs):7.2f}"
    )
    for k in runs[0]["cold"]:
        rows = [r["cold"][k] for r in runs if k in r["cold"]]
        print(
            f"  {k:52s} {int(rows[0][0]):5d} {min(r[1] for r in rows):7.2f} "
            f"{min(r[2] for r in rows):7.2f}"
        )
    print("  compile_graph calls (first process; report stages in s):")
    for g in runs[0]["graphs"]:
        st = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in g["stages_ms"].items())
        print(
            f"    {g['by']:18s} {g['kernels']:3d} kernels {g['cache'] or '':>14s} "
            f"wall {g['wall']:5.2f} CPU {g['cpu']:5.2f}: {st}"
        )
    print(f"  counts: {runs[0]['counts']}")
    if a.profile:
        print("  cProfile CPU stages (first process):")
        for k, v in runs[0]["stages"].items():
            print(f"    {k:50s} {v:7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
