"""Which leaves a custom backward's None would leave without a gradient.

A custom ``autograd.Function``'s backward may return None for an input ("no
gradient").  Eager's engine propagates it as an undefined gradient: a built-in node
whose incoming gradients are all undefined yields undefined ones (its generated
``apply`` computes nothing), a sum of undefined gradients is undefined, and an
accumulate-grad of an undefined gradient leaves ``.grad`` alone; stoker-capture's
Function returns None for a gradient that reads only undefined tangents (an inlined AOT
backward's gradient node carries ``meta["stoker_aot_reads"]``: which of its
prologue's grads it reads).  The captured graph computes with zeros there
(`ops.call_backward`), so a leaf reached only through the None got a zero ``.grad``
where eager leaves None.

`mark_undefined_leaves` gives each `call_backward` node the leaves whose every
gradient flows from its outputs alone (``undefined_leaves=((leaf, (i, ...)), ...)``):
when all those outputs are None at run time and the leaf's ``.grad`` is None, the
call has the leaf's ``.grad`` set back to None at the end of the backward.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._internal import ops
from .._internal.aot_inline import aot_backward_prologue
from ._common import graph_pass, is_accumulate_grad

# A value some gradient other than a custom backward's output may reach (the loss's
# seed, a hook's result, an aten op inside an inlined AOT backward, ...): never undefined.
DEFINED = None
Sources = frozenset[tuple[fx.Node, int]] | None


def _union(parts: list[Sources]) -> Sources:
    out: set[tuple[fx.Node, int]] = set()
    for p in parts:
        if p is DEFINED:
            return DEFINED
        out |= p
    return frozenset(out) if out else DEFINED


def _propagates(n: fx.Node) -> bool:
    """A built-in node's backward: undefined out when every gradient in is undefined.
    (A C++ custom Function materializes zeros instead: not one of these.)"""
    t = n.target
    return isinstance(t, ops.BoundBackward) and not t.is_custom_function


@graph_pass
def mark_undefined_leaves(g: fx.Graph) -> None:
    """Annotate each `call_backward` with the leaves only its outputs reach (see above)."""
    calls = [n for n in g.nodes if n.op == "call_function" and n.target is ops.call_backward]
    if not calls:
        return
    src: dict[fx.Node, Sources] = {}
    leaves: dict[fx.Node, list[tuple[fx.Node, tuple[int, ...]]]] = {c: [] for c in calls}
    prologues = {n.name: n for n in g.nodes if n.target is aot_backward_prologue}
    for n in g.nodes:
        if n.op != "call_function":
            continue
        reads = n.meta.get("stoker_aot_reads")
        if reads is not None and reads[0] in prologues:  # a gradient of an inlined AOT block
            grads = prologues[reads[0]].args[2]
            assert isinstance(grads, list | tuple)
            picked = [grads[i] for i in reads[1]]
            src[n] = _union([src.get(x) if isinstance(x, fx.Node) else DEFINED for x in picked])
        elif n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            base, i = n.args[0], n.args[1]
            if base.target is ops.call_backward and isinstance(i, int):
                src[n] = frozenset({(base, i)})
            elif base in src:
                src[n] = src[base]
        elif _propagates(n) and isinstance(n.args[0], list | tuple):
            src[n] = _union([src.get(x) for x in n.args[0] if isinstance(x, fx.Node)])
        elif n.target is torch.add:  # the engine's sum of two gradients of one input
            src[n] = _union([src.get(x) if isinstance(x, fx.Node) else DEFINED for x in n.args])
        elif is_accumulate_grad(n) and isinstance(n.args[2], fx.Node):
            s = src.get(n.args[2])
            owners = {c for c, _ in s} if s is not None else set()
            if s is not None and len(owners) == 1 and isinstance(n.args[0], fx.Node):
                leaves[owners.pop()].append((n.args[0], tuple(sorted(i for _, i in s))))
    for c, marked in leaves.items():
        if marked:
            c.kwargs = {**c.kwargs, "undefined_leaves": tuple(marked)}
