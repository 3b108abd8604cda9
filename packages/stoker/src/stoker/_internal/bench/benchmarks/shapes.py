"""Guard-check cost: µs per call of a GuardSet over 10 tensor inputs, beside a plain call.

    python -m stoker._internal.bench.benchmarks.shapes [--json PATH]

Measured side by side in one run (the machine is noisy; compare the ratio).
"""

from __future__ import annotations

import argparse
import functools
import json
import timeit
from typing import Any

import torch

from stoker_shapes import Dim, GuardSet, ShapeContext, Source


def guard_set(dynamic: bool) -> tuple[GuardSet, tuple[torch.Tensor, ...]]:
    args = tuple(torch.randn(8, 16) for _ in range(10))
    ctx = ShapeContext()
    b = Dim("batch")
    fakes = [
        ctx.fakeify(a, Source.arg(i), {0: b} if dynamic else False) for i, a in enumerate(args)
    ]
    with ctx.tracing():
        sum(f.sum() for f in fakes)
    return ctx.produce_guards(), args


def per_call_us(fn: Any, number: int = 100_000, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def plain(args: Any, kwargs: Any, self_: Any = None) -> bool:
    return True


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=None)
    p.add_argument("--number", type=int, default=100_000, help="calls per timing")
    p.add_argument("--repeat", type=int, default=5, help="timings; the least is kept")
    ns = p.parse_args(argv)
    timed = functools.partial(per_call_us, number=ns.number, repeat=ns.repeat)
    results: dict[str, float] = {}
    for label, dyn in (("static", False), ("dynamic", True)):
        gs, args = guard_set(dyn)
        assert gs.check(args, {})
        results[f"guard_check_10_tensors_{label}_us"] = timed(
            lambda gs=gs, args=args: gs.check(args, {})
        )
    args = tuple(torch.randn(8, 16) for _ in range(10))
    results["plain_python_call_us"] = timed(lambda: plain(args, {}))
    print(f"stoker-shapes: guard check cost (10 tensor inputs), min of {ns.repeat} runs")
    print(f"{'what':<40}{'µs/call':>10}")
    for k, v in results.items():
        print(f"{k:<40}{v:>10.3f}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
