"""Scheduling and fusion: group IR nodes into kernels.

A kernel iterates an (x, r) space: `xnumel` rows by `rnumel` reduced
elements (`rnumel == 1`: a pointwise kernel). A node joins a kernel when it
*fits* the space (a pointwise node whose dims split into a prefix of product
xnumel and a suffix of product rnumel, or whose numel is xnumel; a reduction
with the same outer and reduced numel) and every buffer it reads that the
kernel itself produces is read at exactly the index it was stored at, so the
value passes in registers (reduction results always can; a pointwise result
of the reduced space only in a persistent kernel). Nodes are placed greedily
in program order into the earliest kernel at or after their last producer;
scatters and extern calls are steps of their own. Buffers produced and read
only inside one kernel are never stored (`Schedule.internal`); the others
are freed after their last reader (`Schedule.last_use`).

A reduction kernel is persistent (the row in registers, read once) when its
row fits (`PERSISTENT_RNUMEL_MAX`), unless one loop would read it once
anyway (`_single_pass`); a looped kernel runs one loop per segment
(`loop_segments`), softmax's max and sum in one (`online_softmax_max`).
docs/triton.md "Reduction tiling" has the rules.

Imports the IR and `tiling.py`; never `lowering/` (the lowering's context comes
in as `SizeGuards`, the size questions the scheduler asks of it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Protocol

import sympy
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from .ir import (
    Buffer,
    Expr,
    ExternNode,
    Load,
    Node,
    Op,
    PointwiseNode,
    Program,
    ReductionNode,
    ScatterNode,
    contiguous_strides,
    index_var,
    loads_of,
    node_reads,
    node_writes,
    product,
)
from .tiling import decompose, is_outer

XINDEX = sympy.Symbol("xindex", integer=True, nonnegative=True)
RINDEX = sympy.Symbol("rindex", integer=True, nonnegative=True)

# The largest reduction kept whole in registers (one block per row); above
# it a kernel loops over the row. 8192 float32 with 16 warps is 16 registers
# per live row value per thread (Inductor keeps such rows too).
PERSISTENT_RNUMEL_MAX = 8192
# A persistent kernel that would read its input once anyway (one loop) loops
# over rows longer than this: same traffic, a smaller tile (and, for outer
# reductions, a tile that can span the contiguous kept dim).
LOOP_SINGLE_PASS_ABOVE = 1024


@dataclasses.dataclass
class Placement:
    """Where a node's index variables sit in its kernel's (x, r) space."""

    varmap: dict[sympy.Symbol, Expr]  # node var -> expression in xindex/rindex
    reduced_space: bool  # the node iterates r (a reduction, or pointwise over x*r)

    def key(self) -> tuple[tuple[str, str], ...]:
        k = self.__dict__.get("_key")
        if k is None:
            k = tuple(sorted((str(a), str(b)) for a, b in self.varmap.items()))
            self.__dict__["_key"] = k
        return k  # type: ignore[no-any-return]


@dataclasses.dataclass
class Kernel:
    name: str
    nodes: list[PointwiseNode | ReductionNode | ScatterNode]
    xnumel: Expr
    rnumel: Expr
    persistent: bool
    placements: dict[str, Placement]

    @property
    def is_reduction(self) -> bool:
        return bool(self.rnumel != 1)

    def __str__(self) -> str:
        kind = (
            "pointwise"
            if not self.is_reduction
            else ("persistent" if self.persistent else "looped")
        )
        names = ", ".join(n.name for n in self.nodes)
        return f"{self.name}: {kind} [{self.xnumel} x {self.rnumel}] <- {names}"


Step = Kernel | ExternNode


@dataclasses.dataclass
class Schedule:
    steps: list[Step]
    internal: set[str]  # buffers that live only in registers
    last_use: dict[str, int]  # buffer -> index of the last step that reads it
    outputs: set[str]

    def as_text(self) -> str:
        lines = []
        for i, s in enumerate(self.steps):
            lines.append(f"[{i}] {s}")
        lines.append(f"internal (never stored): {sorted(self.internal)}")
        return "\n".join(lines)


def _unnest(e: Expr) -> Expr:
    """Digits of digits as digits of the index (static divisors only):
    ``FloorDiv(MI(F, a, m), b)`` is ``MI(F, a*b, m/b)`` and ``MI(MI(F, a, m), b, n)``
    is ``MI(F, a*b, min(m/b, n))`` where b divides m and one of m/b, n divides the
    other (what a flattened row's inner digit becomes after a view splits it)."""

    def num(*xs: Any) -> bool:
        return all(sympy.sympify(x).is_Integer for x in xs)

    def fix(u: Expr) -> Expr:
        if isinstance(u, FloorDiv | ModularIndexing) and isinstance(u.args[0], ModularIndexing):
            f, a, m = u.args[0].args
            b = u.args[1]
            if num(a, m, b) and int(m) % int(b) == 0:
                q = int(m) // int(b)
                if isinstance(u, FloorDiv):
                    return ModularIndexing(f, a * b, q)
                n = u.args[2]
                if num(n) and (q % int(n) == 0 or int(n) % q == 0):
                    return ModularIndexing(f, a * b, min(q, int(n)))
        return u

    if not e.has(ModularIndexing):
        return e
    return e.replace(lambda u: isinstance(u, FloorDiv | ModularIndexing), fix)


def simplify_index(e: Expr) -> Expr:
    """Fold `m*FloorDiv(F, d*m) + ModularIndexing(F, d, m)` into `FloorDiv(F, d)`, and
    `m*ModularIndexing(F, d*m, n) + ModularIndexing(F, d, m)` into
    `ModularIndexing(F, d, m*n)` (what decomposing and re-flattening contiguous dims
    produces: `r % 16 + 16 * (r // 16 % 16)` is `r % 256`)."""
    e = _unnest(e)
    for _ in range(8):
        if not isinstance(e, sympy.Add):
            return e
        terms = list(e.args)
        changed = False
        for i, t in enumerate(terms):
            coeff, rest = t.as_coeff_Mul()
            if not isinstance(rest, ModularIndexing):
                continue
            base, div, mod = rest.args
            for j, u in enumerate(terms):
                if j == i:
                    continue
                c2, r2 = u.as_coeff_Mul()
                if isinstance(r2, sympy.Mul):
                    # symbolic multiplier: c2 * (m * FloorDiv(...))
                    fl = [a for a in r2.args if isinstance(a, FloorDiv)]
                    if len(fl) != 1:
                        continue
                    mult = c2 * sympy.Mul(*[a for a in r2.args if a is not fl[0]])
                    r2 = fl[0]
                else:
                    mult = c2
                if (
                    isinstance(r2, FloorDiv | ModularIndexing)
                    and r2.args[0] == base
                    and sympy.simplify(r2.args[1] - div * mod) == 0
                    and sympy.simplify(mult - coeff * mod) == 0
                ):
                    if isinstance(r2, ModularIndexing):  # two neighbouring digits: one
                        new = coeff * ModularIndexing(base, div, mod * r2.args[2])
                    else:
                        new = coeff * (base if div == 1 else FloorDiv(base, div))
                    terms = [x for k, x in enumerate(terms) if k not in (i, j)] + [new]
                    changed = True
                    break
            if changed:
                break
        if not changed:
            return e
        e = sympy.Add(*terms)
    return e


@functools.lru_cache(maxsize=1 << 16)
def canonical_index(e: Expr) -> Expr:
    """`simplify_index(sympy.expand(e))`, memoized: the same index expressions
    recur across the nodes and kernels of a graph (and the layers of a model)."""
    return simplify_index(sympy.expand(e))


def place(
    node: PointwiseNode | ReductionNode | ScatterNode, xnumel: Expr, rnumel: Expr
) -> Placement | None:
    """Fit `node` into the (xnumel, rnumel) space, or None."""

    def eq(a: Expr, b: Expr) -> bool:
        return bool(a == b or sympy.simplify(a - b) == 0)

    if isinstance(node, ReductionNode):
        if not (eq(product(node.size), xnumel) and eq(product(node.reduce_size), rnumel)):
            return None
        vm: dict[sympy.Symbol, Expr] = {}
        for k, e in enumerate(decompose(XINDEX, node.size)):
            vm[index_var("x", k)] = e
        for k, e in enumerate(decompose(RINDEX, node.reduce_size)):
            vm[index_var("r", k)] = e
        return Placement(vm, True)
    size = node.size
    order = node.order if isinstance(node, PointwiseNode) else None
    if eq(product(size), xnumel):
        if order is not None:  # the flat index walks the stored layout (memory order)
            walk = decompose(XINDEX, [size[d] for d in order])
            return Placement({index_var("x", d): e for d, e in zip(order, walk)}, False)
        return Placement(
            {index_var("x", k): e for k, e in enumerate(decompose(XINDEX, size))}, False
        )
    if rnumel == 1 or isinstance(node, ScatterNode) or order is not None:
        return None
    for k in range(len(size) + 1):
        if eq(product(size[:k]), xnumel) and eq(product(size[k:]), rnumel):
            vm = {index_var("x", i): e for i, e in enumerate(decompose(XINDEX, size[:k]))}
            for i, e in enumerate(decompose(RINDEX, size[k:])):
                vm[index_var("x", k + i)] = e
            return Placement(vm, True)
    return None


def store_index(buf: Buffer, node: PointwiseNode | ReductionNode, p: Placement) -> Expr:
    flat = sum((index_var("x", k) * st for k, st in enumerate(buf.stride)), sympy.Integer(0))
    return canonical_index(flat.xreplace(p.varmap))


def load_index(ld: Load, p: Placement) -> Expr:
    return canonical_index(ld.index.xreplace(p.varmap))


def _fits(
    kernel: Kernel,
    node: PointwiseNode | ReductionNode,
    p: Placement,
    buffers: dict[str, Buffer],
) -> bool:
    produced = {n.name: n for n in kernel.nodes}
    for ld in _all_loads(node):
        prod = produced.get(ld.buf)
        if prod is None:
            continue
        if isinstance(prod, ScatterNode) or ld.indirect:
            return False
        pp = kernel.placements[prod.name]
        if (
            isinstance(prod, PointwiseNode)
            and pp.reduced_space
            and (not kernel.persistent or not p.reduced_space)
        ):
            return False
        if isinstance(prod, ReductionNode) or not pp.reduced_space:
            pass
        si = store_index(buffers[prod.name], prod, pp)
        li = load_index(ld, p)
        if not (si == li or sympy.expand(si - li) == 0):
            return False
    return True


def _all_loads(node: Node) -> list[Load]:
    if isinstance(node, ExternNode):
        return []
    out = loads_of(node.body)
    if isinstance(node, ScatterNode):
        for _, v in node.indirect:
            out += loads_of(v)
    return out


class SizeGuards(Protocol):
    """What `schedule` asks of the lowering's context (`LoweringContext`): size
    conditions decided, symbolic ones guarded, and the persistent-row limit."""

    @property
    def persistent_rnumel_max(self) -> int | None: ...

    def guard_true(self, cond: sympy.Basic, why: str) -> bool: ...

    def statically_known(self, cond: sympy.Basic) -> bool: ...


def schedule(program: Program, ctx: SizeGuards) -> Schedule:
    steps: list[Step] = []
    writer: dict[str, int] = {}  # buffer -> step index of its last writer
    nk = 0

    def new_kernel(node: PointwiseNode | ReductionNode | ScatterNode) -> Kernel:
        nonlocal nk
        if isinstance(node, ReductionNode):
            x, r = product(node.size), product(node.reduce_size)
            # (None: a device that walks every row with loops, the CPU: no row is too long)
            persistent = ctx.persistent_rnumel_max is None or ctx.guard_true(
                sympy.Le(r, ctx.persistent_rnumel_max),
                "a reduction row fits one block (persistent reduction)",
            )
        else:
            x, r, persistent = product(node.size), sympy.Integer(1), True
        k = Kernel(f"kernel{nk}", [], x, r, persistent, {})
        nk += 1
        return k

    # a repeated region's copies (`Program.barriers`, lowering/regions.py): a node joins a kernel
    # of an earlier copy only when that kernel computes what it reads, or when what it
    # reads comes from the copy just before its own (a block's head fused into the last
    # kernels of the block before it): never a kernel of a copy it has nothing to do with
    barriers, floor, prev = list(program.barriers), 0, 0
    for i, node in enumerate(program.nodes):
        while barriers and barriers[0] <= i:
            prev, floor = floor, len(steps)
            barriers.pop(0)
        if isinstance(node, ExternNode):
            steps.append(node)
            for w in node_writes(node):
                writer[w] = len(steps) - 1
            continue
        reads = node_reads(node)
        producers = {writer[b] for b in reads if b in writer}
        dep = max(producers, default=-1)
        placed = False
        if not isinstance(node, ScatterNode):
            for si in range(max(dep, 0), len(steps)):
                step = steps[si]
                if si < floor and dep < prev and si not in producers:
                    continue
                if not isinstance(step, Kernel) or any(
                    isinstance(n, ScatterNode) for n in step.nodes
                ):
                    continue
                if (step.is_reduction or isinstance(node, ReductionNode)) and not _shares_data(
                    step, reads, writer
                ):
                    continue
                if _try_add(step, node, program.buffers):
                    writer[node.name] = si
                    placed = True
                    break
                # a pointwise kernel can turn into a reduction kernel
                if (
                    isinstance(node, ReductionNode)
                    and not step.is_reduction
                    and _connected([*step.nodes, node])
                ):
                    cand = new_kernel(node)
                    cand.name = step.name
                    if all(_try_add(cand, n, program.buffers) for n in step.nodes) and _try_add(
                        cand, node, program.buffers
                    ):
                        steps[si] = cand
                        writer[node.name] = si
                        placed = True
                        nk -= 1
                        break
                    nk -= 1
        if not placed:
            k = new_kernel(node)
            ok = _try_add(k, node, program.buffers)
            assert ok, f"node {node.name} does not fit its own kernel"
            steps.append(k)
            writer[node.name] = len(steps) - 1

    for step in steps if ctx.persistent_rnumel_max is not None else ():
        if isinstance(step, Kernel) and step.persistent and step.is_reduction:
            small = ctx.statically_known(sympy.Le(step.rnumel, LOOP_SINGLE_PASS_ABOVE))
            if (not small or kernel_is_outer(step)) and _single_pass(step):
                step.persistent = False

    # which buffers must exist in memory
    out_bufs = {o for o in program.outputs if isinstance(o, str)}
    last_use: dict[str, int] = {}
    readers: dict[str, set[int]] = {}
    for i, step in enumerate(steps):
        nodes: Sequence[Node] = step.nodes if isinstance(step, Kernel) else [step]
        for n in nodes:
            # sorted: `last_use`'s order is the order the wrapper frees buffers in, and a
            # set's order changes with PYTHONHASHSEED (one wrapper source per process)
            for b in sorted(node_reads(n)):
                readers.setdefault(b, set()).add(i)
                last_use[b] = i
        if isinstance(step, Kernel):
            for n in step.nodes:
                if isinstance(n, ScatterNode):
                    readers.setdefault(n.name, set()).add(i)
                    last_use[n.name] = max(last_use.get(n.name, i), i)
    internal: set[str] = set()
    for i, step in enumerate(steps):
        if isinstance(step, Kernel):
            for n in step.nodes:
                if isinstance(n, ScatterNode) or n.name in out_bufs:
                    continue
                if readers.get(n.name, set()) <= {i}:
                    internal.add(n.name)
    return Schedule(steps, internal, last_use, out_bufs)


def _shares_data(kernel: Kernel, reads: set[str], writer: dict[str, int]) -> bool:
    """Whether a node reading `reads` shares data with `kernel`: reads a buffer the kernel
    produces or reads too, or one an earlier step wrote beside a buffer the kernel reads
    (the weight's and the bias's gradient partials of one norm, written by one kernel).
    A reduction kernel takes only such nodes: fusing one that shares nothing saves no
    memory traffic, only a launch, and mixes in one tile loads contiguous along
    different axes (the backward's first outer reduction took every layer's copies of
    saved attention inputs, each read across its rows, uncoalesced). Unrelated
    pointwise work still shares a pointwise kernel (a launch less)."""
    mine = {writer[b] for b in reads if b in writer}
    for n in kernel.nodes:
        theirs = node_reads(n)
        if n.name in reads or theirs & reads or mine & {writer[b] for b in theirs if b in writer}:
            return True
    return False


def _connected(nodes: Sequence[PointwiseNode | ReductionNode | ScatterNode]) -> bool:
    """Whether `nodes` form one group through the buffers they share (one reads what
    another writes or reads): a pointwise kernel holding unrelated pointwise work
    becomes a reduction kernel only if all of it is related to the reduction."""
    reads = [node_reads(n) | {n.name} for n in nodes]
    group, todo = {0}, [0]
    while todo:
        i = todo.pop()
        for j in range(len(nodes)):
            if j not in group and reads[i] & reads[j]:
                group.add(j)
                todo.append(j)
    return len(group) == len(nodes)


def _try_add(
    kernel: Kernel, node: PointwiseNode | ReductionNode | ScatterNode, buffers: dict[str, Buffer]
) -> bool:
    if isinstance(node, ScatterNode):
        if kernel.nodes:
            return False
        p = place(node, kernel.xnumel, kernel.rnumel)
        if p is None:
            return False
        kernel.nodes.append(node)
        kernel.placements[node.name] = p
        return True
    if any(isinstance(n, ScatterNode) for n in kernel.nodes):
        return False
    p = place(node, kernel.xnumel, kernel.rnumel)
    if p is None or not _fits(kernel, node, p, buffers):
        return False
    kernel.nodes.append(node)
    kernel.placements[node.name] = p
    return True


def online_softmax_max(kernel: Kernel, n: Node) -> ReductionNode | None:
    """The max reduction `m` when `n` is `sum(exp(v - m))` over the same row and
    `m = max(v)` (softmax, log-softmax, logsumexp): a loop computes both at
    once with a running max that rescales the running sum (online softmax)."""
    if not (isinstance(n, ReductionNode) and n.reduce_type == "sum"):
        return None
    b = n.body
    if isinstance(b, Op) and b.name == "to" and len(b.args) == 1:
        b = b.args[0]
    if not (isinstance(b, Op) and b.name == "exp" and isinstance(b.args[0], Op)):
        return None
    sub = b.args[0]
    if sub.name != "sub" or not isinstance(sub.args[1], Load):
        return None
    m = next((k for k in kernel.nodes if k.name == sub.args[1].buf), None)
    if not (
        isinstance(m, ReductionNode)
        and m.reduce_type == "max"
        and m.body == sub.args[0]
        and m.body.dtype.is_floating_point
        and kernel.placements[m.name].key() == kernel.placements[n.name].key()
        and load_index(sub.args[1], kernel.placements[n.name])
        == store_index_of_reduction(m, kernel.placements[m.name])
    ):
        return None
    return m


def store_index_of_reduction(m: ReductionNode, p: Placement) -> Expr:
    flat = sum(
        (index_var("x", k) * st for k, st in enumerate(contiguous_strides(m.size))),
        sympy.Integer(0),
    )
    return canonical_index(flat.xreplace(p.varmap))


def loop_segments(
    kernel: Kernel, online: bool = True
) -> list[list[PointwiseNode | ReductionNode | ScatterNode]]:
    """A looped kernel's nodes in the order it runs them: each segment of
    reduced-space nodes is one loop over the row (a node that reads a reduction
    finished in the current loop starts the next; with `online`, the sum of an
    online softmax does not); a kept-space node is a segment of its own, outside
    any loop."""
    segments: list[list[PointwiseNode | ReductionNode | ScatterNode]] = []
    cur: list[PointwiseNode | ReductionNode | ScatterNode] = []
    cur_red: set[str] = set()
    for n in kernel.nodes:
        if not kernel.placements[n.name].reduced_space:
            if cur:
                segments.append(cur)
            segments.append([n])
            cur, cur_red = [], set()
            continue
        reads = {ld.buf for ld in _all_loads(n)}
        m = online_softmax_max(kernel, n) if online else None
        if m is not None and m.name in cur_red:
            reads -= {m.name}
        if reads & cur_red:
            segments.append(cur)
            cur, cur_red = [], set()
        cur.append(n)
        if isinstance(n, ReductionNode):
            cur_red.add(n.name)
    if cur:
        segments.append(cur)
    return segments


def _single_pass(kernel: Kernel) -> bool:
    """Whether `kernel` run as a looped kernel would loop over the row once and
    needs nothing a looped kernel cannot do (a reduced-space pointwise result
    read by another node lives only in a persistent kernel's registers)."""
    loops = [s for s in loop_segments(kernel) if kernel.placements[s[0].name].reduced_space]
    if len(loops) > 1:
        return False
    red_pw = {
        n.name
        for n in kernel.nodes
        if isinstance(n, PointwiseNode) and kernel.placements[n.name].reduced_space
    }
    return not any({ld.buf for ld in _all_loads(n)} & red_pw for n in kernel.nodes)


def kernel_is_outer(kernel: Kernel) -> bool:
    """Whether most loads of the rows a kernel reduces (buffers it does not
    produce, read in the reduced space) step by one along x, not along r."""
    produced = {n.name for n in kernel.nodes}
    idx = [
        load_index(ld, kernel.placements[n.name])
        for n in kernel.nodes
        if kernel.placements[n.name].reduced_space
        for ld in _all_loads(n)
        if ld.buf not in produced
    ]
    return is_outer(idx, XINDEX, RINDEX)
