"""Which lifted sizes of a captured backward the forward already held symbolic.

A stoker AOT backward inlined into the capture (`aot_inline`) comes with the
forward's own fake values: its saved tensors and the gradients it returns carry the
forward's sizes, symbolic where the forward was compiled dynamic
(``stoker.compile(dynamic=True)``, ``torch.compile(dynamic=True)``, ``mark_dynamic``,
a Dynamo recompile made automatic-dynamic).  Capture notes, per position of the
graph's inputs (`graph.Position`), whether the forward held it symbolic (True) or
static (False); a parameter's sizes (and its ``.grad``'s) are static.

The first compile of the captured graph then makes symbolic the positions the
forward held symbolic (positions of one value share one symbol, as after a
recompile), and gives a symbol of its own to each position of no known kind (sizes
of the eager nodes around the compiled region, such as the loss's
``MseLossBackward0``, or the gradient checks of the AOT node) that holds a multiple of
one of their values (``batch x T`` rows, a mean's ``numel``): a batch size flows from
the compiled forward into the eager loss and back.  The retrace ties such a symbol to the forward's where the
graph combines them, and specializes it where it meets a static size (an output
width that equals the batch by chance: the guard says ``== 4``, exactly).  Positions
the forward held static stay static, so their guards stay exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

from .graph import Position

_LIST = {"inputs": 0, "sizes": 1, "scalars": 2}


def held_symbolic(v: Any) -> bool:
    """``v`` (a size of the forward's fake values) is symbolic after its shape env's
    replacements (a size the forward specialized, such as ``s1 == 16``, is not)."""
    if not isinstance(v, torch.SymInt):
        return False
    node = v.node
    expr = node.expr
    if expr.is_number:
        return False
    env = getattr(node, "shape_env", None)
    if env is not None:
        expr = env.replace(expr)
    return bool(expr.free_symbols)


class ForwardDims:
    """The table capture fills; `seed` reads it at the first compile."""

    def __init__(
        self, inputs: Sequence[torch.Tensor], sym_sources: Mapping[Any, tuple[str, int]]
    ) -> None:
        self._ids = {id(t): i for i, t in enumerate(inputs)}
        self._syms = sym_sources
        self.known: dict[Position, bool] = {}

    def _set(self, pos: Position, symbolic: bool) -> None:
        self.known[pos] = self.known.get(pos, False) or symbolic  # symbolic anywhere wins

    def tensor(self, t: Any, forward_sizes: Sequence[Any]) -> None:
        """A lifted tensor ``t`` whose sizes the forward held as ``forward_sizes``."""
        i = self._ids.get(id(t)) if isinstance(t, torch.Tensor) else None
        if i is not None and len(forward_sizes) == t.dim():
            for d, f in enumerate(forward_sizes):
                self._set((0, i, d), held_symbolic(f))

    def parameter(self, t: Any) -> None:
        """A lifted parameter (or its ``.grad``): static."""
        if isinstance(t, torch.Tensor):
            self.tensor(t, [0] * t.dim())

    def sizes(self, lifted: Sequence[Any], forward_sizes: Sequence[Any]) -> None:
        """Lifted sizes (capture's symbols) the forward held as ``forward_sizes``."""
        for s, f in zip(lifted, forward_sizes):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                src = self._syms.get(s.node.expr)
                if src is not None:
                    self._set((_LIST[src[0]], src[1], -1), held_symbolic(f))

    def seed(self, values: Mapping[Position, int]) -> tuple[set[Position], set[Position]]:
        """``(dynamic, free)`` for the first compile at these ``values``: the positions the
        forward held symbolic (one symbol per value), and the positions of no known kind
        holding a multiple of one of their values (a batch, ``batch x T`` rows, a
        ``numel`` of ``batch x 16``: a symbol each, which the trace ties to the
        forward's, or specializes where it meets a static size)."""
        dynamic = {p for p, sym in self.known.items() if sym and values.get(p, 0) >= 2}
        held = {values[p] for p in dynamic}
        free = {
            p
            for p, v in values.items()
            if p not in self.known and v >= 2 and any(v % h == 0 for h in held)
        }
        return dynamic, free
