"""The pipeline, as one function: `compile_graph_impl`.

prepare    fake inputs + shape env; composite ops decomposed; every node has meta["val"]
lower      each aten op -> loop-level IR by the rule table      (lowering/)
schedule   IR nodes -> fused kernels, buffer lifetimes           (scheduler.py)
codegen    one Triton source per kernel + the Python wrapper     (codegen/)
load       kernels and wrapper from the disk cache -> a callable (modcache/, runtime/)

A graph compiled before, in this process or another, skips decompose..codegen:
its entry in the compiled-graph cache (graphcache.py) names the modules to load.
"""

from __future__ import annotations

import copy
import functools
import logging
import operator
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.fx

from stoker_shapes import timing

from . import graphcache
from .report import CompileReport, KernelInfo, register_kernels
from .runtime import (
    PRECOMPILE_SEED,
    Launcher,
    interpreting,
    load_module,
    native_target,
    precompile,
)

if TYPE_CHECKING:
    from .codegen.kernel import KernelSource

# Code generation (lowering, scheduler, codegen, verify: sympy-heavy) is imported by
# the cold path only: a warm process that hits the compiled-graph cache never needs it.

log = logging.getLogger("stoker.kernels")
log_cache = logging.getLogger("stoker.cache")

aten = torch.ops.aten


class CompiledGraph:
    """The callable compile_graph returns: `fn(*args)` runs the wrapper."""

    def __init__(
        self, call: Any, report: CompileReport, wrapper_source: str, out_spec: Any = None
    ) -> None:
        self._call = call
        self.report = report
        self.wrapper_source = wrapper_source
        self._out_spec = out_spec  # pytree spec when the graph returns nested structures

    def __call__(self, *args: Any) -> Any:
        return self.call_boxed(list(args))

    def call_boxed(self, args: list[Any]) -> Any:
        """Run with the inputs in a list the wrapper empties once it has bound them:
        an input nobody else holds is freed after its last reader (a backward's saved
        tensors, as eager's engine frees them), not when the call returns."""
        out = self._call(args)
        if self._out_spec is None:
            return out
        return torch.utils._pytree.tree_unflatten(out, self._out_spec)


def compile_graph_impl(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    debug: bool | None = None,
    options: dict[str, Any] | None = None,
) -> CompiledGraph:
    options = dict(options or {})
    persistent_opt = options.pop("persistent_rnumel_max", None)  # None: the scheduler's default
    autotune = bool(options.pop("max_autotune", False))
    target_opt = options.pop("target", None)
    if options:
        raise TypeError(
            f"compile_graph: unknown options {sorted(options)}; "
            "known: persistent_rnumel_max, max_autotune, target"
        )
    if debug is None:
        debug = os.environ.get("STOKER_TRITON_DEBUG", "0") == "1"
    report = CompileReport()
    # 0. prepare: fake inputs and the shared shape env; composite ops decomposed
    with report.stage("prepare"):
        fake_mode, shape_env, fake_inputs = prepare_inputs(example_inputs)
        n_guards = len(shape_env.guards) if shape_env is not None else 0
        target = choose_target(target_opt, fake_inputs)
    report.target = target
    # a graph compiled before (in any process): load it, skip every stage below
    key = None
    if graphcache.enabled() and not debug:  # debug prints the IR: compile it
        with report.stage("cache"):
            opts = {"prm": persistent_opt, "at": autotune, "tg": target}
            if target == "c":
                from .compile.ccompile import identity

                opts["cc"] = identity()  # the compiler, its flags, the CPU
            key = graphcache.graph_key(gm, fake_inputs, shape_env, opts, debug)
            hit = _load_cached(key, gm, shape_env, n_guards, autotune, report, target)
        if hit is not None:
            return hit
    caller_gm = gm  # get_attr constants are read from the caller's module on a hit
    from .codegen.kernelmemo import generate_kernels
    from .codegen.wrapper import generate_wrapper
    from .scheduler import PERSISTENT_RNUMEL_MAX, schedule
    from .verify import verify_program, verify_schedule

    persistent_max = int(PERSISTENT_RNUMEL_MAX if persistent_opt is None else persistent_opt)
    from .devices import CPU

    spec = CPU if target == "c" else None
    with report.stage("prepare"):
        device = _device(fake_inputs)
        if target == "triton" and native_target(device) is not None:  # workers start now
            from .compile.xcompile import start_workers

            start_workers()
        gm = decompose(gm, fake_inputs, fake_mode)
    if _has_data_dependent_sizes(gm):
        # Sizes that only exist at run time (nonzero, unique, masked_select, .item())
        # have no input to bind them from: the whole graph runs through aten.
        report.cache = ""  # not stored: the graph runs as it is, nothing to load
        return _aten_graph(gm, report, "sizes that depend on tensor data (unbacked symbols)")
    # 1. lowering: each aten op -> loop-level IR by the rule table
    with report.stage("lower"):
        program, ctx = _lower(gm, fake_inputs, shape_env, device, persistent_max, spec)
        if debug:
            verify_program(program)
    # 2. scheduling and fusion: IR nodes -> kernels; buffer lifetimes
    with report.stage("schedule"):
        sched = schedule(program, ctx)
        if debug:
            verify_schedule(program, sched)
    # 3. codegen: one Triton kernel source per fused group, then the wrapper
    with report.stage("codegen"):
        # each distinct kernel generated once (a model's repeated blocks: codegen/kernelmemo.py)
        kernels = generate_kernels(sched.steps, sched, program.buffers, spec)
        out_kind, out_spec = _output_kind(gm)
        launch = "c" if target == "c" else "triton"
        wrapper_src, consts = generate_wrapper(program, sched, kernels, out_kind, launch)

    if target == "c":  # the CPU: C kernels built side by side, loaded with ctypes
        from .codegen.c_kernel import kernel_file_source
        from .runtime.cload import load_c_files

        with report.stage("load"):
            files = {n: kernel_file_source(ks, kernel_fn_name(ks)) for n, ks in kernels.items()}
            fns, paths, c_ms = load_c_files(files, _graph_name(gm))
            mod, wpath = load_module("wrappers", wrapper_src)
            call = mod.make_call(fns, consts)
        report.timings_ms["c compile"] = c_ms
        _fill_report(report, program, sched, kernels, paths, str(wpath), ctx, shape_env, n_guards)
        if key is not None:
            from .modcache.modules import store_module

            added = list(shape_env.guards[n_guards:]) if shape_env is not None else []
            shas = {n: store_module("kernels", src)[0] for n, src in files.items()}
            with timing.timed("cache write", "compiled-graph cache write"):
                _save_cached(
                    key, caller_gm, report, kernels, shas, wrapper_src, consts, out_spec, added
                )
        if debug:
            print(_debug_text(report, wrapper_src), file=sys.stderr)
        return CompiledGraph(call, report, wrapper_src, out_spec)

    # 4. load: kernel modules and wrapper from the on-disk cache, launchers; on a GPU
    #    each kernel's compiles (each configuration its launch will use) are queued in
    #    the worker processes as soon as its module is loaded, and run in parallel
    def queue(name: str, lau: Launcher) -> None:
        one = {name: kernels[name]}
        precompile(lambda: _precompile_jobs(one, {name: lau}, program, shape_env), device)

    with report.stage("load"):
        launchers, paths = load_kernels(kernels, autotune, on_load=queue)
        mod, wpath = load_module("wrappers", wrapper_src)
        call = mod.make_call(launchers, consts)

    _fill_report(report, program, sched, kernels, paths, str(wpath), ctx, shape_env, n_guards)
    if key is not None:
        added = list(shape_env.guards[n_guards:]) if shape_env is not None else []
        with timing.timed("cache write", "compiled-graph cache write"):
            shas = {n: lau.sha for n, lau in launchers.items()}
            _save_cached(
                key, caller_gm, report, kernels, shas, wrapper_src, consts, out_spec, added
            )
    if debug:
        print(_debug_text(report, wrapper_src), file=sys.stderr)
    return CompiledGraph(call, report, wrapper_src, out_spec)


def regions_enabled() -> bool:
    """Repeated regions lowered once (`lowering/regions.py`); `STOKER_TRITON_REGIONS=0` turns it off."""
    return os.environ.get("STOKER_TRITON_REGIONS", "1") != "0"


# compile_graph calls that found repeated regions, graph nodes lowered by renaming,
# and graphs lowered again without regions (`regions.RegionMismatch`)
region_stats: dict[str, int] = {"graphs": 0, "reused nodes": 0, "mismatches": 0}


def choose_target(requested: Any, inputs: Sequence[Any]) -> str:
    """Which emitter compiles the graph: `options={"target": "c"}` C kernels for CPU
    inputs (what stoker's CPU backend asks for), else Triton (a GPU, Triton's
    interpreter, or a stand-in driver that tests Triton's launch path on the CPU)."""
    if requested is None:
        return "triton"
    if requested not in ("c", "triton"):
        raise TypeError(f"compile_graph: target={requested!r}; use 'c' or 'triton'")
    if requested == "c" and any(
        isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in inputs
    ):
        raise TypeError("compile_graph: target='c' compiles C kernels for CPU tensors only")
    return str(requested)


def _graph_name(gm: torch.fx.GraphModule) -> str:
    return type(gm).__name__ if type(gm).__name__ != "GraphModule" else "graph"


def _lower(
    gm: torch.fx.GraphModule,
    fake_inputs: Sequence[Any],
    shape_env: Any,
    device: torch.device,
    persistent_max: int,
    spec: Any = None,
) -> tuple[Any, Any]:
    """`lower_graph`, each repeated region lowered once (see `lowering/regions.py`)."""
    from .lowering import lower_graph
    from .lowering.regions import RegionMismatch

    if regions_enabled():
        try:
            program, ctx = lower_graph(
                gm, fake_inputs, shape_env, device, persistent_max, regions=True, spec=spec
            )
        except RegionMismatch as e:
            log.info("stoker-triton: repeated regions not reused (%s); lowering each node", e)
            region_stats["mismatches"] += 1
        else:
            if program.regions:
                region_stats["graphs"] += 1
                region_stats["reused nodes"] += program.reused_nodes
            return program, ctx
    return lower_graph(gm, fake_inputs, shape_env, device, persistent_max, spec=spec)


def _load_cached(
    key: str,
    gm: torch.fx.GraphModule,
    shape_env: Any,
    n_guards: int,
    autotune: bool,
    report: CompileReport,
    target: str = "triton",
) -> CompiledGraph | None:
    """The compiled graph from the cache, or None (`report.cache` says why not)."""
    got = graphcache.load(key, gm, shape_env)
    if isinstance(got, str):
        graphcache.count(f"miss: {got}")
        log_cache.info("compiled-graph cache miss (%s): %s", got, key)
        report.cache = got
        return None
    entry = got.entry
    report.cache_local = key in graphcache.WRITTEN_HERE
    if target == "c":  # the objects by their sources' keys: built before, loaded
        from .runtime.cload import load_c_files

        fns, _, c_ms = load_c_files(
            {n: src for n, (src, _) in got.kernels.items()}, _graph_name(gm)
        )
        report.timings_ms["c compile"] = c_ms
        call = got.wrapper.make_call(fns, got.consts)
        added = [str(g.expr) for g in shape_env.guards[n_guards:]] if shape_env is not None else []
        graphcache.report_of(got, report, added)
        register_kernels(report)
        graphcache.count("hits")
        report.cache = "hit"
        log_cache.info("compiled-graph cache hit: %s (%d C kernels)", key, len(fns))
        return CompiledGraph(call, report, _source_of(got.wrapper_path), entry.out_spec)
    launchers = {
        name: _launcher(
            _importer(k.sha, path, src),
            k.sha,
            k.is_reduction,
            k.persistent,
            k.has_atomics,
            k.n_ptrs,
            path,
            autotune,
            outer=_OUTER in src,
        )
        for name, (src, path), k in ((n, got.kernels[n], entry.kernels[n]) for n in entry.kernels)
    }
    call = got.wrapper.make_call(launchers, got.consts)
    added = [str(g.expr) for g in shape_env.guards[n_guards:]] if shape_env is not None else []
    graphcache.report_of(got, report, added)
    register_kernels(report)
    graphcache.count("hits")
    report.cache = "hit"
    log_cache.info("compiled-graph cache hit: %s (%d kernels)", key, len(launchers))
    return CompiledGraph(call, report, _source_of(got.wrapper_path), entry.out_spec)


_OUTER = "\nREDUCTION_HINT = 'outer'\n"  # as `kernel_module_source` writes it


def _importer(sha: str, path: str, source: str) -> Callable[[], Any]:
    """Imports a cached kernel module and returns its kernel (a warm launcher's `fn`)."""
    from pathlib import Path

    from .modcache.modules import import_stored

    return lambda: import_stored("kernels", sha, Path(path), source).kernel


def _source_of(path: str) -> str:
    import linecache

    return "".join(linecache.getlines(path))  # registered by the module loader


def _save_cached(
    key: str,
    gm: torch.fx.GraphModule,
    report: CompileReport,
    kernels: dict[str, KernelSource],
    shas: dict[str, str],
    wrapper_src: str,
    consts: dict[str, Any],
    out_spec: Any,
    guards: list[Any],
) -> None:
    """Store what `_load_cached` needs to rebuild this compiled graph (`shas`: each
    kernel's module key in the cache)."""
    try:
        packed = {k: graphcache.pack_const(c, gm) for k, c in consts.items()}
        _store_entry(key, packed, report, kernels, shas, wrapper_src, out_spec, guards)
    except graphcache.Uncacheable as e:
        log_cache.info("compiled graph not cached: %s", e)
        report.cache = f"uncacheable: {e}"
        return
    report.cache = f"miss ({report.cache})"


def _store_entry(
    key: str,
    packed: dict[str, tuple[str, Any]],
    report: CompileReport,
    kernels: dict[str, KernelSource],
    shas: dict[str, str],
    wrapper_src: str,
    out_spec: Any,
    guards: list[Any],
) -> None:
    import hashlib

    entry = graphcache.Entry(
        wrapper=hashlib.sha256(wrapper_src.encode()).hexdigest()[:24],
        kernels={
            n: graphcache.KernelEntry(
                shas[n],
                ks.is_reduction,
                ks.persistent,
                ks.has_atomics,
                len(ks.pointer_args),
            )
            for n, ks in kernels.items()
        },
        consts=packed,
        out_spec=out_spec,
        guards=guards,
        kernel_infos=list(report.kernels),
        extern_calls=list(report.extern_calls),
        fallback_ops=dict(report.fallback_ops),
        fallback_reasons=dict(report.fallback_reasons),
    )
    graphcache.save(key, entry)


def _has_data_dependent_sizes(gm: torch.fx.GraphModule) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(
        free_unbacked_symbols(v) for n in gm.graph.nodes if _maybe_symbolic(v := n.meta.get("val"))
    )


def _maybe_symbolic(v: Any) -> bool:
    """False for what has no symbols for sure: a plain tensor of static sizes and
    strides, a Python number, None (the common case, checked without sympy)."""
    if v is None or isinstance(v, bool | int | float):
        return False
    if type(v) is torch.Tensor or isinstance(v, torch._subclasses.FakeTensor):
        return not (
            all(type(s) is int for s in v.shape)
            and all(type(s) is int for s in v.stride())
            and type(v.storage_offset()) is int
        )
    return True


def _aten_graph(gm: torch.fx.GraphModule, report: CompileReport, reason: str) -> CompiledGraph:
    """The whole graph through aten: logged once per graph and counted in the report."""
    log.info("stoker-triton: the whole graph runs through aten (%s)", reason)
    report.fallback_ops["<whole graph>"] = 1
    report.fallback_reasons["<whole graph>"] = reason
    return CompiledGraph(lambda args: gm(*args), report, "# the whole graph runs through aten\n")


# --------------------------------------------------------------------------
# stage 0: prepare


def prepare_inputs(example_inputs: Sequence[Any]) -> tuple[Any, Any, list[Any]]:
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    fake_mode = detect_fake_mode(list(example_inputs))
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [
            fake_mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t
            for t in example_inputs
        ]
        return fake_mode, None, fakes
    fakes = []
    tc = torch._guards.TracingContext.try_get()
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
            # a frontend (Dynamo) hands real tensors with its fake mode: reuse its symbols
            ctx = (
                tc.tensor_to_context.get(t)  # type: ignore[no-untyped-call]
                if tc is not None and hasattr(tc, "tensor_to_context")
                else None
            )
            if ctx is not None:
                fakes.append(fake_mode.from_tensor(t, symbolic_context=ctx))
            else:
                fakes.append(fake_mode.from_tensor(t, static_shapes=True))
        else:
            fakes.append(t)
    return fake_mode, fake_mode.shape_env, fakes


# Composite ops that arrive undecomposed in core aten (layer_norm, softmax,
# gelu, batch_norm, ...): decomposed here into what the rule table fuses.
_DECOMPOSE = [
    "native_layer_norm",
    "native_layer_norm_backward",
    "_softmax",
    "_log_softmax",
    "_softmax_backward_data",
    "_log_softmax_backward_data",
    "gelu",
    "gelu_backward",
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "native_batch_norm",
    "native_batch_norm_backward",
    "embedding",
    "embedding_dense_backward",
    "native_dropout",
    "native_dropout_backward",
    "silu",
    "silu_backward",
    "sigmoid_backward",
    "tanh_backward",
    "threshold_backward",
    "hardtanh",
    "hardtanh_backward",
    "leaky_relu",
    "leaky_relu_backward",
    "elu",
    "elu_backward",
    "softplus",
    "softplus_backward",
    "native_group_norm",
    "native_group_norm_backward",
    "addcmul",
    "addcdiv",
    "lerp",
    "logsumexp",
    "mish",
    "hardsigmoid",
    "hardswish",
    "nll_loss_forward",
    "nll_loss_backward",
    "mse_loss",
    "mse_loss_backward",
    "logit",
    "_unsafe_index",
    "rsub",
    "glu",
    "hardsigmoid_backward",
    "hardswish_backward",
    "log_sigmoid_forward",
    "log_sigmoid_backward",
    "masked_fill",
    "bernoulli",
    # Into ops the rule table lowers (else each ran through aten, a fallback):
    # nn.InstanceNorm's running stats (repeat), weight_norm, F.normalize and the
    # distances (vector norms), max and adaptive-average pools.  Not slice_scatter
    # nor diagonal_scatter: their decompositions need ops with no rule either.
    "repeat",
    "select_scatter",
    "linalg_vector_norm",
    "_adaptive_avg_pool2d",
    "max_pool2d_with_indices",
    "max_pool2d_with_indices_backward",
    "max_pool3d_with_indices",
]
_table: dict[Any, Any] | None = None


def decomposition_table() -> dict[Any, Any]:
    global _table
    if _table is None:
        from torch._decomp import get_decompositions

        from .pool_decomp import OWN, channels_last_pooling

        ops = [getattr(aten, n) for n in _DECOMPOSE if hasattr(aten, n)]
        _table = get_decompositions(ops)
        for op in (
            aten.max_pool2d_with_indices.default,
            aten.max_pool2d_with_indices_backward.default,
        ):
            if op in _table:  # torch's, and ours for a channels-last input
                _table[op] = channels_last_pooling(op, _table[op])
        for op, fn in OWN.items():  # max pooling, where this torch has no decomposition
            _table.setdefault(op, fn)
    return _table


def decompose(
    gm: torch.fx.GraphModule, fake_inputs: Sequence[Any], fake_mode: Any
) -> torch.fx.GraphModule:
    """Decompose the table's composite ops one node at a time (each
    decomposition traced alone and inlined: much cheaper than retracing the
    graph; nodes with the same op and input metadata, such as the layers of a
    model, share one trace); a graph with nodes lacking `meta["val"]` is
    retraced whole."""
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    table = decomposition_table()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    if any("val" not in n.meta for n in calls if n.target is not operator.getitem):
        return _retrace(gm, fake_inputs, fake_mode, table)
    if not any(n.target in table for n in calls):
        return gm
    with _use_lazy_graph_module(True):  # generate the Python code only if it is run
        new = _make_graph_module(gm, copy.deepcopy(gm.graph))  # leave the caller's graph alone
    traces: dict[Any, torch.fx.Graph] = {}
    try:
        for node in [n for n in new.graph.nodes if n.op == "call_function" and n.target in table]:
            _inline_decomposition(new, node, table, fake_mode, traces)
    except Exception as e:  # an unusual signature: retrace the whole graph instead
        log.debug("per-node decomposition failed (%s); retracing the graph", e)
        return _retrace(gm, fake_inputs, fake_mode, table)
    new.graph.eliminate_dead_code()
    new.recompile()
    return new


def _inline_decomposition(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    table: dict[Any, Any],
    fake_mode: Any,
    traces: dict[Any, torch.fx.Graph] | None = None,
) -> None:
    """Replace `node` by its decomposition, traced once per `_trace_key` in `traces`."""
    from torch.utils import _pytree as pytree

    vals, spec = pytree.tree_flatten(
        torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
    )
    srcs, _ = pytree.tree_flatten(torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a))
    dyn = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor | torch.SymInt)]
    # which inputs are the same node: a trace of f(x, x) must not serve f(x, y)
    same = tuple(next(j for j in dyn if srcs[j] is srcs[i]) for i in dyn)
    key = _trace_key(node.target, spec, vals, same)
    sub = traces.get(key) if traces is not None and key is not None else None
    if sub is None:
        sub = _trace_decomposition(table[node.target], vals, spec, dyn, same, table, fake_mode)
        if traces is not None and key is not None:
            traces[key] = sub
    env: dict[torch.fx.Node, Any] = {}
    packet = getattr(node.target, "_overloadpacket", None)
    origin = str(packet if packet is not None else node.target)  # for profiles and reports
    placeholders = [n for n in sub.nodes if n.op == "placeholder"]
    for ph, i in zip(placeholders, dyn):
        env[ph] = srcs[i]
    result: Any = None
    with gm.graph.inserting_before(node):
        for sn in sub.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                result = torch.fx.node.map_arg(sn.args[0], lambda a: env[a])
                continue
            if sn.op == "get_attr":
                raise RuntimeError("the decomposition created a constant tensor")
            env[sn] = gm.graph.node_copy(sn, lambda a: env[a])
            env[sn].meta["stoker_origin"] = node.meta.get("stoker_origin", origin)
    if isinstance(result, torch.fx.Node):
        node.replace_all_uses_with(result)
    else:
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise RuntimeError(f"{node} has a user other than getitem")
            user.replace_all_uses_with(result[user.args[1]])
            gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def _trace_decomposition(
    decomp: Any,
    vals: list[Any],
    spec: Any,
    dyn: list[int],
    same: tuple[int, ...],
    table: dict[Any, Any],
    fake_mode: Any,
) -> torch.fx.Graph:
    """The graph of `decomp` on these inputs; placeholders are the `dyn` positions.

    make_fx tells inputs apart by identity, so one value object reaching two
    positions from different nodes (nodes inlined from one shared trace share
    their values) is traced through a distinct stand-in with the same metadata."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils import _pytree as pytree

    inputs: list[Any] = []
    seen: dict[int, int] = {}  # id(value) -> the first dyn position that holds it
    for k, i in enumerate(dyn):
        v = vals[i]
        first = seen.setdefault(id(v), same[k])
        if first != same[k] and isinstance(v, torch.Tensor):
            with fake_mode:
                v = v.as_strided(v.shape, v.stride(), v.storage_offset())
        inputs.append(v)

    def run(*dyn_vals: Any) -> Any:
        full = list(vals)
        for i, v in zip(dyn, dyn_vals):
            full[i] = v
        a, kw = pytree.tree_unflatten(full, spec)
        out = decomp(*a, **kw)
        return tuple(out) if isinstance(out, tuple | list) else out  # plain, not a namedtuple

    # a lazy graph module: its Python code is never needed, only the graph
    with fake_mode, _use_lazy_graph_module(True):
        return make_fx(run, decomposition_table=table)(*inputs).graph


def _trace_key(target: Any, spec: Any, vals: list[Any], same: tuple[int, ...]) -> Any:
    """What a decomposition's trace depends on: the op, the argument structure,
    which inputs are one node, and every argument's value or, for tensors,
    metadata.  None: do not share the trace."""
    parts: list[Any] = [target, spec, same]
    for v in vals:
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided:
                return None
            parts.append(
                (
                    "T",
                    tuple(_size_key(x) for x in v.shape),
                    tuple(_size_key(x) for x in v.stride()),
                    _size_key(v.storage_offset()),
                    v.dtype,
                    v.device,
                    v.requires_grad,
                )
            )
        elif isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
            parts.append(("S", type(v), v.node.expr))
        elif v is None or isinstance(v, bool | int | float | str | torch.dtype | torch.device):
            parts.append((type(v), v))  # the type too: 1, 1.0 and True hash alike
        elif isinstance(v, torch.layout | torch.memory_format):
            parts.append((type(v), str(v)))
        else:
            return None  # anything else: trace this node on its own
    return tuple(parts)


def _size_key(x: Any) -> Any:
    return x.node.expr if isinstance(x, torch.SymInt) else int(x)


def _retrace(
    gm: torch.fx.GraphModule, fake_inputs: Sequence[Any], fake_mode: Any, table: dict[Any, Any]
) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode:
        return make_fx(
            torch.fx.Interpreter(gm).run, decomposition_table=table, _allow_non_fake_inputs=True
        )(*fake_inputs)


def _device(inputs: Sequence[Any]) -> torch.device:
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _output_kind(gm: torch.fx.GraphModule) -> tuple[str, Any]:
    """How the wrapper returns: a flat tuple/list, one value, or leaves to unflatten."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    a = out.args[0]
    if isinstance(a, list | tuple):
        if all(not isinstance(x, list | tuple | dict) for x in a):
            return ("list" if isinstance(a, list) else "tuple"), None
        _, spec = torch.utils._pytree.tree_flatten(a, is_leaf=lambda x: x is None)
        return "list", spec
    if isinstance(a, dict):
        _, spec = torch.utils._pytree.tree_flatten(a, is_leaf=lambda x: x is None)
        return "list", spec
    return "single", None


# --------------------------------------------------------------------------
# stage 4: load


def kernel_fn_name(ks: KernelSource) -> str:
    """The kernel function's name, from its source (the same kernel in another graph or
    layer has the same name): what a profiler lists, `stoker_<kind>_<hash>`, kind `pw`
    (pointwise), `per` (persistent reduction), `red` (looped reduction), `sc` (scatter)."""
    import hashlib

    body = ks.source.replace(f"def {ks.name}(", "def kernel(", 1)
    kind = (
        "sc"
        if ks.has_atomics
        else "pw"
        if not ks.is_reduction
        else ("per" if ks.persistent else "red")
    )
    return f"stoker_{kind}_{hashlib.sha256(body.encode()).hexdigest()[:12]}"


def kernel_module_source(ks: KernelSource) -> str:
    """The kernel's module: Triton imports, the prelude helpers the kernel calls (and
    the helpers they call), the reduction hint, the kernel under its name from
    `kernel_fn_name`. Only those helpers: each `@triton.jit` function of a module is
    one `JITFunction` made (its source read and parsed) when the module is imported,
    in this process and in each compile worker."""
    name = kernel_fn_name(ks)
    body = ks.source.replace(f"def {ks.name}(", f"def {name}(", 1)
    blocks = _prelude_blocks("interpret" if interpreting() else "native")
    want = _called(body, blocks)
    return (
        "# stoker-triton kernel\nimport triton\nimport triton.language as tl\n"
        + "".join(text for helper, text, _ in blocks if helper in want)
        + f"\nREDUCTION_HINT = {'outer' if ks.outer else 'inner'!r}\n\n"
        + body
        + f"\n\nkernel = {name}\n"
    )


_CALL = re.compile(r"\b(_\w+)\b")  # a helper named: called, or passed (a combine fn)


@functools.cache
def _prelude_blocks(mode: str) -> tuple[tuple[str, str, frozenset[str]], ...]:
    """The prelude's helpers in order: (name, source, helpers it calls); the bfloat16
    cast of `mode` last, verbatim (`xcompile.gpu_source` swaps it for a GPU build)."""
    from .codegen.ops import PRELUDE, PRELUDE_BF16

    texts = [t for t in re.split(r"(?=\n@triton\.jit\n)", PRELUDE) if t.strip()]
    texts.append(PRELUDE_BF16[mode])
    names = []
    for t in texts:
        m = re.search(r"\bdef (\w+)\(", t)
        assert m is not None, t
        names.append(m.group(1))
    known = set(names)
    return tuple(
        (n, t, frozenset(c for c in _CALL.findall(t) if c in known and c != n))
        for n, t in zip(names, texts)
    )


def _called(body: str, blocks: Sequence[tuple[str, str, frozenset[str]]]) -> set[str]:
    """The helpers `body` calls, directly or through another helper."""
    deps = {n: d for n, _, d in blocks}
    todo = [c for c in _CALL.findall(body) if c in deps]
    seen: set[str] = set()
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(deps[c])
    return seen


def load_kernels(
    kernels: dict[str, KernelSource],
    autotune: bool = False,
    on_load: Callable[[str, Launcher], None] | None = None,
) -> tuple[dict[str, Launcher], dict[str, str]]:
    """Each kernel's module (stored, imported at its first launch: a graph compiled
    now may first run in a later step, and each import runs `triton.jit` on the
    kernel and its prelude's ~34 helpers) and launcher; `on_load(name, launcher)`
    as each is ready."""
    from .modcache.modules import store_module

    launchers: dict[str, Launcher] = {}
    paths: dict[str, str] = {}
    for name, ks in kernels.items():
        src = kernel_module_source(ks)
        sha, path = store_module("kernels", src)
        launchers[name] = _launcher(
            _importer(sha, str(path), src),
            sha,
            ks.is_reduction,
            ks.persistent,
            ks.has_atomics,
            len(ks.pointer_args),
            str(path),
            autotune,
            outer=ks.outer,
        )
        paths[name] = str(path)
        if on_load is not None:
            on_load(name, launchers[name])
    return launchers, paths


def _launcher(
    importer: Callable[[], Any],
    sha: str,
    is_reduction: bool,
    persistent: bool,
    has_atomics: bool,
    n_ptrs: int,
    path: str,
    autotune: bool,
    outer: bool,
) -> Launcher:
    """The launcher of one stored kernel module, which `importer` imports (returning
    its kernel) when a launch first needs it: a cold launch for Triton's binder,
    a warm one only where no binary was recorded (`warmload`)."""
    from .compile.xcompile import targets

    lau = Launcher(importer, sha, is_reduction, persistent, has_atomics, autotune, lazy=True)
    lau.outer = outer
    lau.n_ptrs = n_ptrs
    lau.path = path
    lau.check_gpu = interpreting() and bool(targets())
    return lau


def _precompile_jobs(
    kernels: dict[str, KernelSource], launchers: dict[str, Launcher], program: Any, shape_env: Any
) -> list[tuple[Launcher, list[Any], int, int]]:
    """Example launch arguments per kernel: static sizes as they are, symbolic
    ones at the shape env's hints (the sizes of the inputs at hand, which the
    first launch is likely to see: a launch with sizes Triton specializes
    differently compiles its own binary, as without a precompile)."""
    from .compile.xcompile import StandIn

    # the sizes at hand (`backed_var_to_val` from torch 2.13, `var_to_val` before)
    known = getattr(shape_env, "backed_var_to_val", None)
    if known is None:
        known = getattr(shape_env, "var_to_val", None)
    hints: dict[Any, Any] = dict(known or {})
    jobs: list[tuple[Launcher, list[Any], int, int]] = []
    for name, ks in kernels.items():
        try:
            x, r = (int(sympy.sympify(e).xreplace(hints)) for e in (ks.xnumel, ks.rnumel))
            # float symbols (a SymFloat, `.item()` of a 0-d input) stay floats
            sizes = [int(hints[s]) if s.is_integer else float(hints[s]) for s in ks.size_args]
        except (KeyError, TypeError):  # a size without a hint (unbacked): at the launch
            continue
        # stand-ins, not tensors: a graph may compile inside a FakeTensorMode (a
        # forward does), where a new tensor is fake and has no address to read
        args: list[Any] = [
            StandIn(str(program.buffers[b].dtype).removeprefix("torch."), True)
            for b in ks.pointer_args
        ]
        args += [x, r, *sizes]
        if ks.uses_seed:
            args.append(PRECOMPILE_SEED)
        jobs.append((launchers[name], args, x, r))
    return jobs


def _fill_report(
    report: CompileReport,
    program: Any,
    sched: Any,
    kernels: dict[str, KernelSource],
    paths: dict[str, str],
    wpath: str,
    ctx: Any,
    shape_env: Any,
    n_guards: int,
) -> None:
    from .scheduler import Kernel

    for step in sched.steps:
        if isinstance(step, Kernel):
            ks = kernels[step.name]
            scatter = any(type(n).__name__ == "ScatterNode" for n in step.nodes)
            kind = (
                "scatter"
                if scatter
                else "pointwise"
                if not step.is_reduction
                else ("persistent-reduction" if step.persistent else "looped-reduction")
            )
            report.kernels.append(
                KernelInfo(
                    step.name,
                    kind,
                    [n.name for n in step.nodes],
                    str(step.xnumel),
                    str(step.rnumel),
                    paths[step.name],
                    ks.source,
                    kernel_fn_name(ks),
                    sorted({o for n in step.nodes for o in n.origins}),
                )
            )
        else:
            report.extern_calls.append(str(step.op))
    report.fallback_ops = dict(ctx.fallbacks)
    report.fallback_reasons = dict(ctx.fallback_reasons)
    if shape_env is not None:
        report.guards_added = [str(g.expr) for g in shape_env.guards[n_guards:]]
    report.wrapper_path = wpath
    report.regions = list(program.regions)
    report.reused_nodes = program.reused_nodes
    report.lowered_nodes = program.lowered_nodes
    report.text_of["ir"] = program.as_text
    report.text_of["schedule"] = sched.as_text
    register_kernels(report)


def _debug_text(report: CompileReport, wrapper_src: str) -> str:
    parts = ["=== stoker-triton IR ===", report.ir_text, "=== schedule ===", report.schedule_text]
    for k in report.kernels:
        parts += [f"=== {k.name} ({k.path}) ===", k.source]
    parts += ["=== wrapper ===", wrapper_src, str(report)]
    return "\n".join(parts)
