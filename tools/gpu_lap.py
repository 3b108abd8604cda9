"""The GPU lap: everything a GPU session measures, as one command that fits a 9-minute call.

    bash tools/gpu_check.sh lap                     # on the GPU machine (what a session runs)
    python tools/gpu_lap.py --out DIR [--budget 510] [--jobs 2]
    python tools/gpu_lap.py --dry-run --out DIR     # on a CPU: every step's code path, tiny sizes

Steps, in order, each a fresh process under its own time limit (what is left of
``--budget`` seconds in all, so a step that hangs cannot take the rest):

1. ``env``: the GPU, torch, Triton, NumPy, the commit.
2. ``suite`` part A, alone on the machine: gpt-m with eager, Inductor and stoker,
   each cold (empty caches) then warm (the caches the cold process left): the
   first steps, the steady step, peak memory, kernels per step, parity against
   eager, and a per-kernel profile (`lap_profile`: each kernel's GPU time per
   step; for stoker each kernel's fused aten ops, for Inductor the same from its
   generated code).
3. ``suite`` part B: hf-llama (profiled too), gpt-m-bf16, mlp-l, hf-gpt2, cnn-m-bf16
   and the kernel benchmark (`stoker bench triton -- --inductor`), ``--jobs`` at a time:
   processes compile side by side on all but two cores, and each holds a lock
   (`GpuLock`) while it measures, pinned to the two cores left, so no two
   measurements share the GPU. Their cold first steps ran beside another
   compile (marked ``concurrent``); part A's did not.
4. ``tests``: stoker-triton's tests natively (``TRITON_INTERPRET=0``), with the time
   that is left.

Everything lands in ``--out`` (default ``$OUT/bench-results/gpu/<date>``) as it is
measured: ``lap.json`` (every row, rewritten after each), ``summary.md`` (the tables),
``profile-<model>-<backend>.json`` (per-kernel), ``kernels.json`` (the kernel
benchmark), ``tests.txt``; logs go to ``--logs`` (default ``$OUT/lap-logs``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

PART_A = "gpt-m"
PROFILED = ("gpt-m", "hf-llama")
PART_B = ("hf-llama", "gpt-m-bf16", "mlp-l", "hf-gpt2", "cnn-m-bf16")
BACKENDS = ("eager", "inductor", "stoker")
TIMED_CPUS = 2  # cores a measurement runs on while others compile (part B)


# ----------------------------------------------------------------------------- the lock


def _split_cpus() -> tuple[str, str] | None:
    """(cores kept for measurements, cores for the compiles beside them), from this
    process's own mask; None on a machine too small to split."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(mine) < TIMED_CPUS + 2:
        return None
    return ",".join(map(str, mine[:TIMED_CPUS])), ",".join(map(str, mine[TIMED_CPUS:]))


# ----------------------------------------------------------------------------- worker


def worker(a: argparse.Namespace) -> int:
    """One suite row in this process (a fresh one per row): `suite_worker` with the
    lock around its measurement and, with ``--profile``, the per-kernel profile."""
    from stoker._internal.bench.gpulock import GpuLock, pin

    if a.cpus:
        pin(a.cpus)  # this process and the compile workers it starts
    from stoker._internal.bench.bench import suite_worker

    lock = GpuLock(a.lock) if a.lock else None
    after = None
    if a.profile:
        import lap_profile

        def after(step: Callable[[], float], fn: Any, model: Any) -> dict[str, Any]:
            prof = lap_profile.profile_steps(step, a.backend, a.device, steps=3)
            prof["grads"] = lap_profile.grad_layout(model)
            with open(a.profile, "w", encoding="utf-8") as f:
                json.dump(prof, f, indent=1, default=str)
            return {"profile": os.path.basename(a.profile), **lap_profile.headline(prof)}

    row = suite_worker(
        a.model,
        a.backend,
        a.steps,
        a.device,
        a.smoke,
        a.params or None,
        timed=lock,
        after=after,
    )
    if lock is not None:
        row["lock_wait_s"] = round(lock.waited_s, 3)
    print(json.dumps(row, default=str))
    return 0


# ----------------------------------------------------------------------------- driver


@dataclass
class Lap:
    out: str
    logs: str
    deadline: float  # time.monotonic() by which everything must have ended
    dry_run: bool
    jobs: int
    steps: int
    models: tuple[str, ...]
    only: tuple[str, ...]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, Any] = field(default_factory=dict)
    tests: dict[str, Any] = field(default_factory=dict)
    params_dir: str = ""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        doc = {
            "env": self.env,
            "rows": self.rows,
            "kernels": self.kernels,
            "tests": self.tests,
            "notes": self.notes,
        }
        _write(os.path.join(self.out, "lap.json"), json.dumps(doc, indent=1, default=str))
        _write(os.path.join(self.out, "summary.md"), summary_text(self))


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


@dataclass
class Job:
    name: str
    cmd: list[str]
    env: dict[str, str]
    cap: float  # its own limit, seconds
    log: str
    on_done: Callable[[int | None, str], None]  # (exit code or None when killed, stdout)
    proc: subprocess.Popen[str] | None = None
    started: float = 0.0
    out_f: Any = None


# A job runs at most until RESERVE_S before the lap's deadline (the summary is still to
# be written); one that would get less than MIN_JOB_S is skipped, not started.
RESERVE_S = 5.0
MIN_JOB_S = 10.0


def _start(job: Job, lap: Lap) -> bool:
    limit = min(job.cap, lap.left() - RESERVE_S)
    if limit < MIN_JOB_S:
        job.on_done(None, f"skipped: {lap.left():.0f} s of the budget left")
        return False
    job.cap = limit
    job.out_f = open(job.log, "w", encoding="utf-8")
    job.proc = subprocess.Popen(
        job.cmd,
        env=job.env,
        stdout=subprocess.PIPE,
        stderr=job.out_f,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    job.started = time.monotonic()
    return True


def _finish(job: Job, killed: bool) -> None:
    assert job.proc is not None
    if killed:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.proc.pid, signal.SIGKILL)
    out, _ = job.proc.communicate()
    job.out_f.close()
    with open(job.log, "a", encoding="utf-8") as f:
        f.write("\n--- stdout ---\n" + (out or ""))
    if killed:
        job.on_done(None, f"killed after {job.cap:.0f} s (its limit)")
    else:
        job.on_done(job.proc.returncode, out or "")


def run_jobs(jobs: list[Job], lap: Lap, parallel: int) -> None:
    """Run `jobs` in order, `parallel` at a time, each killed at its limit."""
    pending = list(jobs)
    running: list[Job] = []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            if _start(job, lap):
                running.append(job)
        time.sleep(0.2)
        for job in list(running):
            assert job.proc is not None
            over = time.monotonic() - job.started > job.cap
            if job.proc.poll() is not None or over:
                _finish(job, killed=job.proc.poll() is None)
                running.remove(job)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    P = os.path.join(ROOT, "packages")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(  # this checkout first, then the caller's path
        [os.path.join(P, p, "src") for p in ("stoker-shapes", "stoker-capture", "stoker-autograd")]
        + [os.path.join(P, "stoker-triton", "src"), os.path.join(P, "stoker", "src")]
        + [os.path.join(ROOT, "tools")]
        + list(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("STOKER_REPORT", None)
    env.update(extra or {})
    return env


def row_job(
    lap: Lap,
    model: str,
    backend: str,
    *,
    cache: str,
    warm: bool,
    concurrent: bool,
    cap: float,
) -> Job:
    device = "cpu" if lap.dry_run else "cuda"
    profile = model in PROFILED and not warm
    tag = f"{model}-{backend}-{'warm' if warm else 'cold'}"
    cmd = [sys.executable, os.path.abspath(__file__), "worker", model, backend]
    cmd += ["--device", device, "--steps", str(1 if warm else lap.steps)]
    cmd += ["--lock", os.path.join(lap.logs, "gpu.lock")]
    if lap.dry_run:
        cmd.append("--smoke")
    if not warm:
        cmd += ["--params", os.path.join(lap.params_dir, f"{model}-{backend}.pt")]
    if profile:
        cmd += ["--profile", os.path.join(lap.out, f"profile-{model}-{backend}.json")]
    extra = {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        "STOKER_CACHE_DIR": os.path.join(cache, "stoker"),
    }
    if backend == "inductor":  # Inductor's estimate of each kernel's bytes, for the profile
        extra["TORCHINDUCTOR_BENCHMARK_KERNEL"] = "1"
    if lap.dry_run:
        extra.update({"TRITON_INTERPRET": "1", "STOKER_BACKEND": "interpret"})
        extra["STOKER_TRITON_CHECK_TARGETS"] = ""
    else:
        extra["TRITON_INTERPRET"] = "0"
    split = _split_cpus() if concurrent else None
    if split is not None:
        extra["STOKER_LAP_TIMED_CPUS"] = split[0]
        cmd += ["--cpus", split[1]]

    def done(code: int | None, out: str) -> None:
        row: dict[str, Any] = {"model": model, "backend": backend, "run": tag}
        got = [ln for ln in out.splitlines() if ln.startswith("{")]
        if code == 0 and got:
            row.update(json.loads(got[-1]))
        else:
            row["error"] = out if code is None else f"exit {code}: {_tail(lap, tag)}"
        row["concurrent"] = concurrent
        _merge_row(lap, row, warm)
        lap.save()
        print(f"  {tag}: {_short(row)}", file=sys.stderr, flush=True)

    return Job(tag, cmd, _env(extra), cap, os.path.join(lap.logs, f"{tag}.log"), done)


def _tail(lap: Lap, tag: str) -> str:
    try:
        with open(os.path.join(lap.logs, f"{tag}.log"), encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip() and not ln.startswith("---")]
        return lines[-1][-300:] if lines else "(no output)"
    except OSError:
        return "(no log)"


def _merge_row(lap: Lap, row: dict[str, Any], warm: bool) -> None:
    """A cold row is added; a warm one fills its cold row's warm columns."""
    if not warm:
        lap.rows.append(row)
        return
    cold = next(
        (r for r in lap.rows if r["model"] == row["model"] and r["backend"] == row["backend"]),
        None,
    )
    if cold is None:
        return
    if "error" in row:
        cold["warm_error"] = row["error"]
    else:
        cold["warm_first_step_s"] = row.get("first_step_s")
        if "stoker" in row:
            cold["warm_stoker"] = row["stoker"]


def _short(row: dict[str, Any]) -> str:
    if "error" in row:
        return "error: " + str(row["error"])[-200:]
    keys = ("first_step_s", "warm_first_step_s", "steady_ms", "peak_mem", "kernels_per_step")
    return ", ".join(f"{k}={row[k]:.4g}" for k in keys if isinstance(row.get(k), int | float))


def compare(lap: Lap) -> None:
    """Parity against eager, ratios to eager and to Inductor (as `bench --suite gpu`)."""
    from stoker._internal.bench.bench import _add_vs_inductor
    from stoker._internal.bench.suite import compare_runs

    for row in lap.rows:
        eager = next(
            (r for r in lap.rows if r["model"] == row["model"] and r["backend"] == "eager"), None
        )
        if eager is None or row is eager or "error" in row or "error" in eager:
            continue
        with contextlib.suppress(Exception):  # a missing parameter file: no parity
            row.update(compare_runs(row, eager))
        if row.get("steady_ms") and eager.get("steady_ms"):
            row["vs_eager"] = row["steady_ms"] / eager["steady_ms"]
    _add_vs_inductor(lap.rows)
    for row in lap.rows:
        row.pop("params_path", None)


# ----------------------------------------------------------------------------- steps


def step_env(lap: Lap) -> None:
    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    code = (
        "import json, torch, triton, numpy; print(json.dumps({'torch': torch.__version__, "
        "'triton': triton.__version__, 'numpy': numpy.__version__, 'cuda': "
        "torch.cuda.is_available() and torch.cuda.get_device_name(0)}))"
    )
    try:
        p = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
        env.update(json.loads(p.stdout.strip().splitlines()[-1]))
    except Exception as e:  # recorded, the lap goes on
        env["error"] = f"{type(e).__name__}: {e}"
    if shutil.which("nvidia-smi"):
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
        env["nvidia_smi"] = p.stdout.strip()
    if shutil.which("git"):
        p = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        )
        env["commit"] = p.stdout.strip() or None
    env["dry_run"] = lap.dry_run
    env["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lap.env = env
    lap.save()


def step_suite(lap: Lap) -> None:
    caches = tempfile.mkdtemp(prefix="stoker-lap-")
    # Inductor's CPU compiles take minutes: the dry run leaves it out (its profile's
    # reading of Inductor's code is tested on its own)
    backends = BACKENDS if not lap.dry_run else ("eager", "stoker")
    # part A: alone; each backend cold then warm on the cache it left
    jobs: list[Job] = []
    for be in backends if PART_A in lap.models else ():
        cache = os.path.join(caches, f"{PART_A}-{be}")
        jobs.append(row_job(lap, PART_A, be, cache=cache, warm=False, concurrent=False, cap=150))
        jobs.append(row_job(lap, PART_A, be, cache=cache, warm=True, concurrent=False, cap=75))
    run_jobs(jobs, lap, parallel=1)
    # part B: side by side, one measurement at a time (the lock)
    jobs = []
    models = [m for m in PART_B if m in lap.models]
    kernels = "kernels" in lap.only
    if kernels and not models:
        jobs.append(kernels_job(lap, concurrent=False))
    for i, model in enumerate(models):
        for be in backends:
            cache = os.path.join(caches, f"{model}-{be}")
            jobs.append(
                row_job(lap, model, be, cache=cache, warm=False, concurrent=lap.jobs > 1, cap=150)
            )
        if i == 0 and kernels:
            jobs.append(kernels_job(lap, concurrent=lap.jobs > 1))
    run_jobs(jobs, lap, parallel=lap.jobs)
    compare(lap)
    write_pairs(lap)
    lap.save()
    shutil.rmtree(caches, ignore_errors=True)


def write_pairs(lap: Lap) -> None:
    """pairs-<model>.txt: each stoker kernel beside the Inductor kernel of the same ops."""
    import lap_profile

    for model in PROFILED:
        profs = {}
        for be in ("stoker", "inductor"):
            try:
                with open(
                    os.path.join(lap.out, f"profile-{model}-{be}.json"), encoding="utf-8"
                ) as f:
                    profs[be] = json.load(f)
            except (OSError, ValueError):
                pass
        if "stoker" in profs:
            rows = lap_profile.pair_kernels(profs["stoker"], profs.get("inductor", {}))
            _write(os.path.join(lap.out, f"pairs-{model}.txt"), lap_profile.pairs_text(rows))


def kernels_job(lap: Lap, concurrent: bool) -> Job:
    path = os.path.join(lap.out, "kernels.json")
    cmd = [sys.executable, "-m", "stoker._internal.bench.benchmarks.kernels", "--json", path]
    cmd += ["--gpu-lock", os.path.join(lap.logs, "gpu.lock")]
    cmd += ["--smoke"] if lap.dry_run else ["--inductor"]
    cache = tempfile.mkdtemp(prefix="stoker-lap-kernels-")
    extra = {"TRITON_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "ind")}
    extra["TRITON_INTERPRET"] = "1" if lap.dry_run else "0"
    if lap.dry_run:
        extra["STOKER_TRITON_CHECK_TARGETS"] = ""
    split = _split_cpus() if concurrent else None
    if split is not None:
        extra["STOKER_LAP_TIMED_CPUS"] = split[0]
        cmd = ["taskset", "-c", split[1], *cmd] if shutil.which("taskset") else cmd

    def done(code: int | None, out: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                lap.kernels = json.load(f)
        except (OSError, ValueError):
            lap.kernels = {}
        if code != 0:
            lap.kernels["error"] = out if code is None else f"exit {code}: {_tail(lap, 'kernels')}"
        lap.save()
        print(f"  kernels: {len(lap.kernels.get('rows', []))} cases", file=sys.stderr, flush=True)

    return Job("kernels", cmd, _env(extra), 200, os.path.join(lap.logs, "kernels.log"), done)


def step_kernels(lap: Lap) -> None:
    """The kernel benchmark, when the suite (which runs it beside its part B) does not."""
    if "suite" not in lap.only:
        run_jobs([kernels_job(lap, concurrent=False)], lap, parallel=1)


_RESULT = re.compile(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def step_tests(lap: Lap) -> None:
    """stoker-triton's tests natively, each result printed as it comes (`-v`), so a run
    cut by the time limit still counts what finished."""
    log = os.path.join(lap.logs, "tests.log")
    if lap.dry_run:  # the step's own code on the CPU: one quick file, interpreted
        targets, extra = (
            ["packages/stoker-triton/tests/test_triton_mode.py"],
            {"TRITON_INTERPRET": "1"},
        )
    else:
        targets, extra = ["packages/stoker-triton/tests"], {"TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider"]
    with contextlib.suppress(ImportError):
        import xdist  # noqa: F401

        if not lap.dry_run:
            cmd += ["-n", "4"]
    cmd += targets

    def done(code: int | None, out: str) -> None:
        lap.tests = parse_tests(out)
        lap.tests["exit"] = code if code is not None else "killed (time limit)"
        lap.tests["command"] = " ".join(cmd[1:])
        _write(os.path.join(lap.out, "tests.txt"), _tests_text(lap.tests))
        lap.save()
        print(f"  tests: {lap.tests.get('counts')}", file=sys.stderr, flush=True)

    job = Job("tests", cmd, _env(extra), 600, log, done)
    run_jobs([job], lap, parallel=1)


def parse_tests(out: str) -> dict[str, Any]:
    counts: dict[str, int] = {}
    failed: list[str] = []
    for ln in out.splitlines():
        m = _RESULT.search(ln)
        if not m or "::" not in ln:
            continue
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        if m.group(1) in ("FAILED", "ERROR"):
            failed.append(next((w for w in ln.split() if "::" in w), ln)[:200])
    short = [ln for ln in out.splitlines() if ln.startswith(("E ", "/")) and ":" in ln][-40:]
    return {"counts": counts, "failed": failed, "errors": short}


def _tests_text(t: dict[str, Any]) -> str:
    lines = [f"command: {t.get('command')}", f"exit: {t.get('exit')}", f"counts: {t.get('counts')}"]
    lines += ["failed:"] + [f"  {f}" for f in t.get("failed", [])]
    lines += ["errors (last lines):"] + [f"  {e}" for e in t.get("errors", [])]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- summary


def summary_text(lap: Lap) -> str:
    from stoker._internal.bench.bench import SUITE_COLUMNS, format_table

    env = lap.env
    lines = [
        "# GPU lap" + (" (dry run on the CPU: the numbers mean nothing)" if lap.dry_run else ""),
        "",
        f"{env.get('cuda') or 'no GPU'}; torch {env.get('torch')}, triton {env.get('triton')}, "
        f"numpy {env.get('numpy')}; commit {env.get('commit')}; started {env.get('started')}",
        "",
        "## Suite (steady: median; a `*` row's cold first step ran beside another compile)",
        "",
        "```",
        format_table(
            [{**r, "model": r["model"] + ("*" if r.get("concurrent") else "")} for r in lap.rows],
            SUITE_COLUMNS,
        )
        if lap.rows
        else "(no rows)",
        "```",
    ]
    profs = [r for r in lap.rows if r.get("profile")]
    if profs:
        lines += ["", "## Profiles (GPU ms per step by kind; files profile-*.json)", ""]
        for r in profs:
            kinds = ", ".join(f"{k} {v:.3f}" for k, v in (r.get("gpu_ms_by_kind") or {}).items())
            lines.append(f"- {r['model']} {r['backend']}: {kinds}")
    rows = lap.kernels.get("rows") if isinstance(lap.kernels, dict) else None
    if rows:
        lines += ["", "## Kernels (stoker bench triton)", "", "```"]
        lines += [json.dumps(r) for r in rows]
        lines.append("```")
    if lap.tests:
        lines += ["", "## Tests", "", "```", _tests_text(lap.tests).rstrip(), "```"]
    if lap.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in lap.notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help=argparse.SUPPRESS)
    w.add_argument("model")
    w.add_argument("backend")
    w.add_argument("--device", default="cuda")
    w.add_argument("--steps", type=int, default=20)
    w.add_argument("--smoke", action="store_true")
    w.add_argument("--params", default="")
    w.add_argument("--profile", default="")
    w.add_argument("--lock", default="")
    w.add_argument("--cpus", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--logs", default="")
    ap.add_argument("--budget", type=float, default=510.0, help="seconds for the whole lap")
    ap.add_argument("--jobs", type=int, default=2, help="suite part B's processes at a time")
    ap.add_argument("--steps", type=int, default=20, help="steady steps per row")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes")
    ap.add_argument(
        "--models",
        default="",
        help=f"suite models (default all: {PART_A},{','.join(PART_B)}; dry run: gpt-m,mlp-l)",
    )
    ap.add_argument("--only", default="env,suite,kernels,tests", help="steps to run")
    a = ap.parse_args(argv)
    if a.cmd == "worker":
        return worker(a)
    t0 = time.monotonic()
    base = os.environ.get("OUT", os.path.join(ROOT, "gpu-out"))
    out = a.out or os.path.join(base, "bench-results", "gpu", time.strftime("%Y-%m-%d"))
    logs = a.logs or os.path.join(base, "lap-logs")
    os.makedirs(out, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    lap = Lap(
        out=out,
        logs=logs,
        deadline=t0 + a.budget,
        dry_run=a.dry_run,
        jobs=max(1, a.jobs),
        steps=2 if a.dry_run else a.steps,
        models=tuple(
            (a.models or ("gpt-m,mlp-l" if a.dry_run else ",".join((PART_A, *PART_B)))).split(",")
        ),
        params_dir=tempfile.mkdtemp(prefix="stoker-lap-params-"),
        only=tuple(x for x in a.only.split(",") if x),
    )
    steps = {"env": step_env, "suite": step_suite, "kernels": step_kernels, "tests": step_tests}
    for name in lap.only:
        if name not in steps:
            raise SystemExit(f"gpu_lap: unknown step {name!r}; steps: {', '.join(steps)}")
        print(f"== {name} ({lap.left():.0f} s left)", file=sys.stderr, flush=True)
        try:
            steps[name](lap)
        except Exception as e:  # the next step still runs; the error is kept
            lap.notes.append(f"step {name} failed: {type(e).__name__}: {e}")
            lap.save()
            print(f"  step {name} failed: {e!r}", file=sys.stderr, flush=True)
    lap.notes.append(f"lap took {time.monotonic() - t0:.0f} s of a {a.budget:.0f} s budget")
    lap.save()
    shutil.rmtree(lap.params_dir, ignore_errors=True)
    print(f"gpu_lap: results in {out}", file=sys.stderr)
    bad = [r for r in lap.rows if "error" in r]
    return 1 if bad or any("failed" in n for n in lap.notes) else 0


if __name__ == "__main__":
    sys.exit(main())
