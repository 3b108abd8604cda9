"""Guards: what must hold of a call's inputs for a compiled artifact to be reused.

`build_guard_set` reads a `ShapeContext` out into a `GuardSet` after the last
stage.  A `GuardSet` checks inputs through ONE generated Python function (see
`GuardSet.source`); tensor metadata (dtype, device, requires_grad, dispatch
keys, static sizes and strides) goes through torch's C++ ``TensorGuards`` when
available, which keeps a 10-tensor check around 2 µs.  `explain` re-checks
guard by guard, slowly, to name the first failure in user terms.

Autocast is a thread-local mode, not tensor metadata: ``TensorGuards`` would
see it in the dispatch keys, so it is built and checked with autocast's keys
excluded (a guard set built or loaded in an autocast region checks the same
inputs the same way outside it).  Whoever compiles differently under autocast
keys on the autocast state itself (stoker-capture's caches, Dynamo's guards).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.utils._sympy.printers import PythonPrinter

from .errors import StokerShapesError
from .inputs import ConstantInput, ContainerInput, ScalarInput, TensorInput
from .provenance import Origin
from .source import Source

FORMAT_VERSION = 1
CheckFn = Callable[..., bool]


class _Printer(PythonPrinter):
    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        return str(expr.name)


_PRINTER = _Printer()


def _print(expr: Any, names: Mapping[sympy.Symbol, str] | None = None) -> str:
    if not isinstance(expr, sympy.Basic):
        return repr(expr)
    if names:
        expr = expr.xreplace(
            {s: sympy.Symbol(names[s], integer=True) for s in expr.free_symbols if s in names}
        )
    return str(_PRINTER.doprint(expr))


def _const_repr(value: Any) -> str:
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    return repr(value)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """The metadata guard of one tensor input; ``None`` sizes/strides are symbolic."""

    source: Source
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    sizes: tuple[int | None, ...]
    strides: tuple[int | None, ...]
    size_origins: tuple[Origin | None, ...]  # why each static size is static
    pytype: str = "Tensor"  # "Tensor" or "Parameter": the exact Python type is guarded

    def mismatch(self, value: object) -> str | None:
        """The first way ``value`` differs from this spec, in user terms; None if it matches."""
        name = self.source.name
        if type(value) is not _PYTYPES[self.pytype]:
            expected = _PYTYPES[self.pytype].__qualname__
            return f"type({name}) is {expected} failed: got {type(value).__qualname__}"
        assert isinstance(value, torch.Tensor)
        t = value
        if t.dtype != self.dtype:
            return f"{name}.dtype == {self.dtype} failed: got {t.dtype}"
        if t.device != self.device:
            return f"{name}.device == {_const_repr(self.device)} failed: got {t.device}"
        if t.requires_grad != self.requires_grad:
            return f"{name}.requires_grad == {self.requires_grad} failed: got {t.requires_grad}"
        if t.dim() != len(self.sizes):
            return f"{name}.dim() == {len(self.sizes)} failed: got {t.dim()}"
        for i, (want, got) in enumerate(zip(self.sizes, t.shape)):
            if want is not None and want != got:
                origin = self.size_origins[i]
                why = f"; {origin.describe()}" if origin else ""
                return f"{name}.size()[{i}] == {want} failed: got {got}{why}"
        for i, (want, got) in enumerate(zip(self.strides, t.stride())):
            if want is not None and want != got:
                return (
                    f"{name}.stride()[{i}] == {want} failed: got {got} (strides are "
                    "guarded; pass a tensor with the same layout, e.g. .contiguous())"
                )
        return None

    def python_check(self, var: str) -> str:
        """A Python expression over local ``var`` equivalent to the C++ check."""
        parts = [f"type({var}) is {self.pytype}", f"{var}.dtype is {self.dtype}"]
        if self.device.type == "cpu":
            parts.append(f"{var}.is_cpu")
        else:
            parts.append(f"{var}.device == {_const_repr(self.device)}")
        parts.append(f"{var}.requires_grad is {self.requires_grad}")
        parts.append(f"{var}.dim() == {len(self.sizes)}")
        parts += [f"{var}.shape[{i}] == {s}" for i, s in enumerate(self.sizes) if s is not None]
        if any(s is not None for s in self.strides):
            parts.append(f"(_st := {var}.stride())")
            parts += [f"_st[{i}] == {s}" for i, s in enumerate(self.strides) if s is not None]
        return " and ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source.to_json(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "requires_grad": self.requires_grad,
            "sizes": list(self.sizes),
            "strides": list(self.strides),
            "size_origins": [o.to_json() if o else None for o in self.size_origins],
            "pytype": self.pytype,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> TensorSpec:
        dtype = getattr(torch, d["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise StokerShapesError(f"unknown dtype {d['dtype']!r} in guard JSON")
        return TensorSpec(
            source=Source.from_json(d["source"]),
            dtype=dtype,
            device=torch.device(d["device"]),
            requires_grad=bool(d["requires_grad"]),
            sizes=tuple(d["sizes"]),
            strides=tuple(d["strides"]),
            size_origins=tuple(Origin.from_json(o) for o in d["size_origins"]),
            pytype=d["pytype"] if d["pytype"] in _PYTYPES else "Tensor",
        )

    def __str__(self) -> str:
        sz = ", ".join("?" if s is None else str(s) for s in self.sizes)
        st = ", ".join("?" if s is None else str(s) for s in self.strides)
        rg = ", requires_grad" if self.requires_grad else ""
        return (
            f"{self.source.name}: Tensor({str(self.dtype).removeprefix('torch.')}, "
            f"{self.device}, size=({sz}), stride=({st}){rg})"
        )


@dataclass(frozen=True, slots=True)
class Guard:
    """One boolean fact about the inputs.

    ``text`` is Python over the roots (``args``, ``kwargs``, ``self``) and is
    what people read; ``code`` is the same fact over the check function's locals.
    """

    kind: str  # "container" | "constant" | "type" | "alias" | "size" | "shape" | "range"
    text: str
    code: str
    origin: Origin | None = None
    reads: tuple[str, ...] = ()  # source texts whose values `explain` reports
    scalar: Source | None = None  # for a specialized Python number: its source (auto dynamic)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "text": self.text,
            "code": self.code,
            "origin": self.origin.to_json() if self.origin else None,
            "reads": list(self.reads),
            "scalar": self.scalar.to_json() if self.scalar else None,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Guard:
        scalar = Source.from_json(d["scalar"]) if d.get("scalar") else None
        origin = Origin.from_json(d["origin"])
        return Guard(d["kind"], d["text"], d["code"], origin, tuple(d["reads"]), scalar)

    def __str__(self) -> str:
        why = f"    # {self.origin.describe()}" if self.origin else ""
        return f"{self.text}{why}"


_PYTYPES: dict[str, type] = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter}
_NAMESPACE_BASE: dict[str, Any] = {
    "torch": torch,
    "Tensor": torch.Tensor,
    "math": math,
    "Parameter": torch.nn.Parameter,
    "int": int,
    "float": float,
    "___int": frozenset({int}),
    # TensorGuards reads thread-local dispatch keys: check them with autocast's excluded
    "___autocast_on": torch._C._is_any_autocast_enabled,
    "___no_autocast": torch._C._DisableAutocast,
}


def _tensor_guards(specs: Sequence[TensorSpec]) -> Any:
    """torch's C++ TensorGuards for these specs, or None when it cannot be built here."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    dummies = []
    try:
        for s in specs:
            t = torch.empty(0, dtype=s.dtype, device=s.device)
            if s.pytype == "Parameter":
                t = torch.nn.Parameter(t, requires_grad=s.requires_grad)
            elif s.requires_grad:
                t.requires_grad_(True)
            dummies.append(t)
        with torch._C._DisableAutocast():  # as every check sees them (module docstring)
            return TensorGuards(
                *dummies,
                dynamic_dims_sizes=[list(s.sizes) for s in specs],  # type: ignore[misc]
                dynamic_dims_strides=[list(s.strides) for s in specs],  # type: ignore[misc]
            )
    except (RuntimeError, TypeError, AssertionError):
        return None  # e.g. a CUDA spec loaded on a machine without CUDA


def _int_item(g: Guard) -> tuple[str, int, int] | None:
    """(container, index, value) of a guard ``type(c[i]) is int and c[i] == v`` (a
    Python int input guarded by value), else None."""
    src = g.scalar
    if g.kind != "constant" or src is None or src.kind != "item" or src.base is None:
        return None
    if type(src.key) is not int or src.key < 0:
        return None
    head = f"type({src.name}) is int and {src.name} == "
    if not g.code.startswith(head):
        return None
    text = g.code[len(head) :]
    try:
        value = int(text)
    except ValueError:
        return None
    return (src.base.name, src.key, value) if repr(value) == text else None


def _sequence_lengths(containers: Sequence[Guard]) -> dict[str, tuple[str, int]]:
    """Container name -> (list or tuple, length), from its guard (checked first)."""
    out: dict[str, tuple[str, int]] = {}
    for g in containers:
        for kind in ("list", "tuple"):
            name, sep, n = g.code.removeprefix("type(").partition(f") is {kind} and len(")
            if sep and n.startswith(f"{name}) == ") and n[len(name) + 5 :].isdigit():
                out[name] = (kind, int(n[len(name) + 5 :]))
    return out


def _constant_checks(guards: Sequence[Guard], containers: Sequence[Guard]) -> list[str]:
    """The lines checking `guards` in order, where a run of ints guarded by value at
    consecutive indices of one list or tuple (compiled autograd's sizes: one per size
    the engine passes) is one comparison of a slice with the values and of its items'
    types with ``int`` (C loops, not a Python line per value). Equivalent:
    the container's type and length are checked before, so the slice has every item."""
    seqs = _sequence_lengths(containers)
    lines: list[str] = []
    run: list[tuple[str, int, int, str]] = []  # (container, index, value, code)

    def flush() -> None:
        if len(run) < 3:
            lines.extend(f"if not ({code}): return False" for *_, code in run)
        else:
            c, first, last = run[0][0], run[0][1], run[-1][1]
            values = ", ".join(str(v) for _, _, v, _ in run)
            values = f"[{values}]" if seqs[c][0] == "list" else f"({values})"
            lines.append(f"___s = {c}[{first}:{last + 1}]")
            lines.append(
                f"if not (___s == {values} and {{*map(type, ___s)}} == ___int): return False"
            )
        run.clear()

    for g in guards:
        item = _int_item(g)
        if item is not None and item[0] in seqs and item[1] < seqs[item[0]][1]:
            if run and (run[-1][0] != item[0] or run[-1][1] + 1 != item[1]):
                flush()
            run.append((*item, g.code))
            continue
        flush()
        lines.append(f"if not ({g.code}): return False")
    flush()
    return lines


class GuardSet:
    """The guards of one compiled artifact: check fast, explain slowly, save as JSON."""

    __slots__ = ("_check", "_tg", "bindings", "guards", "source", "tensors")

    def __init__(
        self,
        tensors: Sequence[TensorSpec],
        guards: Sequence[Guard],
        bindings: Sequence[tuple[str, str]],
    ) -> None:
        self.tensors: tuple[TensorSpec, ...] = tuple(tensors)
        self.guards: tuple[Guard, ...] = tuple(guards)
        # (local name, Python over roots/tensor locals) in binding order
        self.bindings: tuple[tuple[str, str], ...] = tuple(bindings)
        self._tg = _tensor_guards(self.tensors) if self.tensors else None
        self.source = self._generate()
        ns = dict(_NAMESPACE_BASE, ___tg=self._tg)
        exec(compile(self.source, "<stoker guard check>", "exec"), ns)
        self._check: CheckFn = ns["check"]

    # ---------------------------------------------------------------- codegen
    def _generate(self) -> str:
        lines = ["def check(args, kwargs, self=None):", "    try:"]
        body: list[str] = []
        containers = [g for g in self.guards if g.kind == "container"]
        for g in containers:
            body.append(f"if not ({g.code}): return False")
        tvars = [f"t{i}" for i in range(len(self.tensors))]
        for var, spec in zip(tvars, self.tensors):
            body.append(f"{var} = {spec.source.name}")
        if self._tg is not None:
            call = f"___tg.check({', '.join(tvars)})"
            body.append("if ___autocast_on():")  # one C call when autocast is off
            body.append(f"    with ___no_autocast(): ___ok = {call}")
            body.append("    if not ___ok: return False")
            body.append(f"elif not {call}: return False")
        else:
            for var, spec in zip(tvars, self.tensors):
                body.append(f"if not ({spec.python_check(var)}): return False")
        rest = [g for g in self.guards if g.kind != "container"]
        bound_at = {"alias": 0, "constant": 0, "type": 0}
        body += _constant_checks([g for g in rest if g.kind in bound_at], containers)
        for name, expr in self.bindings:
            body.append(f"{name} = {expr}")
        for g in rest:
            if g.kind not in bound_at:
                body.append(f"if not ({g.code}): return False")
        body.append("return True")
        lines += ["        " + b for b in body]
        lines += ["    except Exception:", "        return False", ""]
        return "\n".join(lines)

    # ------------------------------------------------------------------ check
    def check(
        self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, self_: Any = None
    ) -> bool:
        """True iff every guard holds for this call (fast: one generated function)."""
        return self._check(args, kwargs if kwargs is not None else {}, self_)

    def explain(
        self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, self_: Any = None
    ) -> str | None:
        """The first failing guard in user terms, or None when all hold."""
        roots = dict(_NAMESPACE_BASE, args=args, kwargs=kwargs or {}, self=self_)

        def ev(text: str) -> Any:
            return eval(text, roots)  # texts are generated by us, over the roots only

        for g in self.guards:
            if g.kind == "container":
                try:
                    ok = bool(ev(g.text))
                except Exception:
                    ok = False
                if not ok:
                    return self._failure(g, ev)
        for spec in self.tensors:
            try:
                value = ev(spec.source.name)
            except Exception as e:
                return f"{spec.source.name} could not be read: {type(e).__name__}: {e}"
            msg = spec.mismatch(value)
            if msg:
                return msg
        for g in self.guards:
            if g.kind == "container":
                continue
            try:
                ok = bool(ev(g.text))
            except Exception as e:
                return f"{g.text} could not be evaluated: {type(e).__name__}: {e}"
            if not ok:
                return self._failure(g, ev)
        if not self.check(args, kwargs, self_) and self._tg is not None:
            tensors = [ev(s.source.name) for s in self.tensors]
            names = [s.source.name for s in self.tensors]
            with torch._C._DisableAutocast():
                verbose = self._tg.check_verbose(*tensors, tensor_check_names=names)
            return f"tensor metadata differs: {verbose} (e.g. an inference-mode tensor)"
        return None

    @staticmethod
    def _failure(g: Guard, ev: Callable[[str], Any]) -> str:
        got = []
        for r in g.reads:
            try:
                got.append(f"{r} = {ev(r)!r}")
            except Exception:
                got.append(f"{r} unreadable")
        msg = f"{g.text} failed"
        if got:
            msg += ": got " + ", ".join(got)
        if g.origin is not None:
            msg += f"; {g.origin.describe()}"
        return msg

    def failing_sizes(
        self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
    ) -> list[tuple[Source, int]]:
        """(tensor source, dim) of static sizes that differ in this call (automatic dynamic)."""
        roots = {"args": args, "kwargs": kwargs or {}, "self": None}
        out = []
        for spec in self.tensors:
            try:
                t = eval(spec.source.name, roots)
            except Exception:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != len(spec.sizes):
                continue
            out += [
                (spec.source, i)
                for i, (w, g) in enumerate(zip(spec.sizes, t.shape))
                if w is not None and w != g
            ]
        for g in self.guards:  # Python numbers specialized as constants
            if g.scalar is not None:
                try:
                    ok = eval(g.text, dict(_NAMESPACE_BASE, **roots))
                except Exception:
                    ok = False
                if not ok:
                    out.append((g.scalar, -1))
        return out

    # ----------------------------------------------------------- presentation
    def __len__(self) -> int:
        return len(self.tensors) + len(self.guards)

    def __str__(self) -> str:
        lines = [f"GuardSet({len(self.tensors)} tensors, {len(self.guards)} guards)"]
        lines += [f"  {spec}" for spec in self.tensors]
        lines += [f"  {g}" for g in self.guards]
        return "\n".join(lines)

    __repr__ = __str__

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "stoker-guards",
                "version": FORMAT_VERSION,
                "tensors": [t.to_json() for t in self.tensors],
                "guards": [g.to_json() for g in self.guards],
                "bindings": [list(b) for b in self.bindings],
            },
            indent=1,
        )

    @staticmethod
    def from_json(text: str) -> GuardSet:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise StokerShapesError(f"guard JSON is not valid JSON: {e}") from e
        if data.get("format") != "stoker-guards" or data.get("version") != FORMAT_VERSION:
            raise StokerShapesError(
                f"guard JSON has format {data.get('format')!r} version {data.get('version')!r}; "
                f"this stoker-shapes reads stoker-guards version {FORMAT_VERSION}"
            )
        return GuardSet(
            [TensorSpec.from_json(t) for t in data["tensors"]],
            [Guard.from_json(g) for g in data["guards"]],
            [(a, b) for a, b in data["bindings"]],
        )


# --------------------------------------------------------------------- builder
def build_guard_set(ctx: Any) -> GuardSet:
    """Read a `ShapeContext` out into a `GuardSet` (after the last stage)."""
    env = ctx.shape_env
    specs: list[TensorSpec] = []
    guards: list[Guard] = []
    bindings: list[tuple[str, str]] = []
    bound: dict[sympy.Symbol, str] = {}  # symbol -> source text
    pending: list[tuple[str, str, sympy.Expr, Origin | None]] = []  # (text, code-lhs, expr)
    tensor_var: dict[Source, str] = {}
    tensors = [i for i in ctx.inputs if isinstance(i, TensorInput)]
    for k, ti in enumerate(tensors):
        tensor_var[ti.source] = f"t{k}"

    def replaced(e: Any) -> Any:
        return env.replace(e) if isinstance(e, sympy.Basic) else e

    def static_origin(ti: TensorInput, i: int, e: Any) -> Origin | None:
        if isinstance(e, sympy.Basic) and e.free_symbols:
            sym = next(iter(e.free_symbols))
            return ctx.replacement_origins.get(sym) or Origin(note="specialized while tracing")
        if ti.is_param:
            return Origin(note="static because parameters and buffers are static")
        if ctx.policy.value == "auto":
            return Origin(note="static until it changes (policy 'auto')")
        return Origin(
            note=f"static because of policy {ctx.policy.value!r} "
            "(declare the dim dynamic with a Dim, or use policy 'auto')"
        )

    # 1. containers, constants, scalars
    for inp in ctx.inputs:
        name = inp.source.name
        if isinstance(inp, ContainerInput):
            if inp.kind is dict:
                text = f"type({name}) is dict and tuple({name}) == {inp.keys!r}"
            else:
                text = f"type({name}) is {inp.kind.__name__} and len({name}) == {inp.keys[0]}"
            guards.append(Guard("container", text, text, None, (f"type({name})",)))
        elif isinstance(inp, ConstantInput):
            v = inp.value
            if v is None or isinstance(v, bool):
                text = f"{name} is {v!r}"
            elif isinstance(v, str):
                text = f"type({name}) is str and {name} == {v!r}"
            else:  # dtype, device, layout, memory_format
                text = f"{name} == {_const_repr(v)}"
            guards.append(
                Guard(
                    "constant",
                    text,
                    text,
                    Origin(note="non-tensor inputs are guarded by value"),
                    (name,),
                )
            )
        elif isinstance(inp, ScalarInput):
            tname = type(inp.value).__name__
            if inp.expr is None:
                text = f"type({name}) is {tname} and {name} == {_const_repr(inp.value)}"
                guards.append(
                    Guard(
                        "constant",
                        text,
                        text,
                        Origin(note=f"Python {tname} inputs are static unless declared dynamic"),
                        (name,),
                        inp.source,
                    )
                )
            else:
                text = f"type({name}) is {tname}"
                guards.append(Guard("type", text, text, None, (f"type({name})",)))
    # 2. tensors: static parts into the spec; symbolic sizes bind or become equalities
    for ti in tensors:
        var = tensor_var[ti.source]
        sizes: list[int | None] = []
        origins: list[Origin | None] = []
        for i, e in enumerate(ti.sizes):
            r = replaced(e)
            if isinstance(r, int) or (isinstance(r, sympy.Basic) and r.is_number):
                sizes.append(int(r))
                origins.append(static_origin(ti, i, e))
                continue
            sizes.append(None)
            origins.append(None)
            src = ti.source.size(i).name
            if isinstance(r, sympy.Symbol) and r not in bound:
                bound[r] = src
                bindings.append((str(r.name), f"{var}.shape[{i}]"))
            else:
                pending.append(
                    (
                        src,
                        f"{var}.shape[{i}]",
                        r,
                        ctx.notes.get(e) or ctx.replacement_origins.get(e),
                    )
                )
        strides: list[int | None] = []
        for i, e in enumerate(ti.strides):
            r = replaced(e)
            if isinstance(r, int) or (isinstance(r, sympy.Basic) and r.is_number):
                strides.append(int(r))
            else:
                strides.append(None)
                pending.append((ti.source.stride(i).name, f"{var}.stride()[{i}]", r, None))
        off = replaced(ti.storage_offset)
        if not (isinstance(off, int) or (isinstance(off, sympy.Basic) and off.is_number)):
            pending.append((ti.source.storage_offset().name, f"{var}.storage_offset()", off, None))
        elif int(off) != 0:
            t = f"{ti.source.name}.storage_offset() == {int(off)}"
            guards.append(
                Guard(
                    "size",
                    t,
                    f"{var}.storage_offset() == {int(off)}",
                    None,
                    (f"{ti.source.name}.storage_offset()",),
                )
            )
        pytype = (
            "Parameter" if isinstance(ti.fake, torch.nn.Parameter) or ti.is_param_type else "Tensor"
        )
        specs.append(
            TensorSpec(
                ti.source,
                ti.dtype,
                ti.device,
                ti.requires_grad,
                tuple(sizes),
                tuple(strides),
                tuple(origins),
                pytype,
            )
        )
    for inp in ctx.inputs:
        if isinstance(inp, ScalarInput) and inp.expr is not None:
            r = replaced(inp.expr)
            if isinstance(r, sympy.Symbol) and r not in bound:
                bound[r] = inp.source.name
                bindings.append((str(r.name), inp.source.name))
            else:
                pending.append((inp.source.name, inp.source.name, r, None))
    # 3. aliasing between tensor inputs (views of one storage stay views of one storage)
    groups: dict[int, list[TensorInput]] = {}
    for ti in tensors:
        groups.setdefault(ti.storage_key, []).append(ti)
    for members in groups.values():
        first = members[0]
        fv = tensor_var[first.source]
        for other in members[1:]:
            ov = tensor_var[other.source]
            text = (
                f"{other.source.name}.untyped_storage()._cdata == "
                f"{first.source.name}.untyped_storage()._cdata"
            )
            guards.append(
                Guard(
                    "alias",
                    text,
                    f"{ov}.untyped_storage()._cdata == {fv}.untyped_storage()._cdata",
                    Origin(note="inputs aliased one storage when compiled"),
                )
            )
        if len(members) == 1 and not first.is_view and not first.is_param:
            text = f"{first.source.name}._base is None"
            guards.append(
                Guard(
                    "alias",
                    text,
                    f"{fv}._base is None",
                    Origin(note="input was not a view when compiled"),
                )
            )
        elif len(members) == 1 and len(tensors) > 1 and not first.is_param:
            others = [t for t in tensors if t is not first]
            text = " and ".join(
                f"{first.source.name}.untyped_storage()._cdata != "
                f"{o.source.name}.untyped_storage()._cdata"
                for o in others
            )
            code = " and ".join(
                f"{fv}.untyped_storage()._cdata != {tensor_var[o.source]}.untyped_storage()._cdata"
                for o in others
            )
            guards.append(
                Guard(
                    "alias",
                    text,
                    code,
                    Origin(note="a view input shared no storage with other inputs"),
                )
            )
    # 4. equalities for sizes/strides that are expressions of bound symbols
    # a stride or storage offset that is its own symbol (a dynamic view) binds it
    for text_lhs, code_lhs, r, _ in pending:
        if isinstance(r, sympy.Symbol) and r not in bound:
            bound[r] = text_lhs
            bindings.append((str(r.name), code_lhs))
    for text_lhs, code_lhs, r, origin in pending:
        if bound.get(r) == text_lhs:
            continue  # the binding itself
        missing = r.free_symbols - bound.keys()
        if missing:
            raise StokerShapesError(
                f"{text_lhs} = {r} uses symbols {sorted(map(str, missing))} that no input binds"
            )
        text = f"{text_lhs} == {_print(r, bound)}"
        code = f"{code_lhs} == {_print(r)}"
        sym = next(iter(r.free_symbols), None)
        o = origin or (ctx.notes.get(sym) if sym is not None else None)
        reads = (text_lhs, *(bound[s] for s in sorted(r.free_symbols, key=str)))
        guards.append(Guard("size", text, code, o, reads))
    # 5. every guard the stages added to the shape env
    seen: set[str] = set()
    for idx, sg in enumerate(list(env.guards)[ctx._first_guard :], start=ctx._first_guard):
        e = env.simplify(sg.expr)
        if e == sympy.true or (
            isinstance(e, sympy.Basic) and e.is_Boolean and bool(e == sympy.true)
        ):
            continue
        if not e.free_symbols <= bound.keys():
            continue  # about symbols that are not ours (e.g. an adopted env's others)
        code = _print(e)
        if code in seen:
            continue
        seen.add(code)
        origin = ctx.guard_origins.get(idx)
        reads = tuple(bound[s] for s in sorted(e.free_symbols, key=str))
        guards.append(Guard("shape", _print(e, bound), code, origin, reads))
    # 6. value ranges of the bound symbols (0/1 specialization, Dim min/max, refinements)
    for sym, src in bound.items():
        vr = env.var_to_range.get(sym)
        if vr is None:
            continue
        origin = ctx.range_origins.get(sym)
        decl = next((d for d in ctx.dims if d.symbol == sym), None)
        if origin is None:
            if decl is not None and decl.dim is not None:
                origin = Origin(note=f"bound of {decl.dim!r}")
            else:
                origin = Origin(note="dynamic dims exclude sizes 0 and 1 (those are specialized)")
        lo, hi = _finite_int(vr.lower), _finite_int(vr.upper)
        if lo is not None:
            guards.append(Guard("range", f"{src} >= {lo}", f"{sym.name} >= {lo}", origin, (src,)))
        if hi is not None and hi < 2**62:
            guards.append(Guard("range", f"{src} <= {hi}", f"{sym.name} <= {hi}", origin, (src,)))
    return GuardSet(specs, guards, bindings)


def _finite_int(v: Any) -> int | None:
    """``v`` as an int when it is a finite integer bound (not +-oo / int_oo)."""
    try:
        if not bool(v.is_finite) or not bool(v.is_number):
            return None
        return int(v)
    except (TypeError, AttributeError, OverflowError, ValueError):
        return None
