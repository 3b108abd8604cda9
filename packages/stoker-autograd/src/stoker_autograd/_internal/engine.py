"""Turning stoker's compiled autograd on and off around torch's engine hook."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from . import recapture
from .capture import CaptureInstance
from .session import RECOMPILE_REASONS, Compiler, Session, Stats, aten_executor

STATS = Stats()
"""Process-wide counters (`stats()`); every session adds to them."""

_hook = torch._C._dynamo.compiled_autograd


class _State:
    """The stack of active sessions (`on()`/`enable()` nest)."""

    def __init__(self) -> None:
        self.stack: list[tuple[Session, Any, Any]] = []  # (session, prior factory, prior dynamic)
        self.last_factory_owner: object | None = None


_STATE = _State()


def _factory(session: Session) -> CaptureInstance:
    return CaptureInstance(session)


def on(compiler: Compiler | None = None, dynamic: bool = True, recompile_limit: int = 8) -> Session:
    """Register stoker's compiler instance with the engine until the matching `off()`."""
    session = Session(
        compiler=compiler or aten_executor,
        dynamic=bool(dynamic),
        stats=STATS,
        recompile_limit=recompile_limit,
    )
    factory = functools.partial(_factory, session)
    # The engine's cache is process-global and not keyed by factory: clear it whenever
    # the instance changes, so neither stoker's nor torch's graphs replay for the other.
    _hook.clear_cache()
    prior_factory, prior_dynamic = _hook.set_autograd_compiler(factory, bool(dynamic))  # type: ignore[arg-type]
    multithreading = torch.autograd.set_multithreading_enabled(False)
    multithreading.__enter__()
    _STATE.stack.append((session, (prior_factory, prior_dynamic), multithreading))
    return session


def off() -> None:
    """Undo the last `on()`: restore whatever was registered before it."""
    if not _STATE.stack:
        raise RuntimeError("stoker_autograd.off() without a matching on()")
    _session, (prior_factory, prior_dynamic), multithreading = _STATE.stack.pop()
    multithreading.__exit__(None, None, None)
    _hook.set_autograd_compiler(prior_factory, prior_dynamic)
    _hook.clear_cache()


@contextlib.contextmanager
def enable(
    compiler: Compiler | None = None, dynamic: bool = True, recompile_limit: int = 8
) -> Iterator[Session]:
    """Capture ``loss.backward()`` / ``torch.autograd.grad`` into one graph inside this block.

    ``compiler(gm, example_inputs) -> callable`` compiles the retraced core-aten
    graph (default: run it as is).  With ``dynamic`` sizes are graph inputs, so a
    new batch size reuses the captured graph.
    """
    session = on(compiler, dynamic, recompile_limit)
    try:
        yield session
    finally:
        off()


def is_enabled() -> bool:
    return bool(_STATE.stack)


def stats() -> dict[str, int]:
    """Counters: captures, cache_hits, compiles, recompiles, eager_runs, fallbacks, segments."""
    return STATS.as_dict()


def cache_outcomes() -> dict[str, int]:
    """The warm-start cache's outcomes in this process: ``hit``, ``miss (why)``,
    ``uncacheable (why)``, ``write`` (docs/autograd.md, "Warm start")."""
    from . import graphstore

    return dict(graphstore.outcomes)


def recompile_reasons() -> list[str]:
    """Why each backward was compiled again since `reset_stats()` (one line per recompile,
    naming the graph, what changed in user terms (``dim 0 of saved tensor 0 of
    PowBackward0 changed 3 -> 5``) and the guard that failed with the value seen)."""
    return list(RECOMPILE_REASONS)


def recapture_reasons() -> list[str]:
    """Why each backward was captured again since `reset_stats()` (one line per
    recapture, naming the graph and how its autograd nodes differ from the closest
    earlier capture: ``AccumulateGrad of fc1.weight: .grad None -> .grad set``,
    ``no longer: AccumulateGrad of head.bias [.grad set]``)."""
    return list(recapture.RECAPTURE_REASONS)


def reset_stats() -> None:
    for k in STATS.as_dict():
        setattr(STATS, k, 0)
    RECOMPILE_REASONS.clear()
    recapture.RECAPTURE_REASONS.clear()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """The eager engine inside this block, even within `enable()` (the cache is kept)."""
    prior = _hook.set_autograd_compiler(None, False)
    try:
        yield
    finally:
        _hook.set_autograd_compiler(*prior)
