"""Cross-compilation: build every generated kernel for a GPU we do not have.

The interpreter runs kernels with numpy and forgives what the real compiler
does not (a dtype mismatch in `tl.where`, an op with no lowering for
bfloat16, a block that overflows shared memory). With
`STOKER_TRITON_CHECK_TARGETS=cuda:90` (a comma-separated list of
`cuda:<compute capability>`), each kernel the interpreter launches is also
compiled by Triton's own pipeline (TTIR, TTGIR, LLVM IR, PTX, and a cubin
from ptxas) for each target, with every block-size and warp configuration
the GPU autotuner would try. No driver and no GPU are needed; a kernel that
does not compile raises `CrossCompileError` naming its source file.

The signature is derived from the launch arguments the way Triton's own
launcher specializes them: a tensor becomes a typed pointer (16-byte
aligned ones carry `tt.divisibility`), an integer equal to 1 a constant,
other integers `i32`/`i64` (with `tt.divisibility` when a multiple of 16).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ENV = "STOKER_TRITON_CHECK_TARGETS"

_PTR = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "i1",
}


class CrossCompileError(RuntimeError):
    """A generated kernel that Triton cannot compile for a GPU target."""


def targets() -> list[tuple[str, int]]:
    """The targets named by `STOKER_TRITON_CHECK_TARGETS` (empty: no checking)."""
    spec = os.environ.get(ENV, "").strip()
    out: list[tuple[str, int]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        backend, _, cap = part.partition(":")
        if backend != "cuda" or not cap.isdigit():
            raise ValueError(
                f"{ENV}={spec!r}: each target is 'cuda:<compute capability>', e.g. 'cuda:90' "
                "for an H100 or 'cuda:80' for an A100"
            )
        out.append((backend, int(cap)))
    return out


_lock = threading.Lock()
_done: set[tuple[str, str, tuple[str, int], tuple[int, int, int]]] = set()
_pool: Any = None
compiled_count = 0  # cross-compiles run in this process (tests read it)


def _worker_init() -> None:
    # The interpreter patches triton.language in the process that runs it, and
    # the real compiler cannot use the patched functions: compile elsewhere.
    os.environ["TRITON_INTERPRET"] = "0"


def _compile_job(
    path: str,
    sig: dict[str, str],
    consts: dict[str, Any],
    attrs: dict[tuple[int, ...], list[list[Any]]],
    target: tuple[str, int],
    num_warps: int,
) -> str | None:
    """In the worker: compile one kernel; None on success, else the error."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        fn = _native_module(path).kernel
        tgt = GPUTarget(target[0], target[1], 32)
        be = triton.compiler.make_backend(tgt)
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        options = be.parse_options({"num_warps": num_warps})
        triton.compile(src, target=tgt, options=options.__dict__)
    except Exception as e:  # reported to the launching process
        return f"{type(e).__name__}: {e}"
    return None


_modules: dict[str, ModuleType] = {}


def _native_module(path: str) -> ModuleType:
    """The kernel module at `path` imported with real `@triton.jit` functions."""
    mod = _modules.get(path)
    if mod is None:
        name = f"stoker_triton_native_{Path(path).stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _modules[path] = mod
    return mod


def _executor() -> Any:
    global _pool
    with _lock:
        if _pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            _pool = ProcessPoolExecutor(
                max_workers=max(1, min(4, (os.cpu_count() or 1))),
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
            )
            import atexit

            atexit.register(_pool.shutdown, wait=True, cancel_futures=True)
        return _pool


def _arg_names(path: str) -> list[str]:
    """The kernel's parameter names, read from its source (`def kernel(...)`)."""
    text = Path(path).read_text()
    head = text[text.index("def kernel(") + len("def kernel(") :]
    params = head[: head.index("):")]
    return [p.split(":")[0].strip() for p in params.split(",") if p.strip()]


def signature(
    arg_names: Sequence[str], args: Sequence[Any], constexprs: dict[str, int]
) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], list[list[Any]]]]:
    """Triton's (signature, constants, attrs) for launching with `args` positionally
    and `constexprs` by keyword."""
    sig: dict[str, str] = {}
    consts: dict[str, Any] = dict(constexprs)
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (name, a) in enumerate(zip(arg_names, args)):
        if isinstance(a, torch.Tensor):
            if a.dtype not in _PTR:
                raise CrossCompileError(f"argument {name}: no Triton pointer type for {a.dtype}")
            sig[name] = "*" + _PTR[a.dtype]
            if a.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            if a == 1:
                sig[name] = "constexpr"
                consts[name] = 1
                continue
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            raise CrossCompileError(f"argument {name}: cannot type {type(a).__name__} for Triton")
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, consts, attrs


def check(
    path: str,
    args: Sequence[Any],
    configs: Sequence[tuple[int, int, int]],
) -> int:
    """Compile the kernel in `path` for each target and config (XBLOCK, RBLOCK,
    num_warps) with these launch arguments, in worker processes; returns how
    many compiles ran. Raises `CrossCompileError` for the first that fails."""
    global compiled_count
    tgts = targets()
    if not tgts:
        return 0
    names = _arg_names(path)
    jobs = []
    for tgt in tgts:
        for xb, rb, w in configs:
            sig, consts, attrs = signature(names, args, {"XBLOCK": xb, "RBLOCK": rb})
            key = (path, repr(sorted(sig.items())) + repr(sorted(attrs.items())), tgt, (xb, rb, w))
            with _lock:
                if key in _done:
                    continue
            fut = _executor().submit(_compile_job, path, sig, consts, attrs, tgt, w)
            jobs.append((key, sig, fut))
    for key, sig, fut in jobs:
        err = fut.result()
        if err is not None:
            _, _, (backend, cap), (xb, rb, w) = key
            raise CrossCompileError(
                f"stoker-triton: kernel {path} does not compile for {backend}:{cap} "
                f"(XBLOCK={xb}, RBLOCK={rb}, num_warps={w}, signature {sig}): {err}"
            )
        with _lock:
            _done.add(key)
            compiled_count += 1
    return len(jobs)
