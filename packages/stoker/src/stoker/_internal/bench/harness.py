"""`stoker bench`: run registered benchmarks (`registry`), write one JSON and one
markdown table, compare with a baseline.

Each benchmark's result is stored whole (``raw``: the JSON its program wrote, or the
rows of an in-process run) beside its rows (`registry.Row`). With ``baseline``, every
metric of a row that the baseline has too (same benchmark, case and metric name) gets
``baseline`` and ``ratio`` (now / then); a ratio beyond ``threshold`` in the worse
direction (larger, or smaller for the metrics of `registry.HIGHER_IS_BETTER`) is a
regression, flagged in the table.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .registry import (
    HIGHER_IS_BETTER,
    REGISTRY,
    Benchmark,
    Options,
    Row,
    flatten_rows,
    json_given,
)

CACHE_VARS = ("STOKER_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def list_text() -> str:
    """``stoker bench --list``: every benchmark, its package and what it measures."""
    width = max(len(n) for n in REGISTRY)
    lines = []
    for b in REGISTRY.values():
        gpu = " [GPU]" if b.gpu else ""
        lines.append(f"{b.name:<{width}}  {b.group:<16} {b.help}{gpu}")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Where the figures come from. Read without importing torch (seconds of start-up
    that a run of one small benchmark would pay for nothing)."""
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "gpu": _gpu_name(),
        "git": git_commit(),
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_name() -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        p = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = p.stdout.strip().splitlines()
    return names[0].strip() if p.returncode == 0 and names else None


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` when files changed), None outside a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


# ----------------------------------------------------------------------------- running


def run_program(
    b: Benchmark, options: Options, reuse_caches: bool = False
) -> tuple[dict[str, Any], Any]:
    """One program benchmark in a fresh process: (its entry, its JSON or None). Its
    stdout is echoed as it comes; its stderr kept, and its end printed on a failure."""
    work = tempfile.mkdtemp(prefix=f"stoker-bench-{b.name}-")
    js = json_given(options.extra) or os.path.join(work, "result.json")
    env = {**os.environ, **b.env, **(b.smoke_env if options.smoke else {})}
    env.pop("STOKER_REPORT", None)
    if not reuse_caches:  # cold, and no benchmark reads what another left
        for var in CACHE_VARS:
            env[var] = os.path.join(work, var.split("_")[0].lower())
    cmd = [sys.executable, *b.command(options.smoke, options.extra, js)]
    entry: dict[str, Any] = {"command": _shown(b, options)}
    limit = options.timeout or b.limit
    t0 = time.perf_counter()
    out: list[str] = []
    try:
        with open(os.path.join(work, "stderr"), "w+", encoding="utf-8") as err:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                start_new_session=True,  # its workers and ranks end with it on a timeout
            )
            echo = threading.Thread(target=_echo, args=(proc, out), daemon=True)
            echo.start()
            code: int | None
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
            echo.join(timeout=10)
            err.seek(0)
            stderr = err.read()
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        entry["stdout"] = "".join(out)
        if code is None:
            entry["status"] = f"timed out after {limit:.0f} s"
        else:
            entry["status"] = "ok" if code == 0 else f"exit {code}"
        if code != 0:
            entry["stderr_tail"] = stderr[-3000:]
            print(stderr.rstrip()[-3000:], file=sys.stderr, flush=True)
        doc: Any = None
        if os.path.exists(js):
            try:
                with open(js, encoding="utf-8") as f:
                    doc = json.load(f)
            except ValueError:
                doc = None
        return entry, doc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _echo(proc: subprocess.Popen[str], out: list[str]) -> None:
    """Print the program's stdout as it comes, and keep it."""
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        out.append(line)


def _shown(b: Benchmark, o: Options) -> str:
    """The command that runs ``b`` alone (for the JSON and the table)."""
    if b.run is not None:
        return f"stoker bench {b.name}" + (" --smoke" if o.smoke else "")
    args = [*(b.smoke_args if o.smoke else b.args), *o.extra]
    return " ".join(["python", "-m", f"stoker._internal.bench.benchmarks.{b.module}", *args])


def run_one(b: Benchmark, options: Options, reuse_caches: bool) -> tuple[dict[str, Any], Any]:
    if b.run is None:
        return run_program(b, options, reuse_caches)
    t0 = time.perf_counter()
    entry: dict[str, Any] = {"command": _shown(b, options)}
    try:
        doc = b.run(options)
        failed = [r for r in doc if isinstance(r, dict) and "error" in r]
        entry["status"] = "ok" if not failed else f"{len(failed)} of {len(doc)} rows failed"
    except Exception as e:  # reported in the table; the other benchmarks still run
        entry["status"] = f"error: {type(e).__name__}: {e}"
        doc = None
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    return entry, doc


def rows_of(b: Benchmark, doc: Any) -> list[Row]:
    """The benchmark's rows (its own reader's, or `flatten_rows` where that fails on a
    JSON of another shape: the figures are kept either way)."""
    if doc is None:
        return []
    try:
        rows = (b.rows or flatten_rows)(doc)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        print(f"stoker bench {b.name}: rows read generically ({e!r})", file=sys.stderr)
        rows = flatten_rows(doc)
    return [{"benchmark": b.name, **r} for r in rows]


def run(
    names: Sequence[str],
    options: Options,
    *,
    json_path: str,
    markdown_path: str,
    baseline: str | None = None,
    threshold: float = 0.1,
    reuse_caches: bool = False,
) -> dict[str, Any]:
    """Run ``names`` one after another; the JSON and the markdown table are rewritten
    after each benchmark, so a run cut short keeps what it measured."""
    base = load_baseline(baseline) if baseline else None
    doc: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "smoke": options.smoke,
        "baseline": os.path.abspath(baseline) if baseline else None,
        "threshold": threshold,
        "benchmarks": {},
        "rows": [],
    }
    for name in names:
        b = REGISTRY[name]
        print(f"== stoker bench {name}: {b.help}", file=sys.stderr, flush=True)

        def partial(rows: list[dict[str, Any]], b: Benchmark = b) -> None:
            doc["benchmarks"][b.name] = {"status": "running", "raw": rows}
            write(doc, json_path, markdown_path)

        opts = replace(options, on_rows=partial)
        entry, raw = run_one(b, opts, reuse_caches)
        entry["raw"] = raw
        rows = rows_of(b, raw)
        if base is not None:
            compare(rows, base, threshold)
        doc["benchmarks"][name] = entry
        doc["rows"] += rows
        write(doc, json_path, markdown_path)
        print(
            f"== {name}: {entry['status']} in {entry['seconds']:.1f} s, {len(rows)} rows",
            file=sys.stderr,
            flush=True,
        )
    return doc


# ----------------------------------------------------------------------------- baseline


def load_baseline(path: str) -> dict[tuple[str, str, str], float]:
    """(benchmark, case, metric) -> value, from a JSON an earlier `stoker bench` wrote."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    out: dict[tuple[str, str, str], float] = {}
    for r in doc.get("rows", []):
        for m, v in r.get("metrics", {}).items():
            out[(r["benchmark"], r["case"], m)] = v
    return out


def higher_is_better(metric: str) -> bool:
    m = metric.lower()
    return any(k in m for k in HIGHER_IS_BETTER)


def compare(rows: list[Row], base: dict[tuple[str, str, str], float], threshold: float) -> None:
    """Add ``baseline``, ``ratio`` and ``regressions`` to each row that has a baseline."""
    for r in rows:
        then: dict[str, float] = {}
        ratio: dict[str, float] = {}
        worse: list[str] = []
        for m, v in r["metrics"].items():
            b = base.get((r["benchmark"], r["case"], m))
            if b is None:
                continue
            then[m] = b
            if b == 0:
                continue
            ratio[m] = v / b
            if higher_is_better(m):
                if ratio[m] < 1 / (1 + threshold):
                    worse.append(m)
            elif ratio[m] > 1 + threshold:
                worse.append(m)
        if then:
            r["baseline"], r["ratio"], r["regressions"] = then, ratio, worse


def regressions(doc: dict[str, Any]) -> list[str]:
    return [
        f"{r['benchmark']} {r['case']} {m}".replace("  ", " ")
        for r in doc["rows"]
        for m in r.get("regressions", [])
    ]


# ----------------------------------------------------------------------------- output


def _num(v: float | None) -> str:
    if v is None:
        return ""
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4g}"


def markdown(doc: dict[str, Any]) -> str:
    """A summary table (one line per benchmark), then each benchmark's rows: one line
    per metric, with the baseline and the ratio when there is one."""
    m = doc["machine"]
    lines = [
        f"# stoker bench{' --smoke' if doc['smoke'] else ''}, {doc['created']}",
        "",
        f"torch {m['torch']}, triton {m['triton']}, python {m['python']}, {m['cpus']} CPUs, "
        f"GPU {m['gpu'] or 'none'}, commit {m['git'] or 'unknown'}",
        "",
    ]
    if doc["baseline"]:
        lines += [f"Baseline: {doc['baseline']} (regression: beyond {doc['threshold']:.0%})", ""]
    lines += ["| benchmark | status | seconds | rows | regressions |", "|---|---|---|---|---|"]
    for name, e in doc["benchmarks"].items():
        rows = [r for r in doc["rows"] if r["benchmark"] == name]
        worse = sum(len(r.get("regressions", [])) for r in rows)
        secs = e.get("seconds")
        lines.append(
            f"| {name} | {e['status']} | {'' if secs is None else f'{secs:.1f}'} "
            f"| {len(rows)} | {worse or ''} |"
        )
    for name in doc["benchmarks"]:
        rows = [r for r in doc["rows"] if r["benchmark"] == name]
        if not rows:
            continue
        lines += ["", f"## {name}", "", f"`{doc['benchmarks'][name].get('command', '')}`", ""]
        lines += ["| case | metric | value | baseline | ratio | |", "|---|---|---|---|---|---|"]
        for r in rows:
            for metric, v in r["metrics"].items():
                then = r.get("baseline", {}).get(metric)
                ratio = r.get("ratio", {}).get(metric)
                flag = "**regressed**" if metric in r.get("regressions", []) else ""
                lines.append(
                    f"| {r['case']} | {metric} | {_num(v)} | {_num(then)} "
                    f"| {'' if ratio is None else f'{ratio:.2f}'} | {flag} |"
                )
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], json_path: str, markdown_path: str) -> None:
    for path in (json_path, markdown_path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(markdown_path, "w", encoding="utf-8") as f:
        f.write(markdown(doc))
