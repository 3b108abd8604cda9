"""Which lifted sizes of a captured backward the forward already held symbolic.

A stoker AOT backward inlined into the capture (`aot_inline`) comes with the
forward's own fake values: its saved tensors and the gradients it returns carry the
forward's sizes, symbolic where the forward was compiled dynamic
(``stoker.compile(dynamic=True)``, ``torch.compile(dynamic=True)``, ``mark_dynamic``,
a Dynamo recompile made automatic-dynamic).  Capture notes, per position of the
graph's inputs (`graph.Position`), whether the forward held it symbolic (True) or
static (False); a parameter's sizes (and its ``.grad``'s) are static, and so is a
size made only of a module's own attributes (a head count that Dynamo left symbolic
on a module FSDP2 manages: `_model_constants`).

The first compile of the captured graph then makes symbolic the positions the
forward held symbolic (positions that held one symbol of the forward share one
symbol; two that hold one value by chance do not), and gives a symbol of its own
to each position of no known kind (sizes of the eager nodes around the compiled
region, such as the loss's ``MseLossBackward0``, or the gradient checks of the AOT
node) that holds a multiple of one of their values (``batch x T`` rows, a mean's
``numel``): a batch size flows from the compiled forward into the eager loss and
back.  The retrace ties such a symbol to the forward's where the graph combines
them, and specializes it where it meets a static size (an output width that equals
the batch by chance: the guard says ``== 4``, exactly).  Positions the forward held
static stay static, so their guards stay exact.
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
    return forward_symbol(v) is not None


def forward_symbol(v: Any) -> tuple[int, Any] | None:
    """What ``v`` (a size of the forward's fake values) is in the forward: its shape
    env and its expression after that env's replacements, with the model's constants
    (`_model_constants`) put in; None where static."""
    if not isinstance(v, torch.SymInt):
        return None
    node = v.node
    expr = node.expr
    if expr.is_number:
        return None
    env = getattr(node, "shape_env", None)
    if env is not None:
        expr = env.replace(expr)
        constants = _model_constants(env, expr)
        if constants:
            expr = expr.xreplace(constants)
    return (id(env), expr) if expr.free_symbols else None


def _model_constants(env: Any, expr: Any) -> dict[Any, Any]:
    """The symbols of ``expr`` that stand for a module's attribute, each with its value.

    Dynamo keeps an int attribute of a module (a head count) static, except on a module
    FSDP2's ``fully_shard`` manages (its own class, guarded as an FSDP module), or with
    ``allow_unspec_int_on_nn_module``: with ``dynamic=True`` such an int becomes a
    symbol, and every size made from it (the head size ``C // heads``, the width
    ``heads * (C // heads)``) an expression that each view of the backward takes to
    sympy.  Such a size is the model's, not the batch's: the backward holds it static
    (its guards say ``== value``, exactly), as it holds a parameter's.  A symbol that
    any tensor input or plain argument of the frame also names is not a constant."""
    sources = getattr(env, "var_to_sources", None) or {}
    values = getattr(env, "backed_var_to_val", None)  # torch 2.13's name
    if values is None:
        values = getattr(env, "var_to_val", None) or {}
    out: dict[Any, Any] = {}
    for s in expr.free_symbols:
        srcs = sources.get(s)
        val = values.get(s)
        if srcs and val is not None and all(_of_module(src) for src in srcs):
            out[s] = val
    return out


def _of_module(source: Any) -> bool:
    """``source`` (a dynamo ``Source``) reads an attribute of a module (its own int, a
    buffer's size): its guard source is one of the module kinds."""
    gs = getattr(source, "guard_source", None)
    if callable(gs):  # a method before torch 2.12, a property since
        gs = gs()
    if gs is None:
        return False
    checks = ("is_fsdp_module", "is_specialized_nn_module", "is_unspecialized_nn_module")
    return any(bool(getattr(gs, c, lambda: False)()) for c in checks)


class ForwardDims:
    """The table capture fills; `seed` reads it at the first compile."""

    def __init__(
        self, inputs: Sequence[torch.Tensor], sym_sources: Mapping[Any, tuple[str, int]]
    ) -> None:
        self._ids = {id(t): i for i, t in enumerate(inputs)}
        self._syms = sym_sources
        self.known: dict[Position, bool] = {}
        # a symbolic position -> the forward symbol it held (union-find over them: a
        # position two forwards saved makes their symbols one)
        self._held: dict[Position, tuple[int, Any]] = {}
        self._parent: dict[tuple[int, Any], tuple[int, Any]] = {}

    def _set(self, pos: Position, forward: Any) -> None:
        sym = forward_symbol(forward)
        self.known[pos] = self.known.get(pos, False) or sym is not None  # symbolic wins
        if sym is None:
            return
        self._parent.setdefault(sym, sym)
        held = self._held.setdefault(pos, sym)
        a, b = self._root(held), self._root(sym)
        if a != b:
            self._parent[b] = a

    def _root(self, sym: tuple[int, Any]) -> tuple[int, Any]:
        while self._parent[sym] != sym:
            sym = self._parent[sym]
        return sym

    def tensor(self, t: Any, forward_sizes: Sequence[Any]) -> None:
        """A lifted tensor ``t`` whose sizes the forward held as ``forward_sizes``."""
        i = self._ids.get(id(t)) if isinstance(t, torch.Tensor) else None
        if i is not None and len(forward_sizes) == t.dim():
            for d, f in enumerate(forward_sizes):
                self._set((0, i, d), f)

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
                    self._set((_LIST[src[0]], src[1], -1), f)

    def seed(
        self, values: Mapping[Position, int]
    ) -> tuple[set[Position], set[Position], dict[Position, Position]]:
        """``(dynamic, free, groups)`` for the first compile at these ``values``: the
        positions the forward held symbolic, and the positions of no known kind holding
        a multiple of one of their values (a batch, ``batch x T`` rows, a ``numel`` of
        ``batch x 16``: a symbol each, which the trace ties to the forward's, or
        specializes where it meets a static size).  ``groups``: each dynamic position's
        group, named by its first position: those that held one forward symbol (one
        symbol in the retrace; after a recompile, positions that changed share one
        symbol per value).  Two
        symbols of the forward that hold one value by chance (an FSDP block's head
        count and a batch of 2) stay two: one symbol would guard them equal, and the
        next batch recompiled the backward."""
        dynamic = {p for p, sym in self.known.items() if sym and values.get(p, 0) >= 2}
        held = {values[p] for p in dynamic}
        # A value only static positions of the forward hold (a vocabulary, a head size,
        # a sequence length the forward held static) is taken to be that size where a
        # position of no known kind holds it: static, not a symbol of its own that the
        # trace then specializes (a symbol and a guard each, through sympy).  A batch-
        # derived size equal to it by chance then costs one recompile, never a wrong
        # result: its guard says ``== value``.
        static = {values[p] for p, sym in self.known.items() if not sym and p in values} - held
        free = {
            p
            for p, v in values.items()
            if p not in self.known and v >= 2 and v not in static and any(v % h == 0 for h in held)
        }
        first: dict[tuple[Any, int], Position] = {}
        for p in sorted(dynamic):
            first.setdefault((self._root(self._held[p]), values[p]), p)
        groups = {p: first[(self._root(self._held[p]), values[p])] for p in dynamic}
        return dynamic, free, groups
