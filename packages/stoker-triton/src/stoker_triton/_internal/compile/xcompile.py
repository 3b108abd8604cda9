"""Cross-compilation: build every generated kernel for a GPU we do not have.

The interpreter runs kernels with numpy and forgives what the real compiler
does not (a dtype mismatch in `tl.where`, an op with no lowering for
bfloat16, a block that overflows shared memory). With
`STOKER_TRITON_CHECK_TARGETS=cuda:90` (a comma-separated list of
`cuda:<compute capability>`), each kernel the interpreter launches is also
compiled by Triton's own pipeline (TTIR, TTGIR, LLVM IR, PTX, and a cubin
from ptxas) for each target, with every block-size and warp configuration
the GPU autotuner would try. What is compiled is the module a GPU build
loads (`gpu_source`: the interpreter's module differs only in how it rounds
to bfloat16). No driver and no GPU are needed; a kernel that does not
compile raises `CrossCompileError` naming its source file and the
compiler's reason (`describe`).

The same worker pool compiles kernels for the GPU at hand ahead of their
first launch (`precompile`): in processes, so compiles run in parallel, and
through Triton's own argument binder (`create_function_from_signature` and
`JITFunction._pack_args`), so the signature, constants, attributes and
options, and hence Triton's on-disk cache key, are the ones the launch will
compute: the launch then loads the binary from disk. Where a Triton version
lacks those internals, `signature` derives the same specialization (a tensor
is a typed pointer, 16-byte aligned ones carry `tt.divisibility`; an integer
equal to 1 is a constant, others `i32`/`i64`, with `tt.divisibility` when a
multiple of 16).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "STOKER_TRITON_CHECK_TARGETS"

_PTR = {  # dtype name (as torch prints it, less "torch.") -> Triton pointer type
    "float32": "fp32",
    "float64": "fp64",
    "float16": "fp16",
    "bfloat16": "bf16",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "bool": "i1",
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
_done: set[tuple[Any, ...]] = set()
# compiles in the workers now, by key: a graph whose layers repeat a kernel (one
# module path, one specialization) queues it once, and every launcher waits for it
_queued: dict[tuple[Any, ...], Future[Any]] = {}
_pool: Any = None
compiled_count = 0  # compiles run by this process's workers (tests read it)

Target = tuple[str, Any, int]  # (backend, arch, warp size), as triton's GPUTarget


def _arg_spec(a: Any) -> Any:
    """What a worker needs of a launch argument (tensors are not sent)."""
    import torch

    if isinstance(a, StandIn):
        return ("tensor", str(a.dtype).removeprefix("torch."), a.data_ptr() % 16 == 0)
    if isinstance(a, torch.Tensor):
        return ("tensor", str(a.dtype).removeprefix("torch."), a.data_ptr() % 16 == 0)
    return a


class _DtypeName:
    """Stands in for a torch dtype: Triton reads only its printed name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


class StandIn:
    """A launch's tensor argument as Triton's binder sees it (its dtype and whether
    its address is 16-byte aligned), without torch: the workers never import it."""

    def __init__(self, dtype: str, aligned: bool) -> None:
        self.dtype = _DtypeName(dtype)
        self._ptr = 0 if aligned else 4

    def data_ptr(self) -> int:
        return self._ptr


def _stand_in(spec: Any) -> Any:
    """A tensor's stand-in with the dtype and alignment of the one launched."""
    if isinstance(spec, tuple) and len(spec) == 3 and spec[0] == "tensor":
        return StandIn(spec[1], spec[2])
    return spec


def _is_tensor(a: Any) -> bool:
    return hasattr(a, "data_ptr") and hasattr(a, "dtype")


def _source(fn: Any, args: list[Any], kw: dict[str, int], backend: Any) -> tuple[Any, Any]:
    """(ASTSource, options) for launching `fn(*args, **kw)`: Triton's own binder
    when this Triton has it, else our derivation of the same specialization."""
    from triton.compiler import ASTSource

    try:
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binder(*args, **kw)
        options, sig, consts, attrs = fn._pack_args(backend, kw, bound, spec, opts)
        return ASTSource(fn, sig, consts, attrs), options
    except (ImportError, AttributeError, TypeError, ValueError):
        sig, consts_by_name, attrs = signature(
            fn.arg_names, args, {"XBLOCK": kw["XBLOCK"], "RBLOCK": kw["RBLOCK"]}
        )
        src = ASTSource(fn=fn, signature=sig, constexprs=consts_by_name, attrs=attrs)
        return src, backend.parse_options({"num_warps": kw["num_warps"]})


def _compile_job(
    path: str,
    source: str,
    arg_specs: list[Any],
    kw: dict[str, int],
    target: Target,
    launcher: bool = False,
) -> str | None:
    """In a worker (TRITON_INTERPRET=0 there): compile one kernel; None on
    success, else the error. `launcher`: also build Triton's launcher for it
    (triton 3.6 compiles a C module per signature, cached on disk by Triton:
    built here in parallel, the launch finds it; later Tritons need no C
    compile), best effort."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget

        fn = _native_module(path, source).kernel
        tgt = GPUTarget(target[0], target[1], target[2])
        backend = triton.compiler.make_backend(tgt)
        src, options = _source(fn, [_stand_in(a) for a in arg_specs], kw, backend)
        kernel = triton.compile(src, target=tgt, options=options.__dict__)
    except Exception as e:  # reported to the launching process
        return describe(e)
    if launcher and target[0] == "cuda":
        try:
            build = _launcher_builder()
            if build is not None:
                build(kernel.src, kernel.metadata)
        except Exception:  # no C compiler or libcuda here: the launch builds it, as without us
            pass
    return None


_BUILDER: list[Any] = []


def _launcher_builder() -> Any:
    """Triton's CUDA launcher class when constructing it compiles the per-signature
    C module and needs nothing else (Triton 3.6), else None (later Tritons need no
    C compile; their constructor reads `driver.active`).

    Never through `driver.active`: creating Triton's active driver imports torch
    (`CudaDriver.is_active`, `GPUDriver.__init__`), 6 s per worker on the H100,
    which undid the torch-free workers there."""
    if not _BUILDER:
        import inspect

        from triton.backends.nvidia import driver as nvidia

        cls = getattr(nvidia, "CudaLauncher", None)
        src = inspect.getsource(cls.__init__) if cls is not None else ""
        ok = "compile_module_from_src" in src and "driver.active" not in src
        _BUILDER.append(cls if ok else None)
    return _BUILDER[0]


def _torch_imported() -> bool:
    """Whether this process has imported torch (a worker must not: tests ask)."""
    import sys

    return "torch" in sys.modules


class _NoTorch:
    """A meta path finder that refuses ``torch`` and its submodules (`keep_torch_out`)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} in a compile worker", name=name)
        return None


def keep_torch_out() -> None:
    """In a worker or the zygote, first thing: ``import torch`` fails at once there.
    Nothing a worker runs needs torch, but Triton 3.6's native argument binder imports
    it on its first call, to recognise torch tensors: 3.5 to 6 s per worker on the
    H100. Refused, it reads the workers' stand-ins (a dtype name, a data pointer) the
    same way: the signature, constants and attributes, hence Triton's cache key, are
    the ones the launch computes (`test_triton_compile_once.py` checks the key on the
    Triton installed; ``sys.modules["torch"] = None`` instead changed Triton 3.9's)."""
    import sys

    if "torch" not in sys.modules and not any(isinstance(f, _NoTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoTorch())  # type: ignore[arg-type]


def describe(e: BaseException) -> str:
    """The error and what caused it: Triton reports an error inside a
    `@triton.jit` helper as a CompilationError at the call site whose own
    text names no reason; the reason is in its cause chain."""
    parts = [f"{type(e).__name__}: {e}"]
    seen = {id(e)}
    cause = e.__cause__ or e.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        parts.append(f"caused by {type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return "\n".join(parts)


_modules: dict[str, ModuleType] = {}


def _native_module(path: str, source: str | None = None) -> ModuleType:
    """The kernel module at `path` (a cache entry the launching process wrote)
    imported with real `@triton.jit` functions, as a GPU build has it
    (`gpu_source`). Workers get that `source` with the job (reading the entry
    would import the disk cache, hence torch)."""
    mod = _modules.get(path)
    if mod is None:
        from ..modcache.srcmodule import exec_module

        if source is None:
            source = _gpu_source_of(path)
        # a name of its own for linecache: the interpreter's module keeps `path`
        native = str(Path(path).with_suffix(".native.py"))
        mod = exec_module(f"stoker_triton_native_{Path(path).stem}", native, source)
        _modules[path] = mod
    return mod


def _gpu_source_of(path: str) -> str:
    """The GPU build's source of the kernel module at `path` (validated entry)."""
    from ..modcache.modules import module_store

    return gpu_source(module_store("kernels").read_valid(path).decode())


def cpu_count() -> int:
    """The cores this process may run on (every one compiles: one worker each),
    at most its container's CPU quota (cgroups) where one is set."""
    try:
        n = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        n = max(1, os.cpu_count() or 1)
    quota = cgroup_cpus()
    return min(n, quota) if quota is not None else n


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs a cgroup quota allows (rounded up), None without one: cgroup v2's
    `cpu.max` ("200000 100000": two CPUs; "max 100000": none), else v1's
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota == "max" or not quota.lstrip("-").isdigit() or int(quota) <= 0:
        return None
    return max(1, -(-int(quota) // max(1, int(period))))


def gpu_source(source: str) -> str:
    """The kernel module a GPU build loads in place of the interpreter's `source`:
    the same kernel with the GPU's bfloat16 cast instead of the interpreter's
    rounding on the bits (`codegen/ops.py: PRELUDE_BF16`); a GPU build is its own."""
    from ..codegen.ops import PRELUDE_BF16

    return source.replace(PRELUDE_BF16["interpret"], PRELUDE_BF16["native"])


def _executor(start: bool = False) -> Any:
    """The compile workers (plain subprocesses: see `workers.py`); `start`: a new
    pool starts its processes now rather than at their first jobs."""
    global _pool
    with _lock:
        if _pool is None:
            import atexit

            from .workers import Pool

            _pool = Pool(cpu_count(), start=start)
            atexit.register(_pool.shutdown)
        return _pool


def start_workers() -> None:
    """Start the compile workers now, so that their start (the zygote imports
    Triton's compiler: seconds on a host without bytecode caches) overlaps the
    lowering and code generation of the graph whose kernels they will compile.
    A thread of this process computes, meanwhile, what its first launch would:
    Triton's key of itself (a hash of its sources and libraries, which mostly
    releases the GIL; 0.4-1.7 s here) and the Gluon modules."""
    _executor(start=True)
    with _lock:
        if _warming:
            return
        _warming.append(threading.Thread(target=_warm_launch, daemon=True, name="stoker-warm"))
    _warming[0].start()


_warming: list[threading.Thread] = []


def _warm_launch() -> None:
    try:
        import triton.experimental.gluon.language  # noqa: F401
    except Exception:  # a Triton without Gluon
        pass
    warm_triton_key()


def import_compiler() -> None:
    """In a worker, or once in the zygote for every worker it forks: import what
    every compile job needs and do what each worker's first job did (Triton's
    own cache key, a hash of its sources and libraries: 0.38 s here; the Gluon
    modules its code generator imports: 0.08 s), before the first job."""
    try:
        import triton
        import triton.compiler
        import triton.experimental.gluon.language  # noqa: F401
        from triton.backends.nvidia import compiler, driver  # noqa: F401

        _launcher_builder()
    except Exception:  # a Triton without them: the job reports what is missing
        pass
    warm_triton_key()


def warm_triton_key() -> None:
    """Compute Triton's key of itself (cached per process), best effort."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # older Tritons keep it beside the compiler
        try:
            from triton.compiler.compiler import triton_key  # type: ignore[attr-defined,no-redef]
        except ImportError:
            return
    try:
        triton_key()
    except Exception:  # the first compile computes it, and reports what fails
        pass


def signature(
    arg_names: Sequence[str], args: Sequence[Any], constexprs: dict[str, int]
) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], list[list[Any]]]]:
    """Triton's (signature, constants, attrs) for launching with `args` positionally
    and `constexprs` by keyword (the fallback when Triton's binder is not there)."""
    sig: dict[str, str] = {}
    consts: dict[str, Any] = dict(constexprs)
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (name, a) in enumerate(zip(arg_names, args)):
        if _is_tensor(a):  # a tensor, or its `StandIn`
            dtype = str(a.dtype).removeprefix("torch.")
            if dtype not in _PTR:
                raise CrossCompileError(f"argument {name}: no Triton pointer type for {a.dtype}")
            sig[name] = "*" + _PTR[dtype]
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


def _submit(
    path: str,
    args: Sequence[Any],
    configs: Sequence[tuple[int, int, int]],
    tgts: list[Target],
    launcher: bool = False,
) -> list[tuple[tuple[Any, ...], Any]]:
    specs = [_arg_spec(a) for a in args]
    source: str | None = None
    jobs = []
    for tgt in tgts:
        for xb, rb, w in dict.fromkeys(configs):  # small sizes repeat a config
            key = (path, repr(specs), tgt, (xb, rb, w))
            with _lock:
                if key in _done:
                    continue
                running = _queued.get(key)
            if running is not None and not running.done():  # queued for an identical kernel
                jobs.append((key, running))
                continue
            if _built_before(key):  # by an earlier process: no worker needed
                with _lock:
                    _done.add(key)
                continue
            kw = {"XBLOCK": xb, "RBLOCK": rb, "num_warps": w}
            source = source or _gpu_source_of(path)
            fut = _executor().submit("_compile_job", path, source, specs, kw, tgt, launcher)
            with _lock:
                _queued[key] = fut
            fut.add_done_callback(lambda f, key=key: _queued.pop(key, None))
            jobs.append((key, fut))
    return jobs


def _finish(key: tuple[Any, ...]) -> None:
    global compiled_count
    with _lock:
        if key in _done:  # a second waiter on one job
            return
        _done.add(key)
        compiled_count += 1
    _markers().put(_marker_key(key), b"built\n")


# Which compiles succeeded, across processes: one small `DiskCache` entry per
# (kernel source, argument specialization, target, config, Triton version and
# cache dir). A warm process finds every kernel marked and starts no workers
# (starting them costs seconds: each imports torch and Triton); the launch loads
# the binary from Triton's cache. A marker whose binary was since deleted costs
# only a compile at the launch, as without a precompile.


def _markers() -> Any:
    import triton

    from stoker_shapes import DiskCache

    from ..modcache.modules import cache_dir

    return DiskCache(cache_dir, "compiled", f"1-triton{triton.__version__}", ".ok", quiet=True)


def _triton_cache_dir() -> str:
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:  # an older Triton: its environment variable
        return os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")


def _marker_key(key: tuple[Any, ...]) -> str:
    import hashlib

    path, specs, tgt, cfg = key
    text = repr((Path(path).name, specs, tgt, cfg, _triton_cache_dir()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def built_any() -> bool:
    """Whether any kernel was built into this cache before (by any process)."""
    d = _markers().dir
    try:
        return any(True for _ in d.iterdir())
    except OSError:  # no such directory yet
        return False


def _built_before(key: tuple[Any, ...]) -> bool:
    return _markers().get(_marker_key(key)) is not None


def check(path: str, args: Sequence[Any], configs: Sequence[tuple[int, int, int]]) -> int:
    """Compile the kernel in `path` for each target in `STOKER_TRITON_CHECK_TARGETS`
    and each config (XBLOCK, RBLOCK, num_warps) with these launch arguments, in
    worker processes; returns how many compiles ran. Raises `CrossCompileError`
    for the first that fails."""
    tgts = [(b, cap, 32) for b, cap in targets()]
    if not tgts:
        return 0
    jobs = _submit(path, args, configs, tgts)
    for key, fut in jobs:
        err = fut.result()
        if err is not None:
            _, _, (backend, cap, _w), (xb, rb, w) = key
            raise CrossCompileError(
                f"stoker-triton: kernel {path} does not compile for {backend}:{cap} "
                f"(XBLOCK={xb}, RBLOCK={rb}, num_warps={w}): {err}"
            )
        _finish(key)
    return len(jobs)


def submit_precompile(
    work: Sequence[tuple[str, Sequence[Any], Sequence[tuple[int, int, int]]]], target: Target
) -> dict[str, list[Future[str | None]]]:
    """Start compiling kernels for the GPU at hand in the worker processes and
    return at once: per kernel module path, a future per compile that gives
    None once it succeeded and its marker is written, or the error. Jobs are
    queued in the order of `work`: the kernel launched first compiles first."""
    out: dict[str, list[Future[str | None]]] = {}
    for path, args, configs in work:
        for key, fut in _submit(path, args, configs, [target], True):
            out.setdefault(path, []).append(_marked(key, fut))
    return out


def _marked(key: tuple[Any, ...], job: Future[Any]) -> Future[str | None]:
    """`job`'s outcome (None or the error), set after a success's `_finish`."""
    out: Future[str | None] = Future()
    out.set_running_or_notify_cancel()

    def done(f: Future[Any]) -> None:
        try:
            err = f.result()
        except Exception as e:  # the worker died
            err = describe(e)
        if err is None:
            _finish(key)
        _, _, _, (xb, rb, w) = key
        out.set_result(None if err is None else f"XBLOCK={xb} RBLOCK={rb} num_warps={w}: {err}")

    job.add_done_callback(done)
    return out


def precompile(
    work: Sequence[tuple[str, Sequence[Any], Sequence[tuple[int, int, int]]]], target: Target
) -> tuple[int, list[str]]:
    """Compile kernels for the GPU at hand in parallel worker processes, ahead of
    their first launch, which then finds each binary in Triton's disk cache, and
    wait for them. `work`: (kernel module path, launch arguments, configs).
    Returns (compiles that succeeded, errors): a failure only costs the head start."""
    results = [
        (path, fut.result())
        for path, futs in submit_precompile(work, target).items()
        for fut in futs
    ]
    errors = [f"{path} {err}" for path, err in results if err is not None]
    return len(results) - len(errors), errors
