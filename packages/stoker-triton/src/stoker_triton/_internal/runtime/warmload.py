"""Warm loads: a new process launches a cached kernel's binary without Triton's JIT front end.

`triton.jit` re-parses a kernel module's source (and each of its helpers') and,
at the first launch, Triton binds and specializes the arguments, hashes the
source with its dependencies into a cache key and looks the binary up in its
disk cache. None of it changes between processes that launch one kernel
module with arguments of one kind, so the cold process writes down, per kernel
module (``$STOKER_CACHE_DIR/triton/binaries/<sha>.json``, a checked
`DiskCache` entry) and per launch kind, what Triton found: the cache hash of
the binary, its metadata file's name, the signature and the constexprs. A warm
launcher builds Triton's own `CompiledKernel` from those files and launches it
on the lean path (`fastlaunch`), making no `JITFunction` (the kernel module is
imported only when a launch falls back to the plain path).

| decides a record's use | how |
|---|---|
| the kernel source | the record file is keyed by the kernel module's content sha |
| the arguments | `spec_key` (a superset of Triton's CUDA specialization) and the block sizes and warps, as text |
| Triton itself | version, size and mtime of `libtriton` and of the files that make its cache key (its cache key hashes `libtriton`: 0.4 s a process, hence the stat) |
| the target and compiler | the target, `backend.hash()` (ptxas' version), the cache-invalidating environment variables, the options hash of the launch (``num_warps``, ``debug`` and the compilation knobs `JITFunction.run` reads) |

A record whose environment differs, a binary missing from Triton's cache, a
knob that changes what Triton does (an override, ``always_compile``, a JIT
cache hook, a stages-inspection hook) or a Triton whose contract was not read
(`fastlaunch.ABI`): the launch takes the plain path (logged once with the
reason), and records again. Never a binary of another source or specialization.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..modcache.modules import cache_dir
from .fastlaunch import spec_key

log = logging.getLogger("stoker.kernels")

FORMAT = "1"  # bump when a record's layout or meaning changes

# stats of this process: "hits" (binaries loaded from a record), "records" (written),
# "misses: why" (a plain launch where a record might have served)
stats: dict[str, int] = {}


# this process's records and the binaries loaded from them: a model's repeated blocks
# launch one kernel module from many call sites (one launcher each), which read its
# record and load its binary once (a `CompiledKernel` is what Triton itself shares
# between all launches of one specialization)
_records: dict[str, dict[str, Any]] = {}
_kernels: dict[tuple[str, str], Any] = {}


def count(what: str) -> None:
    stats[what] = stats.get(what, 0) + 1


def store() -> Any:
    from stoker_shapes import DiskCache

    return DiskCache(cache_dir, "binaries", FORMAT, ".json", quiet=True)


def spec_text(args: tuple[Any, ...], cfg: tuple[int, int, int]) -> str | None:
    """The launch kind of `args` with block sizes and warps `cfg`, as text (None: not describable)."""
    key = spec_key(args)
    if key is None:
        return None
    parts = []
    for k in key:
        if isinstance(k, tuple):
            parts.append(f"{k[0]}:{int(k[1])}")
        elif isinstance(k, type):
            parts.append(k.__name__)
        else:
            parts.append(repr(k))
    return ",".join(parts) + "|" + ",".join(map(str, cfg))


_env: list[dict[str, Any] | None] = []
_why_off: list[str] = []


def _triton_identity() -> str:
    import triton

    root = Path(triton.__file__).parent
    lib = next(iter(sorted((root / "_C").glob("libtriton*"))), None)
    files = [lib, root / "compiler" / "compiler.py", root / "runtime" / "cache.py"]
    files += sorted((root / "backends").glob("*/compiler.py"))
    stamp = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f is not None]
    return f"triton {triton.__version__} {root} {' '.join(stamp)}"


def environment() -> dict[str, Any] | None:
    """What a record must have been made under (computed once), or None when warm
    loads are off here (the reason is logged once)."""
    if _env:
        return _env[0]
    env: dict[str, Any] | None = None
    try:
        env = _environment()
    except Exception as e:  # an unknown Triton layout: the plain path, as before
        _why_off.append(f"{type(e).__name__}: {e}")
    if env is None:
        log.info("stoker-triton: warm kernel loads off (%s)", _why_off[-1] if _why_off else "?")
    _env.append(env)
    return env


def _environment() -> dict[str, Any] | None:
    from triton import knobs
    from triton.compiler import compiler
    from triton.runtime import driver

    from .fastlaunch import abi

    if abi() is None:
        _why_off.append("no lean launch path here (see the log)")
        return None
    comp = knobs.compilation
    unsafe = [
        ("TRITON_KERNEL_OVERRIDE", getattr(comp, "override", False)),
        ("TRITON_ALWAYS_COMPILE", getattr(comp, "always_compile", False)),
        ("jit_cache_hook", getattr(knobs.runtime, "jit_cache_hook", None)),
        ("add_stages_inspection_hook", getattr(knobs.runtime, "add_stages_inspection_hook", None)),
    ]
    on = [name for name, v in unsafe if v]
    if on:
        _why_off.append("set: " + ", ".join(on))
        return None
    target = driver.active.get_current_target()
    backend = compiler.make_backend(target)
    return {
        "triton": _triton_identity(),
        "target": f"{target.backend} {target.arch} {target.warp_size}",
        "backend": backend.hash(),
        "env": sorted(compiler.get_cache_invalidating_env_vars().items()),
        "_backend": backend,
    }


def options_hash(env: dict[str, Any], cfg: tuple[int, int, int]) -> str:
    """The options hash of a launch with `cfg`, from the kwargs `JITFunction.run` builds."""
    from triton import knobs

    kwargs: dict[str, Any] = {"XBLOCK": cfg[0], "RBLOCK": cfg[1], "num_warps": cfg[2]}
    kwargs["debug"] = knobs.runtime.debug
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # 3.6: the first; 3.9: both
        if hasattr(knobs.compilation, knob):
            kwargs[knob] = getattr(knobs.compilation, knob)
    memo: dict[str, str] = env.setdefault("_options", {})
    key = repr(sorted(kwargs.items()))
    h = memo.get(key)
    if h is None:  # parsing the options: a millisecond, once per configuration and knobs
        h = memo[key] = env["_backend"].parse_options(kwargs).hash()
    return h


def _env_text(env: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in env.items() if not k.startswith("_")}, sort_keys=True)


def read(sha: str) -> dict[str, Any]:
    """The records of kernel module `sha` made under this environment ({}: none)."""
    env = environment()
    if env is None:
        return {}
    got = _records.get(sha)
    if got is not None:
        return got
    body = store().get(sha)
    if body is None:
        return {}
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    if data.get("env") != _env_text(env):
        count("misses: another Triton, target or environment")
        return {}
    launches: dict[str, Any] = data.get("launches", {})
    _records[sha] = launches
    return launches


def record(sha: str, spec: str, cfg: tuple[int, int, int], kernel: Any) -> None:
    """Write down what Triton launched for `spec` (a `CompiledKernel` from its cache)."""
    env = environment()
    if env is None:
        return
    try:
        src = kernel.src
        meta_files = [Path(p).name for c, p in kernel.metadata_group.items() if c.endswith(".json")]
        rec = {
            "hash": kernel.hash,
            "metadata": meta_files[0],
            "options": options_hash(env, cfg),
            "arg_names": list(src.fn.arg_names),
            "signature": dict(src.signature),
            "constants": [
                [list(k) if isinstance(k, tuple) else k, v] for k, v in src.constants.items()
            ],
        }
        json.dumps(rec)  # only plain values (a constexpr of another kind: not recorded)
    except Exception as e:
        log.debug("stoker-triton: no warm-load record for %s (%s)", sha, e)
        return
    st = store()
    try:
        data = json.loads(st.get(sha) or b"{}")
    except ValueError:
        data = {}
    text = _env_text(env)
    if data.get("env") != text:
        data = {"env": text, "launches": {}}
    data["launches"][spec] = rec
    st.put(sha, json.dumps(data, sort_keys=True).encode())
    _records[sha] = data["launches"]
    _kernels[(rec["hash"], rec["metadata"])] = kernel
    count("records")


class _Source:
    """What `CompiledKernel` and the CUDA launcher read of Triton's `ASTSource`."""

    __slots__ = ("constants", "fn", "name", "signature")

    def __init__(self, rec: dict[str, Any]) -> None:
        self.fn = SimpleNamespace(arg_names=rec["arg_names"], launch_metadata=None)
        self.signature = rec["signature"]
        self.constants = {(tuple(k) if isinstance(k, list) else k): v for k, v in rec["constants"]}
        self.name = rec["metadata"].removesuffix(".json")


def compiled_kernel(rec: dict[str, Any], cfg: tuple[int, int, int]) -> Any:
    """Triton's `CompiledKernel` for a record, from Triton's cache, or None (logged)."""
    env = environment()
    if env is None:
        return None
    if rec.get("options") != options_hash(env, cfg):
        count("misses: other options")
        return None
    done = _kernels.get((rec["hash"], rec["metadata"]))
    if done is not None:  # loaded (or launched) in this process already
        count("hits")
        return done
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.cache import get_cache_manager

    group = get_cache_manager(rec["hash"]).get_group(rec["metadata"])
    if not group or rec["metadata"] not in group:
        count("misses: binary not in Triton's cache")
        return None
    try:
        kernel = CompiledKernel(_Source(rec), group, rec["hash"])
    except Exception as e:  # a file gone or broken since: Triton's own path decides
        log.info("stoker-triton: warm load of %s failed (%s: %s)", rec["hash"], type(e).__name__, e)
        count("misses: unreadable binary")
        return None
    count("hits")
    _kernels[(rec["hash"], rec["metadata"])] = kernel
    return kernel


def reset() -> None:
    """Forget the environment (tests that swap Triton's driver or knobs)."""
    _env.clear()
    _why_off.clear()
    stats.clear()
    _records.clear()
    _kernels.clear()


__all__ = ["compiled_kernel", "environment", "read", "record", "reset", "spec_text", "stats"]
