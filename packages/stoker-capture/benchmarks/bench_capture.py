"""First-call compile time and steady per-call overhead: stoker-capture vs torch.

Run: /work/venv/bin/python packages/stoker-capture/benchmarks/bench_capture.py
Numbers are wall-clock on this machine; compare columns of one run only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo

from stoker_capture import aot_module, dynamo_backend


def _models() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 10),
    )
    gpt = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 12 * 12, 10),
    )
    return {
        "mlp": (mlp, torch.randn(32, 64)),
        "gpt_block": (gpt, torch.randn(4, 16, 64)),
        "cnn_bn": (cnn, torch.randn(8, 3, 16, 16)),
    }


def _first_call(make: Callable[[], Callable[..., Any]], x: torch.Tensor) -> float:
    fn = make()
    t0 = time.perf_counter()
    fn(x).sum().backward()
    return time.perf_counter() - t0


def _steady(fn: Callable[..., Any], x: torch.Tensor, n: int = 50) -> float:
    for _ in range(3):
        fn(x).sum().backward()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(x).sum().backward()
    return (time.perf_counter() - t0) / n


def main() -> None:
    torch.set_num_threads(1)  # intra-op threads spin against other processes on a shared box
    print(
        f"{'model':<10} {'stoker 1st':>11} {'aot_eager 1st':>14} {'stoker/step':>12} "
        f"{'eager/step':>11} {'dynamo+stoker 1st':>18}"
    )
    for name, (m, x) in _models().items():
        torch._dynamo.reset()
        first_stoker = _first_call(lambda m=m: aot_module(m), x)
        torch._dynamo.reset()
        first_aot = _first_call(lambda m=m: torch.compile(m, backend="aot_eager"), x)
        torch._dynamo.reset()
        first_dyn = _first_call(lambda m=m: torch.compile(m, backend=dynamo_backend()), x)
        compiled = aot_module(m)
        step_stoker = _steady(compiled, x)
        step_eager = _steady(m, x)
        print(
            f"{name:<10} {first_stoker * 1e3:>9.0f}ms {first_aot * 1e3:>12.0f}ms "
            f"{step_stoker * 1e3:>10.2f}ms {step_eager * 1e3:>9.2f}ms "
            f"{first_dyn * 1e3:>16.0f}ms"
        )


def overhead() -> None:
    """Per-call overhead on a tiny model (guards + wrappers + autograd.Function), forward only."""
    torch.set_num_threads(1)
    m, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    compiled = aot_module(m)
    for label, ctx in (("grad", torch.enable_grad), ("no_grad", torch.no_grad)):
        with ctx():
            for fn in (m, compiled):
                fn(x)
            times = {}
            for key, fn in (("eager", m), ("stoker", compiled)):
                t0 = time.perf_counter()
                for _ in range(2000):
                    fn(x)
                times[key] = (time.perf_counter() - t0) / 2000 * 1e6
        print(
            f"tiny Linear forward ({label}): eager {times['eager']:.1f} us, "
            f"stoker {times['stoker']:.1f} us, overhead {times['stoker'] - times['eager']:.1f} us"
        )


if __name__ == "__main__":
    main()
    overhead()
