"""Inline stoker-capture's AOT backward into the captured graph (seed 001).

stoker-capture's autograd.Function classes carry ``_stoker_aot`` (an
``AOTBackwardInfo``: ``bw_module`` taking ``(*saved_symints, *saved_tensors, *tangents)``
and returning one grad per primal, plus ``num_saved_symints``, ``num_saved_tensors``,
``num_tangents``, ``aot_id``).  Instead of one opaque call we

1. proxy the prologue (`aot_backward_prologue`: puts symints, saved tensors and
   grads in the order ``bw_module`` takes them);
2. copy ``bw_module``'s nodes one by one into the capture, named ``aot{id}_{name}``
   so they can be traced back to the AOT graph;
3. trace the epilogue: one grad per input of the Function, None where the engine
   does not want one.

The engine's cache key for these Functions is ``(function id, *saved symints)``
(``_compiled_autograd_key`` on the class): the copied graph depends on the class
(its ``bw_module``) and on the symints, which the engine lifts as graph inputs.
Anything unexpected returns None and the caller proxies an opaque call instead,
which is always correct.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Protocol, cast

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import PythonKeyTracer

from stoker_capture._internal.runtime.function import tangent_deps, undefined_grads

from .graph import Walk, WalkNode


class Capture(Protocol):
    """What inlining needs of the capture it inlines into (`capture.CaptureInstance`)."""

    tracer: PythonKeyTracer
    graph: Walk  # the captured graph (the tracer's)
    aot_counts: dict[int, int]  # AOT id -> how many of its backwards were inlined so far

    def to_proxy(self, t: Any) -> Any: ...

    def _node(
        self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> WalkNode: ...


def stoker_aot_info(ctx: Any) -> Any:
    """The ``AOTBackwardInfo`` of a stoker-capture Function's ctx, else None."""
    return getattr(getattr(ctx, "_forward_cls", None), "_stoker_aot", None)


def aot_backward_prologue(
    saved_tensors: Sequence[torch.Tensor],
    symints: Sequence[Any],
    grads: Sequence[Any],
    tangent_of: Sequence[int | None],
    num_tangents: int,
    tangent_sizes: Sequence[Sequence[int | str | None] | None] = (),
) -> list[Any]:
    """Arrange ``bw_module``'s inputs: ``(*saved_symints, *saved_tensors, *tangents)``,
    each grad of a Function output placed at its tangent index (as the Function's
    own backward does).  ``tangent_sizes`` (`tangent_sizes`) is read by the retrace
    only: what the forward knew of each tangent's sizes."""
    tangents: list[Any] = [None] * num_tangents
    for g, k in zip(grads, tangent_of):
        if k is not None:
            tangents[k] = g.contiguous() if isinstance(g, torch.Tensor) else g
    return [*symints, *saved_tensors, *tangents]


def tangent_sizes(
    bw: fx.GraphModule, num_symints: int, num_saved: int
) -> tuple[tuple[int | str | None, ...] | None, ...]:
    """Per tangent of ``bw``, its sizes as the forward knew them: an int where static, an
    expression over the saved symints (``a0`` is the first) where every symbol of it is
    one of theirs, None where not known (None for the whole tangent if not a tensor).

    The engine hands a node gradients of exactly its forward outputs' sizes (its
    ``validate_outputs`` reduces or refuses any other), so the retrace may tie each
    incoming gradient's sizes to these before the backward's first view reads them:
    ``rows == batch x T`` as one product of two free symbols is a relation sympy
    cannot solve, and every size after it drags it along."""
    phs = [n.meta.get("val") for n in bw.graph.nodes if n.op == "placeholder"]
    names: dict[Any, str] = {}
    for j, v in enumerate(phs[:num_symints]):
        e = _forward_expr(v)
        if isinstance(e, sympy.Symbol):
            names.setdefault(e, f"a{j}")
    out: list[tuple[int | str | None, ...] | None] = []
    for v in phs[num_symints + num_saved :]:
        if not isinstance(v, torch.Tensor):
            out.append(None)
            continue
        dims: list[int | str | None] = []
        for size in v.shape:
            e = _forward_expr(size)
            if e is None or e.is_number:
                dims.append(None if e is None else int(e))
            elif e.free_symbols <= names.keys():
                dims.append(str(e.xreplace({s: sympy.Symbol(n) for s, n in names.items()})))
            else:
                dims.append(None)
        out.append(tuple(dims))
    return tuple(out)


def _forward_expr(v: Any) -> Any:
    """``v`` (a size of the forward's fake values) as a sympy expression after its shape
    env's replacements; None for what is not a size."""
    if isinstance(v, int):
        return sympy.Integer(v)
    if not isinstance(v, torch.SymInt):
        return None
    expr = v.node.expr
    env = getattr(v.node, "shape_env", None)
    return env.replace(expr) if env is not None else expr


def inline_aot_backward(
    cap: Capture,
    info: Any,
    ctx: Any,
    pgrads: list[Any],
    psaved: list[Any],
    output_metadatas: Sequence[Any],
) -> list[Any] | None:
    """Proxies of the grads for the Function's inputs, or None to proxy an opaque call."""
    bw: fx.GraphModule = info.bw_module
    tangent_of = getattr(ctx._forward_cls, "_stoker_tangent_of", None)
    symints = list(ctx._get_compiled_autograd_symints()) if info.num_saved_symints else []
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    if (
        tangent_of is None
        or torch.is_grad_enabled()  # create_graph=True: the Function's backward says why not
        or len(symints) != info.num_saved_symints
        or len(psaved) != info.num_saved_tensors
        or len(pgrads) != len(tangent_of)
        or len(placeholders) != info.num_saved_symints + info.num_saved_tensors + info.num_tangents
        or any(g is None for g, k in zip(pgrads, tangent_of) if k is not None)
    ):
        return None  # not the layout we were promised: the opaque call is always right
    psymints = [cap.to_proxy(s) for s in symints]

    # 1. the prologue, as one call node (traced through at retrace time)
    pro = cap._node(
        aot_backward_prologue,
        (
            psaved,
            psymints,
            pgrads,
            tuple(tangent_of),
            int(info.num_tangents),
            tangent_sizes(bw, int(info.num_saved_symints), int(info.num_saved_tensors)),
        ),
    )
    aot_id = int(info.aot_id)
    n = cap.aot_counts.get(aot_id, 0)
    cap.aot_counts[aot_id] = n + 1
    prefix = f"aot{aot_id}_" if n == 0 else f"aot{aot_id}_{n}_"

    # 2. copy the backward graph node by node: op, target, arguments and name (its
    # metadata is not needed: what capture's values carry is dropped at its end)
    graph = cap.graph
    remap: dict[fx.Node, WalkNode] = {}
    get = cast(Any, remap.__getitem__)
    outputs: list[Any] | None = None
    i = 0
    for node in bw.graph.nodes:
        if node.op == "placeholder":
            remap[node] = graph.create_node(
                "call_function", operator.getitem, (pro, i), {}, name=prefix + node.name
            )
            i += 1
        elif node.op == "get_attr":
            qual = cap.tracer.get_fresh_qualname(prefix + str(node.target).replace(".", "_"))
            setattr(cap.tracer.root, qual, getattr(bw, str(node.target)))
            remap[node] = cast(WalkNode, cap.tracer.create_node("get_attr", qual, (), {}))
        elif node.op == "call_function":
            new = graph.create_node(
                "call_function",
                node.target,
                fx.map_arg(node.args, get),
                fx.map_arg(node.kwargs, get),
                name=prefix + node.name,
            )
            new.meta["stoker_aot"] = f"aot{aot_id}:{node.name}"
            remap[node] = new
        elif node.op == "output":
            (outs,) = node.args
            outs = outs if isinstance(outs, list | tuple) else (outs,)
            outputs = [
                fx.Proxy(cast(fx.Node, remap[o]), cap.tracer) if isinstance(o, fx.Node) else o
                for o in outs
            ]
        else:
            raise NotImplementedError(f"{node.op} node in an AOT backward graph")
    # 3. the epilogue: one grad per Function input.  The Function's inputs are
    # (sink, *primals); the backward graph returns one grad per primal.
    assert outputs is not None
    # grads that read only tangents the engine materialized as zeros (outputs outside
    # the loss) stay undefined, as in eager (stoker_capture.undefined_grads)
    undefined = {
        k
        for g, k in zip(pgrads, tangent_of)
        if k is not None and g.node.target is torch.ops.aten.zeros.default
    }
    if undefined:
        drop = undefined_grads(info, undefined)
        outputs = [None if d else o for o, d in zip(outputs, drop)]
    _mark_tangent_reads(info, pro.name, tangent_of, outputs)
    extra = len(output_metadatas) - len(outputs)
    if extra < 0 or any(m is not None for m in output_metadatas[:extra]):
        raise NotImplementedError("AOT backward outputs do not match the Function's inputs")
    grads = [None] * extra + outputs
    return [None if m is None else g for g, m in zip(grads, output_metadatas)]


def _mark_tangent_reads(
    info: Any, prologue: str, tangent_of: Sequence[int | None], outputs: Sequence[Any]
) -> None:
    """On each gradient's node, the prologue's name and the positions of the grads it
    reads (``meta["stoker_aot_reads"]``): `passes.mark_undefined_leaves` follows an
    undefined gradient through the block as eager's Function does (`undefined_grads`)."""
    deps = tangent_deps(info)
    for o, d in zip(outputs, deps):
        if isinstance(o, fx.Proxy) and d:
            reads = tuple(g for g, k in enumerate(tangent_of) if k is not None and k in d)
            o.node.meta["stoker_aot_reads"] = (prologue, reads)
