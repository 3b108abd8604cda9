"""Evaluate symbolic sizes at run time from the real inputs (for views and write-backs).

One generated function binds each input symbol from an input's size (or a
SymInt input) and returns every requested expression as an int.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._sympy.printers import PythonPrinter

from ..errors import UnsupportedError


class _Printer(PythonPrinter):
    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        return str(expr.name)


def build_evaluator(
    env: ShapeEnv, fake_primals: Sequence[Any], exprs: Sequence[Any], what: str
) -> Callable[[Sequence[Any]], list[int]]:
    """A function of the real primals returning ``exprs`` as ints."""
    replaced = [env.replace(e) if isinstance(e, sympy.Basic) else int(e) for e in exprs]
    if all(not isinstance(e, sympy.Basic) or e.is_number for e in replaced):
        consts = [int(e) for e in replaced]
        return lambda primals: consts
    binds: dict[sympy.Symbol, str] = {}
    for i, p in enumerate(fake_primals):
        if isinstance(p, torch.Tensor):
            for d, s in enumerate(p.shape):
                e = env.replace(s.node.expr) if isinstance(s, torch.SymInt) else None
                if isinstance(e, sympy.Symbol) and e not in binds:
                    binds[e] = f"p[{i}].shape[{d}]"
        elif isinstance(p, torch.SymInt):
            e = env.replace(p.node.expr)
            if isinstance(e, sympy.Symbol) and e not in binds:
                binds[e] = f"int(p[{i}])"
    printer = _Printer()
    body = []
    used: set[sympy.Symbol] = set()
    texts = []
    for e in replaced:
        if isinstance(e, sympy.Basic):
            missing = e.free_symbols - binds.keys()
            if missing:
                raise UnsupportedError(
                    f"{what}: the size {e} uses {sorted(map(str, missing))}, which no input "
                    "determines (a data-dependent size); return a fresh tensor instead of a view"
                )
            used |= e.free_symbols
            texts.append(printer.doprint(e))
        else:
            texts.append(str(e))
    body = [f"    {s.name} = {binds[s]}" for s in sorted(used, key=str)]
    src = "def ev(p):\n" + "\n".join(body) + f"\n    return [{', '.join(texts)}]\n"
    ns: dict[str, Any] = {"math": __import__("math"), "int": int}
    exec(compile(src, f"<stoker sizes: {what}>", "exec"), ns)
    fn: Callable[[Sequence[Any]], list[int]] = ns["ev"]
    return fn
