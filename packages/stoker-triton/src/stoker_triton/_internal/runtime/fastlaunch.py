"""The lean launch path: after a kernel's first launch for a specialization,
call its compiled binary's launcher directly, with no Python argument binding.

`JITFunction.run` binds the arguments, specializes each one, hashes a cache
key, looks the binary up and checks globals on every call (about 50 µs on an
H100 host). Here the first launch for a key goes through it as before and
returns the `CompiledKernel`; its launcher (`kernel.run`), `kernel.function`
and `kernel.packed_metadata` are kept per launch key (device, xnumel, rnumel
and `spec_key(args)`, computed by `key_function`'s straight-line code), with
the grid and block sizes, and later launches with the same key call

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

# Triton versions whose `JITFunction.run` ends in the call above ("run9": nine
# leading launcher arguments, then the bound arguments with the constexprs) and
# whose CUDA specialization `spec_key` mirrors. Read in the 3.6 and 3.9 sources;
# 3.7 and 3.8 lie between two releases with the same contract. A new version
# is added here after reading its `jit.py`, `compiler.py` and nvidia `driver.py`.
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
        self.device: Callable[[], int] = _device_getter(active.get_current_device)
        self.stream: Callable[[int], int] = active.get_current_stream
        self.runtime_knobs = knobs.runtime

    def hooks_off(self) -> bool:
        """No launch hook is set: Triton 3.6 keeps None, 3.9 an empty `HookChain`."""
        k = self.runtime_knobs
        enter, leave = k.launch_enter_hook, k.launch_exit_hook
        if enter is None and leave is None:
            return True
        return not getattr(enter, "calls", True) and not getattr(leave, "calls", True)


def _device_getter(get: Callable[[], int]) -> Callable[[], int]:
    """The current-device getter a launch calls: Triton's, or for torch's
    ``torch.cuda.current_device`` (a Python function: lazy-init check, then the C
    call) the C call itself. Called per launch; the lazy init has run
    by then (`abi` read the target through this very getter)."""
    import torch

    fast = getattr(torch._C, "_cuda_getDevice", None)
    if fast is not None and get is getattr(torch.cuda, "current_device", None):
        return fast  # type: ignore[no-any-return]
    return get


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
_PLAIN_TYPES = (int, bool, float)


def _key_parts(n_args: int, n_ptrs: int) -> tuple[list[str], list[str], list[str], list[str]]:
    """The straight-line key's source pieces: argument names, the lines reading each
    tensor's address once, the key's items, the launch's arguments."""
    names = [f"a{i}" for i in range(n_args)]
    parts, lines = [], []
    for i, a in enumerate(names):
        if i < n_ptrs:
            lines.append(f"p{i} = {a}.data_ptr()")
            parts.append(f"{a}.dtype, p{i} & 15 == 0")
            continue
        if i in (n_ptrs, n_ptrs + 1):  # xnumel, rnumel: by value
            parts.append(f"type({a}), {a}")
        else:  # equal to 1; multiple of 16; a >> 31: every i32/i64/u64 bound is a multiple of 2**31
            parts.append(f"type({a}), {a} == 1, not {a} & 15, {a} >> 31")
    launch = [f"p{i}" if i < n_ptrs else a for i, a in enumerate(names)]
    return names, lines, parts, launch


def _exec(src: str, name: str, fn: str) -> Callable[..., Any]:
    scope: dict[str, Any] = {}
    exec(compile(src, name, "exec"), scope)
    out: Callable[..., Any] = scope[fn]
    return out


def key_function(n_args: int, n_ptrs: int) -> Callable[..., tuple[Any, ...]]:
    """`spec_key` as straight-line code (about half the loop's cost) for launches
    of `n_args` arguments whose first `n_ptrs` are tensors. It keys on more than
    `spec_key`, never less: xnumel and rnumel (the two after the pointers, which
    the grid and block sizes follow from) by value, and other integers by
    `a >> 31` (never across an i32/i64/u64 bound, all multiples of 2**31; but a
    new key per 2**31 beyond the i32 range, and negative apart from positive:
    at most extra binder calls).

    It returns the key and the launch's arguments with each tensor replaced by
    its address (`data_ptr()`, read once for both). Triton's launcher takes an
    integer pointer as it is; a tensor costs it a `data_ptr` call and a
    `cuPointerGetAttribute` driver call per pointer per launch.
    An argument of another kind raises (AttributeError, TypeError), and the
    caller falls back to `spec_key`."""
    names, lines, parts, launch = _key_parts(n_args, n_ptrs)
    src = (
        f"def key({', '.join(names)}):\n"
        + "".join(f"    {ln}\n" for ln in lines)
        + f"    return ({', '.join(parts)},), ({', '.join(launch)},)\n"
    )
    return _exec(src, f"<stoker launch key {n_args}/{n_ptrs}>", "key")


def lean_function(
    n_args: int, n_ptrs: int
) -> Callable[[FastPath, Callable[..., None]], Callable[..., bool | None]]:
    """A maker of one kernel's whole lean launch as one straight-line function (the
    steady path): `make(fast, slow)(target, *args)` keys the arguments as
    `key_function` does and launches the kept binary as `FastPath.launch` does, with
    `target` = (device, stream, enter hook, exit hook) as `FastPath.target` read them
    once for the whole graph call; it returns True when it launched, else what
    `slow(*args)` returns (None: no target (a launch hook is set), a new key, an
    argument of another kind, a pre-run hook)."""
    names, lines, parts, launch = _key_parts(n_args, n_ptrs)
    args = ", ".join(names)
    src = f"""def make(fast, slow):
    entries = fast.entries

    def lean(target, {args}):
        if target is None:
            return slow({args})  # a launch hook is set (Abi.hooks_off)
        fn = fast.fn
        if fn is not None and fn.pre_run_hooks:
            return slow({args})
        try:
{"".join(f"            {ln}" + chr(10) for ln in lines)}            key = ({", ".join(parts)},)
        except (AttributeError, TypeError, ValueError, RuntimeError):
            return slow({args})
        dev, stream, enter, leave = target
        entry = entries.get((dev, key))
        if entry is None:
            return slow({args})
        run, function, meta, grid, xb, rb = entry
        run(grid, 1, 1, stream, function, meta, None, enter, leave, {", ".join(launch)}, xb, rb)
        return True

    return lean
"""
    return _exec(src, f"<stoker lean launch {n_args}/{n_ptrs}>", "make")


def target_function(adapter: Abi) -> Callable[[], tuple[Any, ...] | None]:
    """What a graph call reads once for all its launches: the current device
    and its stream, and the launch hooks as `JITFunction.run` passes them; None while a
    launch hook is set (`Abi.hooks_off`: every launch then takes Triton's binder)."""
    knobs, device, stream = adapter.runtime_knobs, adapter.device, adapter.stream

    def target() -> tuple[Any, ...] | None:
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        if (enter is not None or leave is not None) and (
            getattr(enter, "calls", True) or getattr(leave, "calls", True)
        ):
            return None
        dev = device()
        return (dev, stream(dev), enter, leave)

    return target


def no_target() -> None:
    """The launch target where no launch is lean (the interpreter, another backend)."""
    return None


class FastPath:
    """One kernel's compiled binaries by launch key (see the module docstring)."""

    __slots__ = ("abi", "entries", "fn", "keyfns", "target")

    def lean(
        self, n_args: int, n_ptrs: int, slow: Callable[..., None]
    ) -> Callable[..., bool | None]:
        """This kernel's one-function steady launch for `n_args` arguments (`lean_function`);
        `slow(*args)` launches what it cannot."""
        return lean_function(n_args, n_ptrs)(self, slow)

    def __init__(self, fn: Any, adapter: Abi) -> None:
        self.fn = fn  # the JITFunction (None until a warm launcher imports its module)
        self.abi = adapter
        self.entries: dict[tuple[Any, ...], Entry] = {}
        self.keyfns: dict[tuple[int, int], Callable[..., tuple[Any, ...]]] = {}
        self.target = target_function(adapter)  # read once per graph call (`launch_target`)

    def key(
        self, args: tuple[Any, ...], n_ptrs: int
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """The launch key of `args` (pointers first, then xnumel, rnumel, ...) and
        the arguments to launch with (tensors as addresses where the straight-line
        key read them), or None when the lean path cannot serve these arguments now."""
        if not self.abi.hooks_off() or (self.fn is not None and self.fn.pre_run_hooks):
            return None
        shape = (len(args), n_ptrs)
        keyfn = self.keyfns.get(shape)
        if keyfn is None:
            keyfn = self.keyfns[shape] = key_function(*shape)
        try:
            spec, launch_args = keyfn(*args)
        except (AttributeError, TypeError, ValueError, RuntimeError):
            general = spec_key(args)
            if general is None:
                return None
            spec, launch_args = ("any", args[n_ptrs], args[n_ptrs + 1], general), args
        return (self.abi.device(), spec), launch_args

    def launch(self, entry: Entry, device: int, args: tuple[Any, ...]) -> None:
        """Launch `args` through a kept binary, as `JITFunction.run` would."""
        run, function, meta, grid, xb, rb = entry
        k = self.abi.runtime_knobs  # the hooks (none set: see `key`) as JITFunction.run passes them
        stream = self.abi.stream(device)
        run(
            grid,
            1,
            1,
            stream,
            function,
            meta,
            None,
            k.launch_enter_hook,
            k.launch_exit_hook,
            *args,
            xb,
            rb,
        )

    def keep(
        self,
        key: tuple[Any, ...],
        args: tuple[Any, ...],
        n_ptrs: int,
        kernel: Any,
        grid: int,
        xb: int,
        rb: int,
    ) -> bool:
        """Keep what `JITFunction.run` returned for `key` (after it launched it), or
        a warm-loaded binary: only for tensors and Python scalars, the kinds
        `spec_key` is written for. True when kept."""
        if kernel is None or hasattr(kernel, "result"):  # warmup / asynchronous compile
            return False
        if not all(isinstance(a, _Tensor) for a in args[:n_ptrs]):
            return False
        if not all(type(a) in _PLAIN_TYPES for a in args[n_ptrs:]):
            return False
        run = kernel.run  # loads the binary (a warm-loaded one: now)
        self.entries[key] = (run, kernel.function, kernel.packed_metadata, grid, xb, rb)
        return True


def fast_path_for(fn: Any, lazy: bool = False) -> FastPath | None:
    """A `FastPath` for `fn` when it is a real `JITFunction` (or, `lazy`, one to
    come: a warm launcher's) and the adapter applies."""
    if not lazy:
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return None
        if not isinstance(fn, JITFunction):
            return None
    adapter = abi()
    return FastPath(fn, adapter) if adapter is not None else None
