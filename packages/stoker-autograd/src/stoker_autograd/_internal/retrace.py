"""Retrace a captured backward graph into a flat, core-aten graph with real shapes.

The capture ran on dummy tensors, so its graph has no usable metadata and its
built-in nodes are calls of functional backwards.  Here we replay it under a
`stoker_shapes.ShapeContext` (symbolic sizes when dynamic): pure calls are traced
through into core aten; opaque calls (hooks, custom Function backwards,
accumulate-grad) are re-emitted as calls, in the same order, each followed by a
`check_sizes` of what the rest of the graph assumed about its result.  The guards
the retrace adds are returned; the caller checks them before every run (the
engine's cache knows nothing about them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    PythonKeyTracer,
    decompose,
    disable_proxy_modes_tracing,
    fetch_object_proxy,
    track_tensor_tree,
)
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from stoker_shapes import Dim, GuardSet, Origin, ShapeContext, Source

from . import ops
from .aot_inline import aot_backward_prologue
from .graph import PLACEHOLDERS, Position, check_sizes, contiguous_strides, graph_module

LISTS = PLACEHOLDERS  # inputs, sizes, scalars, hooks, packed_data


# torch's ScalarType numbers (how the engine packs a dtype in tensor metadata) -> dtype
_DTYPES: dict[int, torch.dtype] = {
    int(torch.ops.prim.dtype(torch.empty(0, dtype=d))): d
    for d in (
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.bool,
        torch.bfloat16,
    )
}


class RetraceError(RuntimeError):
    """The captured graph could not be retraced; names the autograd node."""


@dataclass
class Retraced:
    gm: fx.GraphModule  # flat placeholders, core aten + opaque calls
    arg_spec: list[tuple[int, int]]  # per placeholder: (which list, index)
    ctx: ShapeContext  # read its guards only after the compiler ran (it may add some)
    example_inputs: list[Any]

    def guards(self) -> GuardSet:
        """The guards of every stage so far, over ``(inputs, sizes, scalars)``."""
        return _without_alias_guards(self.ctx.produce_guards())


def _hook_name(hook_node: fx.Node) -> str:
    return f"{hook_node.kwargs.get('hook_type', 'hook')} {hook_node.args[0]}"


class _Replayer:
    def __init__(
        self,
        ctx: ShapeContext,
        sym_sources: dict[sympy.Symbol, tuple[str, int]],
        unpack_meta: dict[str, Any],
    ) -> None:
        self.ctx = ctx
        self.sym_sources = sym_sources
        self.unpack_meta = unpack_meta
        self.tracer = PythonKeyTracer()
        self.tracer.root = torch.nn.Module()
        self.tracer.graph = fx.Graph(tracer_cls=PythonKeyTracer)
        self.tracer.tensor_attrs = {}
        self.mode = _KnownResultsMode(self, self.tracer)
        self.env: dict[fx.Node, Any] = {}
        self.opaque_objects: dict[fx.Node, fx.Proxy] = {}  # hooks/packed placeholders
        self.values: dict[str, list[Any]] = {}
        self.arg_spec: list[tuple[int, int]] = []
        self.examples: list[Any] = []
        self.source_gm: fx.GraphModule | None = None
        self.made: dict[tuple[int, int], Any] = {}
        self.unpack_idx: dict[str, int] = {}
        self.dynamic: frozenset[Position] = frozenset()
        self.sym_by_value: dict[int, Position] = {}  # a dynamic input position per value

    # ------------------------------------------------------------------ proxies
    def proxy(self, v: Any) -> Any:
        if isinstance(v, _Opaque):
            return v.proxy
        if isinstance(v, list):
            return [self.proxy(x) for x in v]
        if isinstance(v, tuple):
            return tuple(self.proxy(x) for x in v)
        if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
            if v.node.expr.is_number:
                return v.node.pytype(v.node.expr)
            return fetch_object_proxy(self.tracer, v).force()  # type: ignore[union-attr]
        if isinstance(v, torch.Tensor):
            return fetch_object_proxy(self.tracer, v).proxy  # type: ignore[union-attr]
        return v

    def bind(self, value: Any, proxy: fx.Proxy) -> None:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            # a graph input or an opaque call's result: its ``tensor_meta`` from the
            # sizes' expressions (`_track`), not three contiguity questions to sympy
            with disable_proxy_modes_tracing(), proxy_tensor._enable_thunkify(self.tracer):
                _track(self.tracer, value, proxy)
            return
        track_tensor_tree(value, proxy, constant=None, tracer=self.tracer)

    # -------------------------------------------------------------------- nodes
    def item(self, which: int, index: int) -> Any:
        """``lists[which][index]`` as a graph input (made on first use)."""
        key = (which, index)
        if key not in self.made:
            self.made[key] = self.placeholder(which, index)
        return self.made[key]

    def placeholder(self, which: int, index: int) -> Any:
        name = f"{LISTS[which]}_{index}"
        p: Any = self.tracer.create_proxy("placeholder", name, (), {})
        self.arg_spec.append((which, index))
        if which >= 3:  # hooks / packed data: Python objects, only passed to opaque calls
            self.examples.append(None)
            return _Opaque(p)
        value = self.values[LISTS[which]][index]
        self.examples.append(value)
        if isinstance(value, torch.Tensor | torch.SymInt | torch.SymFloat):
            self.bind(value, p)
        return value

    def sym(self, e: Any) -> Any:
        """A capture-time size expression in this retrace's symbols."""
        if isinstance(e, int):
            return e
        e = sympy.sympify(e)
        if e.is_number:
            return int(e)
        subs: dict[sympy.Symbol, Any] = {}
        for s in e.free_symbols:
            src = self.sym_sources.get(s)
            if src is None:
                raise RetraceError(f"size expression {e} uses an unknown symbol {s}")
            subs[s] = self.item(LISTS.index(src[0]), src[1])
        if isinstance(e, sympy.Symbol):
            return subs[e]
        return _eval_sym(e, subs)

    def opaque(self, node: fx.Node) -> Any:
        args = pytree.tree_map_only(fx.Node, lambda n: self.env[n], node.args)
        pargs = self.proxy(args)
        kwargs = pytree.tree_map_only(fx.Node, lambda n: self.env[n], dict(node.kwargs))
        pkwargs = {k: self.proxy(v) for k, v in kwargs.items()}  # e.g. undefined_leaves
        out: Any = self.tracer.create_proxy("call_function", node.target, pargs, pkwargs)
        out.node.meta.update(
            {k: v for k, v in node.meta.items() if k.startswith(("autograd", "stoker"))}
        )
        target = node.target
        sizes: list[list[Any] | None] = []
        if target is ops.call_backward:
            metas = node.meta.get("stoker_out_meta")
            if metas is None:
                raise RetraceError("custom backward without output metadata")
            sizes = [None if m is None else [self.sym(s) for s in m[3]] for m in metas]
        with disable_proxy_modes_tracing():
            if target is ops.call_hook:
                kind = node.kwargs["hook_type"]
                what = f"{kind} {node.args[0]}"
                if kind == "tensor_pre_hook":
                    return self.checked(out, args[1], what)
                if kind == "post_acc_grad_hook":
                    return self.like(out, args[1])
                if kind == "pre_hook":
                    return self.checked_list(out, args[1], what)
                if kind == "post_hook":
                    return self.checked_list(out, args[1], what)
                if kind == "unpack_hook":
                    meta = self.unpack_meta.get(node.name)
                    if meta is None:
                        raise RetraceError(f"no recorded result for {what}")
                    return self._check(out, self.unpack_fake(node.name, meta), what)
                raise RetraceError(f"unknown hook kind {kind}")
            if target is ops.accumulate_grad:
                return self.like(out, args[0])
            if target is ops.call_cpp_tensor_pre_hooks:
                return self.like(out, args[1])
            if target is ops.exec_final_callbacks_stub:
                return None
            if target is ops.call_backward:
                what = f"{node.meta.get('stoker_fn', 'autograd.Function')}.backward"
                results: list[Any] = []
                for j, m in enumerate(metas or []):
                    if m is None:
                        results.append(None)
                        continue
                    _layout, device, dtype, _size = m
                    fake = torch.empty(sizes[j] or [], dtype=dtype, device=device)
                    results.append(self._check(out[j], fake, what))
                return results
            if isinstance(target, ops.BoundBackward):  # a C++ Function, not traceable
                return self.untraceable(node, out)
        raise RetraceError(f"opaque call {target} cannot be retraced")

    def untraceable(self, node: fx.Node, out: Any) -> list[Any]:
        """The outputs of a C++ ``autograd::Function`` whose backward may not be traced
        (``is_traceable = false``, the default): kept as a call, as a custom Python
        backward is.  Its outputs get the sizes, dtype and device of the engine's
        ``validate_outputs`` check that follows (the engine passes this node no
        symbolic sizes of its own), and a size check after the call."""
        metas: dict[int, Any] = {}
        count = 0
        for g in node.users:
            if g.target is not operator.getitem or not isinstance(g.args[1], int):
                raise RetraceError(f"{node.target} is read whole, not item by item")
            k = g.args[1]
            count = max(count, k + 1)
            for v in g.users:
                if getattr(v.target, "__name__", "") != "validate_outputs":
                    continue
                outs, checks = v.args[0], v.args[1]
                if not isinstance(outs, list | tuple) or not isinstance(checks, list | tuple):
                    continue
                for o, m in zip(outs, checks, strict=False):
                    if o is g:
                        metas[k] = m
        what = f"{node.target}"
        results: list[Any] = []
        for k in range(count):
            m = metas.get(k)
            if m is None:
                if any(g.args[1] == k for g in node.users):
                    raise RetraceError(
                        f"output {k} of {what} is used without a validate_outputs check"
                    )
                results.append(None)
                continue
            options, size = m[0], m[1]
            device, dtype = options[2], _DTYPES.get(options[3])
            if dtype is None or not isinstance(device, torch.device):
                raise RetraceError(f"output {k} of {what}: unknown tensor options {options}")
            fake = torch.empty([self.size_arg(s) for s in size], dtype=dtype, device=device)
            results.append(self._check(out[k], fake, what))
        return results

    def size_arg(self, s: Any) -> Any:
        """An integer argument of the captured graph: a constant, or a lifted size
        (``sizes[i]``) read as this retrace's value for it."""
        if isinstance(s, int):
            return s
        if (
            isinstance(s, fx.Node)
            and s.target is operator.getitem
            and isinstance(s.args[0], fx.Node)
            and s.args[0].op == "placeholder"
            and isinstance(s.args[1], int)
        ):
            return self.item(LISTS.index(str(s.args[0].target)), s.args[1])
        raise RetraceError(f"size argument {s} is neither a constant nor a lifted size")

    def unpack_fake(self, name: str, meta: Any) -> torch.Tensor:
        """What an unpack hook returns: its recorded sizes, symbolic where they were seen
        to change and an input carries a symbol of that value (else static; the size
        check after the hook and the input guards catch a change)."""
        size, stride, dtype, device = meta
        k = self.unpack_idx.get(name, -1)
        contiguous = list(stride) == contiguous_strides(size)
        sym_size: list[Any] = []
        for d, v in enumerate(size):
            where = self.sym_by_value.get(v) if (3, k, d) in self.dynamic and contiguous else None
            if where is None:
                sym_size.append(v)
                continue
            w, i, dim = where
            val = self.item(w, i)
            sym_size.append(val.shape[dim] if w == 0 else val)
        if all(isinstance(s, int) for s in sym_size):
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
        return torch.empty(sym_size, dtype=dtype, device=device)

    def like(self, out: fx.Proxy, template: torch.Tensor) -> torch.Tensor:
        fake = torch.empty_strided(
            template.size(), template.stride(), dtype=template.dtype, device=template.device
        )
        self.bind(fake, out)
        return fake

    def _check(self, p: fx.Proxy, fake: torch.Tensor, what: str) -> torch.Tensor:
        sizes = [self.proxy(s) for s in fake.shape]
        chk: Any = self.tracer.create_proxy("call_function", check_sizes, (p, sizes, what), {})
        self.bind(fake, chk)
        return fake

    def checked(self, out: fx.Proxy, template: torch.Tensor, what: str) -> torch.Tensor:
        fake = torch.empty_strided(
            template.size(), template.stride(), dtype=template.dtype, device=template.device
        )
        return self._check(out, fake, what)

    def checked_list(self, out: Any, templates: Sequence[Any], what: str) -> list[Any]:
        res: list[Any] = []
        for j, t in enumerate(templates):
            if t is None:
                res.append(None)
                continue
            res.append(self.checked(out[j], t, what))
        return res


class _KnownResultsMode(ProxyTorchDispatchMode):  # type: ignore[no-untyped-call]
    """The replay's proxy mode.  An op that reaches it from inside a functional backward
    (an eager node's C++ backward: ``NllLossBackward0``, ``LogSoftmaxBackward0``,
    ``NativeLayerNormBackward0``, ``ViewBackward0``) or a decomposition takes the same
    path as one the graph holds itself (`_replay_node`): the ops whose result the
    retrace builds (`_KNOWN`, the pointwise ops) are recorded by `_record`, after their
    table entry where they have one (a view relates its sizes first; a fused backward
    whose dtypes mix decomposes).  Everything else, and any op `_record` declines (an
    argument without a proxy, or a constant), goes the proxy mode's way."""

    def __init__(self, rp: _Replayer, tracer: PythonKeyTracer) -> None:
        super().__init__(tracer, "symbolic")
        self.rp = rp

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _built_in_mode(func):
            table = _replay_table()
            if func in table:
                with self:
                    out = table[func](*args, **kwargs)
                if out is not NotImplemented:
                    return out
            out = _record(self.rp, func, args, kwargs, pytree.tree_leaves((args, kwargs)))
            if out is not NotImplemented:
                return out
        return super().__torch_dispatch__(func, types, args, kwargs)


@functools.cache
def _built_in_mode(op: Any) -> bool:
    """Does `_KnownResultsMode` record ``op`` itself: an op whose result the retrace may
    build, that the graph's own nodes would record with `_record` too."""
    return (_recorded_as_is(op) and (op in _KNOWN or _is_pointwise(op))) or _kept_whole(op)


class _Opaque:
    """A placeholder holding a Python object (hook, ctx, packed data)."""

    __slots__ = ("proxy",)

    def __init__(self, proxy: fx.Proxy) -> None:
        self.proxy = proxy


def _eval_sym(e: Any, subs: dict[sympy.Symbol, Any]) -> Any:
    if isinstance(e, sympy.Symbol):
        return subs[e]
    if e.is_Integer:
        return int(e)
    if isinstance(e, sympy.Add):
        args = [_eval_sym(a, subs) for a in e.args]
        out = args[0]
        for a in args[1:]:
            out = out + a
        return out
    if isinstance(e, sympy.Mul):
        args = [_eval_sym(a, subs) for a in e.args]
        out = args[0]
        for a in args[1:]:
            out = out * a
        return out
    if e.func.__name__ == "FloorDiv":
        a, b = (_eval_sym(x, subs) for x in e.args)
        return a // b
    raise RetraceError(f"cannot rebuild size expression {e}")


def _is_param(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad


def unpack_index(gm: fx.GraphModule) -> dict[str, int]:
    """Unpack-hook nodes of a captured graph, numbered in graph order."""
    names = [
        n.name
        for n in gm.graph.nodes
        if n.target is ops.call_hook and n.kwargs.get("hook_type") == "unpack_hook"
    ]
    return {name: k for k, name in enumerate(names)}


def concrete_values(
    inputs: Sequence[Any],
    sizes: Sequence[Any],
    scalars: Sequence[Any],
    unpack_meta: dict[str, Any] | None = None,
    unpack_idx: dict[str, int] | None = None,
) -> dict[Position, int]:
    """Every integer a compile may specialize on, by position (3: unpack-hook results)."""
    out: dict[Position, int] = {}
    for name, meta in (unpack_meta or {}).items():
        k = (unpack_idx or {}).get(name)
        if k is not None:
            for d, v in enumerate(meta[0]):
                out[(3, k, d)] = int(v)
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor):
            for d, v in enumerate(t.shape):
                out[(0, i, d)] = int(v)
    for i, v in enumerate(sizes):
        out[(1, i, -1)] = int(v)
    for i, v in enumerate(scalars):
        if isinstance(v, int) and not isinstance(v, bool):
            out[(2, i, -1)] = v
    return out


def opaque_only_inputs(gm: fx.GraphModule | fx.Graph, count: int) -> frozenset[int]:
    """The indices of the ``count`` inputs that no traced op reads: those only opaque
    calls read (a parameter's ``.grad``, which only its accumulate-grad reads under
    torch 2.13) and those nothing reads (torch 2.11 collects that ``.grad`` as an input
    without passing it to the accumulate-grad, which reads it at run time). Nothing
    traced depends on their metadata."""
    graph = gm if isinstance(gm, fx.Graph) else gm.graph
    ph = next((n for n in graph.nodes if n.op == "placeholder"), None)
    if ph is None:
        return frozenset()
    read = set()
    for u in ph.users:
        i = u.args[1] if u.target is operator.getitem else None
        if not isinstance(i, int):
            return frozenset()  # the list is read whole: every input may be traced
        if not all(ops.is_opaque(c.target) for c in u.users):
            read.add(i)
    return frozenset(range(count)) - read


def fake_inputs(
    ctx: ShapeContext,
    inputs: Sequence[Any],
    sizes: Sequence[Any],
    scalars: Sequence[Any],
    dynamic: frozenset[Position],
    free: frozenset[Position] = frozenset(),
    opaque_only: frozenset[int] = frozenset(),
    groups: Mapping[Position, Position] | None = None,
) -> dict[str, list[Any]]:
    """The graph inputs as ``ctx``'s fakes: ``dynamic`` positions symbolic, positions of
    one value sharing one symbol, or of one value and one of ``groups`` (a position's
    group, named by a position: `ForwardDims.seed`'s forward symbols) where it names
    one; ``free`` positions (not also ``dynamic``) symbolic, each its own symbol, which
    the trace may tie to another or specialize (its guards then say so); every other
    size static.  The symbols are named after their sources, so the same call in
    another process makes the same names (the warm-start cache reads its stored sizes
    back over them)."""
    shared: dict[tuple[int, Position | None], Dim] = {}
    # An input whose dynamic sizes are all shared with an earlier one takes their
    # symbols as they are, not fresh ones tied to them by guards (about 1.5 ms a dim
    # in sympy), and a size held in an int gets a positive symbol, as a tensor's.  Here,
    # so that the warm-start cache's reader makes the same symbols.  A shared input's
    # fake aliases no other input's; the retrace drops the alias guards anyway
    # (`_without_alias_guards`)
    ctx.share_dim_symbols = True

    def spec(pos: Position, v: int) -> Dim | bool:
        if v < 2:  # 0 and 1 always specialize
            return False
        if pos not in dynamic:
            if pos not in free:
                return False
            # a lifted size or int: a Dim of its own, so that its range is a size's,
            # [2, oo), as a tensor dim's is.  Unbounded, ``rows == B*T`` never became
            # a replacement (``B*T`` might be negative), and every later size carried it
            return Dim(f"{LISTS[pos[0]]}_{pos[1]}") if pos[2] < 0 else True
        group = (groups or {}).get(pos)
        if (v, group) not in shared:
            at = "" if group is None else "_" + "_".join(str(max(x, 0)) for x in group)
            shared[(v, group)] = Dim(f"v{v}{at}")
        return shared[(v, group)]

    # A tensor whose strides do not follow from its sizes (a slice such as the ids
    # ``seq[:, :-1]``) is dynamic too: its stride gets its own symbol, bound to the
    # input's stride by the guards.  Kept static, its batch dim would specialize every
    # size computed with it (``batch x T`` rows) and recompile at each new batch size.
    in_specs: list[Any] = [
        [spec((0, i, d), int(n)) for d, n in enumerate(t.shape)]
        if isinstance(t, torch.Tensor)
        else None
        for i, t in enumerate(inputs)
    ]
    # A sparse tensor (a sparse .grad) that only opaque calls read: a static fake beside
    # the shape context, so no guard reads it (its nnz changes every step; the opaque
    # call takes whatever layout it gets).  Read by a traced op, it goes to the shape
    # context, which refuses it (the graph then runs uncompiled, with a warning).
    aside = [
        i
        for i, t in enumerate(inputs)
        if i in opaque_only and isinstance(t, torch.Tensor) and t.layout != torch.strided
    ]
    plain = [_plain(t) for t in inputs]
    if not aside:
        faked = list(ctx.fakeify(plain, Source.arg(0), dynamic=in_specs))
    else:  # item by item, those aside not at all (the engine's key fixes the count)
        faked = []
        for i, (t, dims) in enumerate(zip(plain, in_specs, strict=True)):
            if i in aside:
                with disable_proxy_modes_tracing():
                    faked.append(ctx.fake_mode.from_tensor(inputs[i].detach(), static_shapes=True))
            else:
                faked.append(ctx.fakeify(t, Source.arg(0).item(i), dynamic=dims))
    return {
        "inputs": faked,
        "sizes": list(
            ctx.fakeify(
                list(sizes),
                Source.arg(1),
                dynamic=[spec((1, i, -1), int(v)) for i, v in enumerate(sizes)],
            )
        ),
        "scalars": list(
            ctx.fakeify(
                list(scalars),
                Source.arg(2),
                dynamic=[
                    spec((2, i, -1), v) if isinstance(v, int) and not isinstance(v, bool) else False
                    for i, v in enumerate(scalars)
                ],
            )
        ),
    }


def retrace(
    gm: fx.GraphModule,
    inputs: Sequence[Any],
    sizes: Sequence[Any],
    scalars: Sequence[Any],
    sym_sources: dict[sympy.Symbol, tuple[str, int]],
    unpack_meta: dict[str, Any],
    dynamic: frozenset[Position] = frozenset(),
    free: frozenset[Position] = frozenset(),
    groups: Mapping[Position, Position] | None = None,
) -> Retraced:
    """Replay ``gm`` (a captured graph) with real input shapes into core aten.

    ``dynamic``: the positions that get a symbolic size (those seen to change
    between calls, or held symbolic by the forward); positions holding the same value
    (and in the same of ``groups``, where given) share one symbol, as the same `Dim`
    (a guard checks they stay equal).  ``free``: positions that get a symbol each
    (`fake_inputs`).  Everything else is static.  With unpack hooks ``groups`` is
    not used: their results' sizes take a symbol by value (`_Replayer.unpack_fake`).
    """
    if unpack_meta:
        groups = None
    # "auto": every spec below is explicit, so this only words the guards' reasons right
    # (a static size is static until it changes; then the next compile makes it symbolic)
    ctx = ShapeContext(policy="auto")
    if dynamic or free:
        # Fake tensors' dispatch cache lives on the shape env when sizes are symbolic:
        # this retrace's only.  Its ops rarely repeat with equal metadata (a GPT's: 163
        # hits, 594 misses), and a miss builds the output a second time to check the
        # entry (symbolic contiguity through sympy): a third of the retrace.  Static
        # sizes share the process-wide cache, which does pay (kept).
        ctx.fake_mode.cache_enabled = False
    values = fake_inputs(
        ctx, inputs, sizes, scalars, dynamic, free, opaque_only_inputs(gm, len(inputs)), groups
    )
    rp = _Replayer(ctx, sym_sources, unpack_meta)
    rp.values = values
    rp.source_gm = gm
    rp.unpack_idx = unpack_index(gm)
    rp.dynamic = dynamic
    for pos in sorted(dynamic):
        w, i, d = pos
        if w == 0 and isinstance(inputs[i], torch.Tensor):
            rp.sym_by_value.setdefault(int(inputs[i].shape[d]), pos)
        elif w == 1:
            rp.sym_by_value.setdefault(int(sizes[i]), pos)
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(ctx.tracing())
        stack.enter_context(enable_python_dispatcher())
        stack.enter_context(rp.mode)
        stack.enter_context(decompose(_replay_table()))
        for node in gm.graph.nodes:
            try:
                with _naming_origins(ctx, node):
                    _replay_node(rp, node, placeholders)
            except RetraceError:
                raise
            except Exception as e:
                where = node.meta.get("autograd_node", node.name)
                raise RetraceError(
                    f"retracing {node.format_node()} (from {where}) failed: {e}"
                ) from e
    graph = rp.tracer.graph
    # Graph inputs were made on first use, mid-graph: hoist them, in order, to the top.
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if first is not None:
        for ph in phs:
            first.prepend(ph)
    graph.eliminate_dead_code(is_impure_node=lambda n: _impure(n))
    from .. import passes  # the retrace only: not on a warm start

    graph = passes.run_all(graph, passes.RETRACED_PIPELINE)
    new_gm = graph_module(rp.tracer.root, graph, gm.__class__.__name__ + "Aten")
    return Retraced(new_gm, rp.arg_spec, ctx, rp.examples)


@contextlib.contextmanager
def _naming_origins(ctx: ShapeContext, node: fx.Node) -> Iterator[None]:
    """Name ``node`` in the origin of every guard, replacement and range its replay adds.

    The user's frame is ``loss.backward()`` at best (none at all when a library
    calls it), so explain() would say little more than "origin unknown".
    """
    n_guards = len(ctx.shape_env.guards)
    tables = (ctx.replacement_origins, ctx.range_origins)
    before = [dict(t) for t in tables]
    yield
    what = f"while retracing {node.name} of {node.meta.get('autograd_node', 'the backward')}"

    def named(o: Origin) -> Origin:
        return dataclasses.replace(o, note=f"{o.note}, {what}" if o.note else what)

    for i in range(n_guards, len(ctx.shape_env.guards)):
        ctx.guard_origins[i] = named(ctx.guard_origins.get(i) or Origin())
    for table, old in zip(tables, before, strict=True):
        for k, o in table.items():
            if old.get(k) is not o:
                table[k] = named(o)


def _plain(t: Any) -> Any:
    """``t`` without its view base, ``.grad`` and storage offset (storage shared).

    Saved tensors are often views of parameters, and a parameter's ``.grad`` is
    another input: fakeified as they are, the fake converter would reuse one
    fake for both and lose the dynamic dims of the other.
    """
    if not isinstance(t, torch.Tensor):
        return t
    d = t.detach()
    if d.storage_offset() != 0:  # nothing reads it: offset 0 keeps it out of the guards
        d = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), 0, t.size(), t.stride()
        )
    if isinstance(t, torch.nn.Parameter):  # guards check the type too
        return torch.nn.Parameter(d, requires_grad=t.requires_grad)
    if t.requires_grad:
        d.requires_grad_(True)
    return d


def _without_alias_guards(guards: GuardSet) -> GuardSet:
    """The retraced graph reads its inputs functionally (only opaque calls write,
    as eager would), so how inputs alias does not change what it computes."""
    kept = [g for g in guards.guards if g.kind != "alias"]
    return GuardSet(guards.tensors, kept, guards.bindings)


def _impure(n: fx.Node) -> bool:
    if n.op in ("placeholder", "output") or ops.is_opaque(n.target) or n.target is check_sizes:
        return True
    return bool(n.is_impure())  # in-place aten ops (CopySlices writes through a view)


def _replay_node(rp: _Replayer, node: fx.Node, placeholders: dict[fx.Node, int]) -> None:
    env = rp.env
    if node.op == "placeholder":
        env[node] = node  # a list placeholder; its items become flat placeholders
        return
    if node.op == "output":
        outs = pytree.tree_map_only(fx.Node, lambda n: env[n], node.args[0])
        rp.tracer.create_node("output", "output", (rp.tracer.create_arg(rp.proxy(outs)),), {})
        return
    if node.op == "get_attr":  # a constant of an inlined AOT backward
        const = getattr(rp.source_gm, str(node.target))
        if not isinstance(const, torch.Tensor):
            raise RetraceError(f"get_attr {node.target} of type {type(const).__name__}")
        setattr(rp.tracer.root, str(node.target), const)
        p: Any = rp.tracer.create_proxy("get_attr", str(node.target), (), {})
        with disable_proxy_modes_tracing():
            fake = rp.ctx.fake_mode.from_tensor(const, static_shapes=True)
        rp.bind(fake, p)
        env[node] = fake
        return
    if node.op != "call_function":
        raise RetraceError(f"unexpected node {node.format_node()}")
    if node.target is operator.getitem and node.args[0] in placeholders:
        which = placeholders[node.args[0]]  # type: ignore[index]
        env[node] = rp.item(which, int(node.args[1]))  # type: ignore[arg-type]
        return
    if ops.is_opaque(node.target):
        env[node] = rp.opaque(node)
        return
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: env[n], (node.args, node.kwargs))
    leaves = pytree.tree_leaves((args, kwargs))
    if any(isinstance(a, _Opaque) for a in leaves):
        raise RetraceError(f"{node.format_node()} takes a hook or ctx object but is not opaque")
    if node.target is aot_backward_prologue:
        _tie_tangents(args)
    elif node.target is torch.ops.aten.view.default:  # recorded as is: no table on its way
        _relate_view_sizes(*args, **kwargs)
    if node.target is torch.ops.aten.zeros.default:  # as torch's decomposition: a full
        as_full = _zeros_as_full(args, kwargs)
        if as_full is not None:
            fargs, fkwargs = as_full
            full = torch.ops.aten.full.default
            out = _record(rp, full, fargs, fkwargs, pytree.tree_leaves((fargs, fkwargs)))
            if out is not NotImplemented:
                env[node] = out
                return
    if _recorded_as_is(node.target):  # e.g. an inlined AOT backward's core-aten op
        out = _record(rp, node.target, args, kwargs, leaves)  # type: ignore[arg-type]
        if out is not NotImplemented:
            env[node] = out
            return
    elif _kept_whole(node.target):  # a fused backward: its table entry decides
        out = _replay_table()[node.target](*args, **kwargs)  # traced where it decomposes
        if out is NotImplemented:  # kept whole: recorded as the proxy mode would
            out = _record(rp, node.target, args, kwargs, leaves)  # type: ignore[arg-type]
        if out is not NotImplemented:
            env[node] = out
            return
    env[node] = node.target(*args, **kwargs)  # type: ignore[operator]


def _tie_tangents(args: Sequence[Any]) -> None:
    """Tie each size of the gradients entering an inlined AOT backward (the arguments of
    its `aot_backward_prologue`) to the forward's size of that tangent
    (`aot_inline.tangent_sizes`), before the backward's first view multiplies them:
    ``Eq(s7, s1)`` becomes a replacement, while ``s7*s9 == s1*s2`` (a gradient of free
    sizes viewed to ``batch x T`` rows) would stay an axiom that every later size
    drags along.  The engine hands a node gradients of exactly its forward outputs'
    sizes, so these guards hold wherever the graph runs; a tie whose hints disagree
    is left out (the trace then relates the sizes where it meets them)."""
    _saved, symints, grads, tangent_of, _n, *rest = args
    want_sizes = rest[0] if rest else ()
    names = {sympy.Symbol(f"a{j}"): v for j, v in enumerate(symints)}
    with disable_proxy_modes_tracing():
        for g, k in zip(grads, tangent_of, strict=False):
            if k is None or not isinstance(g, torch.Tensor) or k >= len(want_sizes):
                continue
            want = want_sizes[k]
            if want is None or len(want) != g.dim():
                continue
            for have, w in zip(g.shape, want, strict=True):
                if w is None or not isinstance(have, torch.SymInt):
                    continue
                try:
                    value = w if isinstance(w, int) else _eval_sym(sympy.sympify(w), names)
                except (RetraceError, KeyError, TypeError, ValueError, sympy.SympifyError):
                    continue  # an expression _eval_sym does not rebuild: no tie
                if _expr(have) == _expr(value):
                    continue  # one expression already (the inputs share their Dims' symbols)
                hint = _hint(have)
                if hint is not None and hint == _hint(value):
                    _assume_equal(have, value)


def _relate_view_sizes(x: Any, size: Sequence[Any]) -> None:
    """Relate the sizes of a view's input and output group by group before its meta
    kernel does: the runs of dims whose products agree (by the sizes' hints), such as
    ``(rows, V) -> (B, T, V)``: ``rows == B*T`` and ``V == V'``, each solved into a
    replacement.  The kernel first checks the numels, ``rows*V == B*T*V'`` (no symbol
    of it can be solved for), then splits ``rows`` by ``B`` into ``rows // B``, and every
    size after it carries the floor division.  The kernel's own guards (which dims
    it splits and merges) imply these equalities, so they ask nothing more of a call."""
    if not isinstance(x, torch.Tensor) or not isinstance(size, list | tuple):
        return
    src = [d for d in x.shape if not (isinstance(d, int) and d == 1)]
    dst = [d for d in size if not (isinstance(d, int) and d == 1)]
    if all(isinstance(d, int) for d in (*src, *dst)):
        return
    hs, hd = [_hint(d) for d in src], [_hint(d) for d in dst]
    if any(h is None or h < 1 for h in (*hs, *hd)) or math.prod(hs) != math.prod(hd):  # type: ignore[arg-type]
        return  # -1, zero elements, an error: the kernel says what it says
    groups: list[tuple[list[Any], list[Any]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        a, b = [src[i]], [dst[j]]
        pa, pb = hs[i], hd[j]
        i, j = i + 1, j + 1
        while pa != pb:  # type: ignore[operator]
            if pa < pb:  # type: ignore[operator]
                a.append(src[i])
                pa *= hs[i]  # type: ignore[operator]
                i += 1
            else:
                b.append(dst[j])
                pb *= hd[j]  # type: ignore[operator]
                j += 1
        groups.append((a, b))
    with disable_proxy_modes_tracing():
        for a, b in groups:
            # one expression already (the common case once sizes are related): no SymInt
            # products, whose every multiplication builds a node and its hint
            if sympy.Mul(*(_expr(d) for d in a)) == sympy.Mul(*(_expr(d) for d in b)):
                continue
            _assume_equal(math.prod(a), math.prod(b))


def _view_relating_sizes(x: Any, size: Any) -> Any:
    """``aten.view`` in the replay's table: `_relate_view_sizes`, then the op as it is."""
    _relate_view_sizes(x, size)
    return NotImplemented


def _expr(v: Any) -> Any:
    """A size's expression (replacements applied), or the int itself."""
    return v.node.expr if isinstance(v, torch.SymInt) else v


def _tie(a: Any, b: Any) -> bool:
    """Are sizes ``a`` and ``b`` one expression, once told equal where their hints are
    equal and at least 2?  The kernels whose results the retrace builds check such
    sizes equal (nll's rows against the target's, a backward's gradient against its
    saved output), so their guard ``a == b`` (a replacement) is the one the kernel
    would add; where the eager nodes' sizes hold a symbol each, the rule then applies.
    Hints that differ, or a size 1 (a broadcast), tie nothing."""
    if _expr(a) == _expr(b):
        return True
    ha, hb = _hint(a), _hint(b)
    if ha is None or ha != hb or ha < 2:
        return False
    _assume_equal(a, b)
    return bool(_expr(a) == _expr(b))


def _fill_hole(shape: list[Any], size: list[Any], hole: int) -> list[Any] | None:
    """`size` with its -1 at `hole` replaced by numel / (the other sizes), where that
    quotient is a whole expression (``b*t*768 / 768``: ``b*t``), else None. The new
    size is SymInt arithmetic (a floor division the expressions settle: no guard)."""
    rest = [d for k, d in enumerate(size) if k != hole]
    if any(isinstance(d, int) and d <= 0 for d in rest):
        return None
    q = sympy.Mul(*(_expr(d) for d in shape)) / sympy.Mul(*(_expr(d) for d in rest))
    if sympy.fraction(q)[1] != 1 or not (q.is_positive and q.is_integer):
        return None
    total: Any = 1
    for d in shape:
        total = total * d
    div: Any = 1
    for d in rest:
        div = div * d
    filled = total // div
    if _expr(filled) != q:
        return None
    return [*size[:hole], filled, *size[hole + 1 :]]


def _known_view(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``x.view(size)`` built straight as an ``as_strided`` of ``x`` where its strides
    follow from the sizes' expressions alone, without asking the shape env anything.
    Else None: the op's own meta kernel, torch's generic reshape, which decides every
    split and merge through sympy (a few milliseconds per view, most of a symbolic
    retrace's view cost).  Only when a size is symbolic: static views are cheap.

    The dims are matched group by group as `_relate_view_sizes` relates them (by
    the sizes' hints); a group must have equal products as expressions (after its
    replacements), and the input dims it merges must be laid out one inside the
    next (``stride[i] == stride[i+1] * size[i+1]``), as a view needs.  Then an
    output dim's stride is the next inner one's times its size, from the group's
    innermost input stride.  One ``-1`` is filled from the sizes' expressions where
    they divide exactly (`_fill_hole`); zero sizes are left to the kernel."""
    if kwargs or len(args) != 2:
        return None
    x, size = args
    if not isinstance(x, torch.Tensor) or not isinstance(size, list | tuple):
        return None
    shape, strides = list(x.shape), list(x.stride())
    if all(isinstance(d, int) for d in (*shape, *strides, *size)):
        return None
    holes = [k for k, d in enumerate(size) if isinstance(d, int) and d == -1]
    if len(holes) == 1:  # `x.view(-1, c)`: the hole from the sizes' expressions
        size = _fill_hole(shape, list(size), holes[0])
        if size is None:
            return None
    src = [i for i, d in enumerate(shape) if not (isinstance(d, int) and d == 1)]
    dst = [j for j, d in enumerate(size) if not (isinstance(d, int) and d == 1)]
    hs, hd = [_hint(shape[i]) for i in src], [_hint(size[j]) for j in dst]
    if any(h is None or h < 2 for h in (*hs, *hd)):
        return None  # -1, 0, a symbolic size with hint 1: the kernel decides
    out: list[Any] = [None] * len(size)
    i = j = 0
    while i < len(src) or j < len(dst):
        if i == len(src) or j == len(dst):
            return None  # numels differ: the kernel raises
        a, b = [src[i]], [dst[j]]
        pa, pb = hs[i], hd[j]
        i, j = i + 1, j + 1
        while pa != pb:  # type: ignore[operator]
            if pa < pb and i < len(src):  # type: ignore[operator]
                a.append(src[i])
                pa *= hs[i]  # type: ignore[operator]
                i += 1
            elif pb < pa and j < len(dst):  # type: ignore[operator]
                b.append(dst[j])
                pb *= hd[j]  # type: ignore[operator]
                j += 1
            else:
                return None
        if sympy.Mul(*(_expr(shape[k]) for k in a)) != sympy.Mul(*(_expr(size[k]) for k in b)):
            return None  # equal only at the hints: a guard the kernel adds
        for k, k2 in itertools.pairwise(a):
            if _expr(strides[k]) != _expr(strides[k2]) * _expr(shape[k2]):
                return None  # not one block of memory: no view (the kernel says so)
        st = strides[a[-1]]
        for k in reversed(b):
            out[k] = st
            st = st * size[k]
    inner: Any = 1
    for k in reversed(range(len(size))):  # size-1 dims: as a contiguous layout has them
        if out[k] is None:
            out[k] = inner
        else:
            inner = out[k] * size[k]
    return x.as_strided(size, out, x.storage_offset())


def _known_layer_norm(args: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...] | None:
    """``aten.native_layer_norm``'s results made as its fake kernel makes them (``out``
    contiguous in the input's dtype; ``mean`` and ``rstd`` contiguous, of the leading
    sizes then ones), without running the kernel: torch's is the Python reference,
    a dozen ops whose broadcasts and reductions each ask sympy about the sizes, about
    25 ms a call over symbolic sizes (a checkpointed block recomputes two per
    backward).  Only where the normalized sizes are the input's last sizes as
    expressions (the kernel's only check that could add a guard), a floating input,
    a symbolic size; else None (the kernel)."""
    if kwargs or len(args) != 5:
        return None
    x, normalized, weight, bias, _eps = args
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        return None
    n = len(normalized)
    shape = list(x.shape)
    if n < 1 or n > len(shape) or all(isinstance(d, int) for d in shape):
        return None
    tail = [_expr(d) for d in shape[len(shape) - n :]]
    if tail != [_expr(d) for d in normalized]:
        return None
    for p in (weight, bias):
        if p is not None and (
            not isinstance(p, torch.Tensor) or [_expr(d) for d in p.shape] != tail
        ):
            return None
    if x.device.type in ("cpu", "mtia") or x.dtype in (torch.float32, torch.float64):
        stat_dtype = x.dtype
    else:
        stat_dtype = torch.float32  # the reference's opmath for half types
    stats = [*shape[: len(shape) - n], *([1] * n)]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(stats, dtype=stat_dtype, device=x.device)
    rstd = torch.empty(stats, dtype=stat_dtype, device=x.device)
    return out, mean, rstd


def _known_layer_norm_backward(
    args: Any, kwargs: dict[str, Any]
) -> tuple[torch.Tensor | None, ...] | None:
    """``aten.native_layer_norm_backward``'s results made as its fake kernel makes them,
    without running it: the kernel is torch's decomposition, about twenty ops whose
    broadcasts and reductions each ask sympy about the sizes (about 20 ms a call over
    symbolic sizes, against 1.5 ms static; every layer norm of the model has one).
    The decomposition computes on contiguous copies, so ``grad_input`` is contiguous
    of the input's sizes in its dtype, and ``grad_weight``/``grad_bias`` contiguous of
    the normalized sizes in the weight's/bias's dtype (None where masked off or where
    there is no weight/bias).  Only where nothing could add a guard: ``grad_out`` of the
    input's sizes, ``mean``/``rstd`` of the leading sizes then ones (as the forward
    made them), normalized sizes, weight and bias the input's last sizes, all as
    expressions (the gradient's and the statistics' sizes told equal to the input's
    first where their hints are, `_tie`: an eager ``NativeLayerNormBackward0``'s sizes
    hold a symbol each); no size zero; a floating input, a symbolic size.  Else None."""
    if kwargs or len(args) != 8:
        return None
    grad, x, normalized, mean, rstd, weight, bias, mask = args
    if not all(isinstance(t, torch.Tensor) for t in (grad, x, mean, rstd)):
        return None
    if not x.dtype.is_floating_point or len(mask) != 3:
        return None
    n = len(normalized)
    shape = list(x.shape)
    if n < 1 or n > len(shape) or all(isinstance(d, int) for d in shape):
        return None
    if any(h is None or h < 1 for h in (_hint(d) for d in shape)):
        return None  # an empty input: the kernel returns zeros of other dtypes
    # an eager node's sizes hold a symbol each: tie the gradient's and the statistics'
    # sizes to the input's where their hints are equal (the kernel's broadcasts would
    # guard them so), as the other rules do (`_tie`)
    if grad.dim() != len(shape) or not all(_tie(a, b) for a, b in zip(grad.shape, shape)):
        return None
    for stat in (mean, rstd):
        if stat.dim() == len(shape):
            for a, b in zip(stat.shape[: len(shape) - n], shape[: len(shape) - n]):
                _tie(a, b)
    for a, b in zip(normalized, shape[len(shape) - n :]):  # the kernel's own check
        _tie(a, b)
    for p in (weight, bias):
        if isinstance(p, torch.Tensor) and p.dim() == n:
            for a, b in zip(p.shape, shape[len(shape) - n :]):
                _tie(a, b)
    exprs = [_expr(d) for d in shape]
    lead, tail = exprs[: len(shape) - n], exprs[len(shape) - n :]
    if [_expr(d) for d in grad.shape] != exprs or [_expr(d) for d in normalized] != tail:
        return None
    stats = [*lead, *([1] * n)]
    if [_expr(d) for d in mean.shape] != stats or [_expr(d) for d in rstd.shape] != stats:
        return None
    for p in (weight, bias):
        if p is not None and (
            not isinstance(p, torch.Tensor) or [_expr(d) for d in p.shape] != tail
        ):
            return None
    inner = shape[len(shape) - n :]
    d_input = torch.empty(shape, dtype=x.dtype, device=x.device) if mask[0] else None
    d_weight = (
        torch.empty(inner, dtype=weight.dtype, device=x.device)
        if mask[1] and weight is not None
        else None
    )
    d_bias = (
        torch.empty(inner, dtype=bias.dtype, device=x.device)
        if mask[2] and bias is not None
        else None
    )
    return d_input, d_weight, d_bias


def _known_batch_norm_backward(
    args: Any, kwargs: dict[str, Any]
) -> tuple[torch.Tensor | None, ...] | None:
    """``aten.native_batch_norm_backward``'s results made as its fake kernel makes them,
    without running it: the kernel is torch's decomposition, a dozen broadcasts and
    reductions that each ask sympy about the sizes (about 30 ms a call over symbolic
    sizes, against 2 ms static).  It computes ``grad_input`` pointwise from the
    gradient and the input, so with both contiguous (by their expressions) of one
    size it is contiguous of those sizes in the input's dtype; ``grad_weight`` and
    ``grad_bias`` are per-channel sums, ``(C,)`` in the weight's dtype (the input's
    without a weight), None where masked off (``grad_input`` is made even then, as
    the decomposition makes it).  Only with a floating input of two or
    more dims, a symbolic size, no size zero, a weight of ``(C,)`` as expressions or
    none; else None (the kernel)."""
    if kwargs or len(args) != 10:
        return None
    grad, x, weight = args[0], args[1], args[2]
    mask = args[9]
    if not isinstance(grad, torch.Tensor) or not isinstance(x, torch.Tensor):
        return None
    if not x.dtype.is_floating_point or x.dim() < 2 or len(mask) != 3:
        return None
    if grad.dtype != x.dtype or grad.device != x.device:
        return None
    shape = list(x.shape)
    if all(isinstance(d, int) for d in shape):
        return None
    if any(h is None or h < 1 for h in (_hint(d) for d in shape)):
        return None
    if [_expr(d) for d in grad.shape] != [_expr(d) for d in shape]:
        return None
    if not (_contiguous_by_exprs(x) and _contiguous_by_exprs(grad)):
        return None
    channels = shape[1]
    if weight is not None and (
        not isinstance(weight, torch.Tensor)
        or [_expr(d) for d in weight.shape] != [_expr(channels)]
    ):
        return None
    wdtype = weight.dtype if isinstance(weight, torch.Tensor) else x.dtype
    d_input = torch.empty(shape, dtype=x.dtype, device=x.device)  # whatever the mask
    d_weight = torch.empty([channels], dtype=wdtype, device=x.device) if mask[1] else None
    d_bias = torch.empty([channels], dtype=wdtype, device=x.device) if mask[2] else None
    return d_input, d_weight, d_bias


def _contiguous_by_exprs(t: torch.Tensor) -> bool:
    """Are ``t``'s strides the contiguous strides of its sizes, as expressions (size-1
    dims skipped)?  No question to the shape env; False where only a guard would say."""
    want: Any = 1
    for d, st in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        size = _expr(d)
        if size == 1:
            continue
        if _expr(st) != want:
            return False
        want = want * size
    return True


def _known_pointwise_backward(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The result of a fused pointwise backward (``gelu_backward(grad, self)``,
    ``_softmax_backward_data(grad, output, dim, input_dtype)``, ...), made as its fake
    kernel makes it: torch's decomposition, a handful of broadcasting ops that each
    ask sympy about the sizes (about 10 ms a call over symbolic sizes).  Only where
    its two tensors have one dtype and the same sizes as expressions (sizes of equal
    hints, 2 or more, are told equal first, `_tie`: the kernel's broadcast would guard
    them so) and are both contiguous (by their expressions): the result is then
    contiguous of those sizes, in their dtype, or ``input_dtype`` for the softmax
    backwards (the kernel casts to it).  Else None (the kernel)."""
    if len(args) < 2:
        return None
    a, b = args[0], args[1]
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    if a.layout != torch.strided or b.layout != torch.strided:
        return None
    if a.dtype != b.dtype or not a.dtype.is_floating_point or a.device != b.device:
        return None
    if any(isinstance(v, torch.Tensor) for v in (*args[2:], *kwargs.values())):
        return None
    shape = list(a.shape)
    if all(isinstance(d, int) for d in shape) or a.dim() != b.dim():
        return None
    if [_hint(d) for d in shape] != [_hint(d) for d in b.shape]:
        return None
    if not (_contiguous_by_exprs(a) and _contiguous_by_exprs(b)):
        return None
    if not all(_tie(x, y) for x, y in zip(b.shape, shape, strict=True)):
        return None
    dtype = a.dtype
    if len(args) == 4 and isinstance(args[3], torch.dtype):  # the softmax backwards
        dtype = args[3]
    return torch.empty(shape, dtype=dtype, device=a.device)


_NLL_ARGS = ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")


def _known_nll_loss_backward(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``nll_loss_backward``'s result (what ``NllLossBackward0``'s functional backward
    calls, a cross-entropy's second half): its fake kernel is torch's decomposition, a
    dozen ops each asking sympy about broadcasts (about 15 ms a call over symbolic
    sizes).  Only for an ``(N, C)`` input contiguous by its expressions, a ``(N,)``
    target of the same ``N`` as an expression, a one-element ``total_weight``, a weight
    of ``(C,)`` or none, a gradient of one element (``mean``/``sum``) or of ``(N,)``
    (``none``), all floating tensors of one dtype: the result is then contiguous
    ``(N, C)`` in that dtype, as the decomposition's ``zeros_like(self) * grad`` makes
    it.  Else None (the kernel, and its checks)."""
    if len(args) + len(kwargs) != len(_NLL_ARGS):
        return None
    named = dict(zip(_NLL_ARGS, args, strict=False)) | kwargs
    grad, x, target, weight = (named.get(k) for k in _NLL_ARGS[:4])
    reduction, total = named.get("reduction"), named.get("total_weight")
    tensors = [t for t in (grad, x, target, total) if isinstance(t, torch.Tensor)]
    if len(tensors) != 4 or any(t.layout != torch.strided for t in tensors):
        return None
    assert isinstance(x, torch.Tensor) and isinstance(grad, torch.Tensor)
    assert isinstance(target, torch.Tensor) and isinstance(total, torch.Tensor)
    if x.dim() != 2 or target.dim() != 1 or not isinstance(reduction, int):
        return None
    shape = list(x.shape)
    if all(isinstance(d, int) for d in shape) or not _contiguous_by_exprs(x):
        return None
    dtype = x.dtype
    if not dtype.is_floating_point or grad.dtype != dtype or total.dtype != dtype:
        return None
    if target.dtype not in (torch.int64, torch.int32, torch.uint8):
        return None
    if [_expr(d) for d in total.shape] not in ([], [1]):
        return None
    if reduction == 0:  # none: one gradient per row
        if grad.dim() != 1:
            return None
    elif [_expr(d) for d in grad.shape] not in ([], [1]):
        return None
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or weight.dtype != dtype or weight.dim() != 1:
            return None
        if not _tie(weight.shape[0], shape[1]):
            return None
    if not _tie(target.shape[0], shape[0]):
        return None
    if reduction == 0 and not _tie(grad.shape[0], shape[0]):
        return None
    return torch.empty(shape, dtype=dtype, device=x.device)


def _known_addmm(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``addmm(bias, a, b)``'s result: contiguous ``(M, N)`` in their dtype (its fake
    kernel is torch's decomposition, an ``mm`` then a broadcasting add and scale, about
    3 ms a call over symbolic sizes).  Only where the inner sizes are one expression,
    the bias is ``(N,)``, ``(1, N)`` or ``(M, N)`` as expressions, one floating dtype,
    one device, a symbolic size; else None (the kernel)."""
    if len(args) != 3 or any(k not in ("beta", "alpha") for k in kwargs):
        return None
    bias, a, b = args
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in args):
        return None
    if a.dim() != 2 or b.dim() != 2 or not a.dtype.is_floating_point:
        return None
    if bias.dtype != a.dtype or b.dtype != a.dtype or not (bias.device == a.device == b.device):
        return None
    m, k = a.shape
    k2, n = b.shape
    if all(isinstance(d, int) for d in (m, k, k2, n)) or _expr(k) != _expr(k2):
        return None
    if [_expr(d) for d in bias.shape] not in ([_expr(n)], [1, _expr(n)], [_expr(m), _expr(n)]):
        return None
    return torch.empty([m, n], dtype=a.dtype, device=a.device)


def _known_clone(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``clone(x, memory_format=torch.contiguous_format)``: contiguous of ``x``'s sizes
    whatever its strides (its fake kernel, torch's reference, asks sympy about them).
    Another memory format: the pointwise rule (`_known_pointwise`)."""
    if len(args) != 1 or kwargs != {"memory_format": torch.contiguous_format}:
        return _known_pointwise(torch.ops.aten.clone.default, args, kwargs)
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
        return None
    if all(isinstance(d, int) for d in x.shape):
        return None
    return torch.empty(list(x.shape), dtype=x.dtype, device=x.device)


def _known_cat(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``cat(tensors, dim)``'s result: contiguous, of the tensors' sizes with ``dim`` the
    sum of theirs (its fake kernel checks each size of each tensor against the first's
    and sums them through the shape env: about 2 ms a call over symbolic sizes, a
    GPT-2 attention block's gradient has one).  The kernel's layout is contiguous unless
    its inputs suggest channels-last, which only rank 4 and 5 can: there the tensors
    must be contiguous by their expressions, with no size below 2 (where a layout may
    read as channels-last too).  Only for tensors of one dtype, one device and one rank,
    with every other dim one expression across them, no empty tensor, a symbolic size;
    else None (the kernel)."""
    if any(k != "dim" for k in kwargs) or not 1 <= len(args) <= 2:
        return None
    tensors = args[0]
    dim = args[1] if len(args) == 2 else kwargs.get("dim", 0)
    if not isinstance(tensors, list | tuple) or not tensors or not isinstance(dim, int):
        return None
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in tensors):
        return None
    first = tensors[0]
    ndim = first.dim()
    if ndim == 0 or not -ndim <= dim < ndim:
        return None
    dim %= ndim
    symbolic = False
    exprs = [_expr(d) for d in first.shape]
    for t in tensors:
        if t.dim() != ndim or t.dtype != first.dtype or t.device != first.device:
            return None
        hints = [_hint(d) for d in t.shape]
        low = 2 if ndim in (4, 5) else 1
        if any(h is None or h < low for h in hints):
            return None
        own = [_expr(d) for d in t.shape]
        if any(own[k] != exprs[k] for k in range(ndim) if k != dim):
            return None
        symbolic = symbolic or any(isinstance(d, torch.SymInt) for d in t.shape)
        if ndim in (4, 5) and not _contiguous_by_exprs(t):
            return None  # channels-last inputs may give a channels-last result
    if not symbolic:
        return None
    total: Any = 0
    for t in tensors:
        total = total + t.shape[dim]
    sizes = [*first.shape[:dim], total, *first.shape[dim + 1 :]]
    return torch.empty(sizes, dtype=first.dtype, device=first.device)


def _full_args_known(args: Any, kwargs: dict[str, Any]) -> bool:
    """Are these ``full``'s arguments `_known_full`'s?"""
    if len(args) != 2 or any(k not in ("dtype", "layout", "device", "pin_memory") for k in kwargs):
        return False
    size, value = args
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if not isinstance(dtype, torch.dtype) or not isinstance(device, torch.device):
        return False
    if kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory"):
        return False
    if type(value) not in (bool, int, float) or not isinstance(size, list | tuple):
        return False
    return any(isinstance(d, torch.SymInt) for d in size) and all(
        isinstance(d, int | torch.SymInt) for d in size
    )


def _known_full(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``full(size, value, dtype=..., device=...)``: contiguous of ``size`` (its fake
    kernel, torch's reference, checks and multiplies the sizes through sympy).  Only
    with a dtype and a device given, a strided layout, a number to fill with and a
    symbolic size; else None (the kernel)."""
    if not _full_args_known(args, kwargs):
        return None
    return torch.empty(list(args[0]), dtype=kwargs["dtype"], device=kwargs["device"])


def _zeros_as_full(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
    """``zeros(size, dtype=...)``'s arguments as the ``full`` that torch's decomposition
    of it calls (``full(size, 0, ...)``, ``False`` for booleans), where that ``full``
    is `_known_full`'s; else None (the decomposition, through the proxy mode)."""
    if len(args) != 1 or kwargs.get("requires_grad"):
        return None
    dtype = kwargs.get("dtype")
    if not isinstance(dtype, torch.dtype):
        return None
    kw = {k: v for k, v in kwargs.items() if k != "requires_grad"}
    kw.setdefault("layout", torch.strided)
    kw.setdefault("pin_memory", False)
    fill = False if dtype == torch.bool else 0
    full_args = (list(args[0]), fill)
    if not _full_args_known(full_args, kw):
        return None
    return full_args, kw


_DTYPES_OF: dict[tuple[Any, ...], torch.dtype | None] = {}
"""Result dtype of a pointwise op per argument signature (`_pointwise_dtype`)."""


def _pointwise_dtype(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype of ``op(*args, **kwargs)``'s result, from its fake kernel run once per
    signature on one-element tensors (type promotion reads only dtypes, which tensors
    are zero-dim, and the kinds of scalars), or None where the kernel refuses them."""
    key: list[Any] = [op]
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.dim() == 0, a.device))
        elif isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
            key.append(a.node.pytype)
        elif isinstance(a, bool | int | float | complex):
            key.append(type(a))
        elif a is None or isinstance(a, str | torch.dtype | torch.device | torch.layout):
            key.append(a)
        else:
            return None
    k = tuple(key)
    if k not in _DTYPES_OF:  # the probes only on a miss: each is a fake-mode op
        probe: list[Any] = []
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                shape = [] if a.dim() == 0 else [1]
                probe.append(torch.empty(shape, dtype=a.dtype, device=a.device))
            elif isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
                probe.append(a.node.pytype(1))
            else:
                probe.append(a)
        n = len(args)
        try:
            out = op(*probe[:n], **dict(zip(kwargs, probe[n:], strict=True)))
        except Exception:
            out = None
        _DTYPES_OF[k] = out.dtype if isinstance(out, torch.Tensor) else None
    return _DTYPES_OF[k]


def _known_pointwise(op: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A pointwise op's result (``where``, ``clamp``, ``add``, comparisons, ...) made
    from its operands' sizes as expressions, where its fake kernel (torch's Python
    reference) asks sympy about every broadcast (1-10 ms a call over symbolic sizes).
    Only where no question is open: each dim of the operands (aligned from the right)
    is a static 1 or one expression (sizes equal at the hints, 2 or more, told equal
    first, `_tie`: the broadcast's own guard), they share a device (zero-dim ones aside), and a
    size is symbolic; the dtype comes from `_pointwise_dtype`.  Every operand
    contiguous by its expressions: the result is contiguous.  Else its strides are
    the kernel's layout rule (`_elementwise_strides`), where each comparison of
    strides it makes is settled by the expressions alone; else None (the kernel)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    full = [t for t in tensors if t.dim() > 0]
    if not full or any(t.layout != torch.strided for t in tensors):
        return None
    device = full[0].device
    if any(t.device != device for t in full):
        return None
    ndim = max(t.dim() for t in full)
    sizes: list[Any] = [1] * ndim
    exprs: list[Any] = [1] * ndim
    symbolic = False
    contiguous = True
    for t in full:
        off = ndim - t.dim()
        for i, d in enumerate(t.shape):
            e = _expr(d)
            if isinstance(d, torch.SymInt):
                symbolic = True
            if isinstance(e, int) and e == 1:
                continue
            if isinstance(exprs[off + i], int) and exprs[off + i] == 1:
                sizes[off + i], exprs[off + i] = d, e
            elif exprs[off + i] != e:
                # equal at the hints (2 or more: an eager node's sizes hold a symbol each):
                # told equal, the guard the broadcast itself adds (`_tie`); else the kernel
                if not _tie(d, sizes[off + i]):
                    return None
                exprs = [_expr(x) for x in sizes]  # a replacement may change any of them
        contiguous = contiguous and _contiguous_by_exprs(t)
    if not symbolic:
        return None
    strides: list[Any] | None = None
    if not contiguous:
        if any(t.dim() == 0 and t.device.type != "cpu" for t in tensors):
            return None  # a zero-dim operand the layout rule counts: rare, the kernel's
        strides = _elementwise_strides(sizes, full)
        if strides is None:
            return None
    dtype = _pointwise_dtype(op, args, kwargs)
    if dtype is None:
        return None
    if strides is None:
        return torch.empty(sizes, dtype=dtype, device=device)
    return torch.empty_strided(sizes, strides, dtype=dtype, device=device)


def _monomial(e: Any) -> tuple[int, dict[Any, int]] | None:
    """``e`` as ``c * s1**k1 * s2**k2 ...`` with ``c`` a positive integer and ``k``
    positive integer powers of symbols: ``(c, {s: k})``.  None for anything else."""
    if isinstance(e, int):
        return (e, {}) if e > 0 else None
    c, m = e.as_coeff_Mul()
    if not (c.is_Integer and c > 0):
        return None
    powers: dict[Any, int] = {}
    if m != 1:
        for s, k in m.as_powers_dict().items():
            if not (isinstance(s, sympy.Symbol) and k.is_Integer and k > 0):
                return None
            powers[s] = int(k)
    return int(c), powers


def _settled_ge(a: Any, b: Any, env: Any) -> bool | None:
    """Is ``a >= b`` for every value the symbols may take (True), for none (False), or
    does it depend on them (None)?  ``a`` and ``b`` are positive monomials
    (`_monomial`); a symbol's lower bound comes from the shape env's ranges, and
    decides only where one monomial divides the other (``256*s0 >= 256``: s0 >= 1).
    No question to the shape env: where its ranges settle a comparison, torch's own
    check adds no guard either."""
    ma, mb = _monomial(a), _monomial(b)
    if ma is None or mb is None:
        return None
    (ca, pa), (cb, pb) = ma, mb
    if pa == pb:
        return ca >= cb

    def low(big: dict[Any, int], small: dict[Any, int]) -> int | None:
        """The least value of ``big / small`` (a monomial: small divides big), or None."""
        out = 1
        for s, k in big.items():
            r = env.var_to_range.get(s)
            if r is None or not r.lower.is_Integer or int(r.lower) < 1:
                return None
            out *= int(r.lower) ** (k - small.get(s, 0))
        return out

    if all(pa.get(s, 0) >= k for s, k in pb.items()):  # b's monomial divides a's
        lo = low(pa, pb)
        return True if lo is not None and ca * lo >= cb else None
    if all(pb.get(s, 0) >= k for s, k in pa.items()):  # a's divides b's
        lo = low(pb, pa)
        return False if lo is not None and cb * lo > ca else None
    return None


def _elementwise_strides(shape: list[Any], operands: list[torch.Tensor]) -> list[Any] | None:
    """The strides torch's elementwise kernels give a result of ``shape`` from these
    operands (``torch._prims_common.compute_elementwise_output_strides``, which
    TensorIterator's dim ordering matches): the operands broadcast to ``shape``
    (stride 0 where a dim is broadcast), their dims sorted by stride, operand by
    operand (the first with two non-zero strides that differ decides), the result
    contiguous in that order.  Each comparison is settled by the expressions
    (`_settled_ge`), or the whole is None.  Also None where the result has a static
    size below 2 (a size-1 dim's stride is arbitrary), or a lone operand is not dense
    unless its order is the identity (``empty_like``'s rule then: contiguous)."""
    ndim = len(shape)
    if ndim < 2 or any(isinstance(_expr(d), int) and _expr(d) < 2 for d in shape):
        return None
    env = next(
        (
            d.node.shape_env
            for t in operands
            for d in (*t.shape, *t.stride())
            if isinstance(d, torch.SymInt)
        ),
        None,
    )
    if env is None:
        return None
    size_e = [_expr(d) for d in shape]
    expanded: list[list[Any]] = []
    for t in operands:
        off = ndim - t.dim()
        st = [0] * off
        for d, s in zip(t.shape, t.stride(), strict=True):
            e = _expr(d)
            st.append(0 if isinstance(e, int) and e == 1 else _expr(s))
        expanded.append(st)

    def zero(s: Any) -> bool | None:
        if isinstance(s, int) and s == 0:
            return True
        return False if _monomial(s) is not None else None

    def ge(a: Any, b: Any) -> bool | None:  # torch's: a >= b or a % b == 0, for a, b >= 0
        zb = zero(b)
        if zb is None or zb:
            return zb
        za = zero(a)
        if za is None or za:
            return None if za is None else False
        return _settled_ge(a, b, env)  # False: 0 < a < b, so a % b != 0 too

    def equal(a: Any, b: Any) -> bool | None:
        if a == b:
            return True
        g1, g2 = _settled_ge(a, b, env), _settled_ge(b, a, env)
        if g1 is False or g2 is False:
            return False
        return None

    def should_swap(ia: int, ib: int) -> int | None:
        for st in expanded:
            sa, sb = st[ia], st[ib]
            za, zb = zero(sa), zero(sb)
            if za is None or zb is None:
                return None
            if za or zb:
                continue
            eq = equal(sa, sb)
            if eq is None:
                return None
            if eq:
                g = ge(size_e[ib], size_e[ia])
                if g is None:
                    return None
                if g:
                    continue
                return 1
            g = ge(sb, sa)
            if g is None:
                return None
            if g:
                return -1
            g = ge(sa, sb)
            if g is None:
                return None
            if g:
                return 1
        return 0

    perm = list(reversed(range(ndim)))  # torch's insertion sort, back to front
    for i in range(1, ndim):
        dim1 = i
        for dim0 in reversed(range(i)):
            c = should_swap(perm[dim0], perm[dim1])
            if c is None:
                return None
            if c > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif c < 0:
                break
    order = list(reversed(perm))  # logical dims, outermost first
    out: list[Any] = [None] * ndim
    running: Any = 1
    for k in reversed(order):
        out[k] = running
        running = running * shape[k]
    if len(operands) == 1:
        own = [_expr(s) for s in operands[0].stride()]
        if [_expr(s) for s in out] != own and order != list(range(ndim)):
            return None  # not dense, not in order: empty_like's rules
    return out


@functools.cache
def _is_pointwise(op: Any) -> bool:
    """An aten op tagged pointwise, functional, with one tensor result."""
    return (
        isinstance(op, torch._ops.OpOverload)
        and torch.Tag.pointwise in op.tags
        and not op._schema.is_mutable
        and len(op._schema.returns) == 1
        and str(op._schema.returns[0].type) == "Tensor"
    )


_KNOWN: dict[Any, Any] = {
    torch.ops.aten.view.default: _known_view,
    torch.ops.aten._unsafe_view.default: _known_view,
    torch.ops.aten.native_layer_norm.default: _known_layer_norm,
    torch.ops.aten.native_layer_norm_backward.default: _known_layer_norm_backward,
    torch.ops.aten.native_batch_norm_backward.default: _known_batch_norm_backward,
    torch.ops.aten.addmm.default: _known_addmm,
    torch.ops.aten.clone.default: _known_clone,
    torch.ops.aten.full.default: _known_full,
    torch.ops.aten.cat.default: _known_cat,
    torch.ops.aten.nll_loss_backward.default: _known_nll_loss_backward,
    **{
        getattr(torch.ops.aten, name).default: _known_pointwise_backward
        for name in (
            "gelu_backward",
            "_softmax_backward_data",
            "_log_softmax_backward_data",
            "threshold_backward",
            "sigmoid_backward",
            "tanh_backward",
        )  # silu_backward is CompositeImplicitAutograd: the proxy mode decomposes it
    },
}
"""Ops whose fake result the retrace builds itself over symbolic sizes (`_record`)."""


@functools.cache
def _replay_table() -> dict[Any, Any]:
    """The decompositions of the replay: `symbolic_decomps.retrace_table` (stoker-capture
    materialized it once per process, ~0.06 s per call), plus the backwards whose fake
    kernel rejects symbolic sizes, plus ``aten.view`` relating its sizes first."""
    from .symbolic_decomps import retrace_table  # the retrace only: not a warm start

    return {**retrace_table(), torch.ops.aten.view.default: _view_relating_sizes}


def _assume_equal(a: Any, b: Any) -> None:
    """Tell the shape env ``a == b`` (true at the hints): a guard, and a replacement
    where one side is a symbol it can solve for."""
    torch._check(a == b)  # type: ignore[no-untyped-call]


def _hint(v: Any) -> int | None:
    if isinstance(v, torch.SymInt):
        h = v.node.hint
        return None if h is None else int(h)
    return int(v) if isinstance(v, int) else None


@functools.cache
def _recorded_as_is(op: Any) -> bool:
    """Does the proxy mode record ``op`` as one node of itself, whatever its arguments?

    True for an aten op that the decomposition table, a CompositeImplicitAutograd
    kernel and the proxy mode's special cases all leave alone: the core-aten ops of
    an inlined AOT backward (the joint trace decomposed them already).
    """
    from .symbolic_decomps import retrace_table

    return (
        isinstance(op, torch._ops.OpOverload)
        and op.namespace == "aten"
        and op not in retrace_table()
        and ProxyTorchDispatchMode not in op.python_key_table
        and not op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
        and not op._schema.is_mutable
        and torch.Tag.data_dependent_output not in op.tags
        and op is not torch.ops.aten.lift_fresh.default
    )


@functools.cache
def _kept_whole(op: Any) -> bool:
    """Is ``op`` a fused backward of the replay's table whose result the retrace builds
    (`_KNOWN`), and that the proxy mode records as one node when its table entry keeps
    it whole (``stoker_capture``'s ``KEEP_WHOLE_IN_BACKWARD``: unless its dtypes mix)?
    The replay then asks the entry itself and records the op with `_record`, so that
    its fake result comes from `_KNOWN` instead of torch's decomposition run as the
    fake kernel (about twenty ops asking sympy over symbolic sizes)."""
    from .symbolic_decomps import retrace_table

    return (
        op in _KNOWN
        and op in retrace_table()
        and ProxyTorchDispatchMode not in op.python_key_table
        and not op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
        and not op._schema.is_mutable
    )


def _record(
    rp: _Replayer,
    op: torch._ops.OpOverload,
    args: Any,
    kwargs: dict[str, Any],
    leaves: list[Any],
) -> Any:
    """``op(*args, **kwargs)`` on the fakes, recorded as the proxy mode records an op it
    neither decomposes nor treats specially (``proxy_call``'s common path: a node named
    after the op, then the result bound to it), without dispatching through the proxy
    mode, whose argument flattening, decomposition lookups and constant propagation
    cost about a fifth of the retrace.  NotImplemented where the proxy mode would take
    another path: a tensor argument without a proxy, or with a known constant value."""
    tracer = rp.tracer
    for a in leaves:
        if isinstance(a, torch.Tensor):
            slot = fetch_object_proxy(tracer, a)
            if slot is a or slot.constant is not None:  # type: ignore[union-attr]
                return NotImplemented
    pargs = rp.proxy(args)
    pkwargs = {k: rp.proxy(v) for k, v in kwargs.items()}
    name = tracer.graph._target_to_str(op.overloadpacket.__name__)
    # as inside the proxy mode's handler: the mode is off, so the size arithmetic of
    # the fake kernel and of the value's metadata is not traced
    with disable_proxy_modes_tracing():
        out_proxy = tracer.create_proxy("call_function", op, pargs, pkwargs, name=name)
        with proxy_tensor._enable_thunkify(tracer):
            known = _KNOWN.get(op)
            if known is not None:
                out = known(args, kwargs)
            elif _is_pointwise(op):
                out = _known_pointwise(op, args, kwargs)
            else:
                out = None
            if out is None:
                out = op(*args, **kwargs)
        _track(tracer, out, out_proxy)
    return out


def _track(tracer: PythonKeyTracer, out: Any, proxy: fx.Proxy) -> None:
    """``track_tensor_tree(out, proxy)`` for an op's result (a tensor, or a tuple of
    tensors and Nones), with each node's ``tensor_meta`` from `_tensor_meta`.  torch's
    asks the shape env whether each result is contiguous in three memory formats, a
    dozen sympy questions per result over symbolic sizes, for a field that only
    describes the node (the retraced graph's readers use ``val``)."""
    proxy_tensor._set_unbacked_bindings(out, proxy)
    if isinstance(out, torch.Tensor) and out.layout == torch.strided:
        proxy_tensor.track_tensor(out, proxy, constant=None, tracer=tracer)
        proxy.node.meta["val"] = proxy_tensor.extract_val(out)
        proxy.node.meta["tensor_meta"] = _tensor_meta(out)
        return
    if isinstance(out, tuple | list) and all(
        o is None or (isinstance(o, torch.Tensor) and o.layout == torch.strided) for o in out
    ):
        proxy.node.meta["val"] = proxy_tensor.extract_val(out)
        for i, o in enumerate(out):
            # as torch's: a getitem for every item (dead ones go later)
            item: Any = proxy[i]  # type: ignore[index]
            if o is not None:
                proxy_tensor.track_tensor(o, item, constant=None, tracer=tracer)
                item.node.meta["val"] = proxy_tensor.extract_val(o)
                item.node.meta["tensor_meta"] = _tensor_meta(o)
        return
    track_tensor_tree(out, proxy, constant=None, tracer=tracer)


def _tensor_meta(t: torch.Tensor) -> Any:
    """torch's ``TensorMetadata`` of ``t``; where a size or stride is symbolic, its
    ``memory_format`` is ``contiguous_format`` when the strides are the contiguous
    strides of the sizes as expressions (size-1 dims skipped), else None, instead of
    torch's three contiguity checks through the shape env (about 0.1 ms a node)."""
    shape, strides = t.shape, t.stride()
    if all(isinstance(d, int) for d in (*shape, *strides)):
        return _extract_tensor_metadata(t)
    meta = _extract_tensor_metadata(t, include_contiguity=False)
    if not _contiguous_by_exprs(t):
        return meta
    return meta._replace(memory_format=torch.contiguous_format)
