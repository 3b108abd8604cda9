"""C source for one fused kernel (see scheduler.Kernel): the CPU's emitter.

The kernel is the scheduler's, the same one the Triton emitter writes: its
nodes, their placements in the (x, r) space, the buffers kept in registers. The
loops are the CPU's (the device description, `devices.py`, gives their sizes):

- a pointwise kernel is two loops, `xo` over the outer part of x and `xi` over
  its innermost extent (the last dims of its first node), so index arithmetic
  splits into a per-row part and a unit-stride part; the outer loop runs on
  OpenMP's threads past `parallel_min_work` elements, the inner one is
  `#pragma omp simd`;
- an *inner* reduction (`x.sum(-1)`) runs one row per iteration of the parallel
  x loop, and each segment of the row (`scheduler.loop_segments`) is one
  `simd` loop over r with the reductions as OpenMP `reduction` clauses; where
  the row is several contiguous runs (a BatchNorm's N x H*W per channel), a loop
  over the runs (`ro`) around a `simd` loop along one (`ri`);
- an *outer* reduction (`x.sum(0)`, `tiling.is_outer`) walks `outer_tile`
  neighbouring outputs side by side: for each r, a `simd` loop over the tile,
  one accumulator per output, so its loads run along contiguous memory; so does
  a reduction whose row is shorter than a vector (`short_row_max`: a 2x2 pooling
  window), which would otherwise run scalar.

A value a kernel produces is a C local: a reduction's result and a kept-space
node's value per row (per tile element in an outer reduction); a reduced-space
pointwise value is computed again where it is read (the Triton kernel keeps it
in registers; here that is the same expression at the same point). Reductions
run in a fixed order (the simd lanes' partial results combined in one order), so
a run repeats bit for bit whatever the thread count. Float16 and bfloat16 are
stored as 16 bits and computed in float32 (`c_ops.py`).

Kernel arguments: pointers (buffers read, then written, named by first use as
the Triton emitter names them, so a repeated kernel has one source), `xnumel`,
`rnumel`, size symbols (int64, float symbols as double), the random seed.
"""

from __future__ import annotations

import re

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from ..devices import DeviceSpec
from ..ir import (
    Buffer,
    Const,
    Expr,
    IndexValue,
    Load,
    Op,
    PointwiseNode,
    Rand,
    ReductionNode,
    ScatterNode,
    Value,
    iter_values,
    loads_of,
)
from ..scheduler import (
    RINDEX,
    XINDEX,
    Kernel,
    Placement,
    Schedule,
    canonical_index,
    kernel_is_outer,
    load_index,
    loop_segments,
    store_index,
)
from .c_ops import C_OPS, CTYPE, HALF, PRELUDE, STORAGE, c_float, c_index, cast, literal
from .kernel import KernelSource, _Scope  # (common subexpressions per loop body)

XO = sympy.Symbol("xo", integer=True, nonnegative=True)
XB = sympy.Symbol("xb", integer=True, nonnegative=True)
XI = sympy.Symbol("xi", integer=True, nonnegative=True)
XV = sympy.Symbol("x", integer=True, nonnegative=True)
RV = sympy.Symbol("r", integer=True, nonnegative=True)
RO = sympy.Symbol("ro", integer=True, nonnegative=True)
RI = sympy.Symbol("ri", integer=True, nonnegative=True)
LOOP_NAMES = {"xo", "xi", "x", "r", "ro", "ri", "x0", "xn", "xb", "xnumel", "rnumel", "seed"}
LOOP_NAMES |= {"XI", "RI"}

Node = PointwiseNode | ReductionNode | ScatterNode
_NAME = re.compile(r"[A-Za-z_]\w*")


def _is_int(e: Expr) -> bool:
    return bool(sympy.sympify(e).is_integer) and bool(sympy.sympify(e).is_nonnegative)


def split_index(
    e: Expr,
    inner: Expr,
    var: sympy.Symbol = XINDEX,
    outer_var: sympy.Symbol = XO,
    inner_var: sympy.Symbol = XI,
) -> Expr:
    """`e` (in `var`, XINDEX by default) with var = xo * inner + xi, 0 <= xi < inner: a
    FloorDiv or ModularIndexing of `var` that falls on the split becomes one of xo or
    of xi (`outer_var`, `inner_var`: the names of xo and xi, for a row's ro and ri)."""

    def go(u: Expr) -> Expr:
        if isinstance(u, FloorDiv | ModularIndexing) and u.args[0] == var:
            d = u.args[1]
            m = u.args[2] if isinstance(u, ModularIndexing) else None
            q = sympy.simplify(d / inner)
            if _is_int(q) and q != 0:
                if m is None:
                    return outer_var if q == 1 else FloorDiv(outer_var, q)
                return ModularIndexing(outer_var, q, m)
            q2 = sympy.simplify(inner / d)
            if _is_int(q2) and q2 != 0:
                lo = inner_var if d == 1 else FloorDiv(inner_var, d)
                if m is None:
                    return outer_var * q2 + lo
                if q2 == m:  # xi // d < inner // d == m
                    return lo
                if _is_int(sympy.simplify(q2 / m)):
                    return ModularIndexing(inner_var, d, m)
                k = sympy.simplify(m / q2)
                if _is_int(k):
                    return ModularIndexing(outer_var, 1, k) * q2 + lo
        if not u.args:
            return u
        args = [go(a) for a in u.args]
        if all(a is b for a, b in zip(args, u.args)):
            return u
        return u.func(*args)

    out = go(canonical_index(e))
    return out.xreplace({var: outer_var * inner + inner_var})


class CKernelCodegen:
    def __init__(
        self, kernel: Kernel, sched: Schedule, buffers: dict[str, Buffer], spec: DeviceSpec
    ) -> None:
        self.k = kernel
        self.sched = sched
        self.buffers = buffers
        self.spec = spec
        self.lines: list[str] = []
        self.indent = 1
        self.tmp = 0
        self.ptr_args: dict[str, str] = {}
        self.produced = {n.name: n for n in kernel.nodes}
        self.registers: dict[str, str] = {}  # produced buffer -> its C variable (per row)
        self.scope = _Scope(None)
        self.symbols: set[sympy.Symbol] = set()
        self.local_names: set[str] = set()
        self.uses_seed = False
        self.has_atomics = False
        # how the kernel's index variables print: XINDEX / RINDEX -> C expressions
        self.x_of: Expr = XV
        self.split_inner: Expr | None = None
        self.r_inner: Expr | None = None  # a row walked as ro * RI + ri (inner reductions)
        self.simd_at: int | None = None  # where a scatter's xi loop gets its simd pragma
        self.tile = False  # an outer reduction's tile: row variables are arrays [xi]
        self.tile_size = spec.outer_tile  # outputs per tile (x = xb * tile_size + xi)
        # Loop-invariant code motion: inside an innermost loop (a pointwise kernel's xi,
        # a row's r), a value that does not move with its variable (`inner`) is computed
        # once before the loop, in the enclosing scope (`hoist`: where its lines go, their
        # indent, that scope), and reused by every later loop over the row
        self.inner: frozenset[sympy.Symbol] | None = None
        self.hoist: tuple[int, int, _Scope] | None = None
        self.moves: dict[str, bool] = {}  # C variable -> whether it moves with `inner`
        # In a tile's loop over r, a value that moves with xi but not with r (a
        # channels-last BatchNorm's per-channel scale: each lane its own channel) is
        # computed once per tile, by a simd loop over xi before the loop over r, into
        # an array the r loop reads (`lanes`: where that loop's declarations and body
        # lines go; None until the first such value)
        self.lanes_open = False
        self.lanes: list[int] | None = None
        self.moves_r: dict[str, bool] = {}  # C variable -> whether it moves with r

    # -- emission helpers --------------------------------------------------
    def line(self, s: str) -> None:
        self.lines.append("    " * self.indent + s)

    def new_var(self, prefix: str = "t") -> str:
        self.tmp += 1
        return f"{prefix}{self.tmp}"

    def assign(self, ctype: str, code: str, key: object = None, moves: bool = True) -> str:
        """A local holding `code` (its common subexpression if there is one); one that does
        not move with the innermost loop's variable is declared before that loop."""
        ckey = ("code", ctype, code)
        hit = self.scope.get(ckey)
        if hit is not None:
            if key is not None:
                self.scope.cache[key] = hit
            return hit
        v = self.new_var()
        scope = self.scope
        moves_r = self.lanes_open and self._moves_r(code)  # only a tile's r loop asks
        if not moves and self.hoist is not None:
            at, indent, scope = self.hoist
            self.lines.insert(at, "    " * indent + f"{ctype} {v} = {code};")
            self.hoist = (at + 1, indent, scope)
            if self.lanes is not None:  # the lanes' loop comes after the tile's invariants
                self.lanes[0] += 1
                self.lanes[1] += 1
        elif moves and not moves_r and self.lanes_open and self.hoist is not None:
            v = self._lane(ctype, v, code)
            scope = self.hoist[2]
        else:
            self.line(f"{ctype} {v} = {code};")
        self.moves[v] = moves
        if self.lanes_open:
            self.moves_r[v] = moves_r
        scope.cache[ckey] = v
        if key is not None:
            scope.cache[key] = v
        return v

    def _lane(self, ctype: str, v: str, code: str) -> str:
        """`code` computed per lane by the tile's loop over xi before its loop over r, into
        the array `v`; the r loop reads `v[xi]`."""
        assert self.hoist is not None
        at, indent, _ = self.hoist
        if self.lanes is None:
            pad = "    " * indent
            self.lines[at:at] = [
                f"{pad}#pragma omp simd",
                f"{pad}for (int64_t xi = 0; xi < xn; xi++) {{",
                f"{pad}}}",
            ]
            self.lanes = [at, at + 2]
        decl, body = self.lanes
        self.lines.insert(decl, "    " * indent + f"{ctype} {v}[{self.tile_size}];")
        self.lines.insert(body + 1, "    " * (indent + 1) + f"{v}[xi] = {code};")
        self.lanes = [decl + 1, body + 2]
        self.moves_r[v] = False
        return f"{v}[xi]"

    def _moves_r(self, code: str) -> bool:
        """Whether C text moves with a row's loop (names `r`, `ro`, `ri`, or a local that
        does)."""
        return any(
            n in ("r", "ro", "ri") or self.moves_r.get(n, False) for n in _NAME.findall(code)
        )

    def open_inner(self, *loop_vars: sympy.Symbol) -> None:
        """The next lines open the innermost loops over `loop_vars` (a row's r; a tile's r
        and xi): hoist to here."""
        self.inner = frozenset(loop_vars)
        self.hoist = (len(self.lines), self.indent, self.scope)

    def close_inner(self) -> None:
        self.inner, self.hoist = None, None
        self.lanes_open, self.lanes = False, None

    def _moves(self, e: Expr) -> bool:
        """Whether an index expression (as `index` prints it) moves with the inner loops."""
        if self.inner is None:
            return True
        fs = self._loop_form(e).free_symbols
        return bool(self.inner & fs) or any(self.moves.get(str(s), False) for s in fs)

    def _code_moves(self, *codes: str | None) -> bool:
        """Whether C text moves with the inner loop: a local that does, or (a compound
        mask, `(t5 && t10)`) any name in it that does."""
        for c in codes:
            if c is None:
                continue
            if c in self.moves:
                if self.moves[c]:
                    return True
                continue
            for name in _NAME.findall(c):
                if self.moves.get(name, False) or (
                    self.inner is not None and any(name == str(v) for v in self.inner)
                ):
                    return True
        return False

    def push(self) -> None:
        self.scope = _Scope(self.scope)

    def pop(self) -> None:
        assert self.scope.parent is not None
        self.scope = self.scope.parent

    def ptr(self, buf: str) -> str:
        if buf not in self.ptr_args:
            out = buf in self.produced
            kind = "out" if out else "in"
            n = sum(1 for b in self.ptr_args if (b in self.produced) == out)
            self.ptr_args[buf] = f"{kind}_ptr{n}"
        return self.ptr_args[buf]

    def _loop_form(self, e: Expr) -> Expr:
        """`e` in the loops' variables (xo/xi, or x/r)."""
        e = canonical_index(e)
        if self.split_inner is not None:
            return split_index(e, self.split_inner)
        if self.tile:
            return split_index(e, sympy.Integer(self.tile_size), XINDEX, XB).xreplace({RINDEX: RV})
        if self.r_inner is not None:
            e = split_index(e, self.r_inner, RINDEX, RO, RI)
        return e.xreplace({XINDEX: self.x_of, RINDEX: RV})

    def index(self, e: Expr) -> str:
        """C text of index `e` (in XINDEX, RINDEX and the kernel's symbols)."""
        e = self._loop_form(e)
        for s in e.free_symbols:
            if str(s) not in LOOP_NAMES and str(s) not in self.local_names:
                self.symbols.add(s)
        return c_index(e)

    def row(self, var: str) -> str:
        """A per-row variable as the current loop reads it."""
        return f"{var}[xi]" if self.tile else var

    # -- values ------------------------------------------------------------
    def value(self, v: Value, p: Placement, mask: str | None) -> str:
        key = (v, p.key(), mask)
        hit = self.scope.get(key)
        if hit is not None:
            return hit
        if isinstance(v, Const):
            return literal(v)
        ct = CTYPE[v.dtype]
        if isinstance(v, IndexValue):
            e = v.expr.xreplace(self._bind(v.indirect, p, mask))
            moves = self._moves(e)
            if v.dtype.is_floating_point and not _is_int(e):
                code = c_float(e.xreplace({XINDEX: self.x_of}))
                for s in e.free_symbols:
                    if str(s) not in LOOP_NAMES and str(s) not in self.local_names:
                        self.symbols.add(s)
            else:
                code = self.index(e)
            return self.assign(ct, cast(f"({code})", torch.int64, v.dtype), key, moves)
        if isinstance(v, Load):
            return self.load(v, p, mask, key)
        if isinstance(v, Rand):
            self.uses_seed = True
            off_e = v.offset.xreplace(p.varmap)
            off = self.index(off_e)
            fn = "st_rand" if v.kind == "rand" else "st_randn"
            code = f"{fn}(seed + {v.stream * 1000003}ULL, (uint32_t)({off}))"
            return self.assign(ct, cast(code, torch.float32, v.dtype), key, self._moves(off_e))
        assert isinstance(v, Op)
        if v.name == "masked":
            cond = self.value(v.args[0], p, mask)
            inner_mask = cond if mask is None else f"({mask} && {cond})"
            inner = self.value(v.args[1], p, inner_mask)
            other = self.value(v.args[2], p, mask)
            code = f"({cond} ? {inner} : {other})"
            return self.assign(ct, code, key, self._code_moves(cond, inner, other, mask))
        args = [self.value(a, p, mask) for a in v.args]
        code = C_OPS[v.name](args, [a.dtype for a in v.args], v.dtype)
        if v.name == "pow" and isinstance(v.args[1], Const) and v.dtype.is_floating_point:
            code = _small_power(args[0], float(v.args[1].value), v.dtype) or code
        if v.dtype in HALF and v.name != "to":  # half math rounds as eager stores it
            code = cast(code, torch.float32, v.dtype)
        return self.assign(ct, code, key, self._code_moves(*args))

    def _bind(
        self, indirect: tuple[tuple[sympy.Symbol, Value], ...], p: Placement, mask: str | None
    ) -> dict[sympy.Symbol, Expr]:
        subs: dict[sympy.Symbol, Expr] = dict(p.varmap)
        for sym, iv in indirect:
            code = self.value(iv, p, mask)
            var = self.assign(
                "int64_t", f"(int64_t)({code})", ("ind", code), self._code_moves(code)
            )
            self.local_names.add(var)
            subs[sym] = sympy.Symbol(var, integer=True)
        return subs

    def load(self, v: Load, p: Placement, mask: str | None, key: object) -> str:
        prod = self.produced.get(v.buf)
        if prod is not None and not isinstance(prod, ScatterNode):
            reg = self.registers.get(v.buf)
            if reg is not None:
                return self.row(reg)
            # a reduced-space value of this kernel: the same expression at this point
            return self.value(prod.body, self.k.placements[prod.name], mask)
        binds = self._bind(v.indirect, p, mask)
        e = v.index.xreplace(binds)
        idx = self.index(e)
        ptr = self.ptr(v.buf)
        buf = self.buffers[v.buf]
        dt = buf.dtype
        moves = self._moves(e) or self._code_moves(mask)
        if v.indirect and _fits_int32(buf) and self._gathers(v, p):
            # gcc vectorizes a gather of 32-bit values through 32-bit offsets, not 64-bit
            # ones (at 256-bit vectors); every valid offset into this buffer fits
            idx = f"(int32_t)({idx})"
        # A masked load of a buffer that has elements reads element 0 where the mask is
        # off, then selects: a load the vectorizer can do for every lane (a gather),
        # where `mask ? p[i] : 0` (which may not touch p[i]) keeps the loop scalar.
        # A buffer that may be empty keeps the conditional form: it has no element 0.
        safe = mask is not None and _nonempty(buf.size)
        raw = f"{ptr}[{mask} ? ({idx}) : 0]" if safe else f"{ptr}[{idx}]"
        code = (
            f"st_bf16_to_f32({raw})"
            if dt == torch.bfloat16
            else f"(float)({raw})"
            if dt == torch.float16
            else raw
        )
        if safe:
            code = self.assign(CTYPE[dt], code, None, moves)
        if mask is not None:
            code = f"({mask} ? {code} : ({CTYPE[dt]})0)"
        return self.assign(CTYPE[v.dtype], cast(code, dt, v.dtype), key, moves)

    def store(self, n: Node, p: Placement, val: str) -> None:
        if n.name in self.sched.internal:
            return
        buf = self.buffers[n.name]
        idx = self.index(store_index(buf, n, p))  # type: ignore[arg-type]
        self.line(f"{self.ptr(n.name)}[{idx}] = {self._to_storage(val, buf.dtype)};")

    def _to_storage(self, val: str, dt: torch.dtype) -> str:
        if dt == torch.bfloat16:
            return f"st_f32_to_bf16({val})"
        return f"({STORAGE[dt]})({val})"

    # -- pointwise kernels -------------------------------------------------
    def pointwise(self) -> None:
        k = self.k
        first = k.nodes[0]
        scatter = isinstance(first, ScatterNode)
        inner = _inner_extent(first.size)
        if inner is not None and not scatter:
            inner = self._contiguous_inner(inner)
        self.line("if (xnumel <= 0) return;")
        if inner is not None and inner != k.xnumel and not scatter:
            self.split_inner = inner
            self.line(f"const int64_t XI = {c_index(inner)};")
            self._note_symbols(inner)
            self.line(f"#pragma omp parallel for if (xnumel >= {self.spec.parallel_min_work})")
            self.line("for (int64_t xo = 0; xo < xnumel / XI; xo++) {")
            self.indent += 1
            self.push()  # what the xi loop hoists (per xo)
            self.open_inner(XI)
            self.line(f"#pragma omp simd{self._wide(inner)}")
            self.line("for (int64_t xi = 0; xi < XI; xi++) {")
        elif scatter and inner is not None and inner != k.xnumel and len(k.nodes) == 1:
            # serial over xo: an accumulating scatter adds in one fixed order (bit for
            # bit); the xi loop is simd where its lanes write distinct elements
            self.split_inner = inner
            self.line(f"const int64_t XI = {c_index(inner)};")
            self._note_symbols(inner)
            self.line("for (int64_t xo = 0; xo < xnumel / XI; xo++) {")
            self.indent += 1
            self.push()
            self.open_inner(XI)
            self.simd_at = len(self.lines)
            self.line("for (int64_t xi = 0; xi < XI; xi++) {")
        elif scatter:
            # serial: an accumulating scatter adds in one fixed order (bit for bit)
            self.line("for (int64_t x = 0; x < xnumel; x++) {")
        else:
            self.line(
                f"#pragma omp parallel for simd{self._wide(k.xnumel)}"
                f" if (xnumel >= {self.spec.parallel_min_work})"
            )
            self.line("for (int64_t x = 0; x < xnumel; x++) {")
        self.indent += 1
        self.push()
        for n in k.nodes:
            p = k.placements[n.name]
            if isinstance(n, ScatterNode):
                self.scatter(n, p)
                continue
            val = self.value(n.body, p, None)
            self.registers[n.name] = val
            self.store(n, p, val)
        self.pop()
        self.indent -= 1
        self.line("}")
        if self.split_inner is not None:
            self.close_inner()
            self.pop()
            self.indent -= 1
            self.line("}")

    def _contiguous_inner(self, inner: Expr) -> Expr:
        """The xi loop's extent: `inner`, or the largest divisor of it (8 at least) under
        which every load and store of the kernel walks memory along xi. A head split
        (`x.view(B, T, H, D).transpose(1, 2)`) reads runs of D inside rows of H*D: a loop
        over the row gathers, a loop over one run loads whole vectors."""
        if not inner.is_number:
            return inner
        exprs: list[Expr] = []
        for n in self.k.nodes:
            p = self.k.placements[n.name]
            exprs += [load_index(ld, p) for ld in loads_of(n.body) if not ld.indirect]
            if isinstance(n, PointwiseNode) and n.name not in self.sched.internal:
                exprs.append(store_index(self.buffers[n.name], n, p))

        def along(c: int) -> bool:
            for e in exprs:
                for u in sympy.preorder_traversal(split_index(e, sympy.Integer(c))):
                    if isinstance(u, FloorDiv | ModularIndexing) and XI in u.free_symbols:
                        return False
            return True

        extent = int(inner)
        for c in sorted((d for d in range(8, extent + 1) if extent % d == 0), reverse=True):
            if along(c):
                return sympy.Integer(c)
        return inner

    def scatter(self, n: ScatterNode, p: Placement) -> None:
        val = self.value(n.body, p, None)
        binds = self._bind(n.indirect, p, None)
        e = n.index.xreplace(binds)
        idx = self.index(e)
        if self.simd_at is not None and self._lanes_apart(e, binds):
            # (the loop's `for` has moved down by the lines hoisted above it since)
            at = next(
                i
                for i in range(self.simd_at, len(self.lines))
                if "for (int64_t xi" in self.lines[i]
            )
            self.lines.insert(at, "    " * (self.indent - 1) + "#pragma omp simd")
        ptr = self.ptr(n.name)
        dt = self.buffers[n.name].dtype
        if n.mode == "add":
            cur = f"{ptr}[{idx}]"
            if dt == torch.bfloat16:
                cur = f"st_bf16_to_f32({cur})"
            total = cast(f"({cur} + {val})", torch.float32 if dt in HALF else dt, dt)
            self.line(f"{ptr}[{idx}] = {self._to_storage(total, dt)};")
        else:
            self.line(f"{ptr}[{idx}] = {self._to_storage(val, dt)};")

    def _lanes_apart(self, e: Expr, binds: dict[sympy.Symbol, Expr]) -> bool:
        """Whether the lanes of the xi loop write distinct elements: the target index is
        `c * xi` (c a nonzero constant) plus what does not move with xi (the indirect
        indices among it computed before the loop)."""
        f = self._loop_form(e)
        if any(
            isinstance(u, FloorDiv | ModularIndexing) and XI in u.free_symbols
            for u in sympy.preorder_traversal(f)
        ):
            return False
        c = sympy.diff(f, XI)
        if not (c.is_Integer and c != 0):
            return False
        ind = {str(v) for k, v in binds.items() if str(k).startswith("ind")}
        return not any(self.moves.get(name, True) for name in ind)

    def _gathers(self, v: Load, p: Placement) -> bool:
        """Whether an indirect index varies from lane to lane of the vector loop. gcc
        sees such a load as a gather even where the bound index is a stride of the lane
        (`2 * xi + r % 2` through a local): it reads loaded values or index values that
        move with the lanes."""
        if self.k.is_reduction and not self.tile:
            lane = RI if self.r_inner is not None else RV
        else:
            lane = XI if (self.tile or self.split_inner is not None) else XV
        for _, bound in v.indirect:
            for u in iter_values(bound):
                if isinstance(u, Load | IndexValue):
                    e = (u.index if isinstance(u, Load) else u.expr).xreplace(p.varmap)
                    if lane in self._loop_form(canonical_index(e)).free_symbols:
                        return True
        return False

    def _note_symbols(self, e: Expr) -> None:
        for s in sympy.sympify(e).free_symbols:
            if str(s) not in LOOP_NAMES:
                self.symbols.add(s)

    # -- reduction kernels -------------------------------------------------
    def reduction(self) -> None:
        k = self.k
        work = f"xnumel * rnumel >= {self.spec.parallel_min_work}"
        if self._tiled():
            t = self.tile_size = self._tile_extent()
            self.tile = True
            self.x_of = XB * t + XI
            self.line(f"#pragma omp parallel for if ({work})")
            self.line(f"for (int64_t xb = 0; xb < (xnumel + {t - 1}) / {t}; xb++) {{")
            self.indent += 1
            self.line(f"const int64_t xn = ST_MIN({t}, xnumel - xb * {t});")
        else:
            self.line(f"#pragma omp parallel for if ({work})")
            self.line("for (int64_t x = 0; x < xnumel; x++) {")
            self.indent += 1
            red = next(n for n in k.nodes if isinstance(n, ReductionNode))
            inner = _inner_extent(red.reduce_size)
            if inner is not None and inner != k.rnumel:
                self.r_inner = inner
                self._note_symbols(inner)
                self.line(f"const int64_t RI = {c_index(inner)};")
        self.push()
        for seg in loop_segments(k, online=False):
            if not k.placements[seg[0].name].reduced_space:
                self.kept(seg[0])
            else:
                self.segment(seg)
        self.pop()
        self.indent -= 1
        self.line("}")

    def _tiled(self) -> bool:
        """Whether the kernel walks `outer_tile` outputs side by side (simd across
        outputs) rather than one row at a time (simd along the row): an outer reduction,
        whose rows are strided, and a row too short to fill a vector (a 2x2 max-pool
        window, a softmax over 4 heads), where a row-wise loop would run scalar."""
        k = self.k
        if k.xnumel == 1:
            return False
        if kernel_is_outer(k):
            return True
        r = sympy.sympify(k.rnumel)
        return bool(r.is_number) and int(r) <= self.spec.short_row_max

    def _tile_extent(self) -> int:
        """Outputs per tile: `outer_tile`, or half of it where that makes more of the
        kernel's indices plain in xi. A 2x2 max-pool's window over a row of 8 outputs
        reads `x % 8` and `x // 8`: with 8 outputs per tile (aligned) those are `xi` and a
        tile constant (a strided load), with 16 a lane-by-lane gather, slow on many
        CPUs; a per-channel parameter `(x // 64) % C` becomes one value per tile."""
        exprs: list[Expr] = []
        for n in self.k.nodes:
            p = self.k.placements[n.name]
            vals = iter_values(n.body)
            exprs += [load_index(ld, p) for ld in vals if isinstance(ld, Load)]
            exprs += [
                canonical_index(v.expr.xreplace(p.varmap))
                for v in vals
                if isinstance(v, IndexValue)
            ]
            if isinstance(n, PointwiseNode | ReductionNode) and n.name not in self.sched.internal:
                exprs.append(store_index(self.buffers[n.name], n, p))

        def gathers(t: int) -> int:
            count = 0
            for e in exprs:
                for u in sympy.preorder_traversal(split_index(e, sympy.Integer(t), XINDEX, XB)):
                    if isinstance(u, FloorDiv | ModularIndexing) and XI in u.free_symbols:
                        count += 1
            return count

        full = self.spec.outer_tile
        half = full // 2
        if half >= 4 and gathers(half) < gathers(full):
            return half
        # An outer reduction at least two tiles wide takes 32 float outputs a tile: each r
        # then reads a whole 128-byte pair of cache lines, which the CPU's adjacent-line
        # prefetch fetches together (with one line a tile, it fetched the next tile's
        # line too, evicted before that tile ran). `x.sum(0)` of 8192 x 128, one thread:
        # 0.21 to 0.13 ms
        x = sympy.sympify(self.k.xnumel)
        wide = 2 * full
        if (
            kernel_is_outer(self.k)
            and x.is_number
            and int(x) >= wide
            and gathers(wide) <= gathers(full)
        ):
            return wide
        return full

    def _row_loop(self) -> None:
        """Open a loop over the tile's outputs (an outer reduction only)."""
        self.line("#pragma omp simd")
        self.line("for (int64_t xi = 0; xi < xn; xi++) {")
        self.indent += 1

    def kept(self, n: Node) -> None:
        """A node of the kept space: one value per row."""
        p = self.k.placements[n.name]
        var = self.new_var("row")
        if self.tile:
            self.line(f"{CTYPE[n.body.dtype]} {var}[{self.tile_size}];")
            self._row_loop()
        self.push()
        val = self.value(n.body, p, None)
        if self.tile:
            self.line(f"{var}[xi] = {val};")
        else:
            self.line(f"const {CTYPE[n.body.dtype]} {var} = {val};")
        self.registers[n.name] = var
        self.store(n, p, self.row(var))
        self.pop()
        if self.tile:
            self.indent -= 1
            self.line("}")

    def segment(self, seg: list[Node]) -> None:
        """One loop over the row: its pointwise nodes stored, its reductions accumulated."""
        reds = [n for n in seg if isinstance(n, ReductionNode)]
        accs = {n.name: _Acc(self, n) for n in reds}
        for a in accs.values():
            a.declare()
        if self.tile:
            self.open_inner(XI, RV)  # what is the same for the whole tile: once, before r
            self.lanes_open = True  # what is the same along r: once per lane, before r
            self.line("for (int64_t r = 0; r < rnumel; r++) {")
            self.indent += 1
            self._row_loop()
        else:
            clauses = " ".join(c for a in accs.values() for c in a.clauses())
            simd = all(a.vectorizes for a in accs.values())
            self.open_row(clauses if simd else None)
        self.push()
        for n in seg:
            p = self.k.placements[n.name]
            if isinstance(n, ReductionNode):
                accs[n.name].update(self.value(n.body, p, None))
            else:
                val = self.value(n.body, p, None)
                self.store(n, p, val)
        self.pop()
        if self.tile:
            self.close_inner()
            self.indent -= 1
            self.line("}")
            self.indent -= 1
            self.line("}")
        else:
            self.close_row()
        for n in reds:
            accs[n.name].finish()

    def _wide(self, trip: Expr) -> str:
        """The simdlen clause of a simd loop of `trip` iterations: the CPU's widest
        vectors (`ST_WIDE` lanes: 16 where there is AVX-512) for a long loop, whose
        transcendental math then runs half as many vector instructions; none for a short
        one (a row of 32 runs as four 8-lane vectors, not two 16-lane ones and a tail)."""
        t = sympy.sympify(trip)
        if t.is_number and int(t) < self.spec.wide_loop_min:
            return ""
        return " simdlen(ST_WIDE)"

    def open_row(self, clauses: str | None) -> None:
        """Open a loop over the row (`r`), its body at the next line: one loop, or, where
        the row's last dims are a contiguous run (`r_inner`), a loop over runs (`ro`) and
        a loop within one (`ri`), whose loads then run along memory. The innermost loop
        is `omp simd` with `clauses` (None: not simd). `r` is defined either way (an
        arg-reduction's index)."""
        trip = self.r_inner if self.r_inner is not None else self.k.rnumel
        pragma = None if clauses is None else f"#pragma omp simd{self._wide(trip)} {clauses}"
        pragma = pragma.rstrip() if pragma else None
        if self.r_inner is None:
            self.open_inner(RV)
            if pragma:
                self.line(pragma)
            self.line("for (int64_t r = 0; r < rnumel; r++) {")
            self.indent += 1
            return
        self.line("for (int64_t ro = 0; ro < rnumel / RI; ro++) {")
        self.indent += 1
        self.push()  # what the ri loop hoists (per ro)
        self.open_inner(RI)
        if pragma:
            self.line(pragma)
        self.line("for (int64_t ri = 0; ri < RI; ri++) {")
        self.indent += 1
        self.line("const int64_t r = ro * RI + ri;")

    def close_row(self) -> None:
        self.close_inner()
        self.indent -= 1
        self.line("}")
        if self.r_inner is not None:
            self.pop()
            self.indent -= 1
            self.line("}")

    def finish(self) -> KernelSource:
        k = self.k
        reads = [b for b in self.ptr_args if b not in self.produced]
        writes = [b for b in self.ptr_args if b in self.produced]
        syms = sorted(self.symbols - {XINDEX, RINDEX}, key=str)
        for e in (k.xnumel, k.rnumel):
            for s in sympy.sympify(e).free_symbols:
                if s not in syms:
                    syms.append(s)
        params = [
            f"{'const ' if b in reads else ''}{STORAGE[self.buffers[b].dtype]}* {self.ptr_args[b]}"
            for b in reads + writes
        ]
        params += ["int64_t xnumel_", "int64_t rnumel_"]
        params += [f"{'int64_t' if s.is_integer else 'double'} {s}" for s in syms]
        if self.uses_seed:
            params.append("uint64_t seed")
        head = f"void {k.name}({', '.join(params)}) {{"
        # static sizes are constants of the source: the compiler unrolls a short row and
        # needs no loop tail (the arguments stay, so every kernel has one signature)
        sizes = [
            f"    const int64_t {n} = {int(e) if sympy.sympify(e).is_number else n + '_'};"
            for n, e in (("xnumel", k.xnumel), ("rnumel", k.rnumel))
        ]
        src = "\n".join([head, *sizes, *self.lines, "}"]) + "\n"
        return KernelSource(
            name=k.name,
            source=src,
            pointer_args=reads + writes,
            size_args=syms,
            uses_seed=self.uses_seed,
            xnumel=k.xnumel,
            rnumel=k.rnumel,
            persistent=k.persistent,
            is_reduction=k.is_reduction,
            has_atomics=self.has_atomics,
            outer=k.is_reduction and kernel_is_outer(k),
        )


def _fits_int32(buf: Buffer) -> bool:
    """Whether every element offset of `buf` (static sizes and strides) fits an int32."""
    extent = 1
    for d, st in zip(buf.size, buf.stride):
        d, st = sympy.sympify(d), sympy.sympify(st)
        if not (d.is_number and st.is_number):
            return False
        if int(d) == 0:
            return True
        extent += (int(d) - 1) * abs(int(st))
    return extent < 2**31


def _nonempty(size: tuple[Expr, ...]) -> bool:
    """Whether a buffer of `size` surely has an element (static sizes, none zero)."""
    return all(sympy.sympify(d).is_number and int(d) > 0 for d in size)


def _small_power(x: str, e: float, dtype: torch.dtype) -> str | None:
    """`x ** e` for the exponents eager's CPU pow computes without `pow` (its
    pow_tensor_scalar kernel: products, a square root, reciprocals), or None."""
    sqrt = "sqrt" if dtype == torch.float64 else "sqrtf"
    forms = {
        1.0: f"({x})",
        2.0: f"(({x}) * ({x}))",
        3.0: f"(({x}) * ({x}) * ({x}))",
        0.5: f"{sqrt}({x})",
        -0.5: f"(1 / {sqrt}({x}))",
        -1.0: f"(1 / ({x}))",
        -2.0: f"(1 / (({x}) * ({x})))",
    }
    return forms.get(e)


def _inner_extent(size: tuple[Expr, ...]) -> Expr | None:
    """The innermost extent a pointwise kernel's xi loop walks: the last dim of its
    first node, or the last few when those are short (a loop of at least 16 when the
    sizes are static). None: one flat loop."""
    inner: Expr = sympy.Integer(1)
    for s in reversed(size):
        inner = inner * s
        if not inner.is_number or int(inner) >= 16:
            break
    if inner == 1:
        return None
    return inner


class _Acc:
    """One reduction's accumulator in a segment loop: its declaration, its update per
    element, and its result per row (`CKernelCodegen.registers`)."""

    def __init__(self, g: CKernelCodegen, n: ReductionNode) -> None:
        self.g, self.n = g, n
        self.t = n.reduce_type
        self.dt = n.body.dtype
        self.ct = CTYPE[self.dt] if self.t not in ("any", "all") else "int"
        self.var = g.new_var("acc")
        self.vectorizes = self.t not in ("argmax", "argmin")
        # an arg-reduction's index: 32 bits where the row is known to be shorter than
        # 2**31, so that it fills the lanes of a float's vector (a tile's pool windows)
        r = sympy.sympify(g.k.rnumel)
        self.idx_ct = "int32_t" if r.is_number and int(r) < 2**31 else "int64_t"

    def _ident(self) -> str:
        t, dt = self.t, self.dt
        if t in ("sum", "welford_mean", "welford_m2", "any"):
            return "0"
        if t in ("prod", "all"):
            return "1"
        big = "INFINITY" if dt.is_floating_point else None
        if t in ("max", "argmax"):
            lo = (
                f"(-({self.ct}){big})"
                if big
                else str(torch.iinfo(dt).min if dt != torch.bool else 0)
            )
            return lo if lo != str(-(2**63)) else "INT64_MIN"
        if t in ("min", "argmin"):
            return (
                f"(({self.ct}){big})"
                if big
                else str(torch.iinfo(dt).max if dt != torch.bool else 1)
            )
        raise ValueError(t)

    def _decl(self, name: str, ct: str, init: str) -> None:
        g = self.g
        if g.tile:
            t = g.tile_size
            g.line(f"{ct} {name}[{t}];")
            g.line(f"for (int64_t xi = 0; xi < {t}; xi++) {name}[xi] = {init};")
        else:
            g.line(f"{ct} {name} = {init};")

    def declare(self) -> None:
        self._decl(self.var, self.ct, self._ident())
        if self.t in ("max", "min") and self.dt.is_floating_point:
            self._decl(self.var + "_nan", "int", "0")
        if self.t in ("argmax", "argmin"):
            self._decl(self.var + "_idx", self.idx_ct, "-1")

    def clauses(self) -> list[str]:
        t, v = self.t, self.var
        op = {"sum": "+", "welford_mean": "+", "welford_m2": "+", "prod": "*", "any": "|"}
        op |= {"all": "&", "max": "max", "min": "min"}
        if t not in op:
            return []
        out = [f"reduction({op[t]}:{v})"]
        if t in ("max", "min") and self.dt.is_floating_point:
            out.append(f"reduction(|:{v}_nan)")
        return out

    def update(self, val: str) -> None:
        g, t = self.g, self.t
        a = g.row(self.var)
        if t in ("sum", "welford_mean", "welford_m2"):
            g.line(f"{a} = {a} + {val};")
        elif t == "prod":
            g.line(f"{a} = {a} * {val};")
        elif t == "any":
            g.line(f"{a} = {a} | (({val}) != 0);")
        elif t == "all":
            g.line(f"{a} = {a} & (({val}) != 0);")
        elif t in ("max", "min"):
            cmp = ">" if t == "max" else "<"
            g.line(f"{a} = ({val}) {cmp} {a} ? ({val}) : {a};")
            if self.dt.is_floating_point:
                # a select, not `nan | (val != val)`: gcc vectorizes a loop that also
                # holds an argmax's selects only this way (a max-pool with its indices)
                nan = g.row(self.var + "_nan")
                g.line(f"{nan} = (({val}) != ({val})) ? 1 : {nan};")
        else:  # argmax / argmin: the first best, the first NaN wins
            cmp = ">" if t == "argmax" else "<"
            i = g.row(self.var + "_idx")
            better = f"({val}) {cmp} {a} || {i} < 0"
            if self.dt.is_floating_point:
                better += f" || (({val}) != ({val}) && {a} == {a})"
            take = g.assign("bool", f"{better}")
            g.line(f"{a} = {take} ? ({val}) : {a};")
            g.line(f"{i} = {take} ? ({self.idx_ct})r : {i};")

    def finish(self) -> None:
        """The row's result: a per-row variable, stored unless it stays in the kernel."""
        g, n, t = self.g, self.n, self.t
        res = g.new_var("red")
        rct = CTYPE[n.dtype]
        p = g.k.placements[n.name]
        kept = Placement({k: e for k, e in p.varmap.items() if str(k).startswith("x")}, False)
        if g.tile:
            g.line(f"{rct} {res}[{g.tile_size}];")
            g._row_loop()
        a = g.row(self.var)
        if t == "welford_m2":
            mean = g.new_var("mean")
            g.line(f"const {self.ct} {mean} = {a} / ({self.ct})rnumel;")
            if g.tile:  # the deviations: a second pass over the row
                g.indent -= 1
                g.line("}")
                m2 = g.new_var("m2")
                self._decl(m2, self.ct, "0")
                g.line(f"{self.ct} {mean}s[{g.tile_size}];")
                g._row_loop()
                g.line(f"{mean}s[xi] = {a} / ({self.ct})rnumel;")
                g.indent -= 1
                g.line("}")
                g.line("for (int64_t r = 0; r < rnumel; r++) {")
                g.indent += 1
                g._row_loop()
                g.push()
                v = g.value(n.body, p, None)
                g.line(f"const {self.ct} d = {v} - {mean}s[xi];")
                g.line(f"{m2}[xi] = {m2}[xi] + d * d;")
                g.pop()
                g.indent -= 1
                g.line("}")
                g.indent -= 1
                g.line("}")
                g._row_loop()
                code = f"{m2}[xi]"
            else:
                m2 = g.new_var("m2")
                g.line(f"{self.ct} {m2} = 0;")
                g.open_row(f"reduction(+:{m2})")
                g.push()
                v = g.value(n.body, p, None)
                g.line(f"const {self.ct} d = {v} - {mean};")
                g.line(f"{m2} = {m2} + d * d;")
                g.pop()
                g.close_row()
                code = m2
        elif t == "welford_mean":
            code = f"{a} / ({self.ct})rnumel"
        elif t in ("max", "min") and self.dt.is_floating_point:
            code = f"{g.row(self.var + '_nan')} ? ({self.ct})NAN : {a}"
        elif t in ("argmax", "argmin"):
            i = g.row(self.var + "_idx")
            code = f"{i} < 0 ? 0 : {i}"
        elif t in ("any", "all"):
            code = f"({a} != 0)"
        else:
            code = a
        if g.tile:
            g.line(f"{res}[xi] = {cast(code, self.dt, n.dtype)};")
        else:
            g.line(f"const {rct} {res} = {cast(code, self.dt, n.dtype)};")
        g.registers[n.name] = res
        g.store(n, kept, g.row(res))
        if g.tile:
            g.indent -= 1
            g.line("}")


def generate_c_kernel(
    kernel: Kernel, sched: Schedule, buffers: dict[str, Buffer], spec: DeviceSpec
) -> KernelSource:
    g = CKernelCodegen(kernel, sched, buffers, spec)
    if kernel.is_reduction:
        g.reduction()
    else:
        g.pointwise()
    return g.finish()


def kernel_file_source(ks: KernelSource, fn_name: str) -> str:
    """A kernel's C file: the prelude and the kernel, exported as `fn_name`."""
    body = ks.source.replace(f"void {ks.name}(", f"void {fn_name}(", 1)
    return PRELUDE + "\n" + body
