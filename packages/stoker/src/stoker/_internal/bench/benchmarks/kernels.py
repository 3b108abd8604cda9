"""Benchmark stoker-triton kernels on a GPU: achieved GB/s against a measured
device-to-device copy, and cold compile times.

    python -m stoker._internal.bench.benchmarks.kernels            # on a machine with CUDA
    python -m stoker._internal.bench.benchmarks.kernels --quick    # smaller sizes
    python -m stoker._internal.bench.benchmarks.kernels --smoke    # tiny sizes on the CPU (interpreter): checks
                                            # the script runs; its numbers mean nothing
    python -m stoker._internal.bench.benchmarks.kernels --launch-overhead   # CPU time per launch and per graph
                                            # call; on the CPU with a stand-in driver
    python -m stoker._internal.bench.benchmarks.kernels --workers  # compile workers' start and a cold batch compile
                                            # (benchmarks/workers.py), on the CPU

On a machine without CUDA (and no --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes on the CPU under Triton's interpreter (checks the script, not speed)",
    )
    ap.add_argument(
        "--inductor",
        action="store_true",
        help="also time torch.compile (Inductor) on the same graphs",
    )
    ap.add_argument(
        "--launch-overhead",
        action="store_true",
        help="CPU time per kernel launch (lean path vs JITFunction.run) and fixed overhead "
        "per compiled graph call; without CUDA, Triton's real launch path on a stub driver",
    )
    ap.add_argument(
        "--workers",
        action="store_true",
        help="the compile workers' start and a cold sm_90 batch compile through them, then "
        "a cold start to the first launches (benchmarks/workers.py; on the CPU)",
    )
    ap.add_argument("--json", default="", help="also write the table here (rewritten per case)")
    ap.add_argument(
        "--gpu-lock",
        default="",
        help="hold this lock file while timing (tools/gpu_lap.py: other processes compile "
        "beside this one, none measures at the same time)",
    )
    args = ap.parse_args(argv)
    if args.workers:
        from . import workers

        workers.main([])
        return workers.main(["--cold-start"])
    if args.launch_overhead:
        from .launch import launch_overhead

        return launch_overhead()

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if args.smoke:
        pass
    elif not torch.cuda.is_available():
        print("bench_triton: needs a CUDA GPU (none found); nothing to measure.")
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1" and not args.smoke:
        print("bench_triton: TRITON_INTERPRET=1 is set; unset it to measure native kernels.")
        return 0
    # cold compiles: fresh caches for stoker and for Triton's binaries
    os.environ["STOKER_CACHE_DIR"] = tempfile.mkdtemp(prefix="stoker-bench-")
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-bench-"))

    import torch.nn.functional as F
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton import compile_graph

    dev = "cpu" if args.smoke else "cuda"
    do_bench = _cpu_bench if args.smoke else _cuda_bench()
    sync = (lambda: None) if args.smoke else torch.cuda.synchronize
    name = "CPU (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    rows, cols = (64, 128) if args.smoke else (4096, 4096) if args.quick else (16384, 8192)
    n = rows * cols
    x = torch.randn(rows, cols, device=dev)
    w = torch.randn(cols, device=dev)
    b = torch.randn(cols, device=dev)
    y = torch.empty_like(x)
    g = torch.randn(rows, cols, device=dev)  # an incoming gradient
    sm = torch.softmax(x, -1)
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, correction=0, keepdim=True) + 1e-5)
    # a row longer than any persistent kernel holds (online softmax), as many elements / 8
    lrows, lcols = (2, 256) if args.smoke else (16, 65536) if args.quick else (64, 262144)
    xl = torch.randn(lrows, lcols, device=dev)
    timed: Callable[[], Any] = contextlib.nullcontext
    if args.gpu_lock:
        from ..gpulock import GpuLock

        timed = GpuLock(args.gpu_lock)
    doc: dict[str, Any] = {"device": "", "copy_gbs": None, "rows": []}

    def save() -> None:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)

    with timed():
        copy_ms = do_bench(lambda: y.copy_(x))
    copy_gbs = 2 * x.numel() * 4 / copy_ms / 1e6
    print(f"device: {name}  torch {torch.__version__}")
    print(f"device-to-device copy of {x.numel() * 4 / 2**20:.0f} MiB: {copy_gbs:.0f} GB/s\n")
    doc.update({"device": name, "copy_gbs": copy_gbs, "shape": [rows, cols]})
    save()

    cases: list[tuple[str, Callable[..., Any], tuple[Any, ...], int]] = [
        # name, function, inputs, bytes moved by an ideal kernel
        ("pointwise x*2+1 -> sin", lambda x: (x * 2 + 1).sin(), (x,), 2 * n * 4),
        ("pointwise a+b broadcast", lambda x, b: x + b, (x, b), 2 * n * 4),
        ("reduction sum(-1)", lambda x: x.sum(-1), (x,), n * 4),
        ("reduction sum(0)", lambda x: x.sum(0), (x,), n * 4),
        ("softmax(-1)", lambda x: torch.softmax(x, -1), (x,), 2 * n * 4),
        ("layernorm", lambda x, w, b: F.layer_norm(x, (cols,), w, b), (x, w, b), 2 * n * 4),
        (
            "layernorm+gelu",
            lambda x, w, b: F.gelu(F.layer_norm(x, (cols,), w, b)),
            (x, w, b),
            2 * n * 4,
        ),
        ("log_softmax(-1)", lambda x: torch.log_softmax(x, -1), (x,), 2 * n * 4),
        (f"softmax {lrows}x{lcols}", lambda x: torch.softmax(x, -1), (xl,), 2 * xl.numel() * 4),
        ("rmsnorm", _rms_norm, (x, w), 2 * n * 4),
        (
            "softmax backward",
            lambda g, y: torch.ops.aten._softmax_backward_data(g, y, -1, y.dtype),
            (g, sm),
            3 * n * 4,
        ),
        (
            # dx, dw and db: reads g and x, writes dx (dw, db: cols each)
            "layernorm backward",
            lambda g, x, m, r, w, b: torch.ops.aten.native_layer_norm_backward(
                g, x, [cols], m, r, w, b, [True, True, True]
            ),
            (g, x, mean, rstd, w, b),
            3 * n * 4,
        ),
        ("rmsnorm backward", _rms_norm_backward, (g, x, w), 3 * n * 4),
    ]
    print(
        f"{'kernel':28s} {'kernels':>7s} {'ms':>8s} {'GB/s':>8s} {'% copy':>7s} {'cold compile s':>15s}",
        end="",
    )
    print(f" {'inductor GB/s':>14s}" if args.inductor else "")
    for name, f, inputs, nbytes in cases:
        gm = make_fx(f, decomposition_table=core_aten_decompositions())(*inputs)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        fn = compile_graph(gm, list(inputs))
        fn(*inputs)  # first call: Triton compiles and autotunes
        sync()  # type: ignore[no-untyped-call]
        cold = time.perf_counter() - t0
        torch.testing.assert_close(fn(*inputs), gm(*inputs), atol=1e-3, rtol=1e-3)
        with timed():
            ms = do_bench(lambda fn=fn, inputs=inputs: fn(*inputs))  # type: ignore[misc]
        gbs = nbytes / ms / 1e6
        line = f"{name:28s} {fn.report.n_kernels:7d} {ms:8.3f} {gbs:8.0f} {100 * gbs / copy_gbs:6.0f}% {cold:15.2f}"  # type: ignore[attr-defined]
        row: dict[str, Any] = {
            "case": name,
            "kernels": fn.report.n_kernels,  # type: ignore[attr-defined]
            "kernel_names": [k.fn_name for k in fn.report.kernels],  # type: ignore[attr-defined]
            "ms": ms,
            "gbs": gbs,
            "pct_copy": 100 * gbs / copy_gbs,
            "cold_s": cold,
            "ideal_bytes": nbytes,
        }
        if args.inductor and not args.smoke:
            try:
                cf = torch.compile(f)
                cf(*inputs)
                with timed():
                    ims = do_bench(lambda cf=cf, inputs=inputs: cf(*inputs))  # type: ignore[misc]
                line += f" {nbytes / ims / 1e6:14.0f}"
                row.update({"inductor_ms": ims, "inductor_gbs": nbytes / ims / 1e6})
            except Exception as e:  # Inductor unavailable here: say why
                line += f" {'n/a: ' + type(e).__name__:>14s}"
                row["inductor_error"] = f"{type(e).__name__}: {e}"
        print(line)
        doc["rows"].append(row)
        save()
    return 0


def _rms_norm(x: Any, w: Any) -> Any:
    """RMSNorm as models write it (Llama); F.rms_norm traces an in-place add that
    stoker-triton runs through aten."""
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rms_norm_backward(g: Any, x: Any, w: Any) -> Any:
    """dx of RMSNorm (the weight's gradient aside) for the incoming gradient g."""
    import torch

    xr = x.detach().requires_grad_()
    return torch.autograd.grad(_rms_norm(xr, w), xr, g)[0]


def _cuda_bench() -> Callable[[Callable[[], Any]], float]:
    from triton.testing import do_bench

    return do_bench  # type: ignore[no-any-return]


def _cpu_bench(fn: Callable[[], Any]) -> float:
    """Milliseconds per call, best of 3 (smoke mode only)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


if __name__ == "__main__":
    sys.exit(main())
