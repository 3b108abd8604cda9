"""Graph passes on a captured backward graph (README.md beside this file says what
each may and may not change).

Every pass is a pure function ``fx.Graph -> fx.Graph``: it returns a new graph and
leaves its argument alone.  `run_all` applies `PIPELINE` in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from ._common import GraphPass, copy_graph
from .dce import dce
from .reorder import (
    delay_unpack_hooks,
    order_leaves_by_output,
    place_pre_hooks_before_node,
    place_size_checks_after_their_call,
    reorder_accumulate_grad,
    reorder_post_acc_grad_hooks,
    reorder_post_hooks,
    reorder_tensor_pre_hooks,
    schedule_pre_hooks_early,
)
from .undefined import mark_undefined_leaves

Pass = Callable[[fx.Graph], fx.Graph]

PIPELINE: tuple[Pass, ...] = (
    delay_unpack_hooks,
    reorder_tensor_pre_hooks,
    schedule_pre_hooks_early,
    reorder_accumulate_grad,
    place_pre_hooks_before_node,
    reorder_post_acc_grad_hooks,
    reorder_post_hooks,
    order_leaves_by_output,
    dce,
    mark_undefined_leaves,
)


RETRACED_PIPELINE: tuple[Pass, ...] = (
    reorder_tensor_pre_hooks,
    place_size_checks_after_their_call,
    reorder_accumulate_grad,
    reorder_post_acc_grad_hooks,
    order_leaves_by_output,
)
"""Run again on the retraced aten graph, where the engine's ``validate_outputs``
(one node taking every grad of a node) is traced away: an inlined AOT backward's
accumulate-grads and their hooks can then follow each gradient as eager does."""


def run_all(graph: fx.Graph, pipeline: tuple[Pass, ...] = PIPELINE) -> fx.Graph:
    """Apply each pass in order to one copy of ``graph``, then check the result is well
    formed: once, after the last pass, not after each (a lint walks every node and
    costs as much as a pass; a broken graph fails it all the same).  ``graph`` itself
    is left alone."""
    g, _ = copy_graph(graph)
    for p in pipeline:
        if isinstance(p, GraphPass):
            p.in_place(g)
        else:
            g = p(g)
    g.lint()
    return g


__all__ = [
    "PIPELINE",
    "RETRACED_PIPELINE",
    "Pass",
    "dce",
    "delay_unpack_hooks",
    "mark_undefined_leaves",
    "order_leaves_by_output",
    "place_pre_hooks_before_node",
    "place_size_checks_after_their_call",
    "reorder_accumulate_grad",
    "reorder_post_acc_grad_hooks",
    "reorder_post_hooks",
    "reorder_tensor_pre_hooks",
    "run_all",
    "schedule_pre_hooks_early",
]
