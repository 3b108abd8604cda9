"""Start-up cost of stoker-triton's compile workers (`kernels.py --workers`).

For each worker start (`fork`: forked from the zygote, which imports Triton
once; `subprocess`: each worker its own interpreter, as before the zygote),
each pool size N and each bytecode condition (`pyc`: Python's bytecode cache
as it is; `no-pyc`: ``PYTHONDONTWRITEBYTECODE=1`` and an empty
``PYTHONPYCACHEPREFIX``, as on the H100 image, whose site-packages has no
bytecode cache, so every process compiles Triton's sources again), a new
process measures:

- ready: from the pool's creation until all N workers have imported the compiler;
- batch: from the pool's creation until a batch of real generated kernels
  (a transformer block's: layer norms, softmax, GELU, sums; made under the
  interpreter here) is compiled for sm_90 through the pool into a cold
  Triton cache (`xcompile.precompile`, what a GPU's first step runs), and
  when the first kernel's compile came back;

each as wall seconds and as CPU seconds summed over the processes (the main
process, the zygote and every worker, read from /proc before the pool ends).

    python -m stoker._internal.bench.benchmarks.workers                  # N = 2 and 16, both starts, both caches
    python -m stoker._internal.bench.benchmarks.workers --n 16 --mode fork --cache no-pyc
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import write_json


def _stat(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone
        return None


def _tree_cpu() -> float:
    """CPU seconds of this process and every live descendant (the zygote, the
    workers), each with the children it waited for (ptxas, workers replaced)."""
    kids: dict[int, list[tuple[int, float]]] = {}
    for d in os.listdir("/proc"):
        fields = _stat(d) if d.isdigit() else None
        if fields is not None:
            cpu = sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
            kids.setdefault(int(fields[1]), []).append((int(d), cpu))
    total, todo = time.process_time(), [os.getpid()]
    while todo:
        for pid, cpu in kids.get(todo.pop(), []):
            total += cpu
            todo.append(pid)
    return total


def _block(x: Any, w: Any, b: Any, w1: Any, w2: Any) -> Any:
    import torch
    import torch.nn.functional as F

    h = F.layer_norm(x, (x.shape[-1],), w, b)
    att = torch.softmax((h @ h.transpose(-1, -2)) * 0.125, -1) @ h
    y = x + att
    z = F.gelu(F.layer_norm(y, (y.shape[-1],), w, b) @ w1) @ w2
    out = y + z
    return out, out.sum(0), (out * out).mean(-1), torch.log_softmax(out, -1)


def _mode_is(interpret: str) -> None:
    """The measuring process gets Triton's mode from the table's environment, set before
    the interpreter starts: the kernels are generated under the interpreter, the cold
    start runs Triton's real launch path."""
    if os.environ.get("TRITON_INTERPRET", "") != interpret:
        raise SystemExit(f"--one expects TRITON_INTERPRET={interpret} in its environment")


def _jobs() -> list[tuple[str, list[Any], list[tuple[int, int, int]]]]:
    """The precompile work of `_block` and its gradient graph, generated under the interpreter."""
    _mode_is("1")
    os.environ["STOKER_TRITON_CHECK_TARGETS"] = ""
    import torch
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton import compile_graph
    from stoker_triton._internal import pipeline

    work: list[tuple[str, list[Any], list[tuple[int, int, int]]]] = []

    def record(make_jobs: Any, device: Any) -> int:
        for lau, args, x, r in make_jobs():
            work.append((lau.path, args, lau.candidates(x, r, native=True)))
        return 0

    pipeline.precompile = record  # type: ignore[attr-defined]
    args = [torch.randn(64, 128), torch.randn(128), torch.randn(128)]
    args += [torch.randn(128, 256), torch.randn(256, 128)]
    args = [a.requires_grad_() for a in args]

    def grads(*a: Any) -> Any:
        outs = _block(*a)
        loss = sum(o.float().sum() for o in outs)
        return torch.autograd.grad(loss, a)

    for f in (_block, grads):
        gm = make_fx(f, decomposition_table=core_aten_decompositions())(*args)  # type: ignore[arg-type]
        compile_graph(gm, [a.detach() for a in args])
    return work


def _mode(pool: Any) -> str:
    if not hasattr(pool, "mode"):
        return "subprocess (before the zygote)"
    return str(pool.mode) if pool.fallback is None else f"subprocess ({pool.fallback})"


def one(n: int) -> dict[str, Any]:
    """In a new process: the pool's start and a cold batch compile (see the module doc)."""
    work = _jobs()
    if "TRITON_CACHE_DIR" not in os.environ:  # run alone: an empty Triton cache of its own
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-bench-workers-")
    from stoker_triton._internal.compile import xcompile
    from stoker_triton._internal.compile.workers import Pool

    cpu0, t0 = _tree_cpu(), time.perf_counter()
    pool = Pool(n, start=True)
    xcompile._pool = pool
    if hasattr(pool, "wait_ready"):
        pool.wait_ready(timeout=600)
        ready: float | None = time.perf_counter() - t0
    else:  # a tree from before the workers said when they are ready (`--tree`)
        ready = None
    ready_cpu = _tree_cpu() - cpu0
    first: list[float] = []
    orig = xcompile._finish

    def finish(key: Any) -> None:
        first.append(time.perf_counter() - t0)
        orig(key)

    xcompile._finish = finish
    ok, errors = xcompile.precompile(work, ("cuda", 90, 32))
    batch = time.perf_counter() - t0
    batch_cpu = _tree_cpu() - cpu0
    out = {
        "mode": _mode(pool),
        "n": n,
        "kernels": len(work),
        "compiled": ok,
        "errors": errors[:3],
        "ready_s": None if ready is None else round(ready, 2),
        "ready_cpu_s": round(ready_cpu, 2),
        "first_s": round(min(first), 2) if first else None,
        "batch_s": round(batch, 2),
        "batch_cpu_s": round(batch_cpu, 2),
    }
    pool.shutdown(wait=True)
    return out


def cold_start(n: int) -> dict[str, Any]:
    """In a new process: a cold first step's compile as stoker runs it on a GPU,
    on the CPU: Triton's real launch path on a stand-in sm_90 driver
    (`fakegpu`), the workers started before capture, the forward graph and its
    gradient graph compiled, then the forward's and the gradient's launches.
    Seconds since the start at each point, and CPU summed over processes."""
    t0, cpu0 = time.perf_counter(), _tree_cpu()
    _mode_is("0")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton import compile_graph
    from stoker_triton._internal import runtime
    from stoker_triton._internal.compile import xcompile
    from stoker_triton._internal.fakegpu import install

    install()
    runtime.native_target = lambda device: ("cuda", 90, 32)  # CPU tensors stand in
    xcompile.cpu_count = lambda: n
    marks: dict[str, float] = {"imports": time.perf_counter() - t0}
    xcompile.start_workers()  # as stoker's backend does before capture
    launched: list[float] = []
    call = runtime.Launcher._launch  # a launch the lean path does not serve (the first ones)

    def timed(self: Any, *a: Any) -> None:
        call(self, *a)
        launched.append(time.perf_counter() - t0)

    runtime.Launcher._launch = timed  # type: ignore[method-assign]
    args = [torch.randn(64, 128), torch.randn(128), torch.randn(128)]
    args += [torch.randn(128, 256), torch.randn(256, 128)]
    grads_of = [a.clone().requires_grad_() for a in args]

    def grads(*a: Any) -> Any:
        return torch.autograd.grad(sum(o.float().sum() for o in _block(*a)), a)

    decomp = core_aten_decompositions()
    gm_fw = make_fx(_block, decomposition_table=decomp)(*args)  # type: ignore[arg-type]
    gm_bw = make_fx(grads, decomposition_table=decomp)(*grads_of)  # type: ignore[arg-type]
    marks["capture"] = time.perf_counter() - t0
    fw = compile_graph(gm_fw, args)
    marks["forward compiled"] = time.perf_counter() - t0
    bw = compile_graph(gm_bw, [a.detach() for a in grads_of])
    marks["gradient compiled"] = time.perf_counter() - t0
    fw(*args)
    marks["first launch"] = launched[0]
    marks["forward launched"] = time.perf_counter() - t0
    bw(*grads_of)
    marks["step launched"] = time.perf_counter() - t0
    cpu = _tree_cpu() - cpu0
    xcompile._executor().shutdown(wait=True)
    return {
        "mode": _mode(xcompile._executor()),
        "n": n,
        "kernels": len(fw.report.kernels) + len(bw.report.kernels),  # type: ignore[attr-defined]
        **{k: round(v, 2) for k, v in marks.items()},
        "cpu_s": round(cpu, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, action="append", help="pool sizes (default 2 and 16)")
    ap.add_argument("--mode", action="append", choices=["fork", "subprocess"])
    ap.add_argument("--cache", action="append", choices=["pyc", "no-pyc"])
    ap.add_argument(
        "--cold-start",
        action="store_true",
        help="time a cold first step's compile to its launches instead (fakegpu)",
    )
    ap.add_argument(
        "--tree",
        help="measure the stoker sources of another checkout (e.g. a worktree of an "
        "earlier commit: 'before'; its own copy of this module runs there, so a checkout from "
        "before the harness lacks it)",
    )
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the measuring process
    args = ap.parse_args(argv)
    if args.one is not None:
        print("RESULT " + json.dumps((cold_start if args.cold_start else one)(args.one)))
        return 0
    if args.cold_start:
        return _table(args, cold=True)
    return _table(args, cold=False)


def _table(args: Any, cold: bool) -> int:
    print(f"{os.cpu_count()} cores here ({len(os.sched_getaffinity(0))} usable)")
    if cold:
        cols = "capture | fw compiled | grad compiled | first launch | fw launched | step launched"
        print(f"| start | N | bytecode | kernels | {cols} | CPU s |")
        print("|---" * 11 + "|")
    else:
        cols = "ready s | ready CPU s | first s | batch s | batch CPU s"
        print(f"| start | N | bytecode | kernels | {cols} |")
        print("|---" * 9 + "|")
    # each run's caches (stoker's, Triton's, the empty bytecode cache) in one folder,
    # removed at the end
    root = tempfile.mkdtemp(prefix="stoker-bench-workers-")
    try:
        _rows(args, cold, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _rows(args: Any, cold: bool, root: str) -> None:
    doc: list[dict[str, Any]] = []
    for cache in args.cache or ["pyc", "no-pyc"]:
        for n in args.n or [2, 16]:
            for mode in args.mode or ["subprocess", "fork"]:
                run = tempfile.mkdtemp(dir=root)
                env = {**os.environ, "STOKER_TRITON_WORKERS": mode}
                env["STOKER_CACHE_DIR"] = os.path.join(run, "stoker")
                env["TRITON_CACHE_DIR"] = os.path.join(run, "triton")  # cold for each run
                env["TRITON_INTERPRET"] = "0" if cold else "1"
                if cache == "no-pyc":
                    env["PYTHONDONTWRITEBYTECODE"] = "1"
                    env["PYTHONPYCACHEPREFIX"] = os.path.join(run, "empty-pycache")
                if args.tree:
                    env["PYTHONPATH"] = os.pathsep.join(
                        os.path.join(args.tree, "packages", p, "src")
                        for p in os.listdir(os.path.join(args.tree, "packages"))
                    )
                cmd = [
                    sys.executable,
                    "-m",
                    "stoker._internal.bench.benchmarks.workers",
                    "--one",
                    str(n),
                ]
                proc = subprocess.run(
                    cmd + (["--cold-start"] if cold else []),
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=1800,
                )
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not line:
                    print(f"| {mode} | {n} | {cache} | failed: {proc.stderr[-500:]!r} |")
                    continue
                r = json.loads(line[0][7:])
                doc.append({"case": f"{r['mode']} N={n} {cache}", **r})
                write_json(args.json, doc)
                if cold:
                    keys = ["capture", "forward compiled", "gradient compiled", "first launch"]
                    keys += ["forward launched", "step launched", "cpu_s"]
                    print(
                        f"| {r['mode']} | {n} | {cache} | {r['kernels']} | "
                        + " | ".join(str(r[c]) for c in keys)
                        + " |",
                        flush=True,
                    )
                    continue
                print(
                    f"| {r['mode']} | {n} | {cache} | {r['compiled']}/{r['kernels']} "
                    f"| {r['ready_s']} | {r['ready_cpu_s']} | {r['first_s']} "
                    f"| {r['batch_s']} | {r['batch_cpu_s']} |",
                    flush=True,
                )


if __name__ == "__main__":
    sys.exit(main())
