"""The model benchmark: eager, torch.compile aot_eager / inductor, and stoker, side by side.

For every (model, backend) pair a fresh process trains the model: once with
empty cache directories (cold) and once more with the caches the first left
behind (warm, skipped with ``warm=False``).  Each process reports

* ``first_step_s``: the first training step (forward + backward + AdamW),
  which is where compilation happens;
* ``steady_ms``: the median of the following steps;
* ``peak_mem``: CUDA max allocated on a GPU; on a CPU the bytes of tensors
  autograd saved for backward during one step (``saved_tensors_hooks``);
* ``recompiles``: guard failures while the batch size then varies (×2, ×½).

A table goes to stdout; the harness (`harness`, ``stoker bench models`` / ``stoker
bench gpu``) keeps the rows in its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..config import StokerConfigError, check_device

BACKENDS = ("eager", "aot_eager", "inductor", "stoker")


# ---------------------------------------------------------------------- worker (one process)


def spread_ms(times: Sequence[float]) -> dict[str, Any]:
    """Steady step times (seconds) as the row's ``steady_ms`` (the median, in ms) with
    ``steady_ms_min``, ``steady_ms_max`` and ``steady_repeats`` beside it."""
    if not times:
        return {
            "steady_ms": None,
            "steady_ms_min": None,
            "steady_ms_max": None,
            "steady_repeats": 0,
        }
    return {
        "steady_ms": statistics.median(times) * 1e3,
        "steady_ms_min": min(times) * 1e3,
        "steady_ms_max": max(times) * 1e3,
        "steady_repeats": len(times),
    }


def _saved_bytes(step: Any) -> int:
    """Bytes of distinct tensors autograd saves for backward while ``step()`` runs."""
    import torch

    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta" and t.untyped_storage().nbytes() > 0:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def worker(model_name: str, backend: str, steps: int, device: str) -> dict[str, Any]:
    import torch

    from .models import get_model

    spec = get_model(model_name)
    model = spec.build(device=device)
    n = spec.bench_batch
    gen = torch.Generator().manual_seed(0)
    batches = {b: spec.batch(b, gen, device) for b in (n, 2 * n, max(1, n // 2))}

    if backend == "eager":
        fn: Any = model
    elif backend == "stoker":
        import stoker

        fn = stoker.compile(model)
    else:
        fn = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(b: int = n) -> float:
        inputs, target = batches[b]
        loss = spec.loss(fn(*inputs), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return float(loss.detach())

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    import torch._dynamo.utils as dynamo_utils

    failures = getattr(dynamo_utils, "guard_failures", {})
    before = sum(len(v) for v in failures.values())
    step(2 * n)
    step(max(1, n // 2))
    recompiles = sum(len(v) for v in failures.values()) - before
    if device.startswith("cuda"):
        peak: int | None = int(torch.cuda.max_memory_allocated())
        peak_kind = "cuda max allocated"
    else:
        try:
            peak = _saved_bytes(step)
        except Exception:  # a backend that refuses saved-tensor hooks: say so, not a wrong number
            peak = None
        peak_kind = "saved activations"
    out: dict[str, Any] = {
        "model": model_name,
        "backend": backend,
        "device": device,
        "first_step_s": first,
        **spread_ms(times),
        "peak_mem": peak,
        "peak_kind": peak_kind,
        "recompiles": recompiles,
    }
    if backend == "stoker":
        rep = getattr(fn, "stoker_report", None)
        if rep is not None:
            out["stoker"] = rep.summary()
    return out


def suite_worker(
    entry_name: str,
    backend: str,
    steps: int,
    device: str,
    smoke: bool,
    params_path: str | None,
    *,
    timed: Callable[[], Any] | None = None,
    after: Callable[[Callable[[], float], Any, Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One GPU-suite configuration under one backend (see `suite`).

    ``timed()`` is a context manager entered around the measured part (the steady
    steps, peak memory, kernel count; `tools/gpu_lap.py` holds the GPU alone there
    while other rows compile). ``after(step, fn, model)``, called inside it, returns
    more figures for the row (the lap's per-kernel profile)."""
    import contextlib

    import torch

    from ..report.memprobe import peak_live_bytes
    from .suite import count_device_kernels, get_entry, wrap_model

    entry = get_entry(entry_name)
    size = entry.sized(smoke)
    torch.manual_seed(0)
    model = entry.build(size).to(device)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):  # a few distinct batches, cycled: every backend sees the same ones
        inputs, target = entry.batch(size, gen)
        batches.append((tuple(t.to(device) for t in inputs), target.to(device)))
    fn = wrap_model(model, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if entry.optimizer else None
    dev_type = torch.device(device).type
    calls = [0]

    def step() -> float:
        inputs, target = batches[calls[0] % len(batches)]
        calls[0] += 1
        with torch.autocast(dev_type, dtype=entry.autocast, enabled=entry.autocast is not None):
            loss = entry.loss(fn(*inputs), target)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if opt is not None:
            opt.step()
        if dev_type == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())

    losses: list[float] = []
    t0 = time.perf_counter()
    losses.append(step())
    first = time.perf_counter() - t0
    losses.append(step())
    extra: dict[str, Any] = {}
    with timed() if timed is not None else contextlib.nullcontext():
        if dev_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t0)
        peak: int | None = int(torch.cuda.max_memory_allocated()) if dev_type == "cuda" else None
        kernels = count_device_kernels(step)
        # the CPU proxy of peak memory: bytes allocated at once during one more step, from
        # allocation events (every backend runs this step, so parity is unchanged)
        cpu_peak = peak_live_bytes(step) if dev_type == "cpu" else None
        if after is not None:
            extra = after(step, fn, model)
    out: dict[str, Any] = {
        "model": entry_name,
        "backend": backend,
        "device": device,
        "smoke": smoke,
        "first_step_s": first,
        **spread_ms(times),
        "peak_mem": peak,
        "peak_kind": "cuda max allocated (steady steps)" if peak is not None else None,
        "kernels_per_step": kernels,
        "cpu_peak_mem": cpu_peak,
        "losses": losses,
    }
    rep = getattr(fn, "stoker_report", None)
    if rep is not None:
        out["stoker"] = rep.summary()
    out.update(extra)
    if params_path:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, params_path)
        out["params_path"] = params_path
    return out


# ---------------------------------------------------------------------- driver


def _run_worker(
    model: str,
    backend: str,
    steps: int,
    device: str,
    cache: str,
    timeout: float,
    extra: Sequence[str] = (),
    command: str = "worker",
) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(
        {
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
            "STOKER_CACHE_DIR": os.path.join(cache, "stoker"),
        }
    )
    env.pop("STOKER_REPORT", None)
    cmd = [
        sys.executable,
        "-m",
        "stoker._internal.bench.bench",
        command,
        model,
        backend,
        "--steps",
        str(steps),
        "--device",
        device,
        *extra,
    ]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "backend": backend, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"model": model, "backend": backend, "error": f"exit {p.returncode}: {tail}"}


def _cold_then_warm(
    name: str,
    backend: str,
    steps: int,
    device: str,
    timeout: float,
    warm: bool,
    progress: bool,
    extra: Sequence[str] = (),
    command: str = "worker",
    warm_extra: Sequence[str] = (),
) -> dict[str, Any]:
    """One measurement process with empty caches, then (``warm``) one more with the
    caches it left: the row of the first with the second's first step added."""
    cache = tempfile.mkdtemp(prefix=f"stoker-bench-{name}-{backend}-")
    try:
        if progress:
            print(f"  {name:<11} {backend:<12} cold ...", file=sys.stderr, flush=True)
        row = _run_worker(name, backend, steps, device, cache, timeout, extra, command)
        if warm and "error" not in row:
            if progress:
                print(f"  {name:<11} {backend:<12} warm ...", file=sys.stderr, flush=True)
            w = _run_worker(name, backend, 1, device, cache, timeout, warm_extra, command)
            row["warm_first_step_s"] = w.get("first_step_s")
            if "stoker" in w:  # the warm process's report: cache hits, compile time
                row["warm_stoker"] = w["stoker"]
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return row


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "—"
    if unit == "s":
        return f"{v:.2f}"
    if unit == "ms":
        return f"{v:.2f}"
    if unit == "e":
        return f"{v:.1e}"
    if unit == "B":
        return f"{v / 1024:.0f} KiB" if v < 1 << 20 else f"{v / (1 << 20):.1f} MiB"
    return str(v)


def _cell(row: dict[str, Any], key: str, unit: str) -> str:
    """A row's value; a ``spread`` column shows ``min / median / max`` over the repeats."""
    if unit == "spread":
        lo, mid, hi = (row.get(f"{key}_min"), row.get(key), row.get(f"{key}_max"))
        if lo is None or hi is None:
            return _fmt(mid, "ms")
        return f"{lo:.2f} / {mid:.2f} / {hi:.2f}"
    return _fmt(row.get(key), unit)


# (header, row key, unit) of each column after "model" and "backend". The first steps
# are one measurement each (one cold process, one warm); steady steps are --steps repeats.
MODEL_COLUMNS = (
    ("cold first step s", "first_step_s", "s"),
    ("warm first step s", "warm_first_step_s", "s"),
    ("steady ms min / median / max", "steady_ms", "spread"),
    ("peak mem", "peak_mem", "B"),
    ("recompiles", "recompiles", ""),
)
SUITE_COLUMNS = (
    ("cold 1st s", "first_step_s", "s"),
    ("warm 1st s", "warm_first_step_s", "s"),
    ("steady ms min / median / max", "steady_ms", "spread"),
    ("÷ eager", "vs_eager", "s"),
    ("÷ inductor", "vs_inductor", "s"),
    ("peak mem", "peak_mem", "B"),
    ("CPU peak (proxy)", "cpu_peak_mem", "B"),
    ("kernels/step", "kernels_per_step", ""),
    ("loss rel", "loss_rel", "e"),
    ("params rel", "params_rel", "e"),
)


def format_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]] = MODEL_COLUMNS
) -> str:
    """One line per (model, backend) row; an error fills the row's first column."""
    head = ["model", "backend", *(h for h, _, _ in columns)]
    body: list[list[str]] = []
    for r in rows:
        if "error" in r:
            cells = ["error: " + str(r["error"])[:70]] + [""] * (len(columns) - 1)
        else:
            cells = [_cell(r, key, unit) for _, key, unit in columns]
        body.append([r["model"], r["backend"], *cells])
    return _text_table(head, body)


def _text_table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)
    ]
    line = " | ".join(h.ljust(w) for h, w in zip(head, widths))
    sep = "-|-".join("-" * w for w in widths)
    out = [line, sep] + [" | ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(out)


# ---------------------------------------------------------------------- the GPU suite


def run_suite(
    *,
    entries: Sequence[str] | None,
    backends: Sequence[str],
    steps: int,
    warm: bool,
    device: str | None,
    timeout: float,
    smoke: bool,
    progress: bool = True,
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every suite entry × backend in fresh processes; parity measured against eager's run.

    ``on_row`` gets the rows so far after each one (the driver rewrites its JSON), so a
    run cut short by a time limit keeps what it measured.
    """

    from .suite import SUITE, SUITE_BACKENDS, compare_runs

    device = check_device(device)
    names = list(entries) if entries else [e.name for e in SUITE]
    check_names("--backends", backends, SUITE_BACKENDS, " with --suite gpu")
    check_names("--models", names, [e.name for e in SUITE], " (entries of --suite gpu)")
    order = (["eager"] if "eager" in backends else []) + [b for b in backends if b != "eager"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="stoker-suite-params-") as params_dir:
        for name in names:
            eager_row: dict[str, Any] | None = None
            for be in order:
                size = ["--smoke"] if smoke else []
                params = ["--params", os.path.join(params_dir, f"{name}-{be}.pt")]
                row = _cold_then_warm(
                    name,
                    be,
                    steps,
                    device,
                    timeout,
                    warm,
                    progress,
                    size + params,
                    "suite-worker",
                    size,
                )
                if be == "eager" and "error" not in row:
                    eager_row = row
                elif eager_row is not None and "error" not in row:
                    row.update(compare_runs(row, eager_row))
                    if row.get("steady_ms") and eager_row.get("steady_ms"):
                        row["vs_eager"] = row["steady_ms"] / eager_row["steady_ms"]
                rows.append(row)
                _add_vs_inductor(rows)
                if progress:
                    print("    " + _row_line(row), file=sys.stderr, flush=True)
                if on_row is not None:
                    on_row(rows)
    for row in rows:
        row.pop("params_path", None)
    return rows


def _row_line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['model']} {row['backend']}: error: {row['error']}"
    cells = (f"{h}={_cell(row, k, u)}" for h, k, u in SUITE_COLUMNS if row.get(k) is not None)
    return f"{row['model']} {row['backend']}: " + ", ".join(cells)


def _add_vs_inductor(rows: list[dict[str, Any]]) -> None:
    """The ratio the suite's targets are stated in: steady time over Inductor's."""
    for row in rows:
        ind = next(
            (
                r
                for r in rows
                if r["model"] == row["model"] and r["backend"] == "inductor" and r.get("steady_ms")
            ),
            None,
        )
        if ind is not None and row.get("steady_ms"):
            row["vs_inductor"] = row["steady_ms"] / ind["steady_ms"]


def format_suite_table(rows: Sequence[dict[str, Any]]) -> str:
    return format_table(rows, SUITE_COLUMNS)


def check_names(flag: str, given: Sequence[str], known: Sequence[str], hint: str = "") -> None:
    """A `StokerConfigError` naming what ``flag`` got that is not in ``known``."""
    if not given:
        raise StokerConfigError(f"{flag}: name at least one; choose from {', '.join(known)}")
    bad = [n for n in given if n not in known]
    if bad:
        raise StokerConfigError(
            f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(known)}{hint}"
        )


def run_models(
    *,
    models: Sequence[str] | None,
    backends: Sequence[str],
    steps: int,
    warm: bool,
    device: str | None,
    timeout: float,
    progress: bool = True,
) -> list[dict[str, Any]]:

    from .models import model_zoo

    device = check_device(device)
    zoo = list(model_zoo())
    names = list(models) if models else zoo
    check_names("--backends", backends, BACKENDS)
    hint = ""
    if any(n.startswith("hf-") and n not in zoo for n in names):
        hint = " (the hf-* models need `transformers`)"
    check_names("--models", names, zoo, hint)
    rows: list[dict[str, Any]] = []
    for name in names:
        for be in backends:
            rows.append(_cold_then_warm(name, be, steps, device, timeout, warm, progress))
    return rows


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stoker._internal.bench.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("model")
    w.add_argument("backend", choices=BACKENDS)
    w.add_argument("--steps", type=int, default=20)
    w.add_argument("--device", default="cpu")
    sw = sub.add_parser("suite-worker")
    sw.add_argument("model")
    sw.add_argument("backend")
    sw.add_argument("--steps", type=int, default=20)
    sw.add_argument("--device", default="cpu")
    sw.add_argument("--smoke", action="store_true")
    sw.add_argument("--params", default=None, help="save the final parameters here")
    a = p.parse_args(argv)
    if a.cmd == "suite-worker":
        row = suite_worker(a.model, a.backend, a.steps, a.device, a.smoke, a.params)
    else:
        row = worker(a.model, a.backend, a.steps, a.device)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
