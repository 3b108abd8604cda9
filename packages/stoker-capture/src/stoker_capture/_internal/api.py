"""The entry points: `aot_function`, `aot_module`, `export`, and the pipeline they run.

The pipeline reads as one function per use: `compile_pipeline` (state,
capture, compile) and `export_pipeline` (state, capture, export).  Calls to
`aot_function` / `aot_module` go through a `GuardedCache` per grad mode, so a
new shape recompiles (or is handled by a symbolic dim) and ``torch.no_grad()``
calls take a separately guarded inference graph.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from stoker_shapes import GuardedCache, ShapeContext, timing

from .autocast import autocast_state
from .capcache import CaptureCache
from .config import AOTConfig, Compiler
from .module_hooks import ModuleBackwardHooks
from .stages.capture import aot_stage1_graph_capture
from .stages.compile import CompiledFn, aot_stage2_compile
from .stages.state import DynamicShapes, create_aot_state

if TYPE_CHECKING:  # export and partition: imported where they run (not on a warm start)
    from .stages.export import ExportedGraph


def compile_pipeline(
    fn: Callable[..., Any] | torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    config: AOTConfig,
    compiler: Compiler | None = None,
    *,
    ctx: ShapeContext | None = None,
    fake_args: tuple[Sequence[Any], Mapping[str, Any]] | None = None,
    cache: CaptureCache | None = None,
) -> CompiledFn:
    """fn -> compiled function, stage by stage (guards land in ``ctx``).

    ``cache``: the captured-graph cache of this call (capcache.py); a hit resumes
    at the compile step with the stored forward metadata, graphs and partition.
    """
    took: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        # a capture stored before (any process): skip the forward run, capture and partition
        with _timed(took, "cache"):
            hit = cache.load() if cache is not None else None
        if hit is not None:
            state = create_aot_state(
                fn, args, kwargs, config, stack, ctx=ctx, fake_args=fake_args, meta=hit.meta
            )
            with _timed(took, "compile"):
                compiled = aot_stage2_compile(
                    state, hit.graph, compiler, partition=lambda *a, **k: hit.partition
                )
            compiled.timings = took
            return compiled
        # 0. fake inputs; forward metadata (mutations, aliases, requires_grad)
        with _timed(took, "state"):
            state = create_aot_state(fn, args, kwargs, config, stack, ctx=ctx, fake_args=fake_args)
        # 1. functional core-aten graph: joint when training, else inference
        with _timed(took, "capture"):
            graph = aot_stage1_graph_capture(state)
        # 2. partition, compile forward and backward, wrap in stoker's autograd.Function
        with _timed(took, "compile"):
            partition = None
            if cache is not None and graph.joint:  # noted right after partitioning
                from .partition.core import default_partition

                partition = cache.watch(config.partition or default_partition, graph)
            elif cache is not None:
                cache.snapshot(graph)  # noted before the compiler runs
            compiled = aot_stage2_compile(state, graph, compiler, partition=partition)
        if cache is not None:
            with timing.timed("cache write", "captured-graph cache write"):
                cache.save(state.meta, graph)
    compiled.timings = took
    return compiled


def export_pipeline(
    fn: Callable[..., Any] | torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    config: AOTConfig,
    dynamic_shapes: DynamicShapes = None,
) -> ExportedGraph:
    """fn -> exported graph with guards, stage by stage."""
    took: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        # 0. fake inputs (dynamic only where dynamic_shapes says); forward metadata
        with _timed(took, "state"):
            ctx = ShapeContext(policy="static")
            state = create_aot_state(
                fn, args, kwargs, config, stack, ctx=ctx, dynamic_shapes=dynamic_shapes
            )
        # 1. functional core-aten graph (joint for the researcher's path)
        with _timed(took, "capture"):
            graph = aot_stage1_graph_capture(state)
        # 2. signature, parameters, guards (read out last)
        with _timed(took, "export"):
            from .stages.export import aot_stage2_export

            exported = aot_stage2_export(state, graph)
    exported.timings = took
    return exported


# what `stoker_shapes.timing`'s listener hears of a pipeline stage (none: only its parts)
_MARKS: dict[str, tuple[str, str]] = {
    "cache": ("cache load", "captured-graph cache load"),
    "state": ("capture", "capture: fake inputs, forward metadata"),
    "capture": ("capture", "capture: joint graph"),
}


@contextlib.contextmanager
def _timed(took: dict[str, float], stage: str) -> Iterator[None]:
    """Stamp a stage's result with how long it took (seconds), for as_text and reports."""
    t0, mark = time.perf_counter(), timing.start()
    try:
        yield
    finally:
        took[stage] = time.perf_counter() - t0
        if stage in _MARKS:
            timing.done(_MARKS[stage][0], mark, _MARKS[stage][1])


def export(
    module_or_fn: Callable[..., Any] | torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: DynamicShapes = None,
    joint: bool = False,
    *,
    debug_checks: bool = False,
) -> ExportedGraph:
    """Capture ``module_or_fn`` on ``args`` as a guarded, saveable graph.

    ``dynamic_shapes``: like torch.export, one spec per argument (a dict
    ``{dim: Dim}`` or a list of `Dim`/None), as a sequence or a dict by argument
    name.  Unnamed dims are static.  ``joint=True`` captures forward and
    backward (resume with ``aot_stage2_compile(ep.state, ep.captured)``).
    """
    config = AOTConfig(mode="joint" if joint else "inference", dynamic="static", guard_params=False)
    if debug_checks:
        config.debug_checks = True
    with torch.set_grad_enabled(joint):
        return export_pipeline(module_or_fn, tuple(args), kwargs, config, dynamic_shapes)


class AOTCompiled:
    """What `aot_function` / `aot_module` return: call it like the original.

    One `GuardedCache` per grad mode and autocast state: training calls compile a
    joint graph, ``torch.no_grad()`` calls an inference graph, each guarded
    separately; a graph traced under autocast holds its casts, so it serves only
    calls under the same autocast state (device types and dtypes).
    """

    def __init__(
        self,
        fn: Callable[..., Any] | torch.nn.Module,
        config: AOTConfig,
        compiler: Compiler | None,
        limit: int = 8,
    ) -> None:
        self.fn = fn
        self.config = config
        self.compiler = compiler
        self.module = fn if isinstance(fn, torch.nn.Module) else None
        name = (
            type(fn).__qualname__ if self.module is not None else getattr(fn, "__qualname__", "fn")
        )
        self.name = name
        self.limit = limit
        # one cache per grad mode, autocast state, and module state no input guard can read
        # but that changes the graph: train/eval flags (dropout, BatchNorm), forward hooks
        self._submodules = list(self.module.modules()) if self.module is not None else []
        # backward hooks: the module's own run around each call, others raise (module_hooks.py)
        self._hooks = (
            ModuleBackwardHooks(self.module, f"aot_module({name})")
            if self.module is not None
            else None
        )
        self.caches: dict[tuple[Any, ...], GuardedCache[CompiledFn]] = {}
        if self.module is not None:
            functools.update_wrapper(self, self.module.forward)  # type: ignore[arg-type]
        elif callable(fn):
            functools.update_wrapper(self, fn)

    def _compile(
        self, grad: bool, ctx: ShapeContext, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> CompiledFn:
        hidden: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self._hooks is not None:
            if grad:
                self._hooks.check()
            hidden = self._hooks.hidden()
        with torch.set_grad_enabled(grad), hidden:
            compiled = compile_pipeline(self.fn, args, kwargs, self.config, self.compiler, ctx=ctx)
        compiled.check_guards = False  # the cache checks them before every call
        return compiled

    def _cache(self, grad: bool) -> GuardedCache[CompiledFn]:
        autocast = autocast_state()
        key = (grad, autocast, _module_state(self._submodules))
        cache = self.caches.get(key)
        if cache is None:
            mode = "grad" if grad else "no_grad"
            if self.module is not None:
                mode += ", train" if self.module.training else ", eval"
            for device, dtype in autocast:
                mode += f", {device} autocast {str(dtype).removeprefix('torch.')}"
            cache = self.caches[key] = GuardedCache(
                functools.partial(self._compile, grad),
                limit=self.limit,
                policy=self.config.dynamic,
                name=f"{self.name} ({mode})",
            )
        return cache

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        around = self._hooks.around() if grad and self._hooks is not None else None
        if around is not None:  # the module's backward hooks, as nn.Module.__call__ sets them
            args = tuple(around.setup_input_hook(args))  # type: ignore[no-untyped-call]
        compiled = self._cache(grad).lookup(args, kwargs, self.module)
        assert compiled is not None  # no fallback: a miss compiles or raises
        out = compiled(*args, **kwargs)
        return out if around is None else around.setup_output_hook(out)  # type: ignore[no-untyped-call]

    def cache_stats(self, grad: bool = True) -> dict[str, Any]:
        """Hits, misses, recompile reasons of the cache for this grad mode (and the
        current autocast state and module train/eval flags)."""
        return self._cache(grad).stats()


def _module_state(mods: list[torch.nn.Module]) -> tuple[Any, ...]:
    """Train flags and hook counts of every submodule (and the global hooks): forward
    hooks are traced into the graph; a new backward hook is checked by a new compile
    (module_hooks.py)."""
    g = torch.nn.modules.module
    return (
        len(g._global_forward_hooks),
        len(g._global_forward_pre_hooks),
        len(g._global_backward_hooks),
        len(g._global_backward_pre_hooks),
        *(
            (
                m.training,
                len(m._forward_hooks),
                len(m._forward_pre_hooks),
                len(m._backward_hooks),
                len(m._backward_pre_hooks),
            )
            for m in mods
        ),
    )


def aot_function(
    fn: Callable[..., Any],
    compiler: Compiler | None = None,
    *,
    dynamic: str = "auto",
    bw_compiler: Compiler | None = None,
    partition: Callable[..., Any] | None = None,
    memory_budget: float | None = None,
    lazy_backward: bool = False,
    lazy_backward_fallback: bool = False,
    debug_checks: bool | None = None,
    limit: int = 8,
) -> AOTCompiled:
    """Compile ``fn`` ahead of time per guarded input signature (None: the aten executor).

    ``dynamic``: "auto" (a size that changes recompiles once, symbolically),
    "static" or "dynamic".  A module is compiled as `aot_module` says.
    ``lazy_backward``: compile the backward at its first call; a compile that then needs
    a new guard raises, or with ``lazy_backward_fallback`` runs the graph uncompiled.
    """
    cfg = AOTConfig(
        partition=partition,
        memory_budget=memory_budget,
        fw_compiler=compiler,
        bw_compiler=bw_compiler,
        dynamic=dynamic,
        lazy_backward=lazy_backward,
        lazy_backward_fallback=lazy_backward_fallback,
    )
    if debug_checks is not None:
        cfg.debug_checks = debug_checks
    return AOTCompiled(fn, cfg, None, limit)


def aot_module(
    module: torch.nn.Module,
    compiler: Compiler | None = None,
    *,
    dynamic: str = "auto",
    bw_compiler: Compiler | None = None,
    partition: Callable[..., Any] | None = None,
    memory_budget: float | None = None,
    lazy_backward: bool = False,
    lazy_backward_fallback: bool = False,
    debug_checks: bool | None = None,
    limit: int = 8,
) -> AOTCompiled:
    """Compile ``module`` with its parameters and buffers lifted as inputs.

    Guards name parameters ``self.<path>``; replacing a parameter by one of
    another shape recompiles.  Options as in `aot_function`.  The module's own
    full backward hooks and backward pre-hooks run at every backward, around the
    compiled call; a backward hook on a submodule raises `UnsupportedError`
    (the traced backward would run it once, at trace time).
    """
    return aot_function(
        module,
        compiler,
        dynamic=dynamic,
        bw_compiler=bw_compiler,
        partition=partition,
        memory_budget=memory_budget,
        lazy_backward=lazy_backward,
        lazy_backward_fallback=lazy_backward_fallback,
        debug_checks=debug_checks,
        limit=limit,
    )
