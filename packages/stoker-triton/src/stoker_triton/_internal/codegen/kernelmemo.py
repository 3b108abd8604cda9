"""Kernel sources generated once per distinct kernel, not once per occurrence.

The kernels of a model's repeated blocks (and a kernel a backward shares with its
forward) are the same kernel over other buffers: `generate_kernel` would print
the same source for each, differing only in which buffers the launch passes.
`canonical_key` names a kernel's buffers by their order of first use (as the
generated source names its pointer arguments) and keys everything code
generation reads: the nodes with their placements and bodies, each buffer's
layout and dtype and whether the kernel stores it, the sizes and the
persistence. A kernel whose key was generated before (in this process) takes
that source, renamed to its own kernel name, with its own buffers as the
pointer arguments; the source is the one `generate_kernel` gives it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..ir import Buffer, Const, IndexValue, Load, Op, PointwiseNode, Rand, ReductionNode, Value

# canonical key -> (source, its pointer arguments as positions in the key's names)
_MEMO: dict[Any, tuple[Any, list[int]]] = {}
_MEMO_MAX = 4096
stats = {"generated": 0, "reused": 0}


def canonical_key(
    kernel: Any, internal: set[str], buffers: dict[str, Buffer]
) -> tuple[Any, list[str]]:
    """(the key, the kernel's buffer names in key order)."""
    names: dict[str, int] = {}
    memo: dict[int, Any] = {}

    def cid(b: str) -> int:
        return names.setdefault(b, len(names))

    def vkey(v: Value) -> Any:
        hit = memo.get(id(v))
        if hit is not None:
            return hit
        k: Any
        if isinstance(v, Load):
            ind = tuple((s, vkey(b)) for s, b in v.indirect)
            k = ("L", cid(v.buf), v.index, ind, v.dtype)
        elif isinstance(v, Op):
            k = ("O", v.name, tuple(vkey(a) for a in v.args), v.dtype)
        elif isinstance(v, Const | Rand):
            k = (type(v).__name__, *v.key())
        elif isinstance(v, IndexValue):
            k = ("I", v.expr, tuple((s, vkey(b)) for s, b in v.indirect), v.dtype)
        else:
            raise TypeError(type(v))
        memo[id(v)] = k
        return k

    nodes: list[tuple[Any, ...]] = []
    for n in kernel.nodes:
        p = kernel.placements[n.name]
        head = (type(n).__name__, cid(n.name), tuple(p.varmap.items()), p.reduced_space, n.size)
        if isinstance(n, PointwiseNode):
            nodes.append((*head, vkey(n.body)))
        elif isinstance(n, ReductionNode):
            nodes.append((*head, n.reduce_size, n.reduce_type, n.dtype, vkey(n.body)))
        else:  # a scatter
            ind = tuple((s, vkey(b)) for s, b in n.indirect)
            nodes.append((*head, n.index, ind, vkey(n.body), n.mode))
    order = list(names)
    bufs = tuple(
        (b.size, b.stride, b.offset, b.dtype, name in internal)
        for name in order
        for b in (buffers[name],)
    )
    key = (kernel.xnumel, kernel.rnumel, kernel.persistent, tuple(nodes), bufs)
    return key, order


def generate_kernels(
    steps: list[Any], sched: Any, buffers: dict[str, Buffer], spec: Any = None
) -> dict[str, Any]:
    """`generate_kernel` of every kernel step, each distinct kernel generated once;
    with a CPU's `spec` (`devices.py`), the C emitter's `generate_c_kernel`."""
    from ..scheduler import Kernel
    from .kernel import generate_kernel

    def emit(k: Any, s: Any, b: dict[str, Buffer]) -> Any:
        if spec is not None and spec.name == "cpu":
            from .c_kernel import generate_c_kernel

            return generate_c_kernel(k, s, b, spec)
        return generate_kernel(k, s, b)

    prefix = "void " if spec is not None and spec.name == "cpu" else "def "

    out: dict[str, Any] = {}
    for s in steps:
        if not isinstance(s, Kernel):
            continue
        try:
            key, order = canonical_key(s, sched.internal, buffers)
            hash(key)
        except TypeError:  # something unhashable: generate it
            out[s.name] = emit(s, sched, buffers)
            continue
        key = (prefix, key)
        hit = _MEMO.get(key)
        if hit is not None:
            src, ptrs = hit
            stats["reused"] += 1
            out[s.name] = dataclasses.replace(
                src,
                name=s.name,
                source=src.source.replace(f"{prefix}{src.name}(", f"{prefix}{s.name}(", 1),
                pointer_args=[order[i] for i in ptrs],
            )
            continue
        ks = emit(s, sched, buffers)
        stats["generated"] += 1
        pos = {b: i for i, b in enumerate(order)}
        if all(b in pos for b in ks.pointer_args):
            if len(_MEMO) >= _MEMO_MAX:
                _MEMO.clear()
            _MEMO[key] = (ks, [pos[b] for b in ks.pointer_args])
        out[s.name] = ks
    return out
