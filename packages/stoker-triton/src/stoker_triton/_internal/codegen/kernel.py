"""Triton source for one fused kernel (see scheduler.Kernel).

Layout of a generated kernel: pointer arguments (buffers read, then buffers
written), `xnumel`, `rnumel`, size symbols, the random seed, and the
`XBLOCK`/`RBLOCK` constexprs. A pointwise kernel is 1-D over x; a reduction
kernel is 2-D `[XBLOCK, RBLOCK]`: persistent kernels hold the whole row,
looped kernels walk it in `RBLOCK` chunks, one loop per *segment* of nodes
that do not need a reduction finished in the same segment.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch

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
    online_softmax_max,
    store_index,
)
from .ops import OPS, TL_DTYPE, is_literal, literal, print_index


@dataclasses.dataclass
class KernelSource:
    """Generated source and the calling convention of one kernel."""

    name: str
    source: str
    pointer_args: list[str]  # buffer names, in argument order
    size_args: list[sympy.Symbol]  # size symbols, in argument order
    uses_seed: bool
    xnumel: Expr
    rnumel: Expr
    persistent: bool
    is_reduction: bool
    has_atomics: bool
    outer: bool = False  # an outer reduction (`tiling.is_outer`): the launcher's outer tiles


class _Scope:
    def __init__(self, parent: _Scope | None) -> None:
        self.parent = parent
        self.cache: dict[Any, str] = {}

    def get(self, key: Any) -> str | None:
        s: _Scope | None = self
        while s is not None:
            if key in s.cache:
                return s.cache[key]
            s = s.parent
        return None


class KernelCodegen:
    def __init__(
        self, kernel: Kernel, sched: Schedule, buffers: dict[str, Buffer], int64: bool
    ) -> None:
        self.k = kernel
        self.sched = sched
        self.buffers = buffers
        self.int64 = int64
        self.lines: list[str] = []
        self.indent = 1
        self.tmp = 0
        self.ptr_args: dict[str, str] = {}  # buffer -> arg name
        self.registers: dict[str, str] = {}  # buffer produced in this kernel -> var
        self.scope = _Scope(None)
        self.kernel_scope = self.scope
        self.uses_seed = False
        self.has_atomics = False
        self.symbols: set[sympy.Symbol] = set()
        self.produced = {n.name for n in kernel.nodes}
        self.local_names: set[str] = set()  # kernel variables used inside index expressions

    # -- emission helpers --------------------------------------------------
    def line(self, s: str) -> None:
        self.lines.append("    " * self.indent + s)

    def new_var(self, prefix: str = "tmp") -> str:
        self.tmp += 1
        return f"{prefix}{self.tmp}"

    def assign(self, code: str, key: Any = None, prefix: str = "tmp") -> str:
        ckey = ("code", code)
        hit = self.scope.get(key) if key is not None else None
        hit = hit or self.scope.get(ckey)
        if hit is not None:
            if key is not None:
                self.scope.cache[key] = hit
            return hit
        v = self.new_var(prefix)
        self.line(f"{v} = {code}")
        self.scope.cache[ckey] = v
        if key is not None:
            self.scope.cache[key] = v
        return v

    def ptr(self, buf: str) -> str:
        """The pointer argument of `buf`, named by the order of first use, not by the
        buffer: a kernel that recurs (a model's layers, a forward's in its backward,
        another graph's) has one source, hence one module and one compile."""
        if buf not in self.ptr_args:
            kind = "out" if buf in self.produced else "in"
            n = sum(1 for b in self.ptr_args if (b in self.produced) == (kind == "out"))
            self.ptr_args[buf] = f"{kind}_ptr{n}"
        return self.ptr_args[buf]

    def index_code(self, e: Expr) -> str:
        e = canonical_index(e)
        for s in e.free_symbols:
            if s not in (XINDEX, RINDEX) and str(s) not in self.local_names:
                self.symbols.add(s)
        return print_index(e)

    # -- values ----------------------------------------------------------
    def value(self, v: Value, p: Placement, mask: str, shape_r: bool) -> str:
        key = (v, p.key(), mask)
        hit = self.scope.get(key)
        if hit is not None:
            return hit
        if isinstance(v, Const):
            return literal(v)
        if isinstance(v, IndexValue):
            e = v.expr.xreplace(self._bind(v.indirect, p, mask, shape_r))
            code = self.index_code(e)
            code = self._broadcast(code, e, shape_r)
            return self.assign(f"({code}).to({TL_DTYPE[v.dtype]})", key)
        if isinstance(v, Load):
            return self.load(v, p, mask, shape_r, key)
        if isinstance(v, Rand):
            self.uses_seed = True
            off = self.index_code(v.offset.xreplace(p.varmap))
            off = self._broadcast(off, v.offset.xreplace(p.varmap), shape_r)
            fn = "tl.rand" if v.kind == "rand" else "tl.randn"
            return self.assign(f"{fn}(seed + {v.stream * 1000003}, ({off}).to(tl.uint32))", key)
        assert isinstance(v, Op)
        if v.name == "masked":
            cond = self.value(v.args[0], p, mask, shape_r)
            inner = self.value(v.args[1], p, f"{mask} & {cond}", shape_r)
            return self.assign(
                f"tl.where({cond}, {inner}, {self.value(v.args[2], p, mask, shape_r)})", key
            )
        args = [self.value(a, p, mask, shape_r) for a in v.args]
        code = OPS[v.name](args, [a.dtype for a in v.args], v.dtype)
        return self.assign(code, key)

    def _bind(
        self,
        indirect: tuple[tuple[sympy.Symbol, Value], ...],
        p: Placement,
        mask: str,
        shape_r: bool,
    ) -> dict[sympy.Symbol, Expr]:
        """The placement's index variables, and each ``ind*`` symbol of ``indirect`` bound
        to a local holding its value as int64."""
        subs: dict[sympy.Symbol, Expr] = dict(p.varmap)
        for sym, iv in indirect:
            code = self.value(iv, p, mask, shape_r)
            var = self.assign(f"({code}).to(tl.int64)", ("ind", code))
            self.local_names.add(var)
            subs[sym] = sympy.Symbol(var, integer=True)
        return subs

    def _broadcast(self, code: str, e: Expr, shape_r: bool) -> str:
        """Give an index expression the full block shape."""
        fs = e.free_symbols
        if XINDEX not in fs:
            code = f"{code} + 0 * xindex"
        if shape_r and RINDEX not in fs:
            code = f"{code} + 0 * rindex"
        return code

    def load(self, v: Load, p: Placement, mask: str, shape_r: bool, key: Any) -> str:
        if v.buf in self.produced:
            return self.registers[v.buf]
        e = v.index.xreplace(self._bind(v.indirect, p, mask, shape_r))
        idx = self.index_code(e)
        ptr = self.ptr(v.buf)
        narrow = self._narrow_load(e, mask, shape_r)
        if narrow is not None:
            # a per-row (or per-column) operand of a reduction's tile: loaded once per
            # row as [XBLOCK, 1] (or [1, RBLOCK]) and broadcast by the arithmetic, not
            # once per element of the [XBLOCK, RBLOCK] tile
            idx, mask = narrow
        else:
            idx = self._broadcast(idx, e, shape_r)
        return self.assign(f"tl.load({ptr} + ({idx}), {mask}, other=0)", key)

    def _narrow_load(self, e: Expr, mask: str, shape_r: bool) -> tuple[str, str] | None:
        """(index, mask) of a load in a reduction's [XBLOCK, RBLOCK] space whose index
        moves along one axis only: its own block shape and that axis's mask. None for a
        full-tile load, a load with a compound mask, or an index through loaded values
        (a gather's row, whose shape is its own)."""
        if not shape_r or mask != "xrmask":
            return None
        fs = e.free_symbols
        if any(str(s) in self.local_names for s in fs):
            return None
        has_x, has_r = XINDEX in fs, RINDEX in fs
        if has_x and has_r:
            return None
        code = self.index_code(e)
        if has_r:
            return code, "rmask"
        return (code if has_x else f"{code} + 0 * xindex"), "xmask"

    # -- kernel body -----------------------------------------------------
    def generate(self) -> KernelSource:
        k = self.k
        red = k.is_reduction
        xoff = (
            "tl.program_id(0).to(tl.int64) * XBLOCK" if self.int64 else "tl.program_id(0) * XBLOCK"
        )
        self.line(f"xoffset = {xoff}")
        if red:
            self.line("xindex = xoffset + tl.arange(0, XBLOCK)[:, None]")
        else:
            self.line("xindex = xoffset + tl.arange(0, XBLOCK)")
        self.line("xmask = xindex < xnumel")
        if red and k.persistent:
            self.line("rindex = tl.arange(0, RBLOCK)[None, :]")
            self.line("rmask = rindex < rnumel")
            self.line("xrmask = xmask & rmask")
            for n in k.nodes:
                self.node(n, looped=False)
        elif red:
            self.looped_body()
        else:
            for n in k.nodes:
                self.node(n, looped=False)
        return self.finish()

    def looped_body(self) -> None:
        """One loop over r per segment (`scheduler.loop_segments`)."""
        for seg in loop_segments(self.k):
            if len(seg) == 1 and not self.k.placements[seg[0].name].reduced_space:
                self.node(seg[0], looped=False)
                continue
            reds = [n for n in seg if isinstance(n, ReductionNode)]
            online = {n.name: online_softmax_max(self.k, n) for n in reds}
            accs = {
                n.name: self.online_init(n) if online[n.name] else self.acc_init(n) for n in reds
            }
            self.line("for roffset in range(0, rnumel, RBLOCK):")
            self.indent += 1
            self.scope = _Scope(self.kernel_scope)
            self.line("rindex = roffset + tl.arange(0, RBLOCK)[None, :]")
            self.line("rmask = rindex < rnumel")
            self.line("xrmask = xmask & rmask")
            for n in seg:
                m = online.get(n.name)
                if m is not None and isinstance(n, ReductionNode):
                    self.online_update(n, m, accs[n.name])
                elif isinstance(n, ReductionNode):
                    self.acc_update(n, accs[n.name])
                else:
                    self.node(n, looped=True)
            self.indent -= 1
            self.scope = self.kernel_scope
            for n in reds:
                m = online[n.name]
                if m is not None:
                    self.online_finish(n, m, accs[n.name])
                else:
                    self.acc_finish(n, accs[n.name])

    # -- online softmax: sum(exp(v - max(v))) in the loop that finds the max --
    def online_init(self, n: ReductionNode) -> tuple[str, str]:
        dt = TL_DTYPE[n.body.dtype]
        mx, sm = self.new_var("omax"), self.new_var("osum")
        self.line(f"{mx} = tl.full([XBLOCK, RBLOCK], float('-inf'), {dt})")
        self.line(f"{sm} = tl.zeros([XBLOCK, RBLOCK], {dt})")
        return mx, sm

    def online_update(self, n: ReductionNode, m: ReductionNode, acc: tuple[str, str]) -> None:
        """Per lane: the running max and the sum of exp(v - running max), the
        sum rescaled when the max grows. A NaN or +inf makes NaN as in eager;
        a lane whose max is still -inf (masked or -inf elements) adds 0 and
        rescales by exactly 1 (never -inf - -inf)."""
        mx, sm = acc
        p = self.k.placements[n.name]
        v = self.value(m.body, p, "xrmask", True)
        vm, nm = self.new_var("ov"), self.new_var("onew")
        self.line(f"{vm} = tl.where(xrmask, {v}, float('-inf'))")
        self.line(f"{nm} = tl.where(({vm} > {mx}) | ({vm} != {vm}), {vm}, {mx})")
        scale = f"tl.where({mx} == {nm}, 1.0, tl.exp({mx} - {nm}))"
        term = f"tl.where({nm} == float('-inf'), 0.0, tl.exp({vm} - {nm}))"
        self.line(f"{sm} = {sm} * {scale} + {term}")
        self.line(f"{mx} = {nm}")

    def online_finish(self, n: ReductionNode, m: ReductionNode, acc: tuple[str, str]) -> None:
        mx, sm = acc
        best = self.registers[m.name]  # the row max (m finishes first: it comes first)
        var = self.new_var("red")
        scaled = f"tl.where({mx} == {best}, {sm}, {sm} * tl.exp({mx} - {best}))"
        self.line(f"{var} = tl.sum({scaled}, 1)[:, None]")
        self.registers[n.name] = var
        p = self.k.placements[n.name]
        self.store(
            n,
            Placement({k: e for k, e in p.varmap.items() if str(k).startswith("x")}, False),
            var,
            "xmask",
        )

    def node(self, n: Any, looped: bool) -> None:
        p = self.k.placements[n.name]
        red = self.k.is_reduction
        mask = "xrmask" if (red and p.reduced_space) else "xmask"
        if isinstance(n, ReductionNode):
            self.persistent_reduction(n, p)
            return
        val = self.value(n.body, p, mask, red and p.reduced_space)
        if isinstance(n, ScatterNode):
            self.scatter(n, p, val)
            return
        if looped is False or p.reduced_space:
            self.registers[n.name] = val
        self.store(n, p, val, mask)

    def store(self, n: Any, p: Placement, val: str, mask: str) -> None:
        if n.name in self.sched.internal:
            return
        buf = self.buffers[n.name]
        e = store_index(buf, n, p)
        idx = self._broadcast(self.index_code(e), e, self.k.is_reduction and p.reduced_space)
        if is_literal(val):
            val = (
                f"tl.full([XBLOCK], {val}, {TL_DTYPE[buf.dtype]})"
                if not self.k.is_reduction
                else f"tl.full([XBLOCK, 1], {val}, {TL_DTYPE[buf.dtype]})"
            )
        self.line(f"tl.store({self.ptr(n.name)} + ({idx}), {val}, {mask})")

    def scatter(self, n: ScatterNode, p: Placement, val: str) -> None:
        e = n.index.xreplace(self._bind(n.indirect, p, "xmask", False))
        idx = self._broadcast(self.index_code(e), e, False)
        ptr = self.ptr(n.name)
        if is_literal(val):
            val = f"tl.full([XBLOCK], {val}, {TL_DTYPE[n.body.dtype]})"
        if n.mode == "add":
            self.has_atomics = True
            self.line(f"tl.atomic_add({ptr} + ({idx}), {val}, xmask)")
        else:
            self.line(f"tl.store({ptr} + ({idx}), {val}, xmask)")

    # -- reductions --------------------------------------------------------
    def _ident(self, n: ReductionNode) -> str:
        dt = n.body.dtype
        t = n.reduce_type
        if t in ("sum", "welford_mean", "welford_m2", "any"):
            return "0"
        if t in ("prod", "all"):
            return "1"
        if t in ("max", "argmax"):
            return (
                "float('-inf')"
                if dt.is_floating_point
                else str(torch.iinfo(dt).min if dt != torch.bool else 0)
            )
        if t in ("min", "argmin"):
            return (
                "float('inf')"
                if dt.is_floating_point
                else str(torch.iinfo(dt).max if dt != torch.bool else 1)
            )
        raise ValueError(t)

    def _maxmin_reduce(self, n: ReductionNode, t: str, x: str) -> str:
        if n.body.dtype.is_floating_point:  # NaN propagates, as in eager
            return f"tl.reduce({x}, 1, _{t}_nan)"
        return f"tl.{t}({x}, 1)"

    def _arg_hit(self, n: ReductionNode, v: str, best: str) -> str:
        """Where `v` equals the row's `best` (a NaN `best` matches only NaNs, as in eager)."""
        if n.body.dtype.is_floating_point:
            return f"(({v} == {best}) | (({v} != {v}) & ({best} != {best})))"
        return f"({v} == {best})"

    def persistent_reduction(self, n: ReductionNode, p: Placement) -> None:
        t = n.reduce_type
        v = self.value(n.body, p, "xrmask", True)
        ident = self._ident(n)
        masked = self.assign(f"tl.where(xrmask, {v}, {ident})")
        if t == "sum":
            res = self.assign(f"tl.sum({masked}, 1)[:, None]")
        elif t == "prod":
            res = self.assign(f"tl.reduce({masked}, 1, _prod_combine)[:, None]")
        elif t in ("max", "min"):
            res = self.assign(f"{self._maxmin_reduce(n, t, masked)}[:, None]")
        elif t == "any":
            res = self.assign(f"(tl.max(({masked} != 0).to(tl.int32), 1) != 0)[:, None]")
        elif t == "all":
            res = self.assign(f"(tl.min(({masked} != 0).to(tl.int32), 1) != 0)[:, None]")
        elif t in ("argmax", "argmin"):
            best = self.assign(f"{self._maxmin_reduce(n, t[3:], masked)}[:, None]")
            big = "9223372036854775807"
            hit = self._arg_hit(n, masked, best)
            cand = self.assign(
                f"tl.where(xrmask & {hit}, (rindex + 0 * xindex).to(tl.int64), {big})"
            )
            res = self.assign(f"tl.min({cand}, 1)[:, None]")
        elif t in ("welford_mean", "welford_m2"):
            mean = self.assign(f"(tl.sum({masked}, 1)[:, None] / rnumel)", key=("wmean", masked))
            if t == "welford_mean":
                res = mean
            else:
                d = self.assign(f"tl.where(xrmask, {v} - {mean}, 0.0)", key=("wdev", masked))
                res = self.assign(f"tl.sum({d} * {d}, 1)[:, None]", key=("wm2", masked))
        else:
            raise ValueError(t)
        self.registers[n.name] = res
        self.store(
            n,
            Placement({k: e for k, e in p.varmap.items() if str(k).startswith("x")}, False),
            res,
            "xmask",
        )

    def acc_init(self, n: ReductionNode) -> Any:
        t = n.reduce_type
        # bool rows accumulate in int32 (the identity 0/1 promotes every update to
        # it; a loop-carried int1 that turns int32 is refused), stored as bool
        boolish = t in ("any", "all") or n.body.dtype == torch.bool
        dt = TL_DTYPE[torch.int32 if boolish else n.body.dtype]
        ident = self._ident(n)
        body_key = (n.body, self.k.placements[n.name].key())
        if t in ("welford_mean", "welford_m2"):
            hit = self.kernel_scope.get(("welford", body_key))
            if hit is not None:
                return ("shared", hit)
            names = (self.new_var("wmean"), self.new_var("wm2"), self.new_var("wcount"))
            for nm in names:
                self.line(f"{nm} = tl.zeros([XBLOCK, RBLOCK], {dt})")
            self.kernel_scope.cache[("welford", body_key)] = names  # type: ignore[assignment]
            return ("own", names)
        acc = self.new_var("acc")
        self.line(f"{acc} = tl.full([XBLOCK, RBLOCK], {ident}, {dt})")
        if t in ("argmax", "argmin"):
            idx = self.new_var("accidx")
            self.line(f"{idx} = tl.full([XBLOCK, RBLOCK], 9223372036854775807, tl.int64)")
            return (acc, idx)
        return acc

    def acc_update(self, n: ReductionNode, acc: Any) -> None:
        t = n.reduce_type
        p = self.k.placements[n.name]
        v = self.value(n.body, p, "xrmask", True)
        ident = self._ident(n)
        if t in ("welford_mean", "welford_m2"):
            kind, names = acc
            if kind == "shared":
                return
            mean, m2, w = names
            self.line(f"{w} = {w} + xrmask.to({w}.dtype)")
            self.line(f"delta = tl.where(xrmask, {v} - {mean}, 0.0)")
            self.line(f"{mean} = {mean} + delta / tl.where({w} == 0.0, 1.0, {w})")
            self.line(f"{m2} = {m2} + tl.where(xrmask, delta * ({v} - {mean}), 0.0)")
            return
        masked = f"tl.where(xrmask, {v}, {ident})"
        if t == "sum":
            self.line(f"{acc} = {acc} + {masked}")
        elif t == "prod":
            self.line(f"{acc} = {acc} * {masked}")
        elif t in ("max", "min"):
            if n.body.dtype.is_floating_point:  # NaN wins, as in eager
                cmp = ">" if t == "max" else "<"
                self.line(f"m = {masked}")
                self.line(f"{acc} = tl.where((m {cmp} {acc}) | (m != m), m, {acc})")
            else:
                self.line(f"{acc} = tl.{t}imum({acc}, {masked})")
        elif t == "any":
            self.line(f"{acc} = tl.maximum({acc}, tl.where(xrmask, ({v} != 0).to(tl.int32), 0))")
        elif t == "all":
            self.line(f"{acc} = tl.minimum({acc}, tl.where(xrmask, ({v} != 0).to(tl.int32), 1))")
        else:  # argmax / argmin: keep the first best per lane
            a, i = acc
            cmp = ">" if t == "argmax" else "<"
            m = self.new_var("m")
            self.line(f"{m} = {masked}")
            # the lane's first element is always taken (an all -inf row for argmax still
            # has index 0); later ones only when strictly better, so ties keep the first.
            # Floats: the first NaN wins and stays, as in eager.
            better = f"({m} {cmp} {a}) | ({i} == 9223372036854775807)"
            if n.body.dtype.is_floating_point:
                better += f" | (({m} != {m}) & ({a} == {a}))"
            self.line(f"take = xrmask & ({better})")
            self.line(f"{a} = tl.where(take, {m}, {a})")
            self.line(f"{i} = tl.where(take, (rindex + 0 * xindex).to(tl.int64), {i})")

    def acc_finish(self, n: ReductionNode, acc: Any) -> None:
        t = n.reduce_type
        p = self.k.placements[n.name]
        if t in ("welford_mean", "welford_m2"):
            _, names = acc
            key = ("welford_done", names)
            done = self.kernel_scope.get(key)
            if done is None:
                mean, m2, w = names
                mr, m2r = self.new_var("mean"), self.new_var("m2")
                self.line(f"{mr}, {m2r}, _ = tl.reduce(({mean}, {m2}, {w}), 1, _welford_combine)")
                done = f"{mr}[:, None]|{m2r}[:, None]"
                self.kernel_scope.cache[key] = done
            parts = done.split("|")
            res = parts[0] if t == "welford_mean" else parts[1]
        elif t == "sum":
            res = f"tl.sum({acc}, 1)[:, None]"
        elif t == "prod":
            res = f"tl.reduce({acc}, 1, _prod_combine)[:, None]"
        elif t in ("max", "min"):
            res = f"{self._maxmin_reduce(n, t, acc)}[:, None]"
        elif t == "any":
            res = f"(tl.max({acc}, 1) != 0)[:, None]"
        elif t == "all":
            res = f"(tl.min({acc}, 1) != 0)[:, None]"
        else:
            a, i = acc
            best = self.new_var("best")
            self.line(f"{best} = {self._maxmin_reduce(n, t[3:], a)}[:, None]")
            hit = self._arg_hit(n, a, best)
            res = f"tl.min(tl.where({hit}, {i}, 9223372036854775807), 1)[:, None]"
        var = self.new_var("red")
        self.line(f"{var} = {res}")
        self.registers[n.name] = var
        self.store(
            n,
            Placement({k: e for k, e in p.varmap.items() if str(k).startswith("x")}, False),
            var,
            "xmask",
        )

    def finish(self) -> KernelSource:
        k = self.k
        reads = [b for b in self.ptr_args if b not in self.produced]
        writes = [b for b in self.ptr_args if b in self.produced]
        syms = sorted(self.symbols - {XINDEX, RINDEX}, key=str)
        for e in (k.xnumel, k.rnumel):
            for s in sympy.sympify(e).free_symbols:
                if s not in syms:
                    syms.append(s)
        params = (
            [self.ptr_args[b] for b in reads + writes]
            + ["xnumel", "rnumel"]
            + [str(s) for s in syms]
        )
        if self.uses_seed:
            params.append("seed")
        params += ["XBLOCK: tl.constexpr", "RBLOCK: tl.constexpr"]
        head = ["@triton.jit", f"def {k.name}({', '.join(params)}):"]
        body = self.lines or ["    pass"]
        src = "\n".join(head + body) + "\n"
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


def _loads(n: Any) -> list[Load]:
    vals: list[Value] = [n.body]
    if isinstance(n, ScatterNode):
        vals += [v for _, v in n.indirect]
    return [u for v in vals for u in iter_values(v) if isinstance(u, Load)]


def generate_kernel(kernel: Kernel, sched: Schedule, buffers: dict[str, Buffer]) -> KernelSource:
    int64 = False
    for n in kernel.nodes:
        for b in {n.name} | {ld.buf for ld in _loads(n)}:
            buf = buffers[b]
            extent = sum(
                ((s - 1) * abs(st) for s, st in zip(buf.size, buf.stride)), sympy.Integer(1)
            )
            if not (extent.is_number and extent < 2**31):
                int64 = True
    for e in (kernel.xnumel, kernel.rnumel):
        if not (sympy.sympify(e).is_number and e * 1 < 2**31):
            int64 = True
    return KernelCodegen(kernel, sched, buffers, int64).generate()


__all__ = ["PointwiseNode", "generate_kernel", "load_index"]
