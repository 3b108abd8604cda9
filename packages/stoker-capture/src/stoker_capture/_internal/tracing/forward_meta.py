"""Forward metadata: what running the function once, functionalized, on fake inputs shows.

Which inputs it mutates (data or metadata), which outputs alias inputs or each
other, which outputs require grad; the dataclasses every later stage reads.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from stoker_shapes import ShapeContext, Source

from ..errors import UnsupportedError
from .functional import (
    from_fun,
    functionalized,
    has_data_mutation,
    has_metadata_mutation,
    storage_key,
    to_fun,
)

_SYM = (torch.SymInt, torch.SymFloat)


class InputKind(enum.StrEnum):
    """What a flat input of the captured function is."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    USER = "user_input"


class OutputKind(enum.StrEnum):
    """How the runtime produces one user output."""

    FRESH = "fresh"  # a new tensor: returned by the graph (and by the autograd.Function)
    IS_INPUT = "is_input"  # the input object itself: the runtime returns the real input
    ALIAS_OF_INPUT = "alias_of_input"  # a view of an input: regenerated with as_strided
    ALIAS_OF_OUTPUT = "alias_of_output"  # a view of another output or intermediate base
    SYMBOLIC = "symbolic"  # a SymInt/SymFloat: returned by the graph as a number
    CONSTANT = "constant"  # a Python value the trace specialized on: re-inserted


# A size, stride or offset: an int, or a sympy expression over the input symbols.
SizeExpr = Any


@dataclass(slots=True)
class Layout:
    """Size, stride and storage offset of a tensor (symbolic where dims are dynamic)."""

    size: tuple[SizeExpr, ...]  # per dim: int or sympy expr
    stride: tuple[SizeExpr, ...]  # per dim: int or sympy expr
    offset: SizeExpr  # storage offset: int or sympy expr
    # element type the sizes, strides and offset count in; a view may differ from its
    # base (view_as_complex, view_as_real, view(dtype)).  None: the base's.
    dtype: torch.dtype | None = None

    @staticmethod
    def of(t: torch.Tensor) -> Layout:
        return Layout(
            tuple(_expr(s) for s in t.size()),
            tuple(_expr(s) for s in t.stride()),
            _expr(t.storage_offset()),
            t.dtype,
        )

    def __str__(self) -> str:
        return f"size={list(self.size)} stride={list(self.stride)} offset={self.offset}"


@dataclass(slots=True)
class InputInfo:
    """One flat input (a primal) of the captured function, in primal order."""

    name: str  # placeholder name in the captured graph: primals_<k>
    kind: InputKind  # parameter, buffer or user input
    source: Source  # where the value comes from: self.fc.weight, args[0], kwargs['mask']
    is_tensor: bool  # False for a SymInt/SymFloat input (a dynamic Python number)
    requires_grad: bool  # the tensor requires grad (a gradient is computed for it)
    mutates_data: bool = False  # the function writes its values (x.add_, BatchNorm stats)
    mutates_metadata: bool = False  # the function changes its size/stride (x.t_())
    new_layout: Layout | None = None  # size/stride/offset after a metadata mutation
    new_requires_grad: bool = False  # the mutated value requires grad (x.add_(w), w requiring grad)

    @property
    def mutated(self) -> bool:
        return self.mutates_data or self.mutates_metadata

    def __str__(self) -> str:
        flags = [
            k
            for k, v in (
                ("requires_grad", self.requires_grad),
                ("mutates_data", self.mutates_data),
                ("mutates_metadata", self.mutates_metadata),
            )
            if v
        ]
        what = "" if self.is_tensor else " (symbolic number)"
        return f"{self.name}: {self.kind.value} {self.source.name}{what} {' '.join(flags)}".rstrip()


@dataclass(slots=True)
class OutputInfo:
    """One flat user output of the function."""

    kind: OutputKind  # how the runtime produces it
    requires_grad: bool  # requires grad in eager (False for non-float and detached outputs)
    is_float: bool  # floating/complex tensor (only these get tangents)
    # IS_INPUT/ALIAS_OF_INPUT: the input's index; ALIAS_OF_OUTPUT: the base's index among
    # the graph's forward outputs that follow the mutated inputs
    base: int | None = None
    # aliases: the view to regenerate; a FRESH output other outputs view: its expected layout
    layout: Layout | None = None
    value: Any = None  # the value of a CONSTANT output

    def __str__(self) -> str:
        s = self.kind.value
        if self.base is not None:
            s += f" (base {self.base})"
        if self.kind == OutputKind.CONSTANT:
            s += f" = {self.value!r}"
        if self.requires_grad:
            s += " requires_grad"
        return s


@dataclass(slots=True)
class ForwardMeta:
    """What running the function once, functionalized, showed.

    Graph forward outputs, in order: the new values of mutated inputs, then
    every user output that is a tensor or a symbolic number, then the
    intermediate bases of outputs that alias each other.
    """

    inputs: list[InputInfo]  # length = number of primals
    outputs: list[OutputInfo]  # length = number of flat user outputs
    out_spec: pytree.TreeSpec  # rebuilds the user's output structure from the flat outputs
    intermediate_bases: list[int]  # per extra base: the user output whose ._base it is
    base_layouts: list[Layout]  # per extra base: the layout the runtime expects of it
    # per graph forward output: (size, dtype, device) of a tensor (sizes the tangents); None otherwise
    fw_specs: list[tuple[tuple[Any, ...], torch.dtype, torch.device] | None] = field(
        default_factory=list
    )

    def forward_values(self, f_in: list[Any], outs: list[Any]) -> list[Any]:
        """The graph's forward outputs, from the (functional) inputs and user outputs of a run."""
        vals = [f_in[i] for i in self.mutated_inputs]
        vals += [o for o, info in zip(outs, self.outputs) if info.kind != OutputKind.CONSTANT]
        vals += [outs[j]._base for j in self.intermediate_bases]
        return vals

    @property
    def mutated_inputs(self) -> list[int]:
        return [i for i, inp in enumerate(self.inputs) if inp.mutated]

    def graph_outputs(self) -> list[tuple[str, int]]:
        """Each forward output of the graph: ("mutation", input) | ("user", out) | ("base", k)."""
        roles = [("mutation", i) for i in self.mutated_inputs]
        roles += [("user", j) for j, o in enumerate(self.outputs) if o.kind != OutputKind.CONSTANT]
        roles += [("base", k) for k in range(len(self.intermediate_bases))]
        return roles

    def tangent_mask(self) -> list[bool]:
        """Per graph forward output: does it get a tangent (a gradient flows into it)?"""
        mask = []
        for role, i in self.graph_outputs():
            if role == "mutation":
                inp = self.inputs[i]
                mask.append(inp.is_tensor and inp.new_requires_grad and inp.mutates_data)
            elif role == "user":
                o = self.outputs[i]
                mask.append(o.kind == OutputKind.FRESH and o.requires_grad and o.is_float)
            else:
                o = self.outputs[self.intermediate_bases[i]]
                mask.append(o.requires_grad and o.is_float)
        return mask

    def as_text(self) -> str:
        lines = ["inputs:"] + [f"  {inp}" for inp in self.inputs]
        lines += ["outputs:"] + [f"  [{j}] {o}" for j, o in enumerate(self.outputs)]
        if self.intermediate_bases:
            lines.append(f"intermediate bases (of outputs): {self.intermediate_bases}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.as_text()


def _expr(v: Any) -> Any:
    return v.node.expr if isinstance(v, torch.SymInt | torch.SymFloat) else int(v)


def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def forward_meta(
    flat_fn: Callable[..., list[Any]],
    fake_primals: list[Any],
    inputs: list[InputInfo],
    ctx: ShapeContext,
    joint: bool,
) -> ForwardMeta:
    """Run ``flat_fn`` once, functionalized, on the fake primals; record what it did."""
    # no node meta recording here: this run builds no graph
    # Data-dependent sizes (nonzero, x[mask]) make unbacked symbols no graph binds here
    quiet = ctx.shape_env.ignore_fresh_unbacked_symbols()
    with ctx.tracing(), captured_tensor_error(), quiet, functionalized():
        fp = [to_fun(p) for p in fake_primals]
        with torch.set_grad_enabled(joint):
            outs = flat_fn(*fp)
        for i, f in enumerate(fp):
            inputs[i].mutates_data = has_data_mutation(f)
            inputs[i].mutates_metadata = has_metadata_mutation(f)
            if inputs[i].mutates_metadata:
                inputs[i].new_layout = Layout.of(f)
            inputs[i].new_requires_grad = bool(isinstance(f, torch.Tensor) and f.requires_grad)
        _check_mutated_aliases(fp, inputs)
        outputs, bases, base_layouts = _classify_outputs(outs, fp)
        meta = ForwardMeta(inputs, outputs, pytree.tree_flatten(None)[1], bases, base_layouts)
        meta.fw_specs = [
            (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else None
            for v in meta.forward_values(fp, outs)
        ]
        for f in fp:
            from_fun(f)
    return meta


@contextlib.contextmanager
def captured_tensor_error() -> Iterator[None]:
    """A real tensor the function closes over becomes an error naming the user's line."""
    try:
        yield
    except AssertionError as e:
        if "convert all Tensors to FakeTensors" not in str(e):
            raise
        from stoker_shapes._internal.provenance import origin_from_traceback

        where = origin_from_traceback(e.__traceback__).describe()
        raise UnsupportedError(
            f"the function uses a tensor that is not one of its inputs ({where}): a global or "
            "a closure variable.  Pass it as an argument, or make it a parameter/buffer of a "
            "module and use aot_module, so the compiled graph does not bake in a stale copy."
        ) from e


def _check_mutated_aliases(fp: list[Any], inputs: list[InputInfo]) -> None:
    by_storage: dict[int, list[int]] = {}
    for i, f in enumerate(fp):
        if isinstance(f, torch.Tensor):
            by_storage.setdefault(storage_key(f), []).append(i)
    for members in by_storage.values():
        if len(members) > 1 and any(inputs[i].mutated for i in members):
            names = ", ".join(inputs[i].source.name for i in members)
            raise UnsupportedError(
                f"inputs {names} share one storage and the function mutates one of them; "
                "stoker-capture does not support mutating aliased inputs.  Pass separate "
                "tensors (e.g. .clone() one of them)."
            )


def _classify_outputs(
    outs: list[Any], fp: list[Any]
) -> tuple[list[OutputInfo], list[int], list[Layout]]:
    by_id = {id(f): i for i, f in enumerate(fp) if isinstance(f, torch.Tensor)}
    inp_storage = {storage_key(f): i for i, f in enumerate(fp) if isinstance(f, torch.Tensor)}
    infos: list[OutputInfo] = []
    groups: dict[int, list[int]] = {}
    for j, o in enumerate(outs):
        if isinstance(o, _SYM):
            infos.append(OutputInfo(OutputKind.SYMBOLIC, False, False))
            continue
        if not isinstance(o, torch.Tensor):
            infos.append(OutputInfo(OutputKind.CONSTANT, False, False, value=o))
            continue
        info = OutputInfo(OutputKind.FRESH, o.requires_grad, _is_float(o))
        if id(o) in by_id:
            info.kind, info.base = OutputKind.IS_INPUT, by_id[id(o)]
        elif storage_key(o) in inp_storage:
            info.kind, info.base = OutputKind.ALIAS_OF_INPUT, inp_storage[storage_key(o)]
            info.layout = Layout.of(o)
        else:
            groups.setdefault(storage_key(o), []).append(j)
        infos.append(info)
    # outputs sharing one storage: regenerate the views from one base
    graph_index = {
        j: k for k, j in enumerate(j for j, i in enumerate(infos) if i.kind != OutputKind.CONSTANT)
    }
    bases: list[int] = []
    base_layouts: list[Layout] = []
    n_user_graph = len(graph_index)
    for members in groups.values():
        if len(members) < 2:
            continue
        roots = [j for j in members if outs[j]._base is None]
        if roots:
            base_graph = graph_index[roots[0]]
            infos[roots[0]].layout = Layout.of(outs[roots[0]])  # the layout views assume
            regen = [j for j in members if j != roots[0]]
        else:
            b = outs[members[0]]._base
            bases.append(members[0])
            base_layouts.append(Layout.of(b))
            base_graph = -len(bases)  # fixed up below: extra outputs follow the user outputs
            regen = members
        for j in regen:
            infos[j].kind = OutputKind.ALIAS_OF_OUTPUT
            infos[j].base = base_graph
            infos[j].layout = Layout.of(outs[j])
    for info in infos:
        if info.kind == OutputKind.ALIAS_OF_OUTPUT and info.base is not None and info.base < 0:
            info.base = n_user_graph + (-info.base - 1)
    return infos, bases, base_layouts
