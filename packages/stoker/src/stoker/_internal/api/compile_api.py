"""`stoker.compile`: Dynamo as the frontend, stoker's backend behind it.

``stoker.compile(model)`` is ``torch.compile(model, backend=StokerBackend(options))``
plus two things torch.compile's public signature cannot pass: Dynamo's
final guards (for the report) and its guard-failure reasons (recompiles).
It calls ``torch._dynamo.optimize``, which is what ``torch.compile`` calls.
"""

from __future__ import annotations

import atexit
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from ..config import CompileOptions, ensure_interpret_env
from ..report.report import Report
from .backend import SWITCH, StokerBackend

T = TypeVar("T", bound=Callable[..., Any])

_LAST: list[Report] = []  # the report of the most recent stoker.compile, for last_report()
_TO_FLUSH: list[Report] = []  # reports with a path, rewritten at exit (autograd counters)
# `stoker explain` sets this to a list: `stoker.reset()` then keeps the reports it drops
# there (with compiled autograd's counters as they were), so explain can still write them.
_KEEP_AT_RESET: list[list[Report]] = []


def compile(
    model_or_fn: T,
    *,
    dynamic: bool | None = None,
    backend: str = "auto",
    compiled_autograd: bool = True,
    memory_budget: float | None = None,
    report: str | None = None,
    **options: Any,
) -> T:
    """Compile a module or function for training with stoker.

    Args:
        model_or_fn: an ``nn.Module`` or a function of tensors.
        dynamic: None (automatic: static first, a size seen to change recompiles once as
            symbolic), True (symbolic sizes from the start) or False (always static).
        backend: "auto" (Triton on CUDA inputs; on the CPU, fused C kernels, or the
            aten executor where no C compiler is found), "aten", "c" (C kernels built by
            the system's compiler), "triton" or "interpret" (Triton kernels under
            ``TRITON_INTERPRET=1``, which this sets in ``os.environ`` now, before any
            kernel is jitted).
        compiled_autograd: capture and compile the backward of this model (and of any
            stoker-compiled forward) with stoker-autograd; other backwards in the process
            keep the eager engine.  ``stoker.autograd_enabled(True/False)`` widens or
            pauses it for a block, ``stoker.reset()`` turns it off.
        memory_budget: fraction [0, 1] of forward activations the partitioner may save
            (0 recomputes all it may, 1 saves all; None: the partitioner decides).
        report: write the HTML compile report here (default: ``STOKER_REPORT``).
        **options: fullgraph, partitioner ("min_cut" | "default"), recompile_limit,
            mode ("default": one heuristic Triton config per kernel; "max-autotune": timed on
            the GPU, choices cached on disk),
            extra (a dict passed to stoker-capture).

    Returns the compiled module (a ``torch._dynamo`` OptimizedModule sharing the
    original's parameters) or function; its ``stoker_report`` attribute is the `Report`.
    """
    opts = CompileOptions.from_kwargs(
        dynamic=dynamic,
        backend=backend,
        compiled_autograd=compiled_autograd,
        memory_budget=memory_budget,
        report=report,
        **options,
    )
    if opts.backend == "interpret":
        ensure_interpret_env()  # before triton jits anything
    import torch
    import torch._dynamo

    be = StokerBackend(opts)  # with Dynamo imported: it listens to Dynamo's compiles
    be.exports_guards = True
    be.name_hint = _name_of(model_or_fn)

    kwargs: dict[str, Any] = {
        "nopython": opts.fullgraph,
        "dynamic": opts.dynamic,
        "guard_export_fn": be.on_guards,
        "guard_fail_fn": be.on_guard_fail,
    }
    # recompile_limit is a keyword of optimize in torch 2.13; older releases read the config.
    target = getattr(torch._dynamo.eval_frame, "_optimize", torch._dynamo.optimize)
    if "recompile_limit" in inspect.signature(target).parameters:
        kwargs["recompile_limit"] = opts.recompile_limit
    else:
        _process_wide_recompile_limit(opts.recompile_limit)
    compiled: Any = torch._dynamo.optimize(be, **kwargs)(model_or_fn)
    if isinstance(compiled, torch.nn.Module) and torch.distributed.is_available():
        from ..distributed import distributed as ddp

        if isinstance(model_or_fn, torch.nn.parallel.DistributedDataParallel):
            ddp.adopt(model_or_fn, opts.compiled_autograd)
        ddp.wrap_forward(compiled, opts.compiled_autograd)
    if opts.compiled_autograd:
        from .backend import autograd_compiler

        SWITCH.turn_on(
            compiler=autograd_compiler(opts, be.report), dynamic=opts.dynamic is not False
        )
    _LAST[:] = [be.report]
    if be.report.path:
        _TO_FLUSH.append(be.report)
        be.report.flush()
    try:
        compiled.stoker_report = be.report
    except AttributeError:  # pragma: no cover - a callable that refuses attributes
        pass
    return compiled  # type: ignore[no-any-return]


def _process_wide_recompile_limit(limit: int) -> None:
    """Torches before 2.13 take no recompile limit per compiled function: Dynamo reads
    ``torch._dynamo.config.recompile_limit`` at every frame. A limit other than the
    config's is set there, for every compiled function of the process, with a warning
    that says so."""
    import torch
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    now = getattr(config, name)
    if now == limit:
        return
    warnings.warn(
        f"stoker.compile(recompile_limit={limit}): torch {torch.__version__} takes no "
        f"limit per compiled function, so torch._dynamo.config.{name} is set from "
        f"{now} to {limit}, for every compiled function in this process (torch 2.13 "
        "keeps it per function).",
        stacklevel=3,
    )
    setattr(config, name, limit)


def current_reports() -> list[Report]:
    """The reports `stoker.reset()` would drop that hold a compile: the last
    `stoker.compile`'s and the default ``"stoker"`` backend's."""
    import sys

    found = list(_LAST)
    stoker = sys.modules.get("stoker")
    default = getattr(stoker, "_DEFAULT_BACKEND", None) or []
    found += [be.report for be in default]
    return [r for r in found if r.compiles]


def keep_reports_at_reset() -> None:
    """Called by `stoker.reset()` first: hand the reports it is about to drop to
    `stoker explain`, when explain is running the script."""
    if not _KEEP_AT_RESET:
        return
    from .backend import _autograd_stats

    kept = _KEEP_AT_RESET[-1]
    for r in current_reports():
        if all(r is not k for k in kept):
            r.autograd = _autograd_stats()
            kept.append(r)


def _name_of(obj: Any) -> str:
    import torch

    if isinstance(obj, torch.nn.Module):
        return f"{type(obj).__name__}.forward"
    return str(
        getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    )


def last_report() -> Report | None:
    """The `Report` of the most recent `stoker.compile` call (None before the first),
    with compiled autograd's counters and reasons as they are now (a backward runs
    after the compile that made the report)."""
    if not _LAST:
        return None
    from .backend import _autograd_stats

    r = _LAST[0]
    r.autograd = _autograd_stats()
    return r


@atexit.register
def _flush_at_exit() -> None:
    from .backend import _autograd_stats

    for r in _TO_FLUSH:
        try:
            r.autograd = _autograd_stats()
            r.distributed = _distributed_summary()
            r.flush()
        except Exception:
            pass


def _distributed_summary() -> dict[str, Any]:
    """`distributed.summary()` when torch.distributed was used, else {} (never raises)."""
    import sys

    if "stoker._internal.distributed.distributed" not in sys.modules:
        return {}
    try:
        from ..distributed.distributed import summary

        return summary()
    except Exception as e:  # the report must not fail the program at exit
        return {"error": f"{type(e).__name__}: {e}"}
