"""DistributedDataParallel under stoker: which reducer runs, and stoker's own.

DDP's C++ reducer reduces gradients from hooks on the parameters' AccumulateGrad
nodes.  The compiled-autograd engine hook cannot capture those hooks (the
reducer refuses with "Compiled autograd is not compatible with C++ DDP
Reducer"), so stoker picks one of two modes per DDP module, logged on the
``stoker.distributed`` topic and kept in the report:

==================  ====================================================================
mode                what reduces the gradients
==================  ====================================================================
``stoker_reducer``  compiled autograd on (the default).  DDP's reducer hooks are removed
                    and `BucketReducer` takes over: DDP's buckets (same sizes, same
                    order); the post-accumulate-grad hook of a bucket's last gradient
                    starts its all-reduce (async), so buckets are reduced during the
                    backward, in the captured graph right after their gradients; the
                    backward's final callback waits and writes ``.grad``.  After the
                    first backward (a hook per parameter) the buckets are rebuilt in
                    the order the gradients became ready, as DDP rebuilds its own, and
                    only each bucket's last gradient stays hooked (a cut per bucket).
``ddp_optimizer``   compiled autograd off.  DDP's C++ reducer stays; Dynamo's graph is
                    split at bucket boundaries (torch's DDPOptimizer, with DDP's own
                    first-bucket size), each piece compiled by stoker, so its backward
                    ends where a bucket's gradients are ready and the reducer's hooks
                    fire in between.
==================  ====================================================================

`BucketReducer` (``ddp_reducer.py``) keeps DDP's numerics (each gradient times ``1/world_size``, then a
summing all-reduce) and ``no_sync()`` (gradients accumulate locally; the next
synchronised backward reduces the sum).  What it does not do is refused by
`check_supported` with what to change.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch._dynamo
from torch.nn.parallel import DistributedDataParallel as DDP

from ..report import logs
from . import collectives
from .ddp_reducer import (
    BucketReducer,
    Collective,
    DDPRecord,
    DistributedConfigError,
    check_supported,
    first_bucket_bytes,
    refuse_join,
)

__all__ = ["Collective", "DistributedConfigError", "adopt", "on_graph", "summary", "wrap_forward"]

_LOG = logs.logger("distributed")


_RECORDS: list[DDPRecord] = []  # every DDP module stoker took over, oldest first


def adopt(ddp: Any, compiled_autograd: bool) -> DDPRecord:
    """Make ``ddp`` work under stoker (idempotent); returns its record."""
    rec: DDPRecord | None = getattr(ddp, "_stoker_ddp", None)
    if rec is not None:
        return rec
    if compiled_autograd:
        check_supported(ddp)
        rec = DDPRecord(
            "stoker_reducer",
            "compiled autograd is on: DDP's C++ reducer hooks cannot be captured",
        )
        if getattr(ddp, "_use_python_reducer", False):  # torch's per-parameter hooks
            for h in getattr(ddp, "_accum_grad_hooks", ()):
                h.remove()
        else:
            ddp._remove_autograd_hooks()
            ddp._use_python_reducer = True  # DDP's forward no longer drives its reducer
            _sync_buffers_around_forward(ddp)
        if ddp.gradient_as_bucket_view:
            _LOG.info(
                "DDP gradient_as_bucket_view=True: each .grad stays its own tensor (stoker's "
                "reducer copies the reduced bucket into it); DDP's results, not its memory saving"
            )
        refuse_join(ddp)
        ddp._stoker_reducer = BucketReducer(ddp, rec)  # type: ignore[assignment]
    else:
        rec = DDPRecord(
            "ddp_optimizer",
            "compiled autograd is off: DDP's reducer runs, the graph splits at bucket boundaries",
        )
    ddp._stoker_ddp = rec  # type: ignore[assignment]
    _RECORDS.append(rec)
    _LOG.info(
        "DDP(%s): mode %s (%s); buckets of at most %d bytes (the first %d): %s",
        type(ddp.module).__name__,
        rec.mode,
        rec.why,
        ddp.bucket_bytes_cap,
        first_bucket_bytes(ddp),
        rec.buckets or "DDP's own",
    )
    return rec


def _sync_buffers_around_forward(ddp: Any) -> None:
    """What DDP's forward does for buffers when its reducer drives it (broadcast_buffers)."""

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def pre(module: Any, args: Any) -> None:
        if ddp._check_sync_bufs_pre_fwd():
            ddp._sync_buffers()

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def post(module: Any, args: Any, out: Any) -> None:
        if ddp._check_sync_bufs_post_fwd():
            ddp._sync_buffers()
        ddp.require_forward_param_sync = torch.is_grad_enabled() and ddp.require_backward_grad_sync

    ddp.register_forward_pre_hook(pre)
    ddp.register_forward_hook(post)


def records() -> list[DDPRecord]:
    """Every DDP module stoker took over in this process, oldest first."""
    return list(_RECORDS)


# ---------------------------------------------------------------------- the forward side
_SPLITTING = threading.local()  # set while DDPOptimizer compiles the pieces of one graph


def _active_cpp_ddp() -> DDP | None:
    """The DDP module whose forward is running now with its C++ reducer, if any."""
    ddp: Any = DDP._active_ddp_module
    if ddp is None or getattr(ddp, "_use_python_reducer", False):
        return None
    return ddp  # type: ignore[no-any-return]


def on_graph(
    backend: Callable[[Any, Any], Any], gm: Any, example_inputs: Any, compiled_autograd: bool
) -> Any:
    """Called by the backend with each Dynamo graph; the compiled pieces when it split it.

    Inside a C++-reducer DDP forward: with compiled autograd, take the DDP over
    (`adopt`) and compile the graph whole (None); without, split it at DDP's
    bucket boundaries with DDP's own first-bucket size, unless Dynamo already did.
    """
    ddp = _active_cpp_ddp()
    if ddp is None or getattr(_SPLITTING, "on", False):
        return None
    if compiled_autograd:
        adopt(ddp, compiled_autograd=True)
        return None
    adopt(ddp, compiled_autograd=False)
    if torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer":
        return None  # Dynamo's DDPOptimizer is calling us with its pieces already
    from torch._dynamo.backends.distributed import DDPOptimizer

    splitter = DDPOptimizer(
        int(ddp.bucket_bytes_cap),
        backend_compile_fn=backend,
        first_bucket_cap=first_bucket_bytes(ddp),
    )
    _SPLITTING.on = True
    try:
        return splitter.compile_fn(gm, example_inputs)
    finally:
        _SPLITTING.on = False


def wrap_forward(compiled: torch.nn.Module, compiled_autograd: bool) -> None:
    """Route a compiled module's calls through `adopt` and stoker's graph split.

    Dynamo's own DDPOptimizer is turned off around the call (stoker splits in
    `on_graph`, with DDP's first-bucket size: Dynamo's asserts when buckets are
    smaller than 1 MiB), and a DDP that wraps the compiled module is taken over
    before the call, also when Dynamo does not compile again.
    """
    inner = compiled.forward
    dist = torch.distributed

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        # No process group, no DDP: nothing to take over, and Dynamo's DDPOptimizer (on
        # only while a DDP forward runs) cannot apply; the config patch would cost more
        # than the rest of a small model's call (~100 µs per step on our CPU bench)
        if not (dist.is_available() and dist.is_initialized()):
            return inner(*args, **kwargs)
        collectives.install()  # the report's collectives per step
        ddp = _active_cpp_ddp()
        if ddp is not None and compiled_autograd:
            adopt(ddp, compiled_autograd=True)
        with torch._dynamo.config.patch(optimize_ddp=False):
            return inner(*args, **kwargs)

    compiled.forward = forward  # type: ignore[method-assign]


def backward_collectives() -> list[dict[str, Any]]:
    """`comm_sites` of the newest backward graph stoker-autograd captured in the
    process-wide scope (the one `stoker.compile` sets; [] if none)."""
    import stoker_autograd

    session = stoker_autograd.default_session()
    if session is None or not session.graphs:
        return []
    return collectives.comm_sites(session.graphs[-1].gm.graph)


def step_summary(step: collectives.Step) -> dict[str, Any]:
    """One step's collectives for the report: counts by kind and phase, then each in order."""
    return {
        "compiled": step.compiled,
        "counts": step.counts(),
        "issued": [asdict(c) for c in step.issued],
    }


def summary() -> dict[str, Any]:
    """For the report: each DDP module's mode, buckets and collectives per step (the
    newest steps), where collectives can start in the newest backward graph, and the
    collectives issued through Python per step: the newest steps, and the newest
    eager and compiled ones (``last_eager``, ``last_compiled``) side by side."""
    ddps = [
        {
            "mode": r.mode,
            "why": r.why,
            "buckets": r.buckets,
            "steps": [
                [
                    {
                        "bucket": c.bucket,
                        "params": len(c.params),
                        "bytes": c.nbytes,
                        "after_grads": c.ready,
                    }
                    for c in s
                ]
                for s in r.steps[-4:]
            ],
        }
        for r in _RECORDS
    ]
    sites = backward_collectives()
    steps = collectives.steps()
    # every compiled backward ends in the final callbacks, and user code may have
    # post-accumulate-grad hooks: alone, neither says that anything is distributed
    plain = ("post_acc_grad_hook", "final callbacks")
    if not ddps and not steps and all(s["kind"] in plain for s in sites):
        return {}
    last = {
        f"last_{name}": step_summary(s) if s is not None else None
        for name, s in (
            ("eager", collectives.last(compiled=False)),
            ("compiled", collectives.last(compiled=True)),
        )
    }
    return {
        "ddp": ddps,
        "backward_sites": sites,
        "steps": [step_summary(s) for s in steps[-4:]],
        **last,
    }
