"""What each lifted input of a captured backward is, in user terms.

Capture notes, per ``(list, index)`` of the graph's inputs (``inputs``: tensors,
``sizes``, ``scalars``), which autograd node read it first and as what: the gradient
flowing into it, a tensor it saved, a dim of a shape it saved or of a gradient it
returns.  A recompile reason (`recompile_reasons()`) is translated with this table
when a recompile happens; a source missing from it keeps the guard's raw text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import sympy
import torch

Source = tuple[str, int]  # ("inputs" | "sizes" | "scalars", index)

_LISTS = ("inputs", "sizes", "scalars")  # the guards' ``args[0]``, ``args[1]``, ``args[2]``
_SOURCE = re.compile(r"args\[(\d)\]\[(\d+)\](?:\.(size|stride)\(\)\[(\d+)\])?")
_CHANGE = re.compile(r" == (-?[\w.]+) failed: got (?:\S+ = )?(-?[\w.]+)")


class Origins:
    """The table capture fills: first description wins (the first reader names it)."""

    def __init__(self, inputs: list[torch.Tensor], sym_sources: Mapping[Any, Source]) -> None:
        self._ids = {id(t): i for i, t in enumerate(inputs)}
        self._syms = sym_sources
        self.table: dict[Source, str] = {}
        self.node = "the backward"  # the autograd node being captured (set_node_origin)

    def _set(self, src: Source, text: str) -> None:
        self.table.setdefault(src, text)

    def tensor(self, t: Any, text: str) -> None:
        i = self._ids.get(id(t)) if isinstance(t, torch.Tensor) else None
        if i is not None:
            self._set(("inputs", i), text)

    def size(self, s: Any, text: str) -> None:
        if isinstance(s, torch.SymInt | torch.SymFloat):
            src = self._syms.get(s.node.expr) if isinstance(s.node.expr, sympy.Symbol) else None
            if src is not None:
                self._set(src, text)

    def saved(self, values: Any, shape_text: str, tensor_text: str, size_text: str) -> None:
        """Tensors and sizes among ``values`` (the arguments a node saved or a check's
        metadata): ``dim j of <shape_text>`` for the j-th entry of a nested list of
        sizes, ``size_text`` for a size at the top, ``tensor_text`` with ``{k}`` the
        tensor's place among the tensors of ``values``."""
        tensors: list[torch.Tensor] = []
        top = values if isinstance(values, list | tuple) else [values]
        for v in top:
            if isinstance(v, torch.SymInt | torch.SymFloat):
                self.size(v, size_text)
            else:
                self._walk(v, shape_text, tensors)
        for k, t in enumerate(tensors):
            self.tensor(t, tensor_text.format(k=k))

    def _walk(self, values: Any, shape_text: str, tensors: list[torch.Tensor]) -> None:
        if isinstance(values, list | tuple):
            for j, v in enumerate(values):
                if isinstance(v, torch.SymInt | torch.SymFloat):
                    self.size(v, f"dim {j} of {shape_text}")
                else:
                    self._walk(v, shape_text, tensors)
        elif isinstance(values, torch.Tensor):
            tensors.append(values)


def describe(reason: str, table: Mapping[Source, str] | None) -> str:
    """``reason`` (a guard's explain text) led by what its first source is, with the
    old and new value: ``dim 0 of saved tensor 1 of MulBackward0 changed 3 -> 5 (<reason>)``.  Unchanged when the source is not in ``table``."""
    m = _SOURCE.search(reason)
    if m is None or not table or int(m[1]) >= len(_LISTS):
        return reason
    what = table.get((_LISTS[int(m[1])], int(m[2])))
    if what is None:
        return reason
    if m[3] is not None:
        what = f"{'dim' if m[3] == 'size' else 'stride'} {m[4]} of {what}"
    change = _CHANGE.search(reason, m.end())
    if change is not None and change.start() == m.end():
        what += f" changed {change[1]} -> {change[2]}"
    return f"{what} ({reason})"
