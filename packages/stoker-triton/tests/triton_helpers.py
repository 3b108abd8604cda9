"""Shared test helpers: trace with make_fx, compile, compare with eager on fresh inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from stoker_triton import compile_graph


def device() -> str:
    import os

    return (
        "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    )


def trace(f: Callable[..., Any], *args: Any) -> torch.fx.GraphModule:
    return make_fx(f, decomposition_table=core_aten_decompositions())(*args)


def fresh(args: Sequence[Any]) -> list[Any]:
    """New random values with the same sizes, strides, dtypes (ints stay in range)."""
    out: list[Any] = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
            continue
        base = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
        if a.dtype.is_floating_point:
            # same scale as the example (weights drawn at 0.2 stay at 0.2)
            ad = a.detach().float()
            std = float(ad.std()) if a.numel() > 1 else 1.0
            mean = float(ad.mean()) if a.numel() else 0.0
            std = std if std == std else 1.0
            base.copy_(torch.randn(a.shape, device=a.device) * std + mean)
        elif a.dtype == torch.bool:
            base.copy_(torch.rand(a.shape, device=a.device) > 0.5)
        else:
            hi = int(a.max()) + 1 if a.numel() else 1
            lo = int(a.min()) if a.numel() else 0
            base.copy_(torch.randint(lo, max(hi, lo + 1), a.shape, dtype=a.dtype, device=a.device))
        out.append(base.requires_grad_(a.requires_grad))
    return out


def assert_same(out: Any, ref: Any, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    if isinstance(ref, list | tuple):
        assert isinstance(out, list | tuple) and len(out) == len(ref), (type(out), type(ref))
        for a, b in zip(out, ref):
            assert_same(a, b, atol, rtol)
        return
    if isinstance(ref, torch.Tensor):
        assert isinstance(out, torch.Tensor)
        assert out.shape == ref.shape, (out.shape, ref.shape)
        assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
        torch.testing.assert_close(out, ref.detach(), atol=atol, rtol=rtol, equal_nan=True)
        return
    assert out == ref


def check(
    f: Callable[..., Any],
    *args: Any,
    kernels: int | None = None,
    max_kernels: int | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    fresh_inputs: bool = True,
    **opts: Any,
) -> Any:
    """Trace `f`, compile it, run on fresh inputs, compare with eager `f`."""
    gm = trace(f, *args)
    fn = compile_graph(gm, list(args), **opts)
    run_args = fresh(args) if fresh_inputs else list(args)
    out = fn(*run_args)
    ref = f(*run_args)
    if not isinstance(ref, list | tuple):
        ref = (ref,)
        out = tuple(out) if isinstance(out, list | tuple) else (out,)
    assert_same(list(out), list(ref), atol, rtol)
    report = fn.report  # type: ignore[attr-defined]
    if kernels is not None:
        assert report.n_kernels == kernels, str(report)
    if max_kernels is not None:
        assert report.n_kernels <= max_kernels, str(report)
    return fn


def run_on_fake_gpu(
    tmp_path: Any, script: str, *argv: str, name: str = "script", triton_cache: str = ""
) -> str:
    """Run `script` in a new process with ``TRITON_INTERPRET=0``, fresh stoker and
    Triton caches under `tmp_path` (``triton_cache``: the Triton cache's name there,
    to share it between processes), and return its stdout. The script installs
    `stoker_triton._internal.fakegpu` (a stand-in sm_90 driver) before launching."""
    import os
    import subprocess
    import sys

    path = tmp_path / f"{name}.py"
    path.write_text(script)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "STOKER_CACHE_DIR": str(tmp_path / "stoker"),
        "TRITON_CACHE_DIR": str(tmp_path / (triton_cache or f"triton-{name}-{'-'.join(argv)}")),
        "TRITON_DEFAULT_FP_FUSION": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(path), *argv], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def compile_dynamic(
    f: Callable[..., Any],
    args: Sequence[Any],
    dynamic: Sequence[Any],
    options: dict[str, Any] | None = None,
) -> Any:
    """Trace `f` with symbolic sizes (`dynamic[i]`: `fakeify`'s dims for argument i)
    and compile it (with `options`): returns (the `ShapeContext` holding its guards,
    the compiled fn)."""
    from stoker_shapes import ShapeContext, Source

    ctx = ShapeContext(policy="dynamic")
    fakes = [
        ctx.fakeify(a, Source.arg(i), dynamic=d) for i, (a, d) in enumerate(zip(args, dynamic))
    ]
    with ctx.tracing():
        gm = make_fx(f, decomposition_table=core_aten_decompositions())(*fakes)
    return ctx, compile_graph(gm, fakes, options=options)
