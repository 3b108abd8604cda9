"""A convolution forward and backward, NCHW against channels-last, beside the layout the
C backend picks for it (`stoker_triton`'s `conv_layout.wants_channels_last`).

    python -m stoker._internal.bench.benchmarks.conv_layout [--threads 1] [--smoke]
        [--json PATH]

For each shape (a ResNet's layers, the suite's CNNs), oneDNN's convolution and its
backward (input and weight gradients) run on NCHW tensors and on channels-last ones,
alternately, in this process; each figure is the best of 5 rounds. ``ratio`` is
channels-last ÷ NCHW (below 1: channels-last is faster) and ``picks`` what the pass
chooses for that convolution. Where the two disagree by more than the noise, the
pass's bars (`MIN_PLANE`, `MIN_MACS`) are the thing to move, for this CPU.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from . import write_json

# (in channels, out channels, plane side, batch, kernel, stride)
SHAPES = [
    (3, 64, 112, 8, 7, 2),
    (64, 64, 56, 8, 3, 1),
    (128, 128, 28, 8, 3, 1),
    (256, 256, 14, 8, 3, 1),
    (512, 512, 7, 8, 3, 1),
    (64, 64, 16, 8, 3, 1),
    (128, 128, 8, 8, 3, 1),
    (256, 256, 4, 8, 3, 1),
    (3, 32, 32, 16, 3, 1),
    (32, 64, 16, 16, 3, 1),
    (64, 128, 8, 16, 3, 1),
    (8, 8, 16, 16, 3, 1),
]
SMOKE_SHAPES = [(3, 8, 8, 2, 3, 1), (8, 8, 4, 2, 3, 1)]


def _best_ms(fn: Callable[[], Any], reps: int, rounds: int = 5) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps * 1e3)
    return best


def measure(shape: tuple[int, ...], reps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton._internal.conv_layout import wants_channels_last

    cin, cout, side, n, k, stride = shape
    x = torch.randn(n, cin, side, side)
    w = torch.randn(cout, cin, k, k)

    def step(fmt: torch.memory_format) -> Callable[[], Any]:
        xx = x.contiguous(memory_format=fmt).requires_grad_()
        ww = w.contiguous(memory_format=fmt).requires_grad_()

        def run() -> Any:
            y = F.conv2d(xx, ww, stride=stride, padding=k // 2)
            return torch.autograd.grad(y, [xx, ww], torch.ones_like(y))

        return run

    nchw = step(torch.contiguous_format)
    cl = step(torch.channels_last)
    a, b = _best_ms(nchw, reps), _best_ms(cl, reps)
    a, b = min(a, _best_ms(nchw, reps)), min(b, _best_ms(cl, reps))  # alternately, twice
    gm = make_fx(
        lambda x, w: (F.conv2d(x, w, stride=stride, padding=k // 2),), tracing_mode="fake"
    )(x, w)
    conv = next(nd for nd in gm.graph.nodes if nd.target is torch.ops.aten.convolution.default)
    out = conv.meta["val"]
    return {
        "case": f"{cin}->{cout} @{side} n{n} k{k}s{stride}",
        "plane": int(out.shape[2]) * int(out.shape[3]),
        "nchw_ms": round(a, 3),
        "channels_last_ms": round(b, 3),
        "ratio": round(b / a, 3),
        "picks": "channels_last" if wants_channels_last(conv) else "nchw",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        r = measure(shape, 1 if args.smoke else 5)
        rows.append(r)
        print(
            f"{r['case']:28s} plane {r['plane']:6d}  NCHW {r['nchw_ms']:8.2f} ms  "
            f"channels-last {r['channels_last_ms']:8.2f} ms  ratio {r['ratio']:.2f}  "
            f"picks {r['picks']}",
            flush=True,
        )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
