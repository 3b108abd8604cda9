"""Which aten ops the min-cut partitioner may recompute in the backward.

One table, read top to bottom; the first rule that matches decides:

| kind       | recompute? | rule                                                          |
|------------|------------|---------------------------------------------------------------|
| random     | never      | `torch.Tag.nondeterministic_seeded` (rand, dropout, bernoulli) |
| extern     | never      | `EXTERN_OPS`: matmul, convolution, attention kernels           |
| reduction  | never      | `torch.Tag.reduction` or `REDUCTION_OPS` (softmax, norms, ...) |
| view       | yes (free) | the schema returns an alias of an input (view, permute, ...)   |
| pointwise  | yes        | `torch.Tag.pointwise`                                          |
| cheap      | yes        | `CHEAP_OPS`: creation, copies, cat/pad, gather/index           |
| other      | never      | anything else: unknown cost, so it is saved                    |

Recomputing an op costs roughly the bytes it writes (pointwise ops are
memory-bound); a view costs nothing.

`torch.utils.checkpoint` overrides the table for the nodes it tags (`checkpoint_marks`):
inside a checkpointed region every op the region computes is recomputed in the
backward (matmuls and reductions too), except random ops (saved: recomputing them would
draw other numbers) and ops that are not pure functions (collectives, mutations).
"""

from __future__ import annotations

import operator
from typing import Literal

import torch
import torch.fx as fx

__all__ = [
    "CheckpointMark",
    "OpKind",
    "checkpoint_marks",
    "classify",
    "is_recomputable",
    "may_recompute",
    "recompute_cost",
]

aten = torch.ops.aten


def _ops(names: list[str]) -> frozenset[object]:
    """Resolve "ns.op.overload" names; overloads this torch lacks are skipped (2.11 vs 2.13)."""
    found: set[object] = set()
    for name in names:
        ns, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None)
        target = getattr(packet, overload, None) if packet is not None else None
        if target is not None:
            found.add(target)
    return frozenset(found)


OpKind = Literal[
    "input",
    "constant",
    "getitem",
    "random",
    "extern",
    "reduction",
    "view",
    "pointwise",
    "cheap",
    "other",
]

EXTERN_OPS: frozenset[object] = _ops(
    [
        "aten.mm.default",
        "aten.bmm.default",
        "aten.addmm.default",
        "aten.baddbmm.default",
        "aten.addbmm.default",
        "aten.addmv.default",
        "aten.mv.default",
        "aten.dot.default",
        "aten.convolution.default",
        "aten.convolution_backward.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._flash_attention_forward.default",
        "aten._efficient_attention_forward.default",
        "aten.upsample_bilinear2d.default",
        "aten._cdist_forward.default",
    ]
)

# Reductions (or ops containing one) that carry no `reduction` tag.
REDUCTION_OPS: frozenset[object] = _ops(
    [
        "aten._softmax.default",
        "aten._log_softmax.default",
        "aten.cumsum.default",
        "aten.cumprod.default",
        "aten.logcumsumexp.default",
        "aten.cummax.default",
        "aten.cummin.default",
        "aten.native_layer_norm.default",
        "aten.native_group_norm.default",
        "aten.native_batch_norm.default",
        "aten._native_batch_norm_legit.default",
        "aten._native_batch_norm_legit_functional.default",
        "aten._native_batch_norm_legit_no_training.default",
        "aten.topk.default",
        "aten.sort.default",
        "aten.sort.stable",
        "aten.avg_pool2d.default",
        "aten.max_pool2d_with_indices.default",
        "aten._adaptive_avg_pool2d.default",
        "aten.embedding_dense_backward.default",
        "aten.scatter_add.default",
        "aten.scatter_reduce.two",
        "aten.index_add.default",
        "aten.index_put.default",
        "aten.var_mean.correction",
    ]
)

# Cheap, non-pointwise ops that are safe to run twice.
CHEAP_OPS: frozenset[object] = _ops(
    [
        "aten.full.default",
        "aten.zeros.default",
        "aten.ones.default",
        "aten.empty.memory_format",
        "aten.scalar_tensor.default",
        "aten._local_scalar_dense.default",  # x.item(): a float the backward needs is re-read, not saved
        "aten.arange.default",
        "aten.arange.start",
        "aten.arange.start_step",
        "prims.iota.default",
        "aten.full_like.default",
        "aten.zeros_like.default",
        "aten.ones_like.default",
        "aten.empty_like.default",
        "aten.new_zeros.default",
        "aten.new_ones.default",
        "aten.new_full.default",
        "aten.new_empty.default",
        "aten.clone.default",
        "aten._to_copy.default",
        "aten.copy.default",
        "aten.lift_fresh_copy.default",
        "aten._unsafe_view.default",
        "aten.cat.default",
        "aten.constant_pad_nd.default",
        "aten.index.Tensor",
        "aten.gather.default",
        "aten.index_select.default",
        "aten.embedding.default",
        "aten.slice_scatter.default",
        "aten.select_scatter.default",
        "aten.diagonal_scatter.default",
        "aten.as_strided_scatter.default",
        "aten.triu.default",
        "aten.tril.default",
        "aten.flip.default",
        "aten.roll.default",
        "aten.repeat.default",
        "aten.masked_fill.Scalar",
        "aten.masked_fill.Tensor",
        "prims.convert_element_type.default",
        "prims.broadcast_in_dim.default",
    ]
)


# Tags this torch may lack are None (branch on what exists, not on versions).
_TAG_REDUCTION = getattr(torch.Tag, "reduction", None)
_TAG_VIEW_COPY = getattr(torch.Tag, "view_copy", None)


def _is_view_op(target: torch._ops.OpOverload) -> bool:
    returns = target._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def classify(node: fx.Node) -> OpKind:
    """The kind of a node, per the table in the module docstring."""
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return "constant"
    if node.op != "call_function":
        return "other"
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if not isinstance(target, torch._ops.OpOverload):
        # SymInt arithmetic (operator.mul, sym_size, ...) and other Python callables
        return "cheap" if _is_sym_value(node) else "other"
    tags = target.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return "random"
    if target in EXTERN_OPS:
        return "extern"
    if (_TAG_REDUCTION is not None and _TAG_REDUCTION in tags) or target in REDUCTION_OPS:
        return "reduction"
    if _is_view_op(target):
        return "view"
    if torch.Tag.pointwise in tags:
        return "pointwise"
    if target in CHEAP_OPS or (_TAG_VIEW_COPY is not None and _TAG_VIEW_COPY in tags):
        return "cheap"
    if target is aten.sym_size.int or target is aten.sym_numel.default:
        return "cheap"
    return "other"


def _is_sym_value(node: fx.Node) -> bool:
    return isinstance(
        node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
    )


_RECOMPUTABLE: frozenset[str] = frozenset({"constant", "getitem", "view", "pointwise", "cheap"})


def is_recomputable(kind: OpKind) -> bool:
    """May a node of this kind run again in the backward?"""
    return kind in _RECOMPUTABLE


# What torch.utils.checkpoint asked of a node: recompute it in the backward, or save it.
CheckpointMark = Literal["recompute", "save"]


def checkpoint_marks(graph: fx.Graph) -> dict[fx.Node, CheckpointMark]:
    """The nodes that `torch.utils.checkpoint` tagged while the joint graph was traced.

    Non-reentrant checkpointing (and selective checkpointing's policies) set
    ``node.meta["recompute"]`` to a `CheckpointPolicy` on every op of a checkpointed
    region: ``MUST_RECOMPUTE`` and ``PREFER_RECOMPUTE`` give ``"recompute"``,
    ``MUST_SAVE`` gives ``"save"`` (``PREFER_SAVE``: the partitioner decides).  A region's
    output that a later region reads is saved, as eager's checkpoint saves each
    region's input: otherwise the backward would recompute every region from the
    first one's input."""
    from torch.utils.checkpoint import CheckpointPolicy

    recompute = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
    marks: dict[fx.Node, CheckpointMark] = {}
    for n in graph.nodes:
        policy = n.meta.get("recompute")
        if policy in recompute:
            marks[n] = "recompute"
        elif policy == CheckpointPolicy.MUST_SAVE:
            marks[n] = "save"
    for n in [n for n, m in marks.items() if m == "recompute"]:
        region = n.meta.get("ac_graph_id")
        for u in n.users:
            later = u.meta.get("ac_graph_id")
            if (
                marks.get(u) == "recompute"
                and region is not None
                and later is not None
                and later > region
            ):
                marks[n] = "save"
    return marks


def may_recompute(node: fx.Node, kind: OpKind, mark: CheckpointMark | None) -> bool:
    """May this node run again in the backward, given its kind and its checkpoint mark?"""
    if mark == "save":
        return False
    if mark == "recompute" and kind in ("extern", "reduction", "other"):
        return _pure_aten(node)
    return is_recomputable(kind)


def _pure_aten(node: fx.Node) -> bool:
    """An aten or prims op that writes none of its inputs (no collective, no mutation)."""
    target = node.target
    return (
        isinstance(target, torch._ops.OpOverload)
        and target.namespace in ("aten", "prims")
        and not target._schema.is_mutable
    )


def recompute_cost(kind: OpKind, out_bytes: int) -> int:
    """Rough cost of running a node again: the bytes it writes; views and items are free."""
    if kind in ("view", "getitem", "constant"):
        return 0
    return out_bytes
