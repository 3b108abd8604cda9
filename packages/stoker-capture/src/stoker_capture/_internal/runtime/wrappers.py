"""Runtime wrappers: from the compiled graph's outputs back to eager semantics.

After the compiled forward runs, the wrapper (1) writes mutated inputs back
(``as_strided_`` for metadata, ``copy_`` for data), (2) returns inputs that
were returned as themselves, (3) regenerates outputs that alias an input or
another output as views of their base, and (4) rebuilds the output pytree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..autocast import autocast_off
from ..tracing.forward_meta import ForwardMeta, Layout, OutputKind
from .function import FunctionPlan
from .symeval import build_evaluator

_VIEWS = (OutputKind.ALIAS_OF_INPUT, OutputKind.ALIAS_OF_OUTPUT)


def function_plan(meta: ForwardMeta, num_fw_outputs: int, name: str) -> FunctionPlan:
    """Which forward outputs the autograd.Function returns, and which go around it."""
    roles = meta.graph_outputs()
    mask = meta.tangent_mask()
    returned: list[int] = []
    side: list[int] = []
    for k, (role, i) in enumerate(roles):
        if role == "user":
            kind = meta.outputs[i].kind
            if kind == OutputKind.SYMBOLIC:
                side.append(k)
            if kind != OutputKind.FRESH:
                continue  # aliases are regenerated from their base, numbers go around
        returned.append(k)
    tangent_index = {k: t for t, k in enumerate(k for k, m in enumerate(mask) if m)}
    return FunctionPlan(
        num_fw_outputs=num_fw_outputs,
        returned=tuple(returned),
        side=tuple(side),
        non_differentiable=tuple(r for r, k in enumerate(returned) if not mask[k]),
        tangent_of=tuple(tangent_index.get(k) for k in returned),
        name=name,
    )


@dataclass(slots=True)
class _LayoutSlot:
    start: int  # offset of this layout's ints in the evaluator's result
    ndim: int
    dtype: torch.dtype | None = None  # the element type of the view (None: the base's)

    def read(self, vals: Sequence[int]) -> tuple[list[int], list[int], int]:
        s, n = self.start, self.ndim
        return list(vals[s : s + n]), list(vals[s + n : s + 2 * n]), vals[s + 2 * n]


class Runtime:
    """Runs one compiled artifact (joint or inference) with eager input/output semantics."""

    __slots__ = (
        "_direct",
        "_ev",
        "_out_kind",
        "_plain",
        "_slots",
        "forward",
        "function_class",
        "meta",
        "num_mutated",
        "plan",
    )

    def __init__(
        self,
        meta: ForwardMeta,
        fake_primals: Sequence[Any],
        env: Any,
        forward: Callable[..., Any] | None,
        function_class: type[torch.autograd.Function] | None,
        plan: FunctionPlan | None,
        name: str,
    ) -> None:
        self.meta = meta
        self.forward = forward  # the inference path (None for joint)
        self.function_class = function_class  # the training path (None for inference)
        self.plan = plan
        self.num_mutated = len(meta.mutated_inputs)
        layouts: list[tuple[object, Layout]] = []
        for i in meta.mutated_inputs:
            lay = meta.inputs[i].new_layout
            if lay is not None:
                layouts.append((("input", i), lay))
        for j, o in enumerate(meta.outputs):
            if o.layout is not None:
                layouts.append((("output", j), o.layout))
        for k, lay in enumerate(meta.base_layouts):
            layouts.append((("base", k), lay))
        exprs: list[Any] = []
        self._slots: dict[object, _LayoutSlot] = {}
        for key, lay in layouts:
            self._slots[key] = _LayoutSlot(len(exprs), len(lay.size), lay.dtype)
            exprs += [*lay.size, *lay.stride, lay.offset]
        self._ev = build_evaluator(env, fake_primals, exprs, name)
        spec = meta.out_spec
        # torch 2.13 has children() (children_specs is deprecated); 2.11 has children_specs
        kids = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
        flat_tuple = spec.type is tuple and all(c.is_leaf() for c in kids)
        self._out_kind = 1 if spec.is_leaf() else 2 if flat_tuple else 0
        # The steady cases, decided once: the Function returns the forward
        # outputs in order (`_direct`); no input is mutated and every output is a fresh
        # tensor of the graph (`_plain`: returned as they are, no layout to evaluate)
        self._direct = (
            plan is not None
            and not plan.side
            and plan.returned == tuple(range(plan.num_fw_outputs))
        )
        self._plain = (
            not self.num_mutated
            and not self._slots
            and not meta.intermediate_bases
            and all(o.kind == OutputKind.FRESH for o in meta.outputs)
        )

    def __call__(self, primals: list[Any]) -> Any:
        meta = self.meta
        fw: Any
        if self.function_class is not None:
            assert self.plan is not None
            sink: list[Any] = []
            with autocast_off():  # the graph holds autocast's casts already (autocast.py)
                res = self.function_class.apply(sink, *primals)  # type: ignore[no-untyped-call]
            if self._direct:
                fw = res
            else:
                fw = [None] * self.plan.num_fw_outputs
                for k, v in zip(self.plan.returned, res):
                    fw[k] = v
                for k, v in zip(self.plan.side, sink):
                    fw[k] = v
        else:
            assert self.forward is not None
            with autocast_off():
                fw = list(self.forward(*primals))
        if self._plain:  # the graph's outputs are the user's
            n = len(meta.outputs)
            return self._result(fw if len(fw) == n else fw[:n])
        vals = self._ev(primals) if self._slots else []
        # 1. write mutated inputs back into the real inputs
        for k, i in enumerate(meta.mutated_inputs):
            inp, real, new = meta.inputs[i], primals[i], fw[k]
            if inp.mutates_metadata:
                size, stride, off = self._slots[("input", i)].read(vals)
                # not a data change: keep the version counter, so tensors autograd
                # saved from this input stay valid
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(real):  # type: ignore[attr-defined]
                    real.as_strided_(size, stride, off)
            if inp.mutates_data:
                if real.is_leaf and real.requires_grad:
                    # eager allows this only under no_grad (e.g. weight.clamp_ in forward)
                    with torch.no_grad():
                        real.copy_(new)
                elif real.requires_grad or new.requires_grad:
                    real.copy_(new)
                else:
                    with torch.no_grad():
                        real.copy_(new)
        # 2-3. user outputs: fresh from the graph, inputs themselves, or regenerated views
        user = fw[self.num_mutated :]
        bases: dict[int, torch.Tensor] = {}
        out: list[Any] = []
        k = 0
        for j, o in enumerate(meta.outputs):
            if o.kind == OutputKind.CONSTANT:
                out.append(o.value)
                continue
            v = user[k]
            k += 1
            if o.kind == OutputKind.IS_INPUT:
                assert o.base is not None
                v = primals[o.base]
            elif o.kind == OutputKind.ALIAS_OF_INPUT:
                assert o.base is not None
                slot = self._slots[("output", j)]
                v = _view_as(primals[o.base], *slot.read(vals), slot.dtype)
            elif o.kind == OutputKind.ALIAS_OF_OUTPUT:
                assert o.base is not None
                base = bases.get(o.base)
                if base is None:
                    base = bases[o.base] = self._base(o.base, user, vals)
                slot = self._slots[("output", j)]
                v = _view_as(base, *slot.read(vals), slot.dtype)
            if o.kind in _VIEWS and v.requires_grad and not o.requires_grad:
                v = v.detach()  # e.g. x.detach(): a view of x that does not require grad
            out.append(v)
        for b, t in bases.items():  # a base that is itself an output: return the same tensor
            bj = self._user_index(b)
            if bj is not None:
                out[bj] = t
        return self._result(out)

    def _result(self, out: Sequence[Any]) -> Any:
        """The user outputs (flat) in the structure the function returns."""
        if self._out_kind == 1:
            return out[0]  # a single tensor
        if self._out_kind == 2:
            return tuple(out)  # a flat tuple
        return pytree.tree_unflatten(list(out), self.meta.out_spec)

    def _user_index(self, graph_pos: int) -> int | None:
        k = 0
        for j, o in enumerate(self.meta.outputs):
            if o.kind == OutputKind.CONSTANT:
                continue
            if k == graph_pos:
                return j
            k += 1
        return None

    def _base(self, pos: int, user: list[Any], vals: Sequence[int]) -> torch.Tensor:
        """The base of regenerated views, in the layout the views assume (copied if not)."""
        t = user[pos]
        user_j = self._user_index(pos)
        key: object = (
            ("output", user_j) if user_j is not None else ("base", pos - self._n_user_graph())
        )
        size, stride, off = self._slots[key].read(vals)
        if list(t.stride()) == stride and t.storage_offset() == off:
            return t  # type: ignore[no-any-return]
        fixed = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
        if off:
            fixed = torch.empty(
                off + fixed.untyped_storage().nbytes() // t.element_size(),
                dtype=t.dtype,
                device=t.device,
            ).as_strided(size, stride, off)
        fixed.copy_(t)
        return fixed

    def _n_user_graph(self) -> int:
        return sum(o.kind != OutputKind.CONSTANT for o in self.meta.outputs)


def _view_as(
    base: torch.Tensor,
    size: list[int],
    stride: list[int],
    offset: int,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """A view of `base`'s storage with this layout, counted in `dtype` elements.

    Same dtype: ``as_strided``.  Otherwise the whole storage is first viewed as a
    flat tensor of `dtype` (``view_as_complex`` / ``view_as_real`` for a complex
    dtype and its real counterpart, which autograd differentiates like eager's
    views; ``view(dtype)`` else), then ``as_strided`` in its elements.
    """
    if dtype is None or dtype == base.dtype:
        return base.as_strided(size, stride, offset)
    item = base.element_size()
    n = base.untyped_storage().nbytes() // item
    flat = base.as_strided((n,), (1,), 0)
    if dtype.is_complex and dtype.to_real() == base.dtype:
        flat = torch.view_as_complex(flat[: n - n % 2].view(-1, 2))
    elif base.dtype.is_complex and base.dtype.to_real() == dtype:
        flat = torch.view_as_real(flat).view(-1)
    else:
        out_item = dtype.itemsize
        keep = n * item // out_item * out_item // item  # whole elements of `dtype`
        flat = flat[:keep].view(dtype)
    return flat.as_strided(size, stride, offset)
