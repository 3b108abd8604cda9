"""The generated Python wrapper: binds size symbols, checks input layouts,
allocates buffers, launches kernels and extern calls in schedule order,
frees (or reuses) buffers after their last use, and returns the outputs.

The source is plain Python kept in the cache dir; `make_call(launchers,
consts)` returns `call(args)`.
"""

from __future__ import annotations

import builtins
import functools
import symtable
from typing import Any

import sympy
import torch

from ..ir import Buffer, BufferRef, ExternNode, Program, ScatterNode, SymRef
from ..scheduler import Kernel, Schedule
from . import reuse
from .kernel import KernelSource
from .ops import IndexPrinter

_FREED = ("kernel", "extern", "input")  # buffer kinds the wrapper deletes after their last use


class PyPrinter(IndexPrinter):
    def _print_Max(self, e: Any) -> str:
        return "max(" + ", ".join(self._print(a) for a in e.args) + ")"

    def _print_Min(self, e: Any) -> str:
        return "min(" + ", ".join(self._print(a) for a in e.args) + ")"


_py = PyPrinter()


def py(e: Any) -> str:
    """`e` (an int or a sympy expression) as Python source."""
    try:
        return _py_memo(e)
    except TypeError:  # unhashable
        return str(_py.doprint(sympy.sympify(e)))


@functools.lru_cache(maxsize=1 << 14, typed=True)
def _py_memo(e: Any) -> str:
    # (memoized: a deep graph's buffers repeat the same sizes; typed: `1`, `True`, `1.0`
    # and `Integer(1)` are equal keys that print differently)
    return str(_py.doprint(sympy.sympify(e)))


def _tuple(xs: Any) -> str:
    return _tuple_memo(tuple((type(x), x) for x in xs))


@functools.lru_cache(maxsize=1 << 14)
def _tuple_memo(xs: tuple[tuple[type, Any], ...]) -> str:
    items = [py(x) for _, x in xs]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


class WrapperCodegen:
    def __init__(
        self,
        program: Program,
        sched: Schedule,
        kernels: dict[str, KernelSource],
        output_kind: str,
        launch: str = "triton",
    ) -> None:
        self.p = program
        # "triton": `kernel.go(target, tensors...)` through a `Launcher`; "c": the kernel
        # is a C function called with its buffers' data pointers (`runtime/cload.py`)
        self.launch = launch
        self.s = sched
        self.kernels = kernels
        self.output_kind = output_kind  # "tuple" | "list" | "single"
        self.lines: list[str] = []
        self.consts: list[Any] = []
        # `extern_args`: buffers an extern reads whose result may alias them (a view op,
        # an op of unknown kind): never handed to a later allocation, as the result may
        # still see them. `fresh_results`: extern results in new memory, which may be.
        self.extern_args: set[str] = set()
        self.fresh_results: set[str] = set()
        for step in sched.steps:
            if isinstance(step, ExternNode):
                if returns_fresh(step.op):
                    self.fresh_results |= {o for o in step.outputs if o is not None}
                else:
                    self.extern_args |= _refs(step.args) | _refs(list(step.kwargs.values()))
        # one empty tensor per dtype, whose `new_empty_strided` allocates a buffer (its
        # dtype and device are the prototype's: no keyword arguments parsed per call)
        self.protos: dict[torch.dtype, str] = {}  # dtype -> the line making its prototype

    def const(self, obj: Any) -> str:
        for i, c in enumerate(self.consts):
            if c is obj:
                return f"C{i}"
        self.consts.append(obj)
        return f"C{len(self.consts) - 1}"

    def alloc(self, buf: Buffer) -> str:
        """The line allocating `buf` (uninitialized, its size and stride). On a device
        with an index (or the CPU), through its dtype's prototype: half the CPU cost of
        `empty_strided(size, stride, dtype=, device=)`; else the current device's."""
        size, stride = _tuple(buf.size), _tuple(buf.stride)
        dev = self.p.device
        if dev.type != "cpu" and dev.index is None:
            return (
                f"{buf.name} = empty_strided({size}, {stride}, "
                f"dtype={self.const(buf.dtype)}, device={self.const(dev)})"
            )
        if buf.dtype not in self.protos:
            dtype, device = self.const(buf.dtype), self.const(dev)
            self.protos[buf.dtype] = f"P{len(self.protos)} = prototype({dtype}, {device})"
        proto = self.protos[buf.dtype].split(" ", 1)[0]
        return f"{buf.name} = {proto}.new_empty_strided({size}, {stride})"

    def emit(self, s: str, indent: int = 2) -> None:
        self.lines.append("    " * indent + s)

    def arg(self, a: Any) -> str:
        if isinstance(a, BufferRef):
            buf = self.p.buffers[a.buf]
            if a.size == buf.size and a.stride == buf.stride and a.offset == 0:
                return a.buf
            return f"as_strided({a.buf}, {_tuple(a.size)}, {_tuple(a.stride)}, {a.buf}.storage_offset() + {py(a.offset)})"
        if isinstance(a, SymRef):
            return py(a.expr)
        if isinstance(a, list):
            return "[" + ", ".join(self.arg(x) for x in a) + "]"
        if isinstance(a, tuple):
            return "(" + "".join(self.arg(x) + ", " for x in a) + ")"
        if a is None or isinstance(a, bool | int | str):
            return repr(a)
        if isinstance(a, float):
            return repr(a) if a == a and abs(a) != float("inf") else f"float('{a}')"
        return self.const(a)

    def emit_layout_check(self, name: str, fix: str) -> None:
        """The layout the kernels were generated for: the strides compared inline (the
        steady case: equal, no call), the helper `fix` called only when they differ
        (it copies, or accepts a difference in a size-1 dim). A 0-dim tensor has none."""
        b = self.p.buffers[name]
        if len(b.size) == 0:
            return
        size, stride = _tuple(b.size), _tuple(b.stride)
        self.emit(f"if {name}.stride() != {stride}: {name} = {fix}({name}, {size}, {stride})")

    def scalar(self, a: Any) -> str:
        """An argument of a derived scalar: a symbolic expression or a constant."""
        return self.arg(SymRef(a) if isinstance(a, sympy.Basic) else a)

    def generate(self) -> str:
        p, s = self.p, self.s
        out = [
            "# stoker-triton generated wrapper",
            "import torch",
            "from torch import empty_strided, as_strided",
            "from stoker_triton._internal.runtime import (",
            "    check_layout, ensure_layout, launch_target, new_seed, prototype,",
            ")",
            "",
            "",
            "def make_call(launchers, consts):",
        ]
        for name in self.kernels:
            out.append(f"    {name} = launchers[{name!r}]")
        if self.kernels and self.launch == "triton":  # device, stream, hooks: once per call
            out.append("    target = launch_target(launchers)")
        body_start = len(out)
        self.emit("def call(args):", 1)
        names = [n if isinstance(n, str) else "_" for n in p.inputs]
        if names:
            self.emit(f"{', '.join(names)}{',' if len(names) == 1 else ''} = args")
        for sym, (i, kind, d) in p.symbols.items():
            if kind == "scalar":
                self.emit(f"{sym} = args[{i}]")
            elif kind == "size":
                self.emit(f"{sym} = {names[i]}.shape[{d}]")
            elif kind == "item":  # a number Dynamo passes as a one-element tensor
                self.emit(f"{sym} = {names[i]}.item()")
            elif kind == "stride":
                self.emit(f"{sym} = {names[i]}.stride({d})")
            else:
                self.emit(f"{sym} = {names[i]}.storage_offset()")
        if self.kernels and self.launch == "triton":
            self.emit("tgt = target()")
        if names:
            # the wrapper now holds every input: a caller that passed its own list
            # (`CompiledGraph.call_boxed`) lets each input go after its last reader
            self.emit("args.clear()")
        for sym, (fn, fargs, fkwargs) in p.derived.items():
            vals = [self.scalar(a) for a in fargs]
            vals += [f"{k}={self.scalar(v)}" for k, v in fkwargs.items()]
            self.emit(f"{sym} = {self.const(fn)}({', '.join(vals)})")
        for n in p.inputs:
            if isinstance(n, str):
                self.emit_layout_check(n, "check_layout")
        for cname in p.constants:
            self.emit(f"{cname} = consts[{cname!r}]")
        if p.random_streams:
            self.emit("seed = new_seed()")
        produced = {n.name for st in s.steps if isinstance(st, Kernel) for n in st.nodes}
        for b0 in p.buffers.values():
            if (
                b0.kind == "kernel" and b0.name not in produced
            ):  # empty tensors: nothing computes them
                self.emit(self.alloc(b0))
        protected = set(s.outputs) | set(p.constants)
        protected |= {v.buf for v in p.output_views.values()}

        def frees(name: str) -> bool:
            """The wrapper lets `name` go after its last reader."""
            kind = p.buffers[name].kind if name in p.buffers else None
            return name not in protected and name not in s.internal and kind in _FREED

        # a freed buffer handed to a later allocation of its layout (`reuse.plan`: never
        # raising the peak), unless an extern result may still see it
        taken = reuse.plan(
            p,
            reuse.events(p, s, frees),
            key=lambda b: (_tuple(b.size), _tuple(b.stride), str(b.dtype)),
            may_take=lambda n: p.buffers[n].kind == "kernel" and n not in self.extern_args,
            may_give=lambda n: (
                (p.buffers[n].kind == "kernel" or n in self.fresh_results)
                and n not in self.extern_args
            ),
        )
        given = set(taken.values())
        last_read: dict[int, list[str]] = {}  # step -> the buffers it reads last, in order
        for bname, last in s.last_use.items():
            last_read.setdefault(last, []).append(bname)
        for i, step in enumerate(s.steps):
            if isinstance(step, Kernel):
                ks = self.kernels[step.name]
                for node in step.nodes:
                    if node.name in s.internal or p.buffers[node.name].kind != "kernel":
                        continue
                    if isinstance(node, ScatterNode):
                        continue  # mutates the buffer its init node allocated
                    if node.name in taken:  # (its old name let go: it is freed with the new)
                        self.emit(f"{node.name} = {taken[node.name]}  # reuse")
                        self.emit(f"del {taken[node.name]}")
                    else:
                        self.emit(self.alloc(p.buffers[node.name]))
                ptrs = ks.pointer_args
                if self.launch == "c":
                    ptrs = [f"{b}.data_ptr()" for b in ptrs]
                call_args = [
                    *ptrs,
                    py(ks.xnumel),
                    py(ks.rnumel),
                    *[str(x) for x in ks.size_args],
                ]
                if ks.uses_seed:
                    call_args.append("seed")
                if self.launch == "c":
                    self.emit(f"{step.name}({', '.join(call_args)})")
                else:
                    self.emit(f"{step.name}.go(tgt, {', '.join(call_args)})")
            else:
                op = self.const(step.op)
                args = ", ".join(self.arg(a) for a in step.args)
                kwargs = "".join(f", {k}={self.arg(v)}" for k, v in step.kwargs.items())
                kwargs = kwargs if args else kwargs[2:]
                res = step.outputs[0] if step.single else "_r"
                self.emit(f"{res} = {op}({args}{kwargs})")
                for k, o in enumerate(step.outputs):
                    if o is None:
                        continue
                    if not step.single:
                        self.emit(f"{o} = _r[{k}]")
                    self.emit_layout_check(o, "ensure_layout")
            # free what this step read last (a buffer a later allocation takes: kept)
            for bname in last_read.get(i, ()):
                if frees(bname) and bname not in given:
                    self.emit(f"del {bname}")
        rets = []
        for k, o in enumerate(p.outputs):
            if k in p.output_views:
                r = p.output_views[k]
                rets.append(
                    f"as_strided({r.buf}, {_tuple(r.size)}, {_tuple(r.stride)}, {r.buf}.storage_offset() + {py(r.offset)})"
                )
            elif isinstance(o, str):
                rets.append(o)
            elif isinstance(o, SymRef):
                rets.append(py(o.expr))
            else:
                rets.append(self.arg(o))
        if self.output_kind == "single":
            self.emit(f"return {rets[0]}")
        elif self.output_kind == "list":
            self.emit(f"return [{', '.join(rets)}]")
        else:
            self.emit(f"return ({''.join(r + ', ' for r in rets)})")
        if any(isinstance(st, ExternNode) for st in s.steps):
            # aten calls run without autograd recording, like the kernels, and without
            # the caller's autocast: the graph's dtypes are decided (an autocast region
            # around the call would turn an fp32 matmul into a bf16 one in an fp32 buffer)
            # (grad mode is switched by its C functions: the steady forward and backward
            # run with it off already and pay one check)
            self.emit("no_grad = torch.no_grad", 1)
            self.emit("grad_enabled = torch._C.is_grad_enabled", 1)
            self.emit("set_grad_enabled = torch._C._set_grad_enabled", 1)
            self.emit("any_autocast = torch._C._is_any_autocast_enabled", 1)
            self.emit("no_autocast = torch._C._DisableAutocast", 1)
            self.emit("def call_no_grad(args):", 1)
            self.emit("if any_autocast():", 2)
            self.emit("with no_grad(), no_autocast():", 3)
            self.emit("return call(args)", 4)
            self.emit("if not grad_enabled():", 2)
            self.emit("return call(args)", 3)
            self.emit("set_grad_enabled(False)", 2)
            self.emit("try:", 2)
            self.emit("return call(args)", 3)
            self.emit("finally:", 2)
            self.emit("set_grad_enabled(True)", 3)
            self.emit("return call_no_grad", 1)
        else:
            self.emit("return call", 1)
        consts_lines = [f"    C{i} = consts['C{i}']" for i in range(len(self.consts))]
        consts_lines += [f"    {line}" for line in self.protos.values()]
        return "\n".join(out[:body_start] + consts_lines + self.lines) + "\n"


def returns_fresh(op: Any) -> bool:
    """Whether `op` returns only new memory: an aten overload whose schema marks no
    result as an alias of an argument (a view op's result aliases its input)."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    return all(r.alias_info is None for r in op._schema.returns)


def _refs(x: Any) -> set[str]:
    if isinstance(x, BufferRef):
        return {x.buf}
    if isinstance(x, list | tuple):
        out: set[str] = set()
        for y in x:
            out |= _refs(y)
        return out
    return set()


class UnboundSymbolError(RuntimeError):
    """The generated wrapper would read a symbol that nothing binds."""


def check_bound(src: str, program: Program) -> None:
    """Every name `call` reads must be bound before it runs: a symbolic size or
    scalar that no input provides is an error here, at compile time, naming the
    symbol and where it came from, rather than a NameError at the first call."""
    bound = set(dir(builtins))
    read: set[str] = set()
    # the compiler's symbol tables, not an AST: a long wrapper's AST is 10^5 Python
    # objects, whose allocation set off a full garbage collection (0.25 s on gpt-m)
    tables = [symtable.symtable(src, "<wrapper>", "exec")]
    while tables:  # any scope: a name read in one is bound in another (closures)
        t = tables.pop()
        tables.extend(t.get_children())
        for sym in t.get_symbols():
            if sym.is_referenced():
                read.add(sym.get_name())
            if sym.is_assigned() or sym.is_parameter() or sym.is_imported() or sym.is_namespace():
                bound.add(sym.get_name())
    missing = sorted(read - bound)
    if not missing:
        return
    by_name = {str(s): w for s, w in program.symbol_origins.items()}
    lines = [
        f"  {m}: from {by_name.get(m, 'an unknown source (a stoker-triton bug)')}" for m in missing
    ]
    raise UnboundSymbolError(
        "stoker-triton: the generated wrapper uses symbols that no graph input binds "
        "(an input's size, stride or storage offset, a SymInt/SymFloat input, or "
        "`.item()` of a one-element input):\n"
        + "\n".join(lines)
        + "\nPass the value as a graph input (a SymInt/SymFloat placeholder or a 0-d tensor "
        "read with .item()), or mark it static (e.g. torch._dynamo.config.specialize_float=True)."
    )


def generate_wrapper(
    program: Program,
    sched: Schedule,
    kernels: dict[str, KernelSource],
    output_kind: str,
    launch: str = "triton",
) -> tuple[str, dict[str, Any]]:
    g = WrapperCodegen(program, sched, kernels, output_kind, launch)
    src = g.generate()
    check_bound(src, program)
    consts = {f"C{i}": c for i, c in enumerate(g.consts)}
    consts.update(program.constants)
    return src, consts
