"""Graphs with their node values as plain data: a fake value's sizes and strides as
ints or sympy expressions over the shape env's symbols, rebuilt over a warm one."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from stoker_shapes import ShapeContext
from stoker_shapes._internal.cachekey import hints

from ..errors import UnsupportedError
from ..graphs.serialize import graph_from_json, graph_to_json
from .key import Uncacheable


def _encode_val(v: Any) -> Any:
    """A node's ``meta["val"]`` as plain data: sizes as ints or sympy expressions."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if v is None or type(v) in (bool, int, float):
        return ("C", v)
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        if free_unbacked_symbols(v):
            raise Uncacheable("a size that depends on data (an unbacked symbol)")
        return ("S", type(v).__name__, v.node.expr)
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided:
            raise Uncacheable(f"a tensor of layout {v.layout}")
        if free_unbacked_symbols(v):
            raise Uncacheable("a size that depends on data (an unbacked symbol)")
        sizes = tuple(_expr(s) for s in v.shape)
        strides = tuple(_expr(s) for s in v.stride())
        return (
            "T",
            v.dtype,
            str(v.device),
            sizes,
            strides,
            _expr(v.storage_offset()),
            v.requires_grad,
        )
    if isinstance(v, list | tuple):
        return ("L" if isinstance(v, list) else "U", [_encode_val(x) for x in v])
    raise Uncacheable(f"a node value of type {type(v).__qualname__}")


def _expr(s: Any) -> Any:
    return s.node.expr if isinstance(s, torch.SymInt) else int(s)


class _Decoder:
    """Fake values over ``ctx``'s symbols from `_encode_val`'s data (no guards added).

    Values with the same metadata are one object (``shared``), as nodes inlined
    from one trace share theirs: building a fake tensor of symbolic sizes costs
    about a millisecond, and a model's layers repeat a few shapes many times."""

    def __init__(self, ctx: ShapeContext) -> None:
        self.ctx = ctx
        self.hints = hints(ctx.shape_env)
        self.syms: dict[Any, Any] = {}
        self.tensors: dict[Any, torch.Tensor] = {}

    def size(self, e: Any, kind: str = "SymInt") -> Any:
        if isinstance(e, int):
            return e
        got = self.syms.get((kind, e))
        if got is None:
            env = self.ctx.shape_env
            hint = e.xreplace(self.hints)
            if kind == "SymBool":
                got = env.create_symboolnode(e)
            elif kind == "SymFloat":
                got = env.create_symfloatnode(e, hint=float(hint))
            else:
                got = env.create_symintnode(e, hint=int(hint))
            self.syms[(kind, e)] = got
        return got

    def val(self, d: Any, shared: bool = True) -> Any:
        tag = d[0]
        if tag == "C":
            return d[1]
        if tag == "S":
            return self.size(d[2], d[1])
        if tag == "T":
            t = self.tensors.get(d) if shared else None
            if t is None:
                t = self._tensor(d)
                if shared:
                    self.tensors[d] = t
            return t
        vals = [self.val(x, shared) for x in d[1]]
        return vals if tag == "L" else tuple(vals)

    def _tensor(self, d: Any) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        _, dtype, device, sizes, strides, offset, rg = d
        size = [self.size(s) for s in sizes]
        stride = [self.size(s) for s in strides]
        off = self.size(offset)
        meta = torch.empty_strided(size, stride, dtype=dtype, device="meta")
        if not (isinstance(off, int) and off == 0):
            meta = meta.as_strided(size, stride, off)
        t = FakeTensor(self.ctx.fake_mode, meta, torch.device(device))
        return t.requires_grad_(rg) if rg else t


@dataclasses.dataclass
class GraphData:
    class_name: str
    nodes: list[dict[str, Any]]  # serialize.graph_to_json
    vals: list[Any]  # per node: `_encode_val` of its meta["val"]


def _pack_graph(gm: fx.GraphModule) -> GraphData:
    try:
        nodes = graph_to_json(gm)
    except UnsupportedError as e:
        raise Uncacheable(str(e)) from e
    vals = [_encode_val(n.meta.get("val")) for n in gm.graph.nodes]
    return GraphData(type(gm).__name__, nodes, vals)


def _unpack_graph(data: GraphData, dec: _Decoder) -> fx.GraphModule:
    gm = graph_from_json(data.nodes, class_name=data.class_name)
    for n, v in zip(gm.graph.nodes, data.vals, strict=True):
        if v != ("C", None):
            n.meta["val"] = dec.val(v, shared=n.op != "placeholder")  # inputs: one each
    return gm
