"""Hand an inference `ExportedGraph` to torch's ecosystem as a ``torch.export.ExportedProgram``.

A small module owns the parameters and buffers, calls the graph on the
flattened inputs, writes mutated buffers back (torch.export records that as a
buffer mutation), and is exported with the same dynamic dims.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from .state import OutputKind

if TYPE_CHECKING:
    from .export import ExportedGraph


class _GraphModuleWrapper(torch.nn.Module):
    def __init__(self, exported: ExportedGraph) -> None:
        super().__init__()
        self.graph_module = exported.gm
        self._names: list[str] = []
        for i, (name, t) in enumerate(exported.params.items()):
            attr = f"p{i}_" + name.replace(".", "_")
            self._names.append(attr)
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(attr, t)
            else:
                self.register_buffer(attr, t)
        self._sig = exported.signature
        self._out_spec = pytree.treespec_loads(exported.signature.out_spec)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        sig = self._sig
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        params = [getattr(self, n) for n in self._names]
        primals = [*params, *(leaves[p] for p in sig.user_positions)]
        outs = list(self.graph_module(*primals))
        for k, i in enumerate(sig.mutated_inputs):
            primals[i].copy_(outs[k])
        user = iter(outs[len(sig.mutated_inputs) :])
        flat = [v if kind == OutputKind.CONSTANT.value else next(user) for kind, v in sig.outputs]
        return pytree.tree_unflatten(flat, self._out_spec)


def _set_signature(mod: torch.nn.Module, names: list[str], kw_names: list[str]) -> None:
    """Make ``mod.forward`` present ``(arg0, ..., *, kw...)`` to inspect (it takes *args, **kw)."""
    p = inspect.Parameter
    impl = type(mod).forward

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return impl(self, *args, **kwargs)

    params = [p("self", p.POSITIONAL_OR_KEYWORD)]
    params += [p(n, p.POSITIONAL_OR_KEYWORD) for n in names]
    params += [p(k, p.KEYWORD_ONLY) for k in kw_names]
    forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    mod.__class__ = type("StokerExportedGraph", (type(mod),), {"forward": forward})


def to_torch_export(
    exported: ExportedGraph,
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> torch.export.ExportedProgram:
    """Export the wrapper with torch.export, with the export's `Dim`s as torch Dims."""
    if args is None:
        args, kwargs = exported.example_inputs()
    kwargs = dict(kwargs or {})
    mod = _GraphModuleWrapper(exported)
    dims = exported.signature.dynamic_dims
    made: dict[str, Any] = {}

    def tdim(name: str, lo: int | None, hi: int | None) -> Any:
        if name not in made:
            made[name] = torch.export.Dim(name, min=max(lo or 0, 2), max=hi or 2**31 - 2)
        return made[name]

    specs = [None if d is None else {k: tdim(*v) for k, v in d.items()} for d in dims]
    specs += [None] * (len(args) + len(kwargs) - len(specs))
    # torch.export binds inputs to forward's signature: give the wrapper a named one
    names = [f"arg{i}" for i in range(len(args))]
    _set_signature(mod, names, list(kwargs))
    dynamic_shapes: Any = None
    if any(s is not None for s in specs):
        dynamic_shapes = dict(zip([*names, *kwargs], specs))
    # Our own export already checked every dim against its range; torch 2.11 cannot
    # prove some size identities (min(s*s, 2*s*s) == s*s) and would refuse them as
    # constraint violations: keep what it cannot prove as runtime asserts instead.
    return torch.export.export(
        mod,
        tuple(args),
        kwargs,
        dynamic_shapes=dynamic_shapes,
        prefer_deferred_runtime_asserts_over_guards=True,
    )
