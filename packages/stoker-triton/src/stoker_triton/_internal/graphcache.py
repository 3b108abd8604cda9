"""The compiled-graph cache: a warm process loads a graph's wrapper and kernels
instead of decomposing, lowering, scheduling and generating them again.

An entry (``$STOKER_CACHE_DIR/triton/graphs/<key>``, a checked `DiskCache`
file) names the wrapper and kernel modules by their content keys (the modules
themselves stay in ``triton/wrappers`` and ``triton/kernels``), each kernel's
launcher settings, the wrapper's constants, the output structure, the guards
the compile added to the shape env, and the report's fields.

| what decides the key | how |
|---|---|
| the FX graph | every node: op, name, target (qualified), args, kwargs, ``meta["val"]`` (dtype, device, sizes, strides, offsets, symbolic expressions as text) |
| the inputs | each one's dtype, device, sizes, strides, offset, requires_grad; SymInts as expressions |
| the shape env | each input symbol's replacement and value range, and the guards it already holds (they decide what a compile still has to guard) |
| the compile | options, debug flag, interpreter or native, the GPU's compute capability, sm_90 cross-compile targets |
| the code | torch, triton and stoker-triton versions, a hash of stoker-triton's sources, the module and entry formats |

| on a lookup | result |
|---|---|
| no entry | miss "new key" |
| broken entry (bytes, version) | `DiskCache` warns once naming the file; miss "corrupt entry"; the cold compile rewrites it |
| a module it names is missing or broken | miss "missing module" |
| a recorded guard is false at the current sizes (or names a symbol the shape env lacks) | that variant is skipped; none left: miss "guard replay failed", nothing added to the shape env |
| otherwise | hit: the recorded guards are added to the shape env, as the cold compile added them |

One key holds up to `MAX_VARIANTS` entries, one per set of guards: a dynamic
size on both sides of a guard (a row that fits one block, one that does not)
keeps both compiled graphs instead of rewriting one with the other.

A graph whose wrapper needs a constant that cannot be stored (an object
without a stable name) is compiled every time ("uncacheable").
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.fx

from stoker_shapes._internal.cachekey import (
    add_variant,
    guards_hold,
    read_variants,
    replay,
    source_hash,
)
from stoker_shapes._internal.cachekey import graph_text as _graph_text
from stoker_shapes._internal.cachekey import shape_env_text as _shape_env_text
from stoker_shapes._internal.cachekey import val_text as _val_text

from .modcache.modules import MODULE_FORMAT, cache_dir, interpreting, load_stored, read_stored
from .report import CompileReport, KernelInfo

log = logging.getLogger("stoker.cache")

# Bump when an entry's layout or meaning changes: older entries become misses.
ENTRY_FORMAT = "1"
_ENV_OFF = "STOKER_TRITON_GRAPH_CACHE"  # "0": neither read nor write entries

# process-wide counters: hits, misses by reason, writes
stats: dict[str, int] = {}


def count(what: str) -> None:
    stats[what] = stats.get(what, 0) + 1


def enabled() -> bool:
    return os.environ.get(_ENV_OFF, "1") != "0"


def store() -> Any:
    from stoker_shapes import DiskCache

    return DiskCache(cache_dir, "graphs", f"{ENTRY_FORMAT}.{MODULE_FORMAT}")


# --------------------------------------------------------------------------
# the key


def _code_version() -> str:
    """torch, triton and stoker-triton versions and a hash of stoker-triton's sources
    (a changed generator, released or not, never reads an older entry)."""
    from importlib.metadata import PackageNotFoundError, version

    from ..__about__ import __version__

    try:  # (read from the metadata: importing triton is not needed for C kernels)
        triton_version = version("triton")
    except PackageNotFoundError:
        triton_version = "none"
    h = source_hash(Path(__file__).resolve().parent.parent)
    return f"torch {torch.__version__} triton {triton_version} stoker-triton {__version__} {h}"


def _target() -> str:
    from .compile.xcompile import targets

    gpu = "none"
    if not interpreting() and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = f"sm_{major}{minor}"
    return f"interpret={int(interpreting())} gpu={gpu} check={targets()}"


def graph_key(
    gm: torch.fx.GraphModule,
    inputs: list[Any],
    shape_env: Any,
    options: dict[str, Any],
    debug: bool,
) -> str:
    parts = [
        f"entry {ENTRY_FORMAT} modules {MODULE_FORMAT}",
        _code_version(),
        _target(),
        f"options {sorted(options.items())!r} debug {int(debug)}",
        *(f"input {i} {_val_text(t)}" for i, t in enumerate(inputs)),
        *_shape_env_text(shape_env, inputs),
        *_graph_text(gm),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------
# the entry


@dataclasses.dataclass
class KernelEntry:
    sha: str  # the kernel module's content key in triton/kernels
    is_reduction: bool
    persistent: bool
    has_atomics: bool
    n_ptrs: int


@dataclasses.dataclass
class Entry:
    wrapper: str  # the wrapper module's content key in triton/wrappers
    kernels: dict[str, KernelEntry]
    consts: dict[str, tuple[str, Any]]  # see `pack_const`
    out_spec: Any  # pytree spec, or None
    guards: list[Any]  # the ShapeGuards the compile added to the shape env (expr, where made)
    kernel_infos: list[KernelInfo]  # the report's, paths as written
    extern_calls: list[str]
    fallback_ops: dict[str, int]
    fallback_reasons: dict[str, str]


class Uncacheable(Exception):
    """A wrapper constant with no stable name: the graph is compiled every time."""


def pack_const(c: Any, gm: torch.fx.GraphModule) -> tuple[str, Any]:
    """A wrapper constant as something an entry can hold: ops by name, tensors by
    the caller's attribute that holds them (read from the graph module at load),
    dtypes, devices and module-level functions by pickle (checked by a round trip)."""
    if isinstance(c, torch._ops.OpOverload):
        return "op", (c._schema.name, c._overloadname)
    if isinstance(c, torch.Tensor):
        for n in gm.graph.nodes:
            if n.op == "get_attr" and getattr(gm, str(n.target), None) is c:
                return "attr", str(n.target)
        raise Uncacheable("a tensor constant that is no attribute of the graph module")
    try:
        data = pickle.dumps(c)
        same = pickle.loads(data)
        ok = same is c or (type(same) is type(c) and same == c)
    except Exception:
        ok = False
    if not ok:
        raise Uncacheable(f"a constant of type {type(c).__name__} that cannot be stored")
    return "pickle", data


def unpack_const(kind: str, data: Any, gm: torch.fx.GraphModule) -> Any:
    if kind == "op":
        name, overload = data
        ns, op = name.split("::", 1)
        packet = getattr(getattr(torch.ops, ns), op)
        return getattr(packet, overload or "default")
    if kind == "attr":
        return getattr(gm, data)
    return pickle.loads(data)


MAX_VARIANTS = 8  # entries per key: one per distinct set of guards the compile added


def save(key: str, entry: Entry) -> None:
    """Add ``entry`` to the variants under ``key`` (sizes that made the compile add
    other guards are other variants of one key), newest first. Raises `Uncacheable`
    when the entry cannot be pickled (an output structure of an unregistered type)."""
    add_variant(store(), key, entry, "compiling again", MAX_VARIANTS, Uncacheable)
    count("writes")
    WRITTEN_HERE.add(key)


# keys this process wrote: a hit on one is a graph compiled again in the same run, not a
# warm start (`CompileReport.cache_local`)
WRITTEN_HERE: set[str] = set()


def _read(key: str) -> tuple[list[Entry], str]:
    """The variants stored under ``key``, or ([], why none)."""
    return read_variants(store(), key, Entry, "compiling again")


@dataclasses.dataclass
class Loaded:
    """A hit: the wrapper module, the kernel modules' sources and files (imported
    only when a launch needs Triton's binder: `runtime.warmload`), the consts."""

    wrapper: Any
    wrapper_path: str
    kernels: dict[str, tuple[str, str]]  # name -> (source, path)
    consts: dict[str, Any]
    entry: Entry


def load(key: str, gm: torch.fx.GraphModule, shape_env: Any) -> Loaded | str:
    """The first variant under ``key`` whose guards hold, loaded, its guards replayed
    into ``shape_env``; or why it is a miss (nothing added to the shape env then)."""
    variants, why = _read(key)
    for entry in variants:
        if not guards_hold(entry.guards, shape_env):
            why = "guard replay failed"
            continue
        try:
            consts = {k: unpack_const(kind, data, gm) for k, (kind, data) in entry.consts.items()}
        except Exception as e:  # an op that is gone, an attribute the module lacks
            log.warning("stoker cache: ignoring an entry of %s (%s)", store().path(key), e)
            return "corrupt entry"
        wrapper = load_stored("wrappers", entry.wrapper)
        kernels = {name: read_stored("kernels", k.sha) for name, k in entry.kernels.items()}
        if wrapper is None or any(v is None for v in kernels.values()):
            return "missing module"
        replay(entry.guards, shape_env)
        return Loaded(
            wrapper[0],
            str(wrapper[1]),
            {n: (m[1], str(m[0])) for n, m in kernels.items() if m is not None},
            consts,
            entry,
        )
    return why


def report_of(loaded: Loaded, report: CompileReport, guards_added: list[str]) -> None:
    e = loaded.entry
    paths = {n: p for n, (_, p) in loaded.kernels.items()}
    report.kernels = [
        dataclasses.replace(k, path=paths.get(k.name, k.path)) for k in e.kernel_infos
    ]
    report.extern_calls = list(e.extern_calls)
    report.fallback_ops = dict(e.fallback_ops)
    report.fallback_reasons = dict(e.fallback_reasons)
    report.guards_added = guards_added
    report.wrapper_path = loaded.wrapper_path
    note = (
        "(loaded from the compiled-graph cache; compile with STOKER_TRITON_GRAPH_CACHE=0 to see it)"
    )
    report.text_of["ir"] = note
    report.text_of["schedule"] = note
