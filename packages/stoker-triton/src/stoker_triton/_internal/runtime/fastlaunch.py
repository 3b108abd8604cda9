"""The lean launch path: after a kernel's first launch for a specialization,
call its compiled binary's launcher directly, with no Python argument binding.

`JITFunction.run` binds the arguments, specializes each one, hashes a cache
key, looks the binary up and checks globals on every call (about 50 µs on an
H100 host). Here the first launch for a key goes through it as before and
returns the `CompiledKernel`; its launcher (`kernel.run`), `kernel.function`
and `kernel.packed_metadata` are kept per (device, xnumel, rnumel,
`spec_key(args)`), with the grid and block sizes, and later launches with the
same key call

    kernel.run(grid, 1, 1, stream, function, packed_metadata,
               None, enter_hook, exit_hook, *args, XBLOCK, RBLOCK)

which is what `JITFunction.run` itself ends in (`*bound_args.values()` are the
positional arguments then the constexprs, in parameter order), with one
difference: no launch metadata (`None`), which only a launch hook reads, and
the lean path runs only while no hook is set (Triton 3.6 keeps unset hooks as
None, 3.9 as empty `HookChain`s: both are passed on as they are).

`spec_key` holds everything Triton specializes a CUDA binary on, or more:
a tensor's dtype and whether its address is 16-byte aligned; an integer's
range (i32, i64, u64), whether it equals 1 and whether it is a multiple of
16; bools and floats by type. The block sizes and warps follow from
(xnumel, rnumel), also in the key. A new key goes back through
`JITFunction.run` once. Not covered, hence taking the plain path: Triton's
launch hooks (a profiler such as proton sets them), pre-run hooks, an
asynchronous compile, backends other than CUDA (AMD specializes on pointer
ranges too), and Triton versions whose launch contract was not read (`ABI`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("stoker.kernels")

# Triton versions whose `JITFunction.run` ends in the call above and whose CUDA
# specialization is the one `spec_key` mirrors (read in the 3.6 and 3.9 sources).
ABI: dict[tuple[int, int], str] = {(3, 6): "run9", (3, 7): "run9", (3, 8): "run9", (3, 9): "run9"}

_I32 = 1 << 31
_I64 = 1 << 63
_U64 = 1 << 64
_Tensor = torch.Tensor


def spec_key(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What Triton specializes a launch with `args` on (a superset of it), or
    None for an argument kind it does not describe (that launch takes the plain path)."""
    key: list[Any] = []
    add = key.append
    for a in args:
        t = type(a)
        if t is int:
            if a == 1:
                add(-1)
            elif -_I32 <= a < _I32:
                add(a & 15 == 0)  # False/True: i32
            elif -_I64 <= a < _I64:
                add(2 + (a & 15 == 0))  # 2/3: i64
            elif 0 <= a < _U64:
                add(4 + (a & 15 == 0))  # 4/5: u64
            else:
                return None
        elif isinstance(a, _Tensor):
            add((a.dtype, a.data_ptr() & 15 == 0))
        elif t is float or t is bool:
            add(t)
        else:
            return None
    return tuple(key)


class Abi:
    """The installed Triton's launch entry points, resolved once."""

    __slots__ = ("device", "runtime_knobs", "stream")

    def __init__(self) -> None:
        from triton import knobs
        from triton.runtime import driver

        active = driver.active
        self.device: Callable[[], int] = active.get_current_device
        self.stream: Callable[[int], int] = active.get_current_stream
        self.runtime_knobs = knobs.runtime

    def hooks_off(self) -> bool:
        """No launch hook is set: Triton 3.6 keeps None, 3.9 an empty `HookChain`."""
        k = self.runtime_knobs
        enter, leave = k.launch_enter_hook, k.launch_exit_hook
        if enter is None and leave is None:
            return True
        return not getattr(enter, "calls", True) and not getattr(leave, "calls", True)


_abi: list[Abi | None] = []


def abi() -> Abi | None:
    """The adapter for the installed Triton on a CUDA target, or None (plain
    launches, logged once): an unknown version, another backend, no driver."""
    if _abi:
        return _abi[0]
    found: Abi | None = None
    try:
        import triton
        from triton.runtime import driver

        version = tuple(int(p) for p in triton.__version__.split(".")[:2])
        target = driver.active.get_current_target()
        if version not in ABI:
            log.info(
                "stoker-triton: Triton %s is not one whose launcher contract was read (%s): "
                "kernels launch through JITFunction.run",
                triton.__version__,
                ", ".join(f"{a}.{b}" for a, b in ABI),
            )
        elif target.backend != "cuda":
            log.info("stoker-triton: lean launches are CUDA-only; %s launches plainly", target)
        else:
            found = Abi()
    except Exception as e:  # no driver: nothing launches natively anyway
        log.info("stoker-triton: lean launches off (%s: %s)", type(e).__name__, e)
    _abi.append(found)
    return found


def reset() -> None:
    """Forget the adapter (tests that swap Triton's active driver)."""
    _abi.clear()


# (launcher, function, packed metadata, grid x, XBLOCK, RBLOCK)
Entry = tuple[Callable[..., Any], Any, Any, int, int, int]


class FastPath:
    """One kernel's compiled binaries by launch key (see the module docstring)."""

    __slots__ = ("abi", "entries", "fn")

    def __init__(self, fn: Any, adapter: Abi) -> None:
        self.fn = fn
        self.abi = adapter
        self.entries: dict[tuple[Any, ...], Entry] = {}

    def key(self, args: tuple[Any, ...], xnumel: int, rnumel: int) -> tuple[Any, ...] | None:
        spec = spec_key(args)
        if spec is None or not self.abi.hooks_off() or self.fn.pre_run_hooks:
            return None
        return (self.abi.device(), xnumel, rnumel, spec)

    def launch(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> bool:
        """Launch through the kept binary for `key`; False when there is none yet."""
        hit = self.entries.get(key)
        if hit is None:
            return False
        run, function, meta, grid, xb, rb = hit
        k = self.abi.runtime_knobs  # the hooks (none set: see `key`) as JITFunction.run passes them
        stream = self.abi.stream(key[0])
        enter, leave = k.launch_enter_hook, k.launch_exit_hook
        run(grid, 1, 1, stream, function, meta, None, enter, leave, *args, xb, rb)
        return True

    def keep(self, key: tuple[Any, ...], kernel: Any, grid: int, xb: int, rb: int) -> None:
        """Keep what `JITFunction.run` returned for `key` (after it launched it)."""
        if kernel is None or hasattr(kernel, "result"):  # warmup / asynchronous compile
            return
        self.entries[key] = (kernel.run, kernel.function, kernel.packed_metadata, grid, xb, rb)


def fast_path_for(fn: Any) -> FastPath | None:
    """A `FastPath` for `fn` when it is a real `JITFunction` and the adapter applies."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    if not isinstance(fn, JITFunction):
        return None
    adapter = abi()
    return FastPath(fn, adapter) if adapter is not None else None
