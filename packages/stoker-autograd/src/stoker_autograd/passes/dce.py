"""Dead-code elimination that keeps every node with a side effect."""

from __future__ import annotations

import torch.fx as fx

from ._common import copy_graph, is_impure


def dce(graph: fx.Graph) -> fx.Graph:
    """Remove nodes nobody uses, except hooks, custom backwards, accumulate-grad,
    in-place ops and graph inputs (e.g. the ``sym_size`` queries the engine leaves)."""
    g, _ = copy_graph(graph)
    g.eliminate_dead_code(is_impure)
    return g
