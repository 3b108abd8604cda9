"""``stoker demo``: train a small GPT eager and compiled, side by side.

Both copies start from the same weights and see the same batches (character
windows of the bundled text); each step runs the eager copy (plain autograd
engine) and then the compiled copy (stoker.compile, backward through
stoker-autograd).  At the end it prints compile time, steady step times, how
closely the two loss curves agree, what was compiled, and where the report is.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stoker_shapes import timing
from stoker_shapes._internal.gcfreeze import frozen_heap as _frozen_heap

from .models import GPT, GPTConfig, lm_loss
from .tiny_text import TEXT


@dataclass
class DemoResult:
    executor: str
    device: str
    steps: int
    losses_eager: list[float] = field(default_factory=list)
    losses_compiled: list[float] = field(default_factory=list)
    times_eager: list[float] = field(default_factory=list)  # seconds per step
    times_compiled: list[float] = field(default_factory=list)
    report_path: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    # the first compiled step by stage (ms; they sum to times_compiled[0], "other" included)
    first_step: dict[str, float] = field(default_factory=dict)
    cache: str = ""  # the on-disk caches' state: "warm (hits 2, misses 0)", "cold (...)"

    @property
    def max_loss_diff(self) -> float:
        return max(
            (abs(a - b) for a, b in zip(self.losses_eager, self.losses_compiled)), default=0.0
        )

    def steady(self, times: list[float]) -> float:
        """The steady step time: the median of the second half of the steps."""
        return statistics.median(self.steady_tail(times))

    def steady_tail(self, times: list[float]) -> list[float]:
        return times[len(times) // 2 :] or times

    def spread(self, times: list[float]) -> str:
        """``(min 1.20, max 3.40 ms over 100 steps)``: what the median was taken over."""
        tail = self.steady_tail(times)
        if not tail:
            return ""
        return (
            f"(median; min {min(tail) * 1e3:.2f}, max {max(tail) * 1e3:.2f} ms, {len(tail)} steps)"
        )


def make_data(block: int, device: str) -> tuple[torch.Tensor, int]:
    """The bundled text as a tensor of character ids, and the vocabulary size."""
    chars = sorted(set(TEXT))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in TEXT], dtype=torch.long, device=device)
    return data, len(chars)


def get_batch(
    data: torch.Tensor, block: int, batch: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - block - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts.tolist()])
    return x, y


class Progress:
    """A plain-text progress bar on stderr (carriage returns, no dependencies)."""

    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total, self.enabled, self.width = total, enabled and total > 0, width
        self.t0 = time.perf_counter()

    def update(self, done: int, note: str) -> None:
        if not self.enabled:
            return
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{bar}] {done:>4}/{self.total} {elapsed:5.1f}s  {note}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def frozen_heap() -> contextlib.AbstractContextManager[None]:
    """The training loop with the objects alive at its start (torch's modules, the
    models, the data) outside the cyclic GC's reach, given back at its end.

    The first compiled step allocates enough (Dynamo's frame trace) to set off a
    full collection, which otherwise walks the whole heap, torch's and sympy's
    modules included: about 0.1 to 0.2 s of the demo's 0.8 s warm first step on
    the CPU, more than stoker's own share of it. Collected first, so no garbage is
    frozen (stoker-shapes' `frozen_heap`, which the compiles inside then share).
    """
    return _frozen_heap(collect=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_side_by_side(
    *,
    steps: int,
    batch: int,
    backend: str,
    device: str,
    report: str | None,
    seed: int,
    progress: bool,
    compile_fn: Callable[..., Any] | None = None,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    data_seed: int | None = None,
) -> DemoResult:
    """The demo's loop; ``compile_fn`` defaults to `stoker.compile`.  ``wrap`` (DDP,
    FSDP2) is applied to both copies before compiling; ``data_seed`` (per rank) draws
    the batches (default: ``seed``)."""
    import stoker

    from ..config import resolve_backend

    cfg = GPTConfig()
    data, vocab = make_data(cfg.block_size, device)
    cfg = GPTConfig(vocab_size=vocab)
    torch.manual_seed(seed)
    eager: torch.nn.Module = GPT(cfg).to(device)
    model = copy.deepcopy(eager)
    if wrap is not None:
        eager, model = wrap(eager), wrap(model)
    compile_fn = compile_fn or stoker.compile
    compiled = compile_fn(model, backend=backend, report=report)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    opt_c = torch.optim.AdamW(model.parameters(), lr=3e-3)
    executor = resolve_backend(backend, [torch.device(device)])
    res = DemoResult(executor=executor, device=device, steps=steps, report_path=report)
    rep = getattr(compiled, "stoker_report", None)
    gen = torch.Generator().manual_seed(seed if data_seed is None else data_seed)
    bar = Progress(steps, progress)
    with frozen_heap():
        for step in range(steps):
            x, y = get_batch(data, cfg.block_size, batch, gen)
            # eager: the plain autograd engine, for reference
            with stoker.autograd_enabled(False):
                t0 = time.perf_counter()
                loss_e = lm_loss(eager(x), y)
                opt_e.zero_grad(set_to_none=True)
                loss_e.backward()  # type: ignore[no-untyped-call]
                opt_e.step()
                _sync(device)
                res.times_eager.append(time.perf_counter() - t0)
            # compiled: forward by stoker's backend, backward through stoker-autograd (the
            # loop's own code is marked, so the report's first step accounts for it)
            t0 = time.perf_counter()
            out = compiled(x)
            with timing.timed("user", "loss"):
                loss_c = lm_loss(out, y)
                opt_c.zero_grad(set_to_none=True)
            loss_c.backward()  # type: ignore[no-untyped-call]
            with timing.timed("user", "optimizer step"):
                opt_c.step()
                _sync(device)
            t1 = time.perf_counter()
            res.times_compiled.append(t1 - t0)
            if step == 0 and rep is not None:  # the report accounts for this step's time
                rep.mark_first_step(t0, t1)
            res.losses_eager.append(float(loss_e.detach()))
            res.losses_compiled.append(float(loss_c.detach()))
            bar.update(
                step + 1,
                f"loss eager {res.losses_eager[-1]:.3f} stoker {res.losses_compiled[-1]:.3f}",
            )
        if rep is not None and steps and wrap is None:
            # one more forward and backward, its memory traced for the report (after the
            # loop: the profiler's cost touches no timed step); no optimizer step
            with rep.trace_memory(device):
                lm_loss(compiled(x), y).backward()  # type: ignore[no-untyped-call]
            opt_c.zero_grad(set_to_none=True)
    bar.close()
    if rep is not None:
        from ..api.backend import _autograd_stats
        from ..api.compile_api import _distributed_summary

        rep.autograd = _autograd_stats()
        rep.distributed = _distributed_summary()
        rep.flush()
        res.summary = rep.summary()
        res.report_path = rep.path
        res.cache = rep.cache_line()
        step_rec = rep.step_record()
        if step_rec is not None:
            res.first_step = step_rec.by_stage()
    return res


# the demo's breakdown of its first step, in groups of stages that it always prints
STAGE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Dynamo trace", ("dynamo",)),
    ("capture and partition", ("backend", "capture", "partition")),
    ("codegen and kernel compile", ("codegen", "kernel compile")),
    ("compiled autograd", ("autograd capture", "autograd retrace", "autograd compile")),
    ("caches", ("cache load", "cache write")),
    ("first runs", ("run forward", "run backward")),
    ("loss and optimizer", ("user",)),
    ("report and GC", ("report", "gc")),
    ("other", ("other",)),
)


def format_stages(stages: dict[str, float]) -> list[str]:
    """The first step by group of stages, seconds each, on two lines (every group, in
    one order: the lines read alike from run to run)."""
    parts = [
        f"{name} {sum(stages.get(st, 0.0) for st in keys) / 1e3:.2f} s"
        for name, keys in STAGE_GROUPS
    ]
    return [", ".join(parts[:4]) + ",", ", ".join(parts[4:])]


def format_result(res: DemoResult) -> str:
    steady_e, steady_c = res.steady(res.times_eager), res.steady(res.times_compiled)
    first_c = res.times_compiled[0] if res.times_compiled else float("nan")
    s = res.summary
    lines = [
        f"stoker demo: small GPT ({res.steps} steps) on {res.device}, executor: {res.executor}",
        f"  compile time (first compiled step):  {first_c:8.2f} s",
        f"    of which: {format_stages(res.first_step)[0]}" if res.first_step else "",
        f"              {format_stages(res.first_step)[1]}" if res.first_step else "",
        f"    on-disk caches: {res.cache}" if res.cache else "",
        f"  steady step time, eager:             {steady_e * 1e3:8.2f} ms   "
        f"{res.spread(res.times_eager)}",
        f"  steady step time, stoker:            {steady_c * 1e3:8.2f} ms   "
        f"{res.spread(res.times_compiled)}, {steady_e / steady_c:.2f}x the speed of eager"
        if steady_c > 0
        else "",
        f"  loss eager  first {res.losses_eager[0]:.4f}  last {res.losses_eager[-1]:.4f}"
        if res.losses_eager
        else "",
        f"  loss stoker first {res.losses_compiled[0]:.4f}  last {res.losses_compiled[-1]:.4f}"
        if res.losses_compiled
        else "",
        f"  loss curves agree to max |diff| = {res.max_loss_diff:.2e} over {res.steps} steps",
        f"  compiled: graphs {s.get('graphs', 0)}, guards {s.get('guards', 0)}, "
        f"{'C' if res.executor == 'c' else 'Triton'} kernels {s.get('kernels', 0)}, "
        f"recompiles {s.get('recompiles', 0)}",
        f"  report: {res.report_path}" if res.report_path else "  report: not written",
    ]
    return "\n".join(x for x in lines if x)


def check_demo_args(
    *, steps: int, batch: int, backend: str, device: str | None, ranks: int = 1
) -> str:
    """The device the demo will run on, or a `StokerConfigError` saying what to pass
    instead (``stoker demo`` prints it as one line and exits with 2)."""
    from ..config import BACKENDS, StokerConfigError, check_device, resolve_backend

    if steps < 1:
        raise StokerConfigError(f"--steps {steps}: train at least 1 step (default 200)")
    if batch < 1:
        raise StokerConfigError(f"--batch {batch}: use at least 1 sequence per step (default 16)")
    if ranks < 1:
        raise StokerConfigError(f"--ranks {ranks}: use 1 (one process) or more")
    if backend not in BACKENDS:
        raise StokerConfigError(f"--backend {backend}: choose one of {', '.join(BACKENDS)}")
    device = check_device(device)
    dev = torch.device(device)
    if ranks > 1 and dev.index is not None:
        raise StokerConfigError(
            f"--device {device}: with --ranks, name cpu or cuda without an index (one GPU per rank)"
        )
    if ranks > 1 and dev.type == "cuda" and torch.cuda.device_count() < ranks:
        n = torch.cuda.device_count()
        raise StokerConfigError(
            f"--ranks {ranks} on cuda needs {ranks} GPUs (NCCL, one per rank); this machine "
            f"has {n}: pass --ranks {n}, or --device cpu (gloo)"
        )
    try:
        resolve_backend(backend, [dev])
    except StokerConfigError as e:
        raise StokerConfigError(f"--backend {backend} on {device}: {e}") from None
    return device


def run_demo(
    *,
    steps: int,
    batch: int,
    backend: str,
    device: str | None,
    report: str | None,
    seed: int,
    progress: bool,
) -> int:
    import os

    device = check_demo_args(steps=steps, batch=batch, backend=backend, device=device)
    if backend == "auto":
        from ..config import resolve_backend

        executor = resolve_backend(backend, [torch.device(device)])
        why = (
            "a GPU is present: Triton kernels"
            if executor == "triton"
            else "no GPU: fused C kernels"
            if executor == "c"
            else "no GPU and no C compiler: the aten executor"
        )
    else:
        why = f"requested backend={backend}"
    print(
        f"stoker demo: training a small GPT eager and compiled on {device} ({why})", file=sys.stderr
    )
    res = train_side_by_side(
        steps=steps,
        batch=batch,
        backend=backend,
        device=device,
        report=os.path.abspath(report) if report else None,
        seed=seed,
        progress=progress,
    )
    print(format_result(res))
    return 0
