"""Stage 2 (compile): `aot_stage2_compile` partitions, compiles and wraps the graph.

The joint graph is split by a partitioner, forward and backward are compiled
with a pluggable ``compiler(gm, example_inputs) -> callable`` (at lowering
time, under the state's shape context, so every guard a compiler adds lands
in the guard set: seed 002), and wrapped in stoker's own autograd.Function.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from stoker_shapes import GuardSet, timing

from ..autocast import autocast_off
from ..config import Compiler, PartitionFn
from ..errors import GuardViolationError, StokerCaptureError
from ..graphs.lint import lint_graph
from ..runtime.boxed import call_boxed, mark_boxed
from ..runtime.function import AOTBackwardInfo, make_function_class, next_aot_id
from ..runtime.wrappers import Runtime, function_plan
from .capture import CapturedGraph
from .state import AOTState


@dataclass(slots=True)
class CompiledFn:
    """A compiled function: call it like the original function (or module)."""

    state: AOTState  # the pipeline state it came from (metadata, shape context)
    graph: CapturedGraph  # the captured graph it was compiled from
    partition: Any  # the `Partition` of a joint graph (None for inference)
    runtime: Runtime  # runs the compiled graph(s) with eager semantics
    function_class: type[torch.autograd.Function] | None  # stoker's Function (joint only)
    params: Callable[[], list[Any]]  # reads the parameters and buffers at call time
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage (pipeline runs)
    # check the guards on every call; off where a cache (GuardedCache, Dynamo) already did
    check_guards: bool = True
    guard_set: GuardSet | None = None  # read out of the shape context at the first check
    # what the captured-graph cache did: "hit", "miss (why)", "uncacheable: why"; "" when off
    cache_outcome: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.check_guards:
            self._check(args, kwargs)
        return self.runtime(self.primals(args, kwargs))

    def guards(self) -> GuardSet:
        """The guards of this compilation (read out after the last stage, once)."""
        if self.guard_set is None:
            self.guard_set = self.state.ctx.produce_guards()
        return self.guard_set

    def _check(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        guards, self_ = self.guards(), self.state.module
        if not guards.check(args, kwargs, self_):
            why = guards.explain(args, kwargs, self_) or "guards failed"
            raise GuardViolationError(
                f"{self.state.name}: inputs rejected by the compiled function's guards: {why}.  "
                "Recompile for these inputs (aot_function/aot_module do so automatically)."
            )

    def primals(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """The flat inputs of a call: parameters and buffers, then the user's tensors."""
        return [*self.params(), *self.state.flat_user_inputs(args, kwargs)]

    def as_text(self) -> str:
        kind = "joint" if self.graph.joint else "inference"
        took = ", ".join(f"{k} took {v * 1e3:.0f} ms" for k, v in self.timings.items())
        lines = [f"CompiledFn({self.state.name}, {kind})" + (f"  # {took}" if took else "")]
        if self.partition is not None:
            lines.append(self.partition.report())
            lines.append("forward:" + self.partition.fw.code)
            lines.append("backward:" + self.partition.bw.code)
        else:
            lines.append(self.graph.gm.code)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.as_text()


def example_inputs(gm: fx.GraphModule) -> list[Any]:
    """Fake example inputs of a graph: its placeholders' ``meta['val']``."""
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def run_compiler(compiler: Compiler, gm: fx.GraphModule, state: AOTState) -> Callable[..., Any]:
    """Compile ``gm`` under the state's shape context (its guards join the guard set)."""
    with state.ctx.tracing():
        return compiler(gm, example_inputs(gm))


def _default_partition() -> PartitionFn:
    from ..partition.core import default_partition

    return default_partition


def aot_stage2_compile(
    state: AOTState,
    graph: CapturedGraph,
    compiler: Compiler | None = None,
    *,
    partition: PartitionFn | None = None,
) -> CompiledFn:
    """Partition (joint), compile forward and backward, wrap them with eager semantics.

    ``compiler`` overrides ``state.config.fw_compiler`` (and the backward's, unless
    ``config.bw_compiler`` is set).  ``partition`` overrides ``config.partition``.
    Runs with autocast off: the graph holds its casts, and a compiler that runs or
    fake-propagates ops must not see them cast again.
    """
    with autocast_off():
        return _stage2_compile(state, graph, compiler, partition)


def _stage2_compile(
    state: AOTState,
    graph: CapturedGraph,
    compiler: Compiler | None,
    partition: PartitionFn | None,
) -> CompiledFn:
    cfg = state.config
    fw_compiler = compiler or cfg.fw()
    bw_compiler = cfg.bw_compiler or fw_compiler
    env = state.ctx.shape_env
    if not graph.joint:
        # inference: one graph, no autograd
        fw = run_compiler(fw_compiler, graph.gm, state)
        rt = Runtime(state.meta, state.fake_primals, env, fw, None, None, state.name)
        return CompiledFn(state, graph, None, rt, None, state.param_getter())
    # partition the joint graph into forward and backward
    part_fn = partition or cfg.partition or _default_partition()
    extra = {} if cfg.memory_budget is None else {"memory_budget": cfg.memory_budget}
    with timing.timed("partition"):
        part = part_fn(graph.gm, num_fw_outputs=graph.num_fw_outputs, **extra)
    if cfg.debug_checks:
        lint_graph(part.fw, "stage 2 (partitioned forward)")
        lint_graph(part.bw, "stage 2 (partitioned backward)")
    # compile the forward now, the backward now (default) or at its first use
    fw = run_compiler(fw_compiler, part.fw, state)
    if cfg.lazy_backward:
        bw: Callable[..., Any] = _LazyBackward(
            bw_compiler, part.bw, state, cfg.lazy_backward_fallback
        )
    else:
        bw = run_compiler(bw_compiler, part.bw, state)
    # wrap both in stoker's autograd.Function, with the runtime wrappers around it
    info = AOTBackwardInfo(
        part.bw, len(part.saved_symints), len(part.saved_tensors), graph.num_tangents, next_aot_id()
    )
    plan = function_plan(state.meta, graph.num_fw_outputs, state.name)
    fn_cls = make_function_class(info, plan, fw, bw)
    rt = Runtime(state.meta, state.fake_primals, env, None, fn_cls, plan, state.name)
    return CompiledFn(state, graph, part, rt, fn_cls, state.param_getter())


class _LazyBackward:
    """Compiles the backward at its first call, with the shape env frozen.

    Anything the compilation would assume about shapes (a guard, a
    specialization) could no longer be checked before the forward runs, so it
    is an error here, not a silently ignored guard; with ``fallback`` the graph
    then runs as it is (the aten executor: right at every size the forward's
    guards admit), and a warning says so.
    """

    def __init__(
        self, compiler: Compiler, gm: fx.GraphModule, state: AOTState, fallback: bool = False
    ) -> None:
        self.compiler, self.gm, self.state, self.fallback = compiler, gm, state, fallback
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        return self.call_boxed(list(args))

    def call_boxed(self, args: list[Any]) -> Any:
        """Called with the list (`call_boxed`): the compiled backward frees each saved
        tensor after its last reader, as one compiled eagerly does."""
        if self.compiled is None:
            compiled = self._compile_or_fall_back() if self.fallback else self._compile()
            # a graph run as is (the aten executor): boxed, as make_function_class does
            self.compiled = (
                mark_boxed(compiled) if isinstance(compiled, fx.GraphModule) else compiled
            )
        return call_boxed(self.compiled, args)

    def _compile_or_fall_back(self) -> Callable[..., Any]:
        """`_compile`, or the graph as it is (a copy made first: a compiler that failed
        half-way may have changed the graph it was given)."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.gm.graph, {}))
        kept = fx.GraphModule(self.gm, graph, type(self.gm).__name__)
        try:
            return self._compile()
        except _LateGuardError as e:
            warnings.warn(
                f"{self.state.name}: its backward, compiled at its first call, needed a new "
                f"assumption about input shapes {e.detail}, too late to be guarded; it runs "
                "uncompiled (the aten executor).",
                stacklevel=4,
            )
            return kept

    def _compile(self) -> Callable[..., Any]:
        env = self.state.ctx.shape_env
        n_guards, repl = len(env.guards), dict(env.replacements)
        ignored = _ignored_guards(env)
        was_frozen = env.frozen
        # torch 2.13 can raise at the new guard itself; older ones only count it (hasattr)
        strict = hasattr(env, "_error_on_new_guards")
        was_strict = getattr(env, "_error_on_new_guards", False)
        env.freeze()
        if strict:
            env._error_on_new_guards = True
        try:
            with self.state.ctx.tracing():
                compiled = self.compiler(self.gm, example_inputs(self.gm))
        except Exception as e:
            if type(e).__name__ != "_ShapeEnvGuardError":
                raise
            raise self._error(f"({e})") from e
        finally:
            env.frozen = was_frozen
            if strict:
                env._error_on_new_guards = was_strict
        added = len(env.guards) - n_guards + _ignored_guards(env) - ignored
        if added or dict(env.replacements) != repl:
            raise self._error(f"({added} new guard(s))")
        return compiled

    def _error(self, detail: str) -> StokerCaptureError:
        return _LateGuardError(
            detail,
            f"{self.state.name}: compiling the backward lazily (lazy_backward=True) needed a new "
            f"assumption about input shapes {detail}, which can no longer be guarded.  Compile "
            "the backward at lowering time (lazy_backward=False) so its guards join the "
            "forward's.",
        )


class _LateGuardError(StokerCaptureError):
    """A lazily compiled backward needed a new guard on the input sizes (``detail``)."""

    def __init__(self, detail: str, message: str) -> None:
        super().__init__(message)
        self.detail = detail


def _ignored_guards(env: Any) -> int:
    """Guards a frozen shape env dropped (the counter's name differs across versions)."""
    c = env.counter
    return int(c.get("ignored_backward_guard", 0)) + int(c.get("ignored_backward_guards", 0))
