"""Loading built C kernels (the CPU's loader): ctypes functions the wrapper calls.

A kernel's function takes its buffers' data pointers, `xnumel`, `rnumel`, its size
symbols (int64, or double for float symbols) and, when it draws random numbers, a
64-bit seed (`codegen/c_kernel.py`). The generated wrapper calls it directly
(``kernel0(buf.data_ptr(), ..., 4096, 1)``): one ctypes call per kernel, no
Python frame of ours in between.
"""

from __future__ import annotations

import ctypes
import re
import time
from pathlib import Path
from typing import Any

_LIBS: dict[str, ctypes.CDLL] = {}


def load_function(path: Path, name: str, n_ptrs: int, sizes: list[bool], seed: bool) -> Any:
    """The function `name` of the shared object `path` with its argument types:
    `n_ptrs` pointers, then `xnumel`, `rnumel`, then one size per entry of `sizes`
    (True: int64, False: double), then the seed."""
    lib = _LIBS.get(str(path))
    if lib is None:
        lib = _LIBS[str(path)] = ctypes.CDLL(str(path))
    fn = getattr(lib, name)
    argtypes: list[Any] = [ctypes.c_void_p] * n_ptrs + [ctypes.c_int64, ctypes.c_int64]
    argtypes += [ctypes.c_int64 if is_int else ctypes.c_double for is_int in sizes]
    if seed:
        argtypes.append(ctypes.c_uint64)
    fn.argtypes = argtypes
    fn.restype = None
    return fn


def loaded_openmp_runtimes() -> list[str]:
    """The OpenMP runtimes mapped into this process (Linux): one, torch's, once a
    kernel is loaded beside it."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    names = {ln.split()[-1] for ln in maps.splitlines() if "gomp" in ln or "libomp" in ln}
    return sorted(n for n in names if n.startswith("/"))


_SIGNATURE = re.compile(r"^void (\w+)\(([^)]*)\) \{$", re.M)


class CKernelError(RuntimeError):
    """A generated C kernel did not build: names the graph, the kernel and its source."""


def signature(source: str) -> tuple[str, int, list[bool], bool]:
    """(function name, pointers, size kinds (True: int64), seed) of a kernel file's
    exported function (its last `void name(...) {` line)."""
    found = _SIGNATURE.findall(source)
    if not found:
        raise ValueError("no kernel function in the C source")
    name, params = found[-1]
    parts = [p.strip() for p in params.split(",")]
    n_ptrs = sum(1 for p in parts if "*" in p)
    rest = [p for p in parts if "*" not in p][2:]  # after xnumel, rnumel
    seed = bool(rest) and rest[-1].startswith("uint64_t")
    sizes = [p.startswith("int64_t") for p in (rest[:-1] if seed else rest)]
    return name, n_ptrs, sizes, seed


def load_c_files(files: dict[str, str], graph: str) -> tuple[dict[str, Any], dict[str, str], float]:
    """Each kernel's function (kernel name -> its C file's source): built side by side
    where no object is stored yet, then loaded. Returns the functions, each kernel's
    source path, and the milliseconds spent building (0 on a warm start)."""
    from ..compile.ccompile import CCompileError, build_all, object_dir, object_key
    from ..compile.xcompile import cpu_count
    from ..modcache.modules import cache_dir

    root = cache_dir().parent
    keys = {n: object_key(src) for n, src in files.items()}
    t0 = time.perf_counter()
    built = build_all([(files[n], keys[n]) for n in files], root, cpu_count())
    ms = (time.perf_counter() - t0) * 1e3
    fns: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for (name, src), so in zip(files.items(), built):
        c_path = object_dir(root) / f"{keys[name]}.c"
        if isinstance(so, BaseException):
            if isinstance(so, CCompileError):
                raise CKernelError(
                    f"stoker's CPU backend: kernel {name} of graph {graph} does not compile "
                    f"(source: {c_path}):\n{so}"
                ) from so
            raise so
        fn_name, n_ptrs, sizes, seed = signature(src)
        fns[name] = load_function(so, fn_name, n_ptrs, sizes, seed)
        paths[name] = str(c_path)
    return fns, paths, ms
