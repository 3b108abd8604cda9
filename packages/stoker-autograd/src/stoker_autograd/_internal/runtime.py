"""Running a captured backward: the engine's ``runtime_wrapper`` and `CompiledBackward`.

The engine calls ``runtime_wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_data)``
on every backward, hit or miss.  `CompiledBackward` keeps, per captured graph, a
list of compiled variants, each with the guards its retrace added:

1. a call whose arguments pass a variant's guards runs that variant;
2. otherwise the captured graph runs as is (its Python code calls the same
   functional backwards and hooks as eager), recording what the unpack hooks
   returned; then the graph is retraced with these shapes and compiled, and the
   next call runs the compiled variant (a recompile if it is not the first).

If the retrace fails, stoker warns once, naming the autograd node, and keeps
running the captured graph: the result is the same as eager, only slower.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from stoker_capture import autocast_off, eager_autograd_engine
from stoker_capture._internal.runtime.boxed import BoxedGraph, call_boxed, mark_boxed
from stoker_shapes import timing
from stoker_shapes._internal.gcfreeze import frozen_heap

from . import final_callbacks, graphstore, ops
from .capture import Captured
from .forward_dims import ForwardDims
from .graph import Position, graph_module
from .origins import describe
from .retrace import Retraced, concrete_values, retrace, unpack_index
from .segments import SegmentedBackward
from .session import (
    RELEASE_NODES,
    RUNTIME_CALLS,
    Session,
    aten_executor,
    note_recompile,
    release_stoker_nodes,
)


def runtime_wrapper(
    compiled_fn: CompiledBackward,
    inputs: list[Any],
    sizes: list[Any],
    scalars: list[Any],
    hooks: list[Any],
    packed_data: list[Any],
    *rest: Any,
) -> Any:
    # hooks may call backward; the graph is retraced and run as eager runs a backward
    # called outside autocast (a backward inside an autocast region must not cast again);
    # callbacks queued during the backward (FSDP2, the DDP reducer) run at its end;
    # the `on_backward_start` callables run first
    RUNTIME_CALLS[0] += 1
    t0 = timing.start()
    with eager_autograd_engine(), autocast_off(), final_callbacks.collecting():
        final_callbacks.run_start_callbacks()
        if RELEASE_NODES[0]:  # no retain_graph: its stoker nodes cannot be backwarded again
            release_stoker_nodes(hooks)
        out = compiled_fn(inputs, sizes, scalars, hooks, packed_data)
    if t0:  # someone listens (`stoker_shapes.timing`)
        timing.done("run backward", t0, "backward", f"backward graph {compiled_fn.capture_id}")
    return out if type(out) is list else list(out)  # the engine wants exactly a list


def finish_capture(
    session: Session,
    captured: Captured,
    sym_sources: dict[sympy.Symbol, tuple[str, int]],
    capture_id: int,
    origins: Mapping[tuple[str, int], str] | None,
    forward_dims: ForwardDims | None,
) -> tuple[Callable[..., Any], CompiledBackward]:
    """The end of a capture (`capture.Finish`): what the engine calls on every backward
    of this graph, ``(runtime_wrapper, compiled_fn)``.  The captured graph's FX graph is
    made, and the reordering passes run, at the first use of `CompiledBackward.gm`, which
    a warm-start cache hit never makes (its key is the text of the engine's walk)."""
    compiled = CompiledBackward(session, captured, sym_sources, capture_id, origins, forward_dims)
    return runtime_wrapper, compiled


@dataclass
class Variant:
    guards: Any
    fn: Callable[..., Any]
    arg_spec: list[tuple[int, int]]
    gm: fx.GraphModule
    values: dict[Position, int]  # the sizes it was compiled for
    # compiled for create_graph=True (grad mode on): run as differentiable aten ops,
    # whatever the compiler, so .grad keeps its history as in eager
    grad_mode: bool = False


class _Recorder(fx.Interpreter):
    """Runs the captured graph, recording the size of what each unpack hook returned."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.unpack_meta: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if (
            n.op == "call_function"
            and n.target is ops.call_hook
            and n.kwargs.get("hook_type") == "unpack_hook"
            and isinstance(out, torch.Tensor)
        ):
            self.unpack_meta[n.name] = (tuple(out.shape), out.stride(), out.dtype, out.device)
        return out


_log = logging.getLogger("stoker.autograd")
_anomaly_logged = False


def nan_checks(graph: fx.Graph) -> dict[fx.Node, tuple[str, int | None]]:
    """Where anomaly mode checks a captured graph: per autograd node (``autograd_node``
    meta), the node that yields its final outputs, with the name eager's engine gives
    it and, for the engine's check of one gradient, that gradient's index (None: the
    node's value is the list of outputs).  Eager checks a node's outputs after its
    post-hooks: the last post-hook where it has one, else each ``validate_outputs`` (and
    a custom Function's ``call_backward``, whose outputs the engine validates in C++)."""
    checks: dict[fx.Node, tuple[str, int | None]] = {}
    by_node: dict[str, tuple[list[fx.Node], list[fx.Node]]] = {}
    for n in graph.nodes:
        where = n.meta.get("autograd_node")
        if n.op != "call_function" or where is None:
            continue
        validates, post_hooks = by_node.setdefault(where, ([], []))
        if getattr(n.target, "__name__", "") == "validate_outputs" or n.target is ops.call_backward:
            validates.append(n)  # a custom Function's outputs: the engine checked them in C++
        elif n.target is ops.call_hook and n.kwargs.get("hook_type") == "post_hook":
            post_hooks.append(n)
    for validates, post_hooks in by_node.values():
        for n in post_hooks[-1:] or validates:
            checks[n] = (str(n.meta.get("autograd_fn", "?")), n.meta.get("stoker_out_index"))
    return checks


class _NanChecked(fx.Interpreter):
    """Runs a captured graph, raising eager's anomaly-mode error at the first autograd
    node that returns a NaN (`nan_checks`)."""

    def __init__(self, gm: fx.GraphModule, checks: dict[fx.Node, tuple[str, int | None]]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.checks = checks
        self.extra_traceback = False  # eager's message exactly, not with the FX node appended

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        check = self.checks.get(n)
        if check is not None:
            name, index = check
            values = out if isinstance(out, list | tuple) else [out]
            for i, v in enumerate(values):
                if _has_nan(v):
                    raise RuntimeError(
                        f"Function '{name}' returned nan values in its "
                        f"{i if index is None else index}th output."
                    )
        return out


def _has_nan(t: Any) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    if t.is_sparse:
        t = t._values()
    elif t.layout != torch.strided:
        t = t.values()
    with torch.no_grad():
        return bool(torch.isnan(t).any())


class CompiledBackward:
    """What the engine caches for one captured graph (its ``compiled_fn``)."""

    def __init__(
        self,
        session: Session,
        gm: fx.GraphModule | Captured,
        sym_sources: dict[sympy.Symbol, tuple[str, int]],
        capture_id: int,
        origins: Mapping[tuple[str, int], str] | None = None,
        forward_dims: ForwardDims | None = None,
    ) -> None:
        self.session = session
        # the captured graph after the reordering passes, or (root, the engine's walk,
        # name): made an FX graph, passed and made a module at the first use of `gm`
        self._gm = gm if isinstance(gm, fx.GraphModule) else None
        self._captured = None if isinstance(gm, fx.GraphModule) else gm
        self.sym_sources = sym_sources
        self.capture_id = capture_id
        # what each input source is, for recompile reasons (none: the guards' raw text)
        self.origins = origins
        # which sizes an inlined AOT backward's forward held symbolic (none: unknown)
        self.forward_dims = forward_dims
        self.variants: list[Variant] = []
        self.calls = 0
        self.failed: str | None = None  # why compiling was given up
        self.last_retraced: Retraced | None = None
        self.last_miss: str | None = None
        # positions seen to change, or held symbolic by the forward: symbolic from now on
        self.dynamic: set[Position] = set()
        # positions of the eager nodes around a symbolic forward: a symbol each
        self.free: set[Position] = set()
        # a dynamic position -> its group (`ForwardDims.seed`: one forward symbol each)
        self.groups: dict[Position, Position] = {}
        self._graph_text: str | None = None  # the disk-cache key's graph part ("": uncacheable)
        self._key: str | None = None  # the disk-cache key of the compile under way
        self._entry: list[dict[str, Any]] | None = None  # its retraced graph, serialized
        self._nan_checks: dict[fx.Node, tuple[str, int | None]] | None = None  # anomaly mode

    @property
    def _label(self) -> str:
        return f"backward graph {self.capture_id}"

    @property
    def gm(self) -> fx.GraphModule:
        """The captured graph after the reordering passes (made and run now if not yet)."""
        if self._gm is None:
            assert self._captured is not None
            root, walk, name = self._captured
            t0 = timing.start()
            from .. import passes  # a cache hit never runs them: not on a warm start

            self._gm = graph_module(root, passes.run_all(walk.to_graph()), name)
            timing.done("autograd retrace", t0, "reordering passes", self._label)
        return self._gm

    def __call__(
        self,
        inputs: list[Any],
        sizes: list[Any],
        scalars: list[Any],
        hooks: list[Any],
        packed: list[Any],
    ) -> Any:
        self.calls += 1
        stats = self.session.stats
        if self.calls > 1:
            stats.cache_hits += 1
        if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
            return self._run_checking_nans(inputs, sizes, scalars, hooks, packed)
        lists = (inputs, sizes, scalars, hooks, packed)
        gargs = (inputs, sizes, scalars)
        grad_mode = torch.is_grad_enabled()  # create_graph=True
        for v in self.variants:
            if v.grad_mode is grad_mode and v.guards.check(gargs, {}, None):
                return _run(v, lists)
        mine = [v for v in self.variants if v.grad_mode is grad_mode]
        if mine:  # why the newest variant did not fit (`recompile_reasons()`)
            self.last_miss = mine[-1].guards.explain(gargs, {}, None)
        if self.failed is None and len(self.variants) < self.session.recompile_limit:
            t0 = timing.start()
            warm = self._load(inputs, sizes, scalars)
            timing.done("cache load", t0, "compiled-autograd cache load", self._label)
            if warm is not None:
                return _run(warm, lists)
        if self.failed is not None or len(self.variants) >= self.session.recompile_limit:
            if self.failed is None:
                self.failed = f"recompile limit ({self.session.recompile_limit}) reached"
                self._warn(self.failed)
            stats.eager_runs += 1
            stats.fallbacks += 1
            return self.gm(inputs, sizes, scalars, hooks, packed)
        # The retrace after the run reads only metadata, which the run does not change.
        with frozen_heap():  # full GC walks skip the heap that was there before
            rec = _Recorder(self.gm)
            stats.eager_runs += 1
            out = rec.run(inputs, sizes, scalars, hooks, packed)
            if final_callbacks.take_skip_compile():  # the engine will capture another graph
                return out
            now = concrete_values(inputs, sizes, scalars, rec.unpack_meta, unpack_index(self.gm))
            self.dynamic, self.free, self.groups = self._shape_state(now)
            if mine:
                why = describe(self.last_miss, self.origins) if self.last_miss else "?"
                note_recompile(f"backward graph {self.capture_id}", why)
            self._compile(inputs, list(sizes), list(scalars), rec.unpack_meta, now)
        return out

    def _run_checking_nans(
        self,
        inputs: list[Any],
        sizes: list[Any],
        scalars: list[Any],
        hooks: list[Any],
        packed: list[Any],
    ) -> Any:
        """Anomaly mode (``torch.autograd.detect_anomaly()``): the captured graph runs
        uncompiled, and each autograd node's outputs are checked for NaN as eager's
        engine checks them (after its post-hooks), with eager's message.  Decided per
        call, not per capture: the engine's cache may replay a graph captured with
        anomaly mode off, and a graph captured with it on costs nothing once it is off."""
        global _anomaly_logged
        if not _anomaly_logged:
            _anomaly_logged = True
            _log.info(
                "anomaly mode is on: compiled backwards run uncompiled, each autograd node's "
                "outputs checked for NaN as the eager engine checks them"
            )
        if self._nan_checks is None:
            self._nan_checks = nan_checks(self.gm.graph)
        self.session.stats.eager_runs += 1
        out = _NanChecked(self.gm, self._nan_checks).run(inputs, sizes, scalars, hooks, packed)
        final_callbacks.take_skip_compile()  # nothing is compiled after this run anyway
        return out

    def _shape_state(
        self, now: dict[Position, int]
    ) -> tuple[set[Position], set[Position], dict[Position, Position]]:
        """``(dynamic, free, groups)``: the positions the next compile makes symbolic for
        the sizes ``now`` (`retrace.fake_inputs`).

        Automatic dynamic: a size that changed since the last compile becomes symbolic.
        At the first compile, the sizes an inlined AOT backward's forward already held
        symbolic are symbolic from the start, one symbol per forward symbol (``groups``),
        and the eager nodes' sizes that may follow them get a symbol each
        (`forward_dims`): a dynamic forward's backward compiles once, not static and
        then again."""
        dynamic, free, groups = set(self.dynamic), set(self.free), dict(self.groups)
        if not self.session.dynamic:
            return dynamic, free, groups
        if self.variants:
            last = self.variants[-1].values
            dynamic |= {p for p, v in now.items() if p in last and last[p] != v}
        elif self.forward_dims is not None:
            seed, free, groups = self.forward_dims.seed(now)
            dynamic |= seed
        return dynamic, free, groups

    def _compile(
        self,
        inputs: list[Any],
        sizes: list[Any],
        scalars: list[Any],
        unpack_meta: dict[str, Any],
        values: dict[Position, int],
    ) -> None:
        stats = self.session.stats
        t0 = timing.start()
        try:
            rt = retrace(
                self.gm,
                inputs,
                sizes,
                scalars,
                self.sym_sources,
                unpack_meta,
                frozenset(self.dynamic),
                frozenset(self.free),
                self.groups,
            )
        except Exception as e:
            self.failed = str(e)
            self._warn(f"could not compile it ({e})")
            return
        timing.done("autograd retrace", t0, "retrace", self._label)
        self.last_retraced = rt
        self._entry = None
        if self._key is not None:  # serialized before the compiler may change the graph
            try:
                self._entry = graphstore.graph_json(rt.gm)
            except graphstore.Uncacheable as e:
                self._uncacheable(str(e))
        t0 = timing.start()
        fn = self._compiled(rt.gm)
        timing.done("autograd compile", t0, "compile", self._label)
        if fn is None:
            return
        try:
            guards = rt.guards()  # after the compiler: it may have added guards
        except Exception as e:
            self.failed = f"its guards could not be built: {e}"
            self._warn(self.failed)
            return
        t0 = timing.start()
        self._store(fn, rt, guards, values, inputs, sizes, scalars)
        timing.done("cache write", t0, "compiled-autograd cache write", self._label)
        grad_mode = torch.is_grad_enabled()
        recompile = any(v.grad_mode is grad_mode for v in self.variants)
        self.variants.append(Variant(guards, fn, rt.arg_spec, rt.gm, values, grad_mode))
        stats.compiles += 1
        if recompile:
            stats.recompiles += 1

    def _compiled(self, gm: fx.GraphModule) -> Callable[..., Any] | None:
        """``gm`` compiled (None: the compiler failed, and a warning said so)."""
        try:
            # create_graph=True: the gradients must carry their history (the aten ops run
            # under grad mode record it; a compiler's kernels would not)
            if self.session.compiler is aten_executor or torch.is_grad_enabled():
                _mark_stealable(gm)
                return mark_boxed(gm)
            return SegmentedBackward(gm, self._counted_compiler)  # pure aten segments
        except Exception as e:
            self.failed = f"the compiler failed: {e}"
            self._warn(self.failed)
            return None

    # ------------------------------------------------------- warm-start cache
    def _warm_key(
        self,
        inputs: list[Any],
        sizes: list[Any],
        scalars: list[Any],
        dynamic: set[Position],
        free: set[Position],
        groups: dict[Position, Position],
    ) -> str | None:
        """The disk-cache key of a compile for these arguments (None: not cached)."""
        if self._graph_text is None:
            if not graphstore.enabled():
                return None
            try:
                if self._captured is not None:  # keyed as walked: a hit makes no FX graph
                    root, walk, _ = self._captured
                    self._graph_text = graphstore.graph_text(walk, self.sym_sources, root)
                else:
                    self._graph_text = graphstore.graph_text(self.gm, self.sym_sources)
            except graphstore.Uncacheable as e:
                self._uncacheable(str(e))
                return None
        if self._graph_text == "":
            return None
        try:
            return graphstore.key(
                self._graph_text,
                inputs,
                sizes,
                scalars,
                frozenset(dynamic),
                self.session,
                frozenset(free),
                groups,
            )
        except graphstore.Uncacheable as e:
            self._uncacheable(str(e))
            return None

    def _uncacheable(self, why: str) -> None:
        self._graph_text = ""  # never looked up again for this captured graph
        self._key = None
        graphstore.count(f"uncacheable ({why})")
        graphstore.log.info(
            "autograd cache: backward graph %d is uncacheable: %s", self.capture_id, why
        )

    def _load(self, inputs: list[Any], sizes: list[Any], scalars: list[Any]) -> Variant | None:
        """The compiled variant for this call from the disk cache, or None (a miss).

        Sets the key the cold path stores its compile under: the dynamic positions
        are those it will pick after its run (a cacheable graph has no unpack hooks,
        so the run adds no sizes to compare)."""
        dynamic, free, groups = self._shape_state(concrete_values(inputs, sizes, scalars))
        self._key = self._warm_key(inputs, sizes, scalars, dynamic, free, groups)
        if self._key is None:
            return None
        st = graphstore.store()
        got = st.get_entry(self._key)
        if got is None:  # DiskCache warned about a broken file, naming it
            self._miss("corrupt entry" if st.path(self._key).exists() else "new key")
            return None
        path, body = got
        try:
            gm, arg_spec, guards, values, code = graphstore.from_json(body, inputs, sizes, scalars)
        except Exception as e:
            graphstore.log.warning("stoker cache: ignoring %s (%s); compiling again", path, e)
            self._miss("corrupt entry")
            return None
        if not guards.check((inputs, sizes, scalars), {}, None):
            self._miss("guards failed")
            return None
        fn = self._compiled(gm)
        if fn is None:
            return None
        boxed = _boxed_graphs(fn)
        if len(boxed) == len(code):  # the stored code of what runs as is: none generated
            for b, c in zip(boxed, code):
                if c is not None:
                    b.load(c)
        variant = Variant(guards, fn, arg_spec, gm, values, torch.is_grad_enabled())
        self.variants.append(variant)
        self.dynamic, self.free, self.groups = dynamic, free, groups
        self.session.stats.disk_hits += 1
        graphstore.count("hit")
        graphstore.log.info(
            "autograd cache hit: backward graph %d loaded from %s", self.capture_id, path
        )
        return variant

    def _miss(self, why: str) -> None:
        self.session.stats.disk_misses += 1
        graphstore.count(f"miss ({why})")
        graphstore.log.info("autograd cache miss: backward graph %d (%s)", self.capture_id, why)
        return None

    def _store(
        self,
        fn: Callable[..., Any],
        rt: Retraced,
        guards: Any,
        values: dict[Position, int],
        inputs: list[Any],
        sizes: list[Any],
        scalars: list[Any],
    ) -> None:
        if self._key is None or self._entry is None:
            return
        try:
            # the code of what runs as is, generated now rather than at its first run
            code = [b.stored() for b in _boxed_graphs(fn)]
            body = graphstore.entry(
                self._entry,
                rt.arg_spec,
                guards,
                values,
                code,
                frozenset(self.dynamic),
                frozenset(self.free),
                self.groups,
            )
        except graphstore.Uncacheable as e:
            self._uncacheable(str(e))
            return
        graphstore.store().put(self._key, body)
        graphstore.count("write")

    def _counted_compiler(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.session.stats.segments += 1  # first: a compiler that reports stats sees it
        return self.session.compiler(gm, example_inputs)

    def _warn(self, why: str) -> None:
        key = f"{self.capture_id}:{why}"
        if key in self.session.warned:
            return
        self.session.warned.add(key)
        warnings.warn(
            f"stoker-autograd: backward graph {self.capture_id} runs uncompiled (as the eager "
            f"engine would compute it): {why}",
            stacklevel=3,
        )


def _run(v: Variant, lists: tuple[list[Any], ...]) -> Any:
    """Run a compiled variant on the engine's lists, boxed: the engine's ``inputs``
    list (the saved tensors and gradients) is emptied, so that each saved tensor is
    freed after its last reader in the compiled graph, as eager's engine frees it
    once its node has run, not when the whole backward returns."""
    args = [lists[w][i] for w, i in v.arg_spec]
    lists[0].clear()
    return call_boxed(v.fn, args)


def _boxed_graphs(fn: Callable[..., Any]) -> list[BoxedGraph]:
    """What of a compiled backward runs as is, in order (its code can be stored)."""
    if isinstance(fn, BoxedGraph):
        return [fn]
    if isinstance(fn, SegmentedBackward):
        return fn.boxed_graphs()
    return []


def _mark_stealable(gm: fx.GraphModule) -> None:
    """Let accumulate-grad take a gradient the graph computed and nobody else holds."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is ops.accumulate_grad and len(n.args) == 4:
            g = n.args[2]
            if (
                isinstance(g, fx.Node)
                and g.op == "call_function"
                and isinstance(g.target, torch._ops.OpOverload)
                and len(g.users) == 1
            ):
                n.args = (*n.args, True)
    gm.recompile()
