"""`Launcher`: what the generated wrapper calls for each kernel launch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from stoker_shapes import timing

from ..modcache.modules import interpreting
from . import warmload
from .autotune import _Tuned
from .fastlaunch import FastPath, fast_path_for


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def outer_tile(xnumel: int, rnumel: int, persistent: bool) -> tuple[int, int, int]:
    """(XBLOCK, RBLOCK, num_warps) of an outer reduction: XBLOCK over the
    contiguous kept dim so loads coalesce, RBLOCK rows per step (Inductor's
    `outer_config_opt` for static shapes, then its scaling to the sizes at
    hand: a tile of at most `xnumel x rnumel`, grown back along x, a warp
    per 128 elements, 2 to 8). A persistent kernel's RBLOCK is its whole row."""
    xp, rp = next_pow2(xnumel), next_pow2(rnumel)
    if xnumel <= 1024:
        xb, rb = next_pow2(max(min(xnumel // 128, 8), 2)), 64
    elif xnumel // 4096 <= 8:
        xb, rb = 16, 32
    else:
        xb = max(min(256, next_pow2(xnumel // 4096)), 64)
        rb = 512 // xb
    target = xb * rb
    if persistent:
        rb = rp
        target = max(target, min(rb * 16, 8192))
        xb = max(1, min(xb, target // rb))
    xb, rb = min(xb, xp), min(rb, rp)
    while xb < xp and xb * rb < target:
        xb *= 2
    return (xb, rb, min(8, max(2, xb * rb // 128)))


class Launcher:
    """Launches one generated kernel with XBLOCK/RBLOCK/num_warps for the sizes
    at hand (cached per size): one configuration chosen by `heuristic`, or, with
    ``autotune`` (``mode="max-autotune"``), the fastest of `candidates` on a GPU,
    remembered on disk.

    ``fn``: the kernel's `JITFunction`, or a function that imports the kernel
    module and returns it (``lazy``; what the loaders pass, cold and warm: the
    module is imported only when a launch needs Triton's binder; `warmload`
    serves the others)."""

    def __init__(
        self,
        fn: Any,
        sha: str,
        is_reduction: bool,
        persistent: bool,
        has_atomics: bool,
        autotune: bool = False,
        lazy: bool = False,
    ) -> None:
        self._fn: Any = None if lazy else fn
        self._load_fn: Callable[[], Any] | None = fn if lazy else None
        self.sha = sha
        self.is_reduction = is_reduction
        self.persistent = persistent
        self.has_atomics = has_atomics
        self.autotune = autotune
        self.outer = False  # an outer reduction (set by the loader from the kernel module)
        self.interpret = interpreting()
        self.configs: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.path: str | None = None  # the kernel module's file (set by the loader)
        self.check_gpu = False  # cross-compile for STOKER_TRITON_CHECK_TARGETS (set by the loader)
        # its compiles queued in the workers (`runtime.precompile`): the first launch waits
        self.pending: list[Future[str | None]] = []
        # compiled binaries launched without Triton's binder (none under the interpreter)
        self.fast: FastPath | None = None if self.interpret else fast_path_for(self._fn, lazy)
        # binaries an earlier process launched, by `warmload.spec_text` (read at the first launch)
        self.binaries: dict[str, Any] | None = None
        # the steady launch (key, kept binary, launch in one function), once a binary is kept
        self.lean: Callable[..., bool | None] | None = None
        # what the generated wrapper calls per launch: `go(target, *args)` with the launch
        # target its graph call read once (`launch_target`); the lean launch once there is one
        self.go: Callable[..., bool | None] = self._go

    @property
    def fn(self) -> Any:
        """The kernel's `JITFunction` (a lazy launcher imports its module now)."""
        if self._fn is None and self._load_fn is not None:
            self._fn, self._load_fn = self._load_fn(), None
            if self.fast is not None:
                self.fast.fn = self._fn
        return self._fn

    def heuristic(self, xnumel: int, rnumel: int) -> tuple[int, int, int]:
        """The one GPU configuration used without autotuning (Inductor's rules,
        docs/triton.md "Reduction tiling"): 1024-element pointwise blocks; an
        outer reduction's tile spans the contiguous kept dim (`outer_tile`); a
        persistent reduction's whole row, with rows per program up to 2048
        elements and a warp per 128 elements (4 to 8); looped inner reductions
        in 2048-wide chunks."""
        xp = next_pow2(xnumel)
        if not self.is_reduction:
            return (min(xp, 1024), 1, 4)
        if self.outer:
            return outer_tile(xnumel, rnumel, self.persistent)
        if self.persistent:
            rb = next_pow2(rnumel)
            xb = max(1, min(xp, 2048 // rb))
            return (xb, rb, min(8, max(4, xb * rb // 128)))
        rb = min(2048, max(16, next_pow2(rnumel)))
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
            # (a looped row shorter than 1024 is read in one block: an outer reduction
            # over a few rows would otherwise run thousands of 8-row programs)
            rb = next_pow2(rnumel) if self.persistent else min(1024, next_pow2(rnumel))
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
        elif self.outer:
            rp = next_pow2(rnumel)
            out = [
                (min(xp, x), min(rp, r), w)
                for x, r, w in ((64, 8, 4), (16, 32, 4), (32, 16, 4), (64, 4, 8), (128, 8, 8))
            ]
        else:
            out = [
                (min(xp, x), r, w)
                for x, r, w in ((1, 2048, 8), (1, 1024, 4), (4, 512, 4), (8, 256, 4))
            ]
        return list(dict.fromkeys([first, *out]))

    def __call__(self, *args: Any) -> None:
        """Launch with `args` (pointers..., xnumel, rnumel, sizes..., [seed]), the launch
        target read now (a caller other than a generated wrapper)."""
        self.go(self.fast.target() if self.fast is not None else None, *args)

    def _go(self, target: Any, *args: Any) -> None:
        """`go` until a lean launch exists: the target is read again where needed."""
        self._launch(*args)

    def _launch(self, *args: Any) -> None:
        """A launch the lean path does not serve: a kept binary through `FastPath`, a warm
        binary, or Triton's binder (xnumel/rnumel are found by position)."""
        fast, key, launch_args = self.fast, None, args
        if fast is not None:
            got = fast.key(args, self.n_ptrs)
            if got is not None:
                key, launch_args = got
                entry = fast.entries.get(key)
                if entry is not None:
                    fast.launch(entry, key[0], launch_args)
                    return
        xnumel, rnumel = self._numels(args)
        if xnumel == 0 or (rnumel == 0 and not self.is_reduction):
            return
        cfg = self.configs.get((xnumel, rnumel))
        first = 0  # the mark of a first launch for these sizes on a GPU (Triton compiles it)
        if cfg is None:
            if self.pending:
                t0 = timing.start()
                self._await_precompile()
                timing.done("kernel compile", t0, f"wait for compile workers: {self._name}")
            first = 0 if self.interpret else timing.start()
            if self.check_gpu and self.path is not None:
                from ..compile.xcompile import check

                check(self.path, args, self.candidates(xnumel, rnumel, native=True))
            cfg = self._choose(args, xnumel, rnumel)
            self.configs[(xnumel, rnumel)] = cfg
        xb, rb, w = cfg
        grid = cdiv(xnumel, xb)
        spec = None
        if key is not None and fast is not None:
            spec = warmload.spec_text(args, cfg)
            if spec is not None and self._warm(spec, key, args, launch_args, cfg, grid):
                self._go_lean(len(args))
                return
        try:
            kernel = self.fn[(grid,)](*args, XBLOCK=xb, RBLOCK=rb, num_warps=w)
            if first:
                timing.done("kernel compile", first, f"first launch (compile): {self._name}")
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
        if key is not None and fast is not None:
            if fast.keep(key, args, self.n_ptrs, kernel, grid, xb, rb):
                self._go_lean(len(args))
                if spec is not None:
                    warmload.record(self.sha, spec, cfg, kernel)

    def _go_lean(self, n_args: int) -> None:
        """From now on, launches with a kept key take `FastPath.lean`'s one function."""
        if self.lean is None and self.fast is not None:
            self.lean = self.go = self.fast.lean(n_args, self.n_ptrs, self._launch)

    def _warm(
        self,
        spec: str,
        key: tuple[Any, ...],
        args: tuple[Any, ...],
        launch_args: tuple[Any, ...],
        cfg: tuple[int, int, int],
        grid: int,
    ) -> bool:
        """Launch the binary an earlier process recorded for `spec` (False: none usable)."""
        fast = self.fast
        if self.binaries is None:
            self.binaries = warmload.read(self.sha)
        rec = self.binaries.get(spec)
        if rec is None or fast is None:
            return False
        kernel = warmload.compiled_kernel(rec, cfg)
        if kernel is None or not fast.keep(key, args, self.n_ptrs, kernel, grid, cfg[0], cfg[1]):
            return False
        fast.launch(fast.entries[key], key[0], launch_args)
        return True

    n_ptrs = 0

    @property
    def _name(self) -> str:
        """The kernel's module file name, for timing marks."""
        return (self.path or self.sha).rsplit("/", 1)[-1]

    def _await_precompile(self) -> None:
        """Wait for this kernel's compiles in the workers, so that its launch loads
        the binary instead of compiling it again (a failed one: the launch compiles)."""
        pending, self.pending = self.pending, []
        for fut in pending:
            err = fut.result()
            if err is not None:
                logging.getLogger("stoker.kernels").debug(
                    "precompile of %s failed (the launch compiles it): %s", self.path, err
                )

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
