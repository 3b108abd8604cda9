"""The CPU backend against eager and Inductor-CPU: steady step, cold and warm compile.

    python -m stoker._internal.bench.benchmarks.cpu_step [--models demo-gpt,mlp-l,...]
        [--threads 1,2] [--steps 5] [--rounds 7] [--backends eager,stoker,inductor]
        (also: stoker-noca)
        [--smoke] [--json PATH]

For each model and thread count, one fresh process with empty cache folders
(stoker's and Inductor's) trains the same model from the same weights three ways
side by side: eager, `stoker.compile` (C kernels: ``backend="c"``) and
``torch.compile`` (Inductor's C++ backend). It reports

- ``cold_s``: the first two steps minus two steady ones (the forward compiles at the
  first, compiled autograd's backward at the second), per compiler;
- ``steady_ms``: the median over ``--rounds`` interleaved rounds of ``--steps`` steps
  (forward, loss, backward, AdamW), each backend's round right after the others';
- ``warm_s``: the same first two steps in a second fresh process that finds the first
  one's caches (what a second run of a training script pays);
- the ratios ``stoker / eager`` and ``stoker / inductor`` of the steady step and of
  the compile times.

``--backends`` may add ``stoker-noca``: the same C kernels with
``compiled_autograd=False``, so the backward runs on torch's eager engine through
stoker's compiled AOT backward, as ``torch.compile``'s does (what compiled autograd
costs or saves per step, measured beside the rest).

The models: the demo's GPT at its size (``demo-gpt``), the GPU suite's models at
CPU sizes (`CPU_SIZES`: smaller than the H100's, so a step takes milliseconds here),
and ``cnn-m``: the suite's BatchNorm CNN (``cnn-m-bf16``'s model) in float32 on
32×32 images, batch 16, whose first convolutions run channels-last on the C backend.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import write_json

# The GPU suite's models at sizes a 2-core CPU steps through in tens of milliseconds.
CPU_SIZES: dict[str, dict[str, int]] = {
    "gpt-m": {
        "vocab": 2048,
        "seq": 64,
        "layers": 2,
        "heads": 4,
        "hidden": 128,
        "tie": 1,
        "batch": 8,
    },
    "hf-llama": {
        "vocab": 1024,
        "seq": 64,
        "layers": 2,
        "hidden": 128,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 344,
        "batch": 4,
    },
    "hf-gpt2": {"vocab": 1024, "seq": 64, "layers": 2, "hidden": 128, "heads": 4, "batch": 4},
    "mlp-l": {"d": 256, "batch": 128},
    "tiny-gpt": {"vocab": 65, "seq": 32, "layers": 2, "heads": 2, "hidden": 64, "batch": 4},
    "small-cnn": {"width": 8, "image": 16, "batch": 16},
}
DEFAULT_MODELS = ("demo-gpt", "gpt-m", "hf-llama", "hf-gpt2", "mlp-l", "small-cnn", "cnn-m")
BACKENDS = ("eager", "stoker", "inductor", "stoker-noca")
DEFAULT_BACKENDS = ("eager", "stoker", "inductor")


def _build(name: str, smoke: bool) -> tuple[Any, Callable[[Any], Any], Any, bool]:
    """(model, batch(gen) -> (inputs, target), loss, optimizer) of `name`."""
    from ..models import GPT, GPTConfig, lm_loss
    from ..suite import get_entry

    if name == "demo-gpt":
        import torch

        cfg = GPTConfig(vocab_size=65) if not smoke else GPTConfig(vocab_size=16, n_embd=16)
        b = 16 if not smoke else 2

        def batch(gen: Any) -> Any:
            x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=gen)
            y = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=gen)
            return (x,), y

        return GPT(cfg), batch, lm_loss, True
    if name == "cnn-m":  # the suite's cnn-m-bf16 model, float32, at a CPU size
        e = get_entry("cnn-m-bf16")
        sizes = e.smoke if smoke else {"width": 32, "image": 32, "batch": 16}
        return e.build(sizes), (lambda gen: e.batch(sizes, gen)), e.loss, e.optimizer
    e = get_entry(name)
    sizes = e.smoke if smoke else CPU_SIZES.get(name, e.smoke)
    return e.build(sizes), (lambda gen: e.batch(sizes, gen)), e.loss, e.optimizer


def worker(
    name: str, threads: int, steps: int, rounds: int, backends: list[str], smoke: bool
) -> dict[str, Any]:
    """One model, every backend, side by side in this process."""
    import torch

    import stoker

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    base, batch, loss_fn, use_opt = _build(name, smoke)
    gen = torch.Generator().manual_seed(0)
    inputs, target = batch(gen)
    runs: dict[str, Callable[[], None]] = {}
    first: dict[str, list[float]] = {}
    for b in backends:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if use_opt else None
        if b == "eager":
            fn: Any = model
        elif b == "inductor":
            fn = torch.compile(model)
        elif b == "stoker-noca":
            fn = stoker.compile(model, backend="c", compiled_autograd=False)
        else:
            fn = stoker.compile(model, backend="c")

        def step(fn: Any = fn, model: Any = model, opt: Any = opt, b: str = b) -> None:
            with stoker.autograd_enabled(b == "stoker"):
                loss = loss_fn(fn(*inputs), target)
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                loss.backward()
                if opt is not None:
                    opt.step()

        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        first[b] = times
        runs[b] = step
    steady: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(rounds):
        for b in backends:
            t0 = time.perf_counter()
            for _ in range(steps):
                runs[b]()
            steady[b].append((time.perf_counter() - t0) / steps)
    out: dict[str, Any] = {"model": name, "threads": threads}
    for b in backends:
        med = statistics.median(steady[b])
        out[f"{b}_steady_ms"] = med * 1e3
        out[f"{b}_steady_min_ms"] = min(steady[b]) * 1e3
        out[f"{b}_first_two_s"] = sum(first[b])
        if b != "eager":
            out[f"{b}_cold_s"] = max(0.0, sum(first[b]) - 2 * med)
    return out


def _run_worker(name: str, threads: int, args: argparse.Namespace, caches: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["STOKER_CACHE_DIR"] = os.path.join(caches, "stoker")
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
    env["OMP_NUM_THREADS"] = str(threads)
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "stoker._internal.bench.benchmarks.cpu_step",
        "--worker",
        name,
        "--threads",
        str(threads),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--backends",
        ",".join(args.backends),
    ] + (["--smoke"] if args.smoke else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        return {"model": name, "threads": threads, "error": done.stderr[-2000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS))
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the test")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default="")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        p.error(f"--backends: unknown {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    if args.worker:
        res = worker(
            args.worker, int(args.threads), args.steps, args.rounds, args.backends, args.smoke
        )
        print(json.dumps(res))
        return 0
    rows: list[dict[str, Any]] = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for name in [m for m in args.models.split(",") if m]:
            with tempfile.TemporaryDirectory(prefix="stoker-cpu-step-") as caches:
                row = _run_worker(name, threads, args, caches)
                if "error" not in row and any(b.startswith("stoker") for b in args.backends):
                    warm = _run_worker(name, threads, args, caches)  # the caches the first left
                    for b in args.backends:
                        if b != "eager" and f"{b}_first_two_s" in warm:
                            steady = warm[f"{b}_steady_ms"] / 1e3
                            row[f"{b}_warm_s"] = max(0.0, warm[f"{b}_first_two_s"] - 2 * steady)
            _ratios(row)
            rows.append(row)
            print(_line(row), flush=True)
    write_json(args.json, rows)
    return 0 if all("error" not in r for r in rows) else 1


def _ratios(row: dict[str, Any]) -> None:
    n = row.get("stoker-noca_steady_ms")
    if n is not None:
        if row.get("eager_steady_ms"):
            row["stoker-noca_over_eager"] = n / row["eager_steady_ms"]
        if row.get("inductor_steady_ms"):
            row["stoker-noca_over_inductor"] = n / row["inductor_steady_ms"]
    s = row.get("stoker_steady_ms")
    if s is None:
        return
    if row.get("eager_steady_ms"):
        row["stoker_over_eager"] = s / row["eager_steady_ms"]
    if row.get("inductor_steady_ms"):
        row["stoker_over_inductor"] = s / row["inductor_steady_ms"]
        if row.get("inductor_cold_s"):
            row["cold_stoker_over_inductor"] = row["stoker_cold_s"] / row["inductor_cold_s"]
        if row.get("inductor_warm_s") and "stoker_warm_s" in row:
            row["warm_stoker_over_inductor"] = row["stoker_warm_s"] / max(
                row["inductor_warm_s"], 1e-9
            )


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['model']:10s} {r['threads']}T  error: {r['error'].splitlines()[-1] if r['error'] else ''}"

    def f(k: str, fmt: str = "{:.2f}") -> str:
        return fmt.format(r[k]) if k in r else "-"

    return (
        f"{r['model']:10s} {r['threads']}T  steady ms: eager {f('eager_steady_ms')}  stoker "
        f"{f('stoker_steady_ms')}  inductor {f('inductor_steady_ms')}  | stoker/eager "
        f"{f('stoker_over_eager')}  stoker/inductor {f('stoker_over_inductor')}  | cold s: stoker "
        f"{f('stoker_cold_s')} inductor {f('inductor_cold_s')}  | warm s: stoker "
        f"{f('stoker_warm_s')} inductor {f('inductor_warm_s')}"
        + (
            f"  | no compiled autograd: {f('stoker-noca_steady_ms')} ms, "
            f"/eager {f('stoker-noca_over_eager')} /inductor {f('stoker-noca_over_inductor')}"
            if "stoker-noca_steady_ms" in r
            else ""
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
