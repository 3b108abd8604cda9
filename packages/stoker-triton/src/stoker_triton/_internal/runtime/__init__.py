"""Runtime: kernel modules on disk, launchers with block-size choice and a
small autotuner, and helpers the generated wrapper calls.

Cache layout under `$STOKER_CACHE_DIR` (default `~/.cache/stoker`):
`triton/kernels/<sha>.py` (kernel source, keyed by its content),
`triton/wrappers/<sha>.py` (wrapper source), `triton/autotune/<sha>.json`
(best config per size for one kernel). Every file is a `stoker_shapes.DiskCache`
entry: written atomically, checked on read (a broken one is a miss, rewritten).
Triton keeps the compiled binaries in its own cache, keyed by the same source
and the launch options.
"""

from __future__ import annotations

import hashlib
import json
import linecache
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from stoker_shapes import DiskCache
from stoker_shapes._internal.diskcache import cache_root

# Bump when the generated modules' layout changes: older entries become misses.
MODULE_FORMAT = "1"


def cache_dir() -> Path:
    return cache_root() / "triton"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def module_store(kind: str) -> DiskCache:
    """The cache of generated modules of one kind ("kernels", "wrappers")."""
    return DiskCache(cache_dir, kind, MODULE_FORMAT, ".py")


def load_module(kind: str, source: str) -> tuple[ModuleType, Path]:
    """Store `source` in the cache (keyed by content) and import it."""
    sha = hashlib.sha256(source.encode()).hexdigest()[:24]
    name = f"stoker_triton_{kind}_{sha}"
    mod = sys.modules.get(name)
    if mod is not None and mod.__file__ is not None:
        return mod, Path(mod.__file__)
    store = module_store(kind)
    found = store.get_entry(sha)
    if found is not None and found[1] == source.encode():
        path = found[0]
    else:
        path = store.put(sha, source.encode())
    return exec_module(name, path, source), path


def exec_module(name: str, path: Path | str, source: str) -> ModuleType:
    """Import `source` as module `name` whose file is `path` (a cache entry).

    The source runs from memory (no `__pycache__`, no second read of the file)
    and is registered with `linecache`, where `inspect.getsource` (hence
    `@triton.jit`) reads it: the code, its line numbers and what Triton
    hashes are the validated source's, whatever happens to the file later."""
    mod = ModuleType(name)
    mod.__file__ = str(path)
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    code = compile(source, str(path), "exec")
    sys.modules[name] = mod
    try:
        exec(code, mod.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class _Tuned:
    """Autotune results on disk, one entry per kernel: {"x,r": [XBLOCK, RBLOCK, warps]}."""

    lock = threading.Lock()
    data: ClassVar[dict[str, dict[str, list[int]]]] = {}

    @staticmethod
    def _store() -> DiskCache:
        import triton

        return DiskCache(cache_dir, "autotune", f"1-triton{triton.__version__}", ".json")

    @classmethod
    def _load(cls, sha: str) -> dict[str, list[int]]:
        if sha not in cls.data:
            body = cls._store().get(sha)
            try:
                loaded = json.loads(body) if body is not None else {}
            except ValueError:
                loaded = {}
            cls.data[sha] = loaded if isinstance(loaded, dict) else {}
        return cls.data[sha]

    @classmethod
    def get(cls, sha: str, key: str) -> list[int] | None:
        with cls.lock:
            return cls._load(sha).get(key)

    @classmethod
    def put(cls, sha: str, key: str, cfg: list[int]) -> None:
        with cls.lock:
            cls._load(sha)[key] = cfg
            cls._store().put(sha, json.dumps(cls.data[sha]).encode())


class Launcher:
    """Launches one generated kernel with XBLOCK/RBLOCK/num_warps for the sizes
    at hand (cached per size): one configuration chosen by `heuristic`, or, with
    ``autotune`` (``mode="max-autotune"``), the fastest of `candidates` on a GPU,
    remembered on disk."""

    def __init__(
        self,
        fn: Any,
        sha: str,
        is_reduction: bool,
        persistent: bool,
        has_atomics: bool,
        autotune: bool = False,
    ) -> None:
        self.fn = fn
        self.sha = sha
        self.is_reduction = is_reduction
        self.persistent = persistent
        self.has_atomics = has_atomics
        self.autotune = autotune
        self.interpret = interpreting()
        self.configs: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.path: str | None = None  # the kernel module's file (set by the loader)
        self.check_gpu = False  # cross-compile for STOKER_TRITON_CHECK_TARGETS (set by the loader)

    def heuristic(self, xnumel: int, rnumel: int) -> tuple[int, int, int]:
        """The one GPU configuration used without autotuning (Inductor's defaults in
        spirit): 1024-element pointwise blocks; a persistent reduction's whole row,
        with rows per program up to 2048 elements; looped reductions in 2048-wide chunks."""
        xp = next_pow2(xnumel)
        if not self.is_reduction:
            return (min(xp, 1024), 1, 4)
        rb = next_pow2(rnumel) if self.persistent else min(2048, max(16, next_pow2(rnumel)))
        xb = max(1, min(xp, 2048 // rb))
        return (xb, rb, 8 if xb * rb >= 2048 else 4)

    def candidates(
        self, xnumel: int, rnumel: int, native: bool | None = None
    ) -> list[tuple[int, int, int]]:
        """The configurations a launch may use: the interpreter's one choice, the
        heuristic's one, or (autotuning) every one the tuner times, the heuristic's
        first (`native=True` asks for the GPU's even when interpreting)."""
        xp = next_pow2(xnumel)
        if self.interpret if native is None else not native:
            # the interpreter pays per program: big blocks, small grids
            if not self.is_reduction:
                return [(min(xp, 4096), 1, 4)]
            rb = next_pow2(rnumel) if self.persistent else 1024
            return [(max(1, min(xp, 8192 // rb)), rb, 4)]
        first = self.heuristic(xnumel, rnumel)
        if not self.autotune or self.has_atomics:
            return [first]
        if not self.is_reduction:
            out = [(min(xp, b), 1, w) for b, w in ((1024, 4), (2048, 8), (512, 4), (4096, 8))]
        elif self.persistent:
            rb = next_pow2(rnumel)
            out = []
            for elems in (1024, 2048, 4096, 8192):
                xb = max(1, min(xp, elems // rb))
                out.append((xb, rb, 4 if rb * xb <= 2048 else 8))
        else:
            out = [
                (min(xp, x), r, w)
                for x, r, w in ((1, 2048, 8), (1, 1024, 4), (4, 512, 4), (8, 256, 4))
            ]
        return list(dict.fromkeys([first, *out]))

    def __call__(self, *args: Any) -> None:
        # args: pointers..., xnumel, rnumel, sizes..., [seed]; xnumel/rnumel are found by position
        xnumel, rnumel = self._numels(args)
        if xnumel == 0 or (rnumel == 0 and not self.is_reduction):
            return
        cfg = self.configs.get((xnumel, rnumel))
        if cfg is None:
            if self.check_gpu and self.path is not None:
                from .xcompile import check

                check(self.path, args, self.candidates(xnumel, rnumel, native=True))
            cfg = self._choose(args, xnumel, rnumel)
            self.configs[(xnumel, rnumel)] = cfg
        xb, rb, w = cfg
        try:
            self.fn[(cdiv(xnumel, xb),)](*args, XBLOCK=xb, RBLOCK=rb, num_warps=w)
        except Exception as e:
            if self.interpret and "only 0-dimensional arrays can be converted" in str(e):
                import numpy
                import triton

                raise RuntimeError(
                    f"Triton {triton.__version__}'s interpreter cannot loop over a kernel "
                    f"argument with NumPy {numpy.__version__} (it calls int() on a 1-element "
                    "array, which NumPy 2.4 refuses). Install numpy<2.4, or triton>=3.8 "
                    f"(kernel: {self.path})."
                ) from e
            raise

    n_ptrs = 0

    def _numels(self, args: tuple[Any, ...]) -> tuple[int, int]:
        return int(args[self.n_ptrs]), int(args[self.n_ptrs + 1])

    def _choose(self, args: tuple[Any, ...], xnumel: int, rnumel: int) -> tuple[int, int, int]:
        cands = self.candidates(xnumel, rnumel)
        if len(cands) == 1 or self.interpret:
            return cands[0]
        key = f"{xnumel},{rnumel}"
        hit = _Tuned.get(self.sha, key)
        if hit is not None:
            return (hit[0], hit[1], hit[2])
        from triton.testing import do_bench

        best, best_t = cands[0], float("inf")
        for xb, rb, w in cands:
            try:
                t = do_bench(
                    lambda xb=xb, rb=rb, w=w: self.fn[(cdiv(xnumel, xb),)](
                        *args, XBLOCK=xb, RBLOCK=rb, num_warps=w
                    ),
                    warmup=3,
                    rep=10,
                )
            except Exception:  # a config that does not compile (too many registers) is skipped
                continue
            if t < best_t:
                best, best_t = (xb, rb, w), t
        _Tuned.put(self.sha, key, list(best))
        return best


def check_layout(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """The generated kernels index inputs with the strides seen at compile
    time; an input with other strides is copied into that layout (correct,
    slower) rather than read wrongly."""
    ts = t.stride()
    if ts == stride:
        return t
    for n, a, b in zip(size, ts, stride):
        if n > 1 and a != b:
            if any(s == 0 and m > 1 for s, m in zip(stride, size)):
                raise ValueError(
                    f"stoker-triton: an input was compiled as an expanded view (strides {stride}) "
                    f"and now arrives with strides {ts}; the kernels cannot read it. "
                    "Recompile for this layout (or pass a contiguous tensor to both)."
                )
            out = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
            out.copy_(t)
            return out
    return t


def ensure_layout(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """An extern result in the layout later kernels were generated for."""
    return check_layout(t, size, stride)


def new_seed() -> int:
    """A seed per call from torch's CPU generator: reproducible under torch.manual_seed.

    Always odd and above 1: Triton specializes an integer argument equal to 1 or
    divisible by 16, so seeds of one kind keep every launch on one compiled binary
    (the one the precompile built with `PRECOMPILE_SEED`)."""
    return 2 * int(torch.randint(1, 2**30 - 1, (), dtype=torch.int64).item()) + 1


PRECOMPILE_SEED = 12345  # an odd seed: the specialization every `new_seed()` has


def native_target(device: torch.device) -> tuple[str, Any, int] | None:
    """The Triton target that kernels for `device` compile for natively, as
    (backend, arch, warp size); None under the interpreter or off the GPU."""
    if device.type != "cuda" or interpreting():
        return None
    from triton.runtime import driver

    t = driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


def precompile(
    make_jobs: Callable[[], list[tuple[Launcher, list[Any], int, int]]], device: torch.device
) -> int:
    """Compile kernels ahead of their first launch, in parallel worker processes (GPU only).

    `make_jobs()`: (launcher, example arguments, xnumel, rnumel) with the static
    sizes the wrapper will pass. Each configuration the launch will use (one, or
    the autotuner's under max-autotune) is compiled for this GPU through
    Triton's own binder, so the launch computes the same key and loads the
    binary from Triton's disk cache without compiling (`xcompile.precompile`).
    Returns how many compiles succeeded; a failure only costs the head start
    (the launch compiles, and reports errors, as usual)."""
    target = native_target(device)
    if target is None:
        return 0
    jobs = make_jobs()
    if len(jobs) < 2:  # one kernel compiles as fast at its launch as in a worker
        return 0
    import logging

    log = logging.getLogger("stoker.kernels")
    work = [
        (lau.path, args, lau.candidates(x, r, native=True)) for lau, args, x, r in jobs if lau.path
    ]
    try:
        from .xcompile import precompile as in_workers

        ok, errors = in_workers(work, target)
    except Exception as e:  # no worker processes here: the launches compile
        log.debug("precompile skipped: %s", e)
        return 0
    for err in errors:
        log.debug("precompile failed: %s", err)
    return ok
