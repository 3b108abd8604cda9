"""The lowering table (`LOWERINGS`, grouped by kind in the modules beside
this one) and `lower_graph`, which walks an FX graph and builds a `Program`;
`regions.py` finds a model's repeated blocks so `lower_graph` lowers each once.

May import the IR (`ir.py`) and `tiling.py`; never the scheduler, `codegen/`,
`runtime/`, `compile/` or the pipeline."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx

from ..devices import DeviceSpec
from ..ir import BufferRef, Expr, Program, SymRef, contiguous_strides, product
from . import extern, indexing, pointwise, random, reduction, views  # register the rules
from .core import (
    LOWERINGS,
    REUSE_BODY_LIMIT,
    LoweringContext,
    TensorValue,
    channels_last_stride,
    recompute_bytes,
)
from .extern import extern_call
from .noop import noop_copies

aten = torch.ops.aten

__all__ = ["LOWERINGS", "LoweringContext", "lower_graph"]
_ = (indexing, pointwise, random, reduction, views, extern)


def _is_dense(val: torch.Tensor) -> bool:
    if any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())):
        return False
    # a permutation of a contiguous layout (the helper's name differs across torch versions)
    dims = sorted((d for d in range(val.ndim) if val.shape[d] != 1), key=lambda d: val.stride()[d])
    expect = 1
    for d in dims:
        if val.stride()[d] != expect:
            return False
        expect *= int(val.shape[d])
    return True


def lower_graph(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Any],
    shape_env: Any,
    device: torch.device,
    persistent_rnumel_max: int = 8192,
    regions: bool = False,
    spec: DeviceSpec | None = None,
) -> tuple[Program, LoweringContext]:
    """Lower every node of `gm` by the rule table; ops with no rule (or whose
    rule declines) become extern aten calls. `regions`: lower each repeated
    region once and the other copies by renaming (`regions.py`; may raise
    `RegionMismatch`, then lower again without). `spec`: the device's choices
    (`devices.py`; None: a GPU's)."""
    pmax = persistent_rnumel_max if spec is None or spec.persistent_rnumel_max else None
    ctx = LoweringContext(shape_env, device, persistent_rnumel_max=pmax, spec=spec)
    env: dict[torch.fx.Node, Any] = {}
    in_names: list[str | SymRef | None] = []
    symbols: dict[sympy.Symbol, tuple[int, str, int]] = {}
    origins: dict[sympy.Symbol, str] = {}  # where a symbol no input binds came from
    derived: dict[sympy.Symbol, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}
    constants: dict[str, torch.Tensor] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, (ph, val) in enumerate(zip(placeholders, inputs)):
        if isinstance(val, torch.Tensor):
            name = f"arg{i}"
            buf = ctx.add_buffer(
                name,
                [ctx.expr(s) for s in val.shape],
                [ctx.expr(s) for s in val.stride()],
                val.dtype,
                "input",
                ctx.expr(val.storage_offset()),
            )
            env[ph] = ctx.buffer_value(buf)
            in_names.append(name)
            for d, s in enumerate(buf.size):
                if isinstance(s, sympy.Symbol) and s not in symbols:
                    symbols[s] = (i, "size", d)
        elif isinstance(val, torch.SymInt | torch.SymFloat):
            e = ctx.expr(val)
            env[ph] = e
            in_names.append(SymRef(e))
            if isinstance(e, sympy.Symbol) and e not in symbols:
                symbols[e] = (i, "scalar", 0)
        else:
            env[ph] = val
            in_names.append(None)
    # symbols seen only in a stride or storage offset (a slice of a tensor whose
    # width varies): read from the input at call time
    for i, n in enumerate(in_names):
        if not isinstance(n, str):
            continue
        b = ctx.buffers[n]
        for kind, d, e in [
            *(("stride", d, e) for d, e in enumerate(b.stride)),
            ("offset", 0, b.offset),
        ]:
            if isinstance(e, sympy.Symbol) and e not in symbols:
                symbols[e] = (i, kind, d)
    for i, n in enumerate(in_names):
        if isinstance(n, str):
            b = ctx.buffers[n]
            exprs = (*b.size, *b.stride, b.offset)
            if any(s not in symbols for e in exprs for s in getattr(e, "free_symbols", ())):
                # (formatted only here: printing every input's sizes cost 3000 sympy prints)
                where = f"input {i} ({placeholders[i].name}): size {b.size}, stride {b.stride}"
                for e in exprs:
                    _note_origin(e, symbols, origins, where)
        elif isinstance(n, SymRef):
            _note_origin(n.expr, symbols, origins, f"input {i} ({placeholders[i].name}): {n.expr}")

    outputs: list[Any] = []
    output_views: dict[int, BufferRef] = {}
    noops = noop_copies(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = list(gm.graph.nodes)
    reuse = None
    if regions:
        from .regions import LazyEnv, lowering_order

        nodes = lowering_order(gm)  # constants first: a block's copies stay alike
        lazy = LazyEnv()
        lazy.update(env)
        env = lazy
        reuse = _region_lowering(ctx, gm, nodes, env, noops)
    # graph nodes lowered by their rule (not renamed from a region's copy), constants
    # (nodes that read no other node: a mask's `arange`, a `full`) aside
    lowered = 0
    for node in nodes:
        if node.op == "placeholder":
            continue
        if reuse is not None and reuse.before(node):
            continue  # a copy of a region lowered before: made by renaming
        if node.op == "get_attr":
            t = getattr(gm, node.target)
            name = ctx.new_name("const")
            constants[name] = t
            env[node] = ctx.buffer_value(
                ctx.add_buffer(name, list(t.shape), list(t.stride()), t.dtype, "constant")
            )
            continue
        if node.op == "output":
            outs = torch.utils._pytree.tree_leaves(node.args[0], is_leaf=lambda a: a is None)
            taken = _output_buffers(ctx, outs, env)
            for k, o in enumerate(outs):
                outputs.append(_output(ctx, o, env, k, output_views, taken))
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.target is operator.getitem:
            env[node] = args[0][args[1]]
            _keep_channels_last(env[node], node)  # a BatchNorm's or a max-pool's output
            continue
        val = node.meta.get("val")
        if isinstance(
            val, torch.SymInt | torch.SymFloat | torch.SymBool | int | float | bool
        ) and not isinstance(val, torch.Tensor):
            e = ctx.expr(val)
            _bind_item(node, e, placeholders, symbols)
            _note_origin(
                e, symbols, origins, f"graph node {node.name} = {node.target}{tuple(node.args)}"
            )
            if isinstance(val, torch.SymFloat) and not (e.is_Symbol or e.is_number):
                e = _derive(node, args, kwargs, derived)
            env[node] = e
            continue
        n_before = len(ctx.nodes)
        lowered += bool(node.all_input_nodes)
        if node in noops:
            env[node] = _noop_copy(ctx, node, env)
        else:
            env[node] = _lower_call(ctx, node, args, kwargs)
            _tag_origins(ctx, node, args, kwargs, env[node], n_before)
            _keep_channels_last(env[node], node)
        _after_in_place_writes(ctx, n_before, env, order[node], order)
        _maybe_realize_shared(ctx, node, env)
        if reuse is not None:
            reuse.after(node)

    program = Program(
        inputs=in_names,
        buffers=ctx.buffers,
        nodes=ctx.nodes,
        outputs=outputs,
        output_views=output_views,
        symbols=symbols,
        symbol_origins=origins,
        derived=derived,
        constants=constants,
        random_streams=ctx.random_streams,
        device=device,
        barriers=reuse.barriers if reuse is not None else [],
        regions=[str(r) for r in reuse.regions] if reuse is not None else [],
        reused_nodes=reuse.reused_nodes if reuse is not None else 0,
        lowered_nodes=lowered,
    )
    return program, ctx


def _region_lowering(
    ctx: LoweringContext,
    gm: torch.fx.GraphModule,
    nodes: list[torch.fx.Node],
    env: dict[torch.fx.Node, Any],
    noops: Any,
) -> Any:
    """The repeated regions' hook (`regions.RegionLowering`), or None: no region, or a
    graph that writes a tensor in place (the copies' reads could see each other's writes)."""
    from .regions import RegionLowering, find_regions

    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if (schema is not None and schema.is_mutable) or isinstance(
            n.target, torch._ops.HigherOrderOperator
        ):
            return None
    found = find_regions(nodes, lambda n: n in noops)
    return RegionLowering(ctx, nodes, env, found) if found else None


def origin_name(node: torch.fx.Node) -> str:
    """The aten op a node stands for: the composite op it was decomposed from
    (`native_layer_norm`, tagged by the pipeline's `decompose`), else its own."""
    tagged = node.meta.get("stoker_origin")
    if isinstance(tagged, str):
        return tagged
    t = node.target
    packet = getattr(t, "_overloadpacket", None)
    return str(packet if packet is not None else getattr(t, "__name__", t))


def _tag_origins(
    ctx: LoweringContext, node: torch.fx.Node, args: Any, kwargs: Any, result: Any, n_before: int
) -> None:
    """Record on the IR nodes this FX node's lowering added, and on its lazy result, the
    aten ops they compute: this node's and those of the lazy values it read (fused in)."""
    from ..ir import ExternNode

    lazy = frozenset().union(
        *(
            a.origins
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, TensorValue) and a.layout is None
        )
    )
    mine = lazy | {origin_name(node)}
    for n in ctx.nodes[n_before:]:
        if not isinstance(n, ExternNode) and not n.origins:
            n.origins = tuple(sorted(mine))
    for r in torch.utils._pytree.tree_leaves(result):
        if isinstance(r, TensorValue) and r.layout is None and not r.origins:
            r.origins = mine


# ops that read a one-element tensor as a Python number
_ITEM_OPS = {aten._local_scalar_dense.default, aten.item.default}


def _bind_item(
    node: torch.fx.Node,
    e: Any,
    placeholders: list[torch.fx.Node],
    symbols: dict[sympy.Symbol, tuple[int, str, int]],
) -> None:
    """`x.item()` of a one-element graph input whose value is a (backed) symbol:
    the wrapper binds the symbol from that input. Dynamo hands a Python float it
    made dynamic this way (a 0-d float64 input read with `_local_scalar_dense`)."""
    src = node.args[0] if node.target in _ITEM_OPS and node.args else None
    if not isinstance(e, sympy.Symbol) or e in symbols or not isinstance(src, torch.fx.Node):
        return
    if src.op == "placeholder" and src in placeholders:
        symbols[e] = (placeholders.index(src), "item", 0)


def _derive(
    node: torch.fx.Node,
    args: Any,
    kwargs: Any,
    derived: dict[sympy.Symbol, tuple[Any, tuple[Any, ...], dict[str, Any]]],
) -> sympy.Symbol:
    """A float computed from symbols (`1.0 / s`, `math.sqrt(s)`, `sym_float(n)`):
    the wrapper computes it in Python by calling the node's target on the bound
    values, and kernels take the result as one more scalar argument (sympy's
    float functions have no Triton spelling)."""
    sym = sympy.Symbol(f"dsf{len(derived)}", real=True)
    derived[sym] = (node.target, tuple(args), dict(kwargs))
    return sym


def _note_origin(
    e: Any,
    symbols: dict[sympy.Symbol, tuple[int, str, int]],
    origins: dict[sympy.Symbol, str],
    where: str,
) -> None:
    """Remember where each symbol that no input binds was first seen (for the
    error the wrapper raises when generated code would read it)."""
    for s in getattr(e, "free_symbols", ()):
        if s not in symbols:
            origins.setdefault(s, where)


def _lower_call(ctx: LoweringContext, node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
    rule = LOWERINGS.get(node.target)
    if rule is None:
        return extern_call(ctx, node, args, kwargs, "no lowering")
    if _has_unsupported_dtype(node):
        return extern_call(
            ctx, node, args, kwargs, "a dtype Triton kernels do not handle (complex)"
        )
    n_nodes, n_streams = len(ctx.nodes), ctx.random_streams
    try:
        return rule.fn(ctx, node, *args, **kwargs)
    except Exception as e:  # a rule that cannot handle this call: aten runs it (logged, counted)
        del ctx.nodes[n_nodes:]
        ctx.random_streams = n_streams
        return extern_call(ctx, node, args, kwargs, f"{type(e).__name__}: {e}")


_KERNEL_DTYPES = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
}


def _has_unsupported_dtype(node: torch.fx.Node) -> bool:
    vals = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    for v in torch.utils._pytree.tree_leaves(vals):
        if isinstance(v, torch.Tensor) and v.dtype not in _KERNEL_DTYPES:
            return True
    return False


def _after_in_place_writes(
    ctx: LoweringContext,
    n_before: int,
    env: dict[torch.fx.Node, Any],
    pos: int,
    order: dict[torch.fx.Node, int],
) -> None:
    """An extern wrote a buffer in place (a non-functional graph, an input
    mutation's `copy_`): graph nodes whose value lives in that buffer read it
    from now on; values built before the write keep the old contents. A value
    not stored yet that reads the buffer (a clone of the input, `x * 2`) and is
    still needed after the write (a later user, a graph output) is stored
    before the write; a value stored earlier is recomputed if realized again."""
    from ..ir import ExternNode, index_var, loads_of

    new = ctx.nodes[n_before:]
    written = [b for n in new if isinstance(n, ExternNode) for b in n.mutated]
    if not written:
        return
    bases = {ctx.aliases.get(b, b) for b in written}
    del ctx.nodes[n_before:]

    def before_write(v: Any) -> Any:
        if isinstance(v, list | tuple):  # a multi-output op, its getitems still to come
            return type(v)(before_write(x) for x in v)
        if not isinstance(v, TensorValue) or v.layout is not None:
            return v
        body = v.load(tuple(index_var("x", i) for i in range(v.ndim)))
        if not any(ctx.aliases.get(ld.buf, ld.buf) in bases for ld in loads_of(body)):
            return v
        stored = ctx.realize(v)  # (or the buffer it is stored in already)
        assert stored.layout is not None
        if ctx.aliases.get(stored.layout.buf, stored.layout.buf) in bases:
            return v  # stored in the written buffer itself: handled below
        return stored

    for k, v in list(env.items()):
        if any(u.op == "output" or order[u] > pos for u in k.users):
            env[k] = before_write(v)
    ctx.nodes.extend(new)
    for b in written:
        for view in ctx.realized_views.pop(b, []):
            view.realized = None  # a view of the written buffer: realized again if needed
        old = ctx.realized_by.pop(b, None)
        if old is None:
            continue
        old.realized = None  # realizing the old value again recomputes it
        post = ctx.buffer_value(ctx.buffers[b])
        for k, v in env.items():
            if v is old:
                env[k] = post


def _keep_channels_last(tv: Any, node: torch.fx.Node) -> None:
    """A value not stored yet that eager makes channels-last is stored channels-last."""
    if isinstance(tv, TensorValue) and tv.layout is None and tv.view_of is None:
        stride = channels_last_stride(node.meta.get("val"))
        if stride is not None:
            tv.stored_stride = stride


def _noop_copy(ctx: LoweringContext, node: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
    """A copy `noop_copies` found to be a no-op is its input's value. An input
    that is a graph output is stored here, in its output layout, so the copy's
    consumers read that buffer rather than store the same values again."""
    src = node.args[0]
    assert isinstance(src, torch.fx.Node)
    v = env[src]
    val = src.meta.get("val")
    if (
        isinstance(v, TensorValue)
        and v.layout is None
        and isinstance(val, torch.Tensor)
        and val.ndim > 0
        and _is_dense(val)
        and _is_output(src)
    ):
        env[src] = v = ctx.realize(v, [sympy.Integer(s) for s in val.stride()])
    return v


def _is_output(n: torch.fx.Node) -> bool:
    return any(
        u.op == "output" and n in torch.utils._pytree.tree_leaves(u.args[0]) for u in n.users
    )


def _maybe_realize_shared(
    ctx: LoweringContext, node: torch.fx.Node, env: dict[torch.fx.Node, Any]
) -> None:
    """Store a value used more than once when recomputing it would be costly: a large
    body (`REUSE_BODY_LIMIT`), or more bytes read per element than storing it and
    reading it back (a residual stream, the sum of several full-size tensors, read by
    the next block's norm and by the next residual add); for a value the graph returns
    anyway (a forward's saved activation) already when recomputing reads more than the
    value itself. Stored in its output layout when it is an output."""
    tv = env[node]
    if not isinstance(tv, TensorValue) or tv.layout is not None or len(node.users) < 2:
        return
    from ..ir import index_var

    idx = tuple(index_var("x", i) for i in range(tv.ndim))
    body = tv.load(idx)
    per_elem = recompute_bytes(body, idx, tv.size)
    val = node.meta.get("val")
    output = (
        _is_output(node)
        and isinstance(val, torch.Tensor)
        and val.ndim > 0
        and val.dtype == tv.dtype
        and _is_dense(val)
    )
    if body.size > REUSE_BODY_LIMIT or per_elem > 2 * tv.dtype.itemsize:
        env[node] = ctx.realize(tv)
    elif output and per_elem > tv.dtype.itemsize and isinstance(val, torch.Tensor):
        env[node] = ctx.realize(tv, [sympy.Integer(s) for s in val.stride()])


def _expanded_output(ctx: LoweringContext, v: TensorValue, val: torch.Tensor) -> BufferRef | None:
    """An output the graph produces as an expanded view (stride 0 along some
    dims, e.g. `x.sum(1, keepdim=True).expand_as(x)` saved for the backward):
    store one slice and return the same expanded view, so whatever consumes
    it (a backward compiled for those strides) sees the layout eager gives.
    None when the output is not expanded or its strides are symbolic."""
    st = val.stride()
    if val.ndim == 0 or not all(isinstance(s, int) for s in st):
        return None
    exp = {d for d in range(val.ndim) if st[d] == 0 and v.size[d] != 1}
    if not exp:
        return None
    size = [sympy.Integer(1) if d in exp else v.size[d] for d in range(val.ndim)]
    # dense over the kept dims, in the order of the graph's strides (largest outermost)
    stride: list[Expr] = [sympy.Integer(0)] * val.ndim
    acc: Expr = sympy.Integer(1)
    for d in sorted((d for d in range(val.ndim) if d not in exp), key=lambda d: (st[d], d)):
        stride[d] = acc
        acc = acc * size[d]
    base = TensorValue(
        size,
        v.dtype,
        ctx.device,
        lambda idx: v.load(
            tuple(sympy.Integer(0) if d in exp else idx[d] for d in range(len(idx)))
        ),
    )
    r = ctx.realize(base, stride)
    assert r.layout is not None
    return BufferRef(r.layout.buf, tuple(v.size), tuple(stride), sympy.Integer(0))


def _output(
    ctx: LoweringContext,
    o: Any,
    env: dict[torch.fx.Node, Any],
    k: int,
    views: dict[int, BufferRef],
    taken: set[str],
) -> Any:
    if not isinstance(o, torch.fx.Node):
        return o
    v = env[o]
    if isinstance(v, sympy.Basic):
        return int(v) if v.is_number else SymRef(v)
    if not isinstance(v, TensorValue):
        return v
    if v.layout is not None:
        buf = ctx.buffers[v.layout.buf]
        if (v.layout.size, v.layout.stride, v.layout.offset) == (buf.size, buf.stride, 0):
            return buf.name
        views[k] = v.layout
        return v.layout.buf
    val = o.meta.get("val")
    if isinstance(val, torch.Tensor):
        ref = _expanded_output(ctx, v, val)
        if ref is not None:
            views[k] = ref
            return ref.buf
    stride = None
    if isinstance(val, torch.Tensor) and _is_dense(val) and val.ndim > 0:
        stride = [sympy.Integer(s) for s in val.stride()]
    ref = _stored_once(ctx, o, v, stride, env, taken)
    if ref is not None:
        taken.add(ref.buf)
        buf = ctx.buffers[ref.buf]
        if (ref.size, ref.stride) != (buf.size, buf.stride):
            views[k] = ref
        return ref.buf
    r = ctx.realize(v, stride, view=False)
    assert r.layout is not None
    taken.add(r.layout.buf)
    return r.layout.buf


def _output_buffers(
    ctx: LoweringContext, outs: Sequence[Any], env: dict[torch.fx.Node, Any]
) -> set[str]:
    """The buffers outputs already stored read (views included, by their base):
    an output stored once in an extern's buffer must not be one of them."""
    taken: set[str] = set()
    for o in outs:
        v = env[o] if isinstance(o, torch.fx.Node) else None
        if isinstance(v, TensorValue) and v.layout is not None:
            taken.add(ctx.aliases.get(v.layout.buf, v.layout.buf))
    return taken


_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def _stored_once(
    ctx: LoweringContext,
    o: torch.fx.Node,
    v: TensorValue,
    stride: Sequence[Expr] | None,
    env: dict[torch.fx.Node, Any],
    taken: set[str],
) -> BufferRef | None:
    """The buffer output `o` (value `v`, wanted `stride`) is stored in already,
    for an extern that reads it (a layernorm output the `addmm` reads and the
    backward saves), so the output is that buffer rather than a second store of
    the same values: `v`'s own buffer when its layout is the output's, or the
    contiguous buffer of a reshape of `o` (the `view` an `addmm` reads) when
    the output is contiguous too (the same elements in the same order). The
    wrapper keeps an output alive (never freed after its last reader). None
    when there is none, or it could alias another output (the value returned
    twice) or a view an extern made of it (an output must be its own tensor)."""
    contiguous = contiguous_strides(v.size)
    want = tuple(stride) if stride is not None else contiguous
    if v.view_of is not None:
        # a view of a value an extern had stored (its view taken for the extern): the
        # output is that buffer, seen in the output's layout, when it is the whole buffer
        r0 = v.realized
        lay = r0.layout if r0 is not None and r0.layout is not None else ctx.planned_layout(v)
        buf = ctx.buffers.get(lay.buf)
        if (
            buf is not None
            and buf.kind == "kernel"
            and buf.name not in taken
            and buf.name not in ctx.aliases.values()
            and buf.offset == 0
            and lay.offset == 0
            and tuple(lay.stride) == want
            and product(buf.size) == product(v.size)
        ):
            return BufferRef(buf.name, tuple(v.size), want, sympy.Integer(0))
    cands = [v]
    if want == contiguous:
        cands += [env[u] for u in o.users if u.target in _RESHAPES and u.args[0] is o]
    for c in cands:
        r = c.realized if isinstance(c, TensorValue) else None
        if r is None or r.layout is None or c.dtype != v.dtype:
            continue
        buf = ctx.buffers[r.layout.buf]
        if buf.kind != "kernel" or buf.name in taken or buf.name in ctx.aliases.values():
            continue
        layout = (r.layout.size, r.layout.stride, r.layout.offset)
        if layout != (buf.size, buf.stride, buf.offset) or buf.offset != 0:
            continue  # a view of its buffer
        if c is v and buf.size == tuple(v.size) and buf.stride == want:
            return BufferRef(buf.name, buf.size, buf.stride, sympy.Integer(0))
        if (
            c is not v
            and buf.stride == contiguous_strides(buf.size)
            and product(buf.size) == product(v.size)
        ):
            return BufferRef(buf.name, tuple(v.size), contiguous, sympy.Integer(0))
    return None
