"""What one `enable()` (or `set_default`) holds: the compiler, the dynamic flag, the counters."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from . import recapture

Compiler = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


@dataclass
class Stats:
    """Counters since the last `reset_stats()`.

    captures:   engine-cache misses (a new backward graph was captured)
    cache_hits: backwards replayed from the engine's cache
    compiles:   retrace + compile of a captured graph (first run and guard misses)
    recompiles: compiles caused by a failed guard of an earlier compile
    eager_runs: backwards run by the captured graph uncompiled (first run of each compile)
    fallbacks:  of those, runs after compiling was given up (a warning said why)
    segments:   aten sub-graphs handed to the compiler, over all compiles (a backward is
                split only at Python calls: hooks, custom backwards, size checks of their
                results; 0 with the default `aten_executor`, which runs the whole graph)
    disk_hits:  compiles loaded from the warm-start cache (``STOKER_CACHE_DIR/autograd/graphs``):
                no eager run, no retrace (the engine still walks its graph: ``captures``)
    disk_misses: lookups of that cache that found nothing usable (the log says why)
    """

    captures: int = 0
    cache_hits: int = 0
    compiles: int = 0
    recompiles: int = 0
    eager_runs: int = 0
    fallbacks: int = 0
    segments: int = 0
    disk_hits: int = 0
    disk_misses: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


RUNTIME_CALLS = [0]
"""Calls of stoker's runtime wrapper (the engine ran a graph stoker captured); the router
checks that a compiled backward it routed ran one."""

RELEASE_NODES = [False]
"""Set by the router while a compiled backward without ``retain_graph`` runs: the runtime
wrapper then marks the stoker Function nodes of its graph as backwarded (stoker-capture's
``LIVE`` count, the router's O(1) check)."""

_STOKER_CTX: dict[type, bool] = {}  # ctx type -> is a stoker Function's


def release_stoker_nodes(hooks: list[Any]) -> None:
    """The stoker Function ctxs among a compiled backward's lifted objects: backwarded."""
    kinds = _STOKER_CTX
    for h in hooks:
        t = type(h)
        k = kinds.get(t)
        if k is None:
            k = kinds[t] = (
                getattr(getattr(h, "_forward_cls", None), "_stoker_aot", None) is not None
            )
        if k:
            live = getattr(h, "_stoker_live", None)
            if live is not None:
                live.release()


RECOMPILE_REASONS: list[str] = []
"""Why each backward recompile happened, since the last `reset_stats()`
(`stoker_autograd.recompile_reasons()`): what changed in user terms (`origins.describe`),
then the failed guard of the newest variant, in terms of the graph's inputs
(``args[0][2].size()[0]``, ``args[1][3]``) with the value seen."""

_recompile_log = logging.getLogger("stoker.recompiles")


def note_recompile(graph: str, reason: str) -> None:
    """Record (and log on ``stoker.recompiles``) why `graph` is compiled again."""
    if len(RECOMPILE_REASONS) < 1000:  # a bound for a process that recompiles forever
        RECOMPILE_REASONS.append(f"{graph}: {reason}")
    _recompile_log.info("recompiling %s: %s", graph, reason)


def aten_executor(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The default compiler: run the core-aten GraphModule as it is."""
    return gm


@dataclass
class Session:
    compiler: Compiler = aten_executor
    dynamic: bool = True
    stats: Stats = field(default_factory=Stats)
    recompile_limit: int = 8
    warned: set[str] = field(default_factory=set)
    graphs: list[Any] = field(default_factory=list)  # CompiledBackward per capture, in order
    capture_reasons: list[list[str]] = field(default_factory=list)  # engine's miss reasons
    # `recapture`'s signatures, newest last: one list for every session (the engine's
    # cache, and so what a recapture is compared with, outlives a session)
    signatures: list[list[str]] = field(default_factory=lambda: recapture.SIGNATURES)

    def config(self) -> tuple[Any, bool, int]:
        """What the graphs this session captures are compiled for: the engine's cache can
        serve a session of the same config (`engine`)."""
        return (self.compiler, self.dynamic, self.recompile_limit)
