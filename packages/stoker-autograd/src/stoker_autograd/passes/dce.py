"""Dead-code elimination that keeps every node with a side effect."""

from __future__ import annotations

import torch.fx as fx

from ._common import graph_pass, is_impure


@graph_pass
def dce(g: fx.Graph) -> None:
    """Remove nodes nobody uses, except hooks, custom backwards, accumulate-grad,
    in-place ops and graph inputs (e.g. the ``sym_size`` queries the engine leaves)."""
    g.eliminate_dead_code(is_impure)
