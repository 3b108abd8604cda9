"""Runtime: kernel modules on disk, launchers with block-size choice and a
small autotuner, and helpers the generated wrapper calls. One file per job:

- `launcher.py`: `Launcher`, what the wrapper calls per kernel launch;
- `fastlaunch.py`: the lean launch path (compiled binaries called directly);
- `warmload.py`: a warm process launches the binaries an earlier one recorded;
- `autotune.py`: autotune results on disk;
- `layout.py`: input layouts, buffer prototypes and random seeds for the wrapper;
- here: the parallel precompile, and the names the wrappers import.

The generated modules themselves are stored and imported by `modcache/`; the
precompile runs in `compile/`'s workers. May import `modcache/` and `compile/`;
never `codegen/`, `lowering/` or the pipeline.

Cache layout under `$STOKER_CACHE_DIR` (default `~/.cache/stoker`):
`triton/kernels/<sha>.py` (kernel source, keyed by its content),
`triton/wrappers/<sha>.py` (wrapper source), `triton/autotune/<sha>.json`
(best config per size for one kernel), `triton/binaries/<sha>.json` (per kernel
and launch kind, the Triton binary an earlier process launched). Every file is a `stoker_shapes.DiskCache`
entry: written atomically, checked on read (a broken one is a miss, rewritten).
Triton keeps the compiled binaries in its own cache, keyed by the same source
and the launch options.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..modcache.modules import (
    MODULE_FORMAT,
    cache_dir,
    interpreting,
    load_module,
    module_store,
)
from ..modcache.srcmodule import exec_module
from .autotune import _Tuned
from .fastlaunch import no_target
from .launcher import Launcher, cdiv, next_pow2
from .layout import PRECOMPILE_SEED, check_layout, ensure_layout, new_seed, prototype

__all__ = [
    "MODULE_FORMAT",
    "PRECOMPILE_SEED",
    "Launcher",
    "_Tuned",
    "cache_dir",
    "cdiv",
    "check_layout",
    "ensure_layout",
    "exec_module",
    "interpreting",
    "launch_target",
    "load_module",
    "module_store",
    "native_target",
    "new_seed",
    "next_pow2",
    "precompile",
    "prototype",
]


def launch_target(launchers: dict[str, Launcher]) -> Callable[[], tuple[Any, ...] | None]:
    """What a generated wrapper calls once per graph call and passes to each launch
    (`Launcher.go`): the current device and stream and the launch hooks, read once
    `no_target` where no launcher launches lean (the interpreter)."""
    for lau in launchers.values():
        if lau.fast is not None:
            return lau.fast.target
    return no_target


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
    """Start compiling kernels ahead of their first launch, in parallel worker
    processes (GPU only), and return without waiting for them. `compile_graph`
    calls it for each kernel as soon as its module is loaded.

    `make_jobs()`: (launcher, example arguments, xnumel, rnumel) with the static
    sizes the wrapper will pass. Each configuration the launch will use (one, or
    the autotuner's under max-autotune) is compiled for this GPU through
    Triton's own binder, so the launch computes the same key and loads the
    binary from Triton's disk cache without compiling (`xcompile.submit_precompile`).
    Each launcher keeps its compiles' futures (`Launcher.pending`) and its first
    launch waits for them only: the caller goes on (a backward graph is lowered
    while the forward's kernels compile) and the first kernel waits for its own
    compile, not the whole graph's. Returns how many compiles were queued; a
    failure only costs the head start (the launch compiles, and reports errors,
    as usual)."""
    target = native_target(device)
    if target is None:
        return 0
    # (a graph of one kernel too: its compile overlaps what the caller does next)
    jobs = make_jobs()
    work = [
        (lau.path, args, lau.candidates(x, r, native=True)) for lau, args, x, r in jobs if lau.path
    ]
    try:
        from ..compile.xcompile import submit_precompile

        pending = submit_precompile(work, target)
    except Exception as e:  # no worker processes here: the launches compile
        logging.getLogger("stoker.kernels").info("precompile skipped (the launches compile): %s", e)
        return 0
    for lau, *_ in jobs:
        lau.pending = pending.get(lau.path or "", [])
    return sum(len(futs) for futs in pending.values())
