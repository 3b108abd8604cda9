"""Memory traffic of a compiled graph, read from its schedule (no kernel runs).

For every kernel the scheduler made: the bytes it reads and writes, and how
many passes it makes over its inputs; for every extern call the bytes of its
arguments and results; and the graph's minimum, every input read once and
every output written once. `stoker bench traffic` sums these over a suite
model's forward and backward graphs; docs/benchmarks.md has the figures.

How a kernel's bytes are counted (what the generated code does, not a model
of the caches):

- a buffer the kernel produces is never re-read (codegen keeps it in
  registers); a node the schedule keeps `internal` is never stored;
- a load's *footprint* is the distinct elements its index can reach: the
  product of the extents of the loop variables the index depends on (and of
  those an indirect index is loaded with), at most the buffer's extent. A
  broadcast operand (a bias read per row) counts once, as a cache keeps it;
- a looped reduction reads again in every loop segment (`loop_segments`)
  that loads the buffer: that is a *pass*. A persistent kernel, a pointwise
  kernel and a kept-space node read once;
- several loads of one buffer in one pass add up, capped at the buffer;
- a store writes its node's elements; an atomic scatter its updates.

A load is *uncoalesced* when neighbouring lanes of the kernel's contiguous
axis (x for pointwise and outer reductions, r for inner ones) do not read
neighbouring elements: a GPU then fetches a sector per element. Its bytes are
reported apart; the ratio does not weight them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch

from .ir import Buffer, BufferRef, ExternNode, Load, Program, ReductionNode, ScatterNode, Value
from .ir import iter_values as _iter_values


@dataclasses.dataclass
class KernelTraffic:
    """One kernel's traffic (bytes) and shape."""

    name: str
    fn_name: str  # the Triton function's name (what a profile lists: `kernel_fn_name`)
    kind: str  # pointwise | persistent | looped | scatter
    xnumel: int
    rnumel: int
    nodes: list[str]
    origins: list[str]  # the aten ops fused into it
    read: int  # bytes read, passes included
    written: int
    ideal: int  # each input's footprint read once, each output written once
    passes: float  # the most bytes read of one input over its footprint
    uncoalesced: int  # bytes read by uncoalesced loads (in `read`)
    loads: int  # tl.load sites in the source
    int64: bool  # 64-bit index arithmetic
    outer: bool  # an outer reduction (launcher's outer tiles)
    config: tuple[int, int, int]  # the GPU launch's (XBLOCK, RBLOCK, num_warps)
    reads: dict[str, int]  # buffer -> bytes read
    writes: dict[str, int]  # buffer -> bytes written

    @property
    def total(self) -> int:
        return self.read + self.written

    @property
    def ratio(self) -> float:
        return self.total / self.ideal if self.ideal else 1.0


@dataclasses.dataclass
class ExternTraffic:
    op: str
    read: int  # the arguments' footprints
    written: int  # the results

    @property
    def total(self) -> int:
        return self.read + self.written


@dataclasses.dataclass
class GraphTraffic:
    """The traffic of one compiled graph."""

    kernels: list[KernelTraffic]
    externs: list[ExternTraffic]
    input_bytes: int  # every graph input the graph reads, once
    output_bytes: int  # every distinct output buffer, once

    @property
    def kernel_bytes(self) -> int:
        return sum(k.total for k in self.kernels)

    @property
    def extern_bytes(self) -> int:
        return sum(e.total for e in self.externs)

    @property
    def total(self) -> int:
        return self.kernel_bytes + self.extern_bytes

    @property
    def minimum(self) -> int:
        return self.input_bytes + self.output_bytes

    @property
    def ratio(self) -> float:
        return self.total / self.minimum if self.minimum else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "kernels": [
                {**dataclasses.asdict(k), "total": k.total, "ratio": k.ratio} for k in self.kernels
            ],
            "externs": [dataclasses.asdict(e) for e in self.externs],
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "kernel_bytes": self.kernel_bytes,
            "extern_bytes": self.extern_bytes,
            "total": self.total,
            "minimum": self.minimum,
            "ratio": self.ratio,
        }


# --------------------------------------------------------------------------- entry point


def analyze_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    persistent_rnumel_max: int | None = None,
) -> GraphTraffic:
    """Lower and schedule `gm` as `compile_graph` does (static sizes: fake or real
    example inputs), generate each kernel's source, and count its traffic. Nothing
    is loaded or run."""
    from .codegen.kernel import generate_kernel
    from .lowering import lower_graph
    from .pipeline import _device, decompose, prepare_inputs
    from .scheduler import PERSISTENT_RNUMEL_MAX, Kernel, schedule

    fake_mode, shape_env, fake_inputs = prepare_inputs(example_inputs)
    gm = decompose(gm, fake_inputs, fake_mode)
    pmax = PERSISTENT_RNUMEL_MAX if persistent_rnumel_max is None else persistent_rnumel_max
    program, ctx = lower_graph(gm, fake_inputs, shape_env, _device(fake_inputs), int(pmax))
    sched = schedule(program, ctx)
    kernels: list[KernelTraffic] = []
    externs: list[ExternTraffic] = []
    for step in sched.steps:
        if isinstance(step, Kernel):
            ks = generate_kernel(step, sched, program.buffers)
            kernels.append(kernel_traffic(step, sched.internal, program, ks))
        else:
            externs.append(extern_traffic(step, program.buffers))
    return GraphTraffic(kernels, externs, _input_bytes(program), _output_bytes(program))


# --------------------------------------------------------------------------- kernels


def kernel_traffic(kernel: Any, internal: set[str], program: Program, ks: Any) -> KernelTraffic:
    """The traffic of one scheduled kernel (`scheduler.Kernel`) with its source `ks`."""
    from .pipeline import kernel_fn_name
    from .runtime.launcher import Launcher
    from .scheduler import RINDEX, XINDEX, load_index, loop_segments
    from .tiling import strides

    bufs = program.buffers
    produced = {n.name for n in kernel.nodes}
    xnumel, rnumel = _int(kernel.xnumel), _int(kernel.rnumel)
    looped = kernel.is_reduction and not kernel.persistent
    segments = loop_segments(kernel) if looped else [list(kernel.nodes)]
    reads: dict[str, int] = {}
    unique: dict[str, int] = {}
    uncoalesced = 0
    for seg in segments:
        seg_reads: dict[str, int] = {}
        seen: set[tuple[str, sympy.Expr]] = set()
        for node in seg:
            p = kernel.placements[node.name]
            contiguous = RINDEX if (p.reduced_space and not ks.outer) else XINDEX
            for ld in _node_loads(node):
                if ld.buf in produced:
                    continue  # in registers
                key = (ld.buf, ld.index)
                if key in seen:
                    continue  # codegen loads it once per scope
                seen.add(key)
                elems = _footprint(ld, node, bufs[ld.buf])
                nbytes = elems * _itemsize(bufs[ld.buf].dtype)
                seg_reads[ld.buf] = seg_reads.get(ld.buf, 0) + nbytes
                if not kernel.is_reduction or p.reduced_space or contiguous is XINDEX:
                    step = strides(load_index(ld, p), XINDEX, RINDEX)
                    st = step[1] if contiguous is RINDEX else step[0]
                    if st not in (0, 1, -1):
                        uncoalesced += nbytes
        for b, n in seg_reads.items():
            cap = _extent(bufs[b]) * _itemsize(bufs[b].dtype)
            reads[b] = reads.get(b, 0) + min(n, cap)
            unique[b] = min(max(unique.get(b, 0), min(n, cap)), cap)
    writes: dict[str, int] = {}
    for node in kernel.nodes:
        if isinstance(node, ScatterNode):
            n = math.prod(_int(s) for s in node.size)
            writes[node.name] = writes.get(node.name, 0) + n * _itemsize(node.body.dtype)
        elif node.name not in internal:
            writes[node.name] = _numel(bufs[node.name]) * _itemsize(bufs[node.name].dtype)
    passes = max((reads[b] / unique[b] for b in reads if unique[b]), default=1.0)
    kind = (
        "scatter"
        if any(isinstance(n, ScatterNode) for n in kernel.nodes)
        else (
            "pointwise" if not kernel.is_reduction else ("persistent" if not looped else "looped")
        )
    )
    lau = Launcher.__new__(Launcher)
    lau.is_reduction, lau.persistent, lau.outer = kernel.is_reduction, kernel.persistent, ks.outer
    return KernelTraffic(
        name=kernel.name,
        fn_name=kernel_fn_name(ks),
        kind=kind,
        xnumel=xnumel,
        rnumel=rnumel,
        nodes=[n.name for n in kernel.nodes],
        origins=sorted({o for n in kernel.nodes for o in getattr(n, "origins", ())}),
        read=sum(reads.values()),
        written=sum(writes.values()),
        ideal=sum(unique.values()) + sum(writes.values()),
        passes=round(passes, 3),
        uncoalesced=uncoalesced,
        loads=ks.source.count("tl.load("),
        int64=".to(tl.int64) * XBLOCK" in ks.source,
        outer=bool(ks.outer),
        config=Launcher.heuristic(lau, xnumel, rnumel),
        reads=reads,
        writes=writes,
    )


def _node_loads(node: Any) -> list[Load]:
    vals: list[Value] = [node.body]
    if isinstance(node, ScatterNode):
        vals += [v for _, v in node.indirect]
    return [u for v in vals for u in _iter_values(v) if isinstance(u, Load)]


def _var_extents(node: Any) -> dict[sympy.Symbol, int]:
    from .ir import index_var

    ext = {index_var("x", k): _int(s) for k, s in enumerate(node.size)}
    if isinstance(node, ReductionNode):
        ext.update({index_var("r", k): _int(s) for k, s in enumerate(node.reduce_size)})
    return ext


def _footprint(ld: Load, node: Any, buf: Buffer) -> int:
    """Distinct elements `ld` can reach in `node`'s loops (at most the buffer's extent)."""
    ext = _var_extents(node)
    deps = set(ld.index.free_symbols)
    for _, iv in ld.indirect:  # a gather reaches as many rows as the index is loaded at
        for u in _iter_values(iv):
            if isinstance(u, Load):
                deps |= u.index.free_symbols
    n = math.prod(ext[s] for s in deps if s in ext)
    return min(n, _extent(buf))


# --------------------------------------------------------------------------- externs, graph


def extern_traffic(step: ExternNode, bufs: dict[str, Buffer]) -> ExternTraffic:
    read = 0
    for a in _leaves((step.args, list(step.kwargs.values()))):
        if isinstance(a, BufferRef):
            view = math.prod(_int(s) for s in a.size) if a.size else 1
            if any(_int(st) == 0 and _int(s) != 1 for s, st in zip(a.size, a.stride)):
                view = 1 + sum((_int(s) - 1) * abs(_int(st)) for s, st in zip(a.size, a.stride))
            read += min(view, _extent(bufs[a.buf])) * _itemsize(bufs[a.buf].dtype)
    written = sum(_numel(bufs[o]) * _itemsize(bufs[o].dtype) for o in step.outputs if o is not None)
    return ExternTraffic(str(step.op), read, written)


def _input_bytes(program: Program) -> int:
    from .ir import node_reads

    used: set[str] = set()
    for n in program.nodes:
        used |= node_reads(n)
    used |= {o for o in program.outputs if isinstance(o, str)}
    return sum(
        _extent(b) * _itemsize(b.dtype)
        for b in program.buffers.values()
        if b.kind == "input" and b.name in used
    )


def _output_bytes(program: Program) -> int:
    names = dict.fromkeys(o for o in program.outputs if isinstance(o, str))
    total = 0
    for k, o in enumerate(program.outputs):
        if not isinstance(o, str) or o not in names:
            continue
        names.pop(o)
        b = program.buffers[o]
        if b.kind == "input":
            continue  # an input returned as it is: nothing written
        view = program.output_views.get(k)
        n = _numel(b) if view is None else math.prod(_int(s) for s in view.size)
        total += n * _itemsize(b.dtype)
    return total


def _leaves(x: Any) -> list[Any]:
    if isinstance(x, list | tuple):
        return [y for e in x for y in _leaves(e)]
    return [x]


def _int(e: Any) -> int:
    e = sympy.sympify(e)
    if not e.is_number:
        raise ValueError(f"traffic counts static sizes only; got {e}")
    return int(e)


def _numel(buf: Buffer) -> int:
    return math.prod(_int(s) for s in buf.size)


def _extent(buf: Buffer) -> int:
    """Elements between the buffer's first and last element (its storage span)."""
    if any(_int(s) == 0 for s in buf.size):
        return 0
    return 1 + sum((_int(s) - 1) * abs(_int(st)) for s, st in zip(buf.size, buf.stride))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype != torch.bool else 1
