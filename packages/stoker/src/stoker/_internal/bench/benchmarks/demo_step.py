"""`stoker demo`'s steady training step, eager vs stoker, side by side.

    python -m stoker._internal.bench.benchmarks.demo_step [--steps 60] [--rounds 3] [--batch 16] [--threads 1]
                                    [--backend aten] [--partitioner min_cut|default] [--profile]

The demo's model (the small GPT of `stoker._internal.bench.models`, the demo's default
config and data) trained eager and compiled from the same weights on the same
batch, exactly the demo's step (forward, loss, ``zero_grad``, ``loss.backward()``,
AdamW). After three warm-up steps each, every round runs ``--steps`` steps
*alternating* eager and stoker, each timed alone by the thread's CPU time (a step
the machine took the core away in does not count the wait; with ``--threads 1``
torch's intra-op pool does not hide work in other threads). Reported per round: the
min and the median of each, and their ratio; the last line is the min over all
rounds, the reproducible number (noise only adds time).

``--profile``: after timing, torch.profiler (record_shapes) over 10 steps of each,
and the aten ops whose call counts differ between eager and stoker.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from . import write_json


def build(
    batch: int, backend: str, partitioner: str
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(eager step, stoker step) of the demo's model on one fixed batch."""
    import stoker
    from stoker._internal.bench.models import lm_loss

    from .demo_start import demo_setup

    eager, model, x, y = demo_setup(batch)
    compiled = stoker.compile(model, backend=backend, partitioner=partitioner, report=None)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    opt_c = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def step_eager() -> None:
        with stoker.autograd_enabled(False):  # the plain autograd engine, as the demo
            loss = lm_loss(eager(x), y)
            opt_e.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt_e.step()

    def step_stoker() -> None:
        loss = lm_loss(compiled(x), y)
        opt_c.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt_c.step()

    return step_eager, step_stoker


def one_round(
    step_e: Callable[[], None], step_c: Callable[[], None], steps: int
) -> tuple[list[float], list[float]]:
    te: list[float] = []
    tc: list[float] = []
    clock = time.thread_time_ns
    for _ in range(steps):
        t0 = clock()
        step_e()
        te.append((clock() - t0) / 1e6)
        t0 = clock()
        step_c()
        tc.append((clock() - t0) / 1e6)
    return te, tc


def op_counts(step: Callable[[], None], n: int = 10) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(n):
            step()
    return {e.key: e.count // n for e in prof.key_averages() if e.key.startswith("aten::")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="steps of each per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (demo: 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--backend", default="aten", help="stoker executor (demo on a CPU: aten)")
    ap.add_argument("--partitioner", default="min_cut")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", help="write the per-round and best figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    step_e, step_c = build(args.batch, args.backend, args.partitioner)
    for _ in range(3):  # the first compiles the forward, the second the backward
        step_e()
        step_c()
    print(
        f"demo step (batch {args.batch}, threads {args.threads}, backend {args.backend}, "
        f"partitioner {args.partitioner}), thread CPU ms per step, {args.steps} steps "
        f"per round, alternating"
    )
    print(f"{'round':>5}  {'eager min':>9} {'median':>7}  {'stoker min':>10} {'median':>7}  ratio")
    best_e = best_c = float("inf")
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        te, tc = one_round(step_e, step_c, args.steps)
        best_e, best_c = min(best_e, *te), min(best_c, *tc)
        me, mc = statistics.median(te), statistics.median(tc)
        rounds.append({"eager_min_ms": min(te), "eager_median_ms": me})
        rounds[-1].update({"stoker_min_ms": min(tc), "stoker_median_ms": mc})
        print(
            f"{r:>5}  {min(te):9.2f} {me:7.2f}  {min(tc):10.2f} {mc:7.2f}  {min(te) / min(tc):.2f}x"
        )
    print(
        f"best   eager {best_e:.2f} ms  stoker {best_c:.2f} ms  "
        f"({best_e / best_c:.2f}x the speed of eager)"
    )
    best = {"eager_ms": best_e, "stoker_ms": best_c, "speed_vs_eager": best_e / best_c}
    write_json(args.json, {"rounds": rounds, "best": best})
    if args.profile:
        ce, cc = op_counts(step_e), op_counts(step_c)
        diff = sorted(k for k in {*ce, *cc} if ce.get(k, 0) != cc.get(k, 0))
        print("aten ops per step whose counts differ (eager, stoker):")
        for k in diff:
            print(f"  {k:40s} {ce.get(k, 0):5d} {cc.get(k, 0):5d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
