"""Checks between stages (run when debugging: `STOKER_TRITON_DEBUG=1` or
`debug=True`). Each raises `AssertionError` naming the node and what is wrong."""

from __future__ import annotations

import sympy

from .ir import (
    ExternNode,
    Op,
    Program,
    ReductionNode,
    ScatterNode,
    iter_values,
    loads_of,
    node_reads,
    node_writes,
)
from .lowering.precision import EXACT_IN_HALF, HALF
from .scheduler import Kernel, Schedule


def verify_program(p: Program) -> None:
    """Lowering output: every read names a buffer that exists and is written
    before it is read; node bodies use only their own index variables, size
    symbols and bound indirect symbols; nothing computes in half precision."""
    written = {n for n in p.inputs if isinstance(n, str)} | set(p.constants)
    for node in p.nodes:
        for b in node_reads(node):
            assert b in p.buffers, f"{node}: reads unknown buffer {b}"
            assert b in written, f"{node}: reads {b} before anything writes it"
        if not isinstance(node, ExternNode):
            _check_symbols(node, p)
            _check_half(node)
        written |= set(node_writes(node))
    for o in p.outputs:
        if isinstance(o, str):
            assert o in p.buffers, f"output {o} is not a buffer"


def _check_symbols(node: object, p: Program) -> None:
    allowed = set(p.symbols)
    body = node.body  # type: ignore[attr-defined]
    for v in iter_values(body):
        bound = {s for s, _ in getattr(v, "indirect", ())}
        exprs = [getattr(v, a) for a in ("index", "expr", "offset") if hasattr(v, a)]
        for e in exprs:
            for s in sympy.sympify(e).free_symbols:
                name = str(s)
                ok = s in allowed or s in bound or (name[0] in "xr" and name[1:].isdigit())
                assert ok, f"{node}: unbound symbol {s} in {v}"
    _ = loads_of


def _check_half(node: object) -> None:
    """lowering/precision.py, rule 2: only ops exact on half values see half
    operands or give half results; everything else computes in float32."""
    if isinstance(node, ReductionNode) and node.reduce_type not in ("max", "min", "any", "all"):
        assert node.dtype not in HALF, f"{node}: accumulates in {node.dtype}"
    for v in iter_values(node.body):  # type: ignore[attr-defined]
        if not isinstance(v, Op) or v.name in EXACT_IN_HALF:
            continue
        dts = {v.dtype, *(a.dtype for a in v.args)}
        assert not dts & set(HALF), f"{node}: {v.name} computes in half precision: {v}"


def verify_schedule(p: Program, s: Schedule) -> None:
    """Scheduler output: every IR node is in exactly one step, steps keep
    producers before consumers, scatters run alone."""
    seen: dict[str, int] = {}
    for i, step in enumerate(s.steps):
        nodes = step.nodes if isinstance(step, Kernel) else [step]
        if isinstance(step, Kernel) and any(isinstance(n, ScatterNode) for n in nodes):
            assert len(nodes) == 1, f"{step.name}: a scatter shares its kernel"
        for n in nodes:
            for b in node_reads(n):
                if b in seen:
                    assert seen[b] <= i, f"{step}: reads {b} written by a later step"
            for w in node_writes(n):
                seen[w] = i
    want = sum(len(node_writes(n)) for n in p.nodes)
    got = sum(len(st.nodes) if isinstance(st, Kernel) else len(node_writes(st)) for st in s.steps)
    assert want == got, f"schedule holds {got} node outputs, the program {want}"
