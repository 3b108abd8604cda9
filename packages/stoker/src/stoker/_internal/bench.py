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

A table goes to stdout and everything to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

BACKENDS = ("eager", "aot_eager", "inductor", "stoker")


# ---------------------------------------------------------------------- worker (one process)


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
        "steady_ms": statistics.median(times) * 1e3 if times else None,
        "peak_mem": peak,
        "peak_kind": peak_kind,
        "recompiles": recompiles,
    }
    if backend == "stoker":
        rep = getattr(fn, "stoker_report", None)
        if rep is not None:
            out["stoker"] = rep.summary()
    return out


# ---------------------------------------------------------------------- driver


def _run_worker(
    model: str, backend: str, steps: int, device: str, cache: str, timeout: float
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
        "stoker._internal.bench",
        "worker",
        model,
        backend,
        "--steps",
        str(steps),
        "--device",
        device,
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


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "—"
    if unit == "s":
        return f"{v:.2f}"
    if unit == "ms":
        return f"{v:.2f}"
    if unit == "B":
        return f"{v / 1024:.0f} KiB" if v < 1 << 20 else f"{v / (1 << 20):.1f} MiB"
    return str(v)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = [
        "model",
        "backend",
        "cold first step s",
        "warm first step s",
        "steady ms",
        "peak mem",
        "recompiles",
    ]
    body: list[list[str]] = []
    for r in rows:
        if "error" in r:
            body.append(
                [r["model"], r["backend"], "error: " + str(r["error"])[:60], "", "", "", ""]
            )
            continue
        body.append(
            [
                r["model"],
                r["backend"],
                _fmt(r.get("first_step_s"), "s"),
                _fmt(r.get("warm_first_step_s"), "s"),
                _fmt(r.get("steady_ms"), "ms"),
                _fmt(r.get("peak_mem"), "B"),
                _fmt(r.get("recompiles")),
            ]
        )
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)
    ]
    line = " | ".join(h.ljust(w) for h, w in zip(head, widths))
    sep = "-|-".join("-" * w for w in widths)
    out = [line, sep] + [" | ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(out)


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
    import torch

    from .models import model_zoo

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = list(models) if models else list(model_zoo())
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise SystemExit(
            f"stoker bench: unknown backend(s) {bad}; choose from {', '.join(BACKENDS)}"
        )
    rows: list[dict[str, Any]] = []
    for name in names:
        for be in backends:
            cache = tempfile.mkdtemp(prefix=f"stoker-bench-{name}-{be}-")
            try:
                if progress:
                    print(f"  {name:<10} {be:<10} cold ...", file=sys.stderr, flush=True)
                row = _run_worker(name, be, steps, device, cache, timeout)
                if warm and "error" not in row:
                    if progress:
                        print(f"  {name:<10} {be:<10} warm ...", file=sys.stderr, flush=True)
                    w = _run_worker(name, be, 1, device, cache, timeout)
                    row["warm_first_step_s"] = w.get("first_step_s")
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            rows.append(row)
    return rows


def run_bench(
    *,
    models: Sequence[str] | None,
    backends: Sequence[str],
    steps: int,
    json_path: str,
    warm: bool,
    device: str | None,
    timeout: float,
) -> int:
    """``stoker bench``: the sibling benchmark scripts (when run from a checkout) and the models."""
    suites = run_tool_scripts(timeout=timeout)
    print(f"stoker bench: models × backends, {steps} steady steps each", file=sys.stderr)
    rows = run_models(
        models=models, backends=backends, steps=steps, warm=warm, device=device, timeout=timeout
    )
    print(format_table(rows))
    write_json(json_path, rows, suites)
    print(f"stoker bench: JSON written to {os.path.abspath(json_path)}", file=sys.stderr)
    return 0 if all("error" not in r for r in rows) else 1


def run_tool_scripts(timeout: float, root: str | None = None) -> dict[str, Any]:
    """Run tools/bench_<name>.py (shapes, capture, autograd, triton) found in a checkout."""
    root = root or _checkout_root()
    suites: dict[str, Any] = {}
    if root is None:
        return suites
    for name in ("shapes", "capture", "autograd", "triton"):
        script = os.path.join(root, "tools", f"bench_{name}.py")
        if not os.path.exists(script):
            suites[name] = {"status": "absent"}
            continue
        print(f"== tools/bench_{name}.py", flush=True)
        t0 = time.perf_counter()
        js = os.path.join(root, "bench-results", f"bench_{name}.json")
        os.makedirs(os.path.dirname(js), exist_ok=True)
        try:
            # Scripts that take --json write their numbers there; others are run bare.
            p = subprocess.run(
                [sys.executable, script, "--json", js],
                capture_output=True,
                text=True,
                cwd=root,
                timeout=timeout,
            )
            if p.returncode == 2 and "--json" in p.stderr:
                p = subprocess.run(
                    [sys.executable, script],
                    capture_output=True,
                    text=True,
                    cwd=root,
                    timeout=timeout,
                )
            print(p.stdout.rstrip(), flush=True)
            if p.returncode:
                print(p.stderr.rstrip()[-2000:], file=sys.stderr)
            suites[name] = {
                "status": "ok" if p.returncode == 0 else f"exit {p.returncode}",
                "seconds": round(time.perf_counter() - t0, 2),
                "stdout": p.stdout,
            }
        except subprocess.TimeoutExpired:
            suites[name] = {"status": f"timed out after {timeout:.0f} s"}
        if os.path.exists(js):
            try:
                with open(js, encoding="utf-8") as f:
                    suites[name]["json"] = json.load(f)
            except ValueError:
                pass
    return suites


def _checkout_root() -> str | None:
    """The repository root when stoker runs from a checkout (tools/bench.py beside packages/)."""
    here = os.path.abspath(__file__)
    for _ in range(7):
        here = os.path.dirname(here)
        if os.path.isdir(os.path.join(here, "tools")) and os.path.isdir(
            os.path.join(here, "packages")
        ):
            return here
    cwd = os.getcwd()
    return cwd if os.path.isdir(os.path.join(cwd, "tools")) else None


def write_json(path: str, rows: Sequence[dict[str, Any]], suites: dict[str, Any]) -> None:
    import torch

    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "models": list(rows),
        "suites": suites,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stoker._internal.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("model")
    w.add_argument("backend", choices=BACKENDS)
    w.add_argument("--steps", type=int, default=20)
    w.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    print(json.dumps(worker(a.model, a.backend, a.steps, a.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
