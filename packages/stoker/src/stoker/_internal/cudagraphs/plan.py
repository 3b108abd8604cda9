"""Whether a compiled graph may be recorded into a CUDA graph, decided before its first call.

`plan_graph(gm, example_inputs)` reads the FX graph a compiled callable runs and
its example inputs, and returns a `GraphPlan`: the reason the graph must run as
plain launches (None when it may be recorded), which inputs the graph mutates,
and which inputs have symbolic sizes (they make the size key). The rules, one
row each, in `REASONS`:

| rule        | what makes a replay wrong or impossible                                   |
|-------------|---------------------------------------------------------------------------|
| cpu-sync    | an op that reads tensor data on the host (``.item()``, ``nonzero``, ...)  |
| data-sizes  | sizes that exist only at run time (unbacked symbols)                      |
| random      | seeded random ops: the seed is drawn on the host per call, a replay would |
|             | repeat the recorded one                                                   |
| cpu-tensor  | a CPU tensor among the inputs or constants (a host copy per call)         |
| collective  | a collective (``_c10d_functional``): NCCL is not set up for capture here  |

Whether a device can record at all ("no CUDA device") is the recorder's
question (`cudagraphs.CudaRecorder.unsupported`), not the graph's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

# Ops that read tensor data on the host: under capture they fail, and a replay would
# reuse the value read while recording.
SYNC_OPS: frozenset[Any] = frozenset(
    getattr(aten, name)
    for name in (
        "_local_scalar_dense",
        "item",
        "nonzero",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "equal",
        "is_nonzero",
        "allclose",
        "bincount",
    )
    if hasattr(aten, name)
)

_NUMBERS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)

REASONS: dict[str, str] = {
    "cpu-sync": "{op} reads tensor data on the host (a CPU sync); a replay would reuse the "
    "value read while recording",
    "data-sizes": "sizes that depend on tensor data ({op}); a graph has fixed sizes",
    "random": "random op {op}: its seed is drawn on the host per call, so a replay would "
    "repeat the recorded random numbers",
    "cpu-tensor": "{op} is a CPU tensor; a graph records device work only",
    "collective": "collective {op}: communication is not recorded into CUDA graphs",
}

COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d", "c10d_functional", "_dtensor"})


@dataclass
class GraphPlan:
    """What `plan_graph` decided for one compiled graph."""

    reason: str | None  # why it runs as plain launches; None: it may be recorded
    mutated: frozenset[int] = frozenset()  # inputs the graph writes in place
    # inputs whose sizes are symbolic (their shapes and strides make the size key), and
    # the positions of non-tensor inputs (numbers: their values are part of the key)
    symbolic: tuple[int, ...] = ()
    scalars: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)


def plan_graph(gm: fx.GraphModule | None, example_inputs: Sequence[Any]) -> GraphPlan:
    """The plan for a graph over ``example_inputs``; see the module docstring."""
    symbolic = tuple(
        i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and _has_symbols(x)
    )
    scalars = tuple(i for i, x in enumerate(example_inputs) if isinstance(x, _NUMBERS))
    for i, x in enumerate(example_inputs):
        if x is not None and not isinstance(x, (torch.Tensor, *_NUMBERS)):
            why = f"input {i} is a {type(x).__name__}, not a tensor or a number"
            return GraphPlan(why, symbolic=symbolic, scalars=scalars)
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and _on_device(example_inputs):
            return GraphPlan(_why("cpu-tensor", f"input {i}"), symbolic=symbolic, scalars=scalars)
    if gm is None:
        return GraphPlan(None, symbolic=symbolic, scalars=scalars)
    reason = _graph_reason(gm, example_inputs)
    return GraphPlan(reason, _mutated_inputs(gm), symbolic, scalars)


def _graph_reason(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str | None:
    on_device = _on_device(example_inputs)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and on_device:
            val = _attr(gm, str(n.target))
            if isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dim() > 0:
                return _why("cpu-tensor", f"constant {n.target}")
        if n.op != "call_function":
            continue
        target = n.target
        packet = getattr(target, "overloadpacket", target)
        if target in SYNC_OPS or packet in SYNC_OPS:
            return _why("cpu-sync", _name(target))
        if getattr(target, "namespace", None) in COLLECTIVE_NAMESPACES:
            return _why("collective", _name(target))
        if isinstance(target, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in target.tags
        ):
            return _why("random", _name(target))
        if _unbacked(n.meta.get("val")):
            return _why("data-sizes", _name(target))
    return None


def _mutated_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Placeholders an op of the graph writes (its schema marks the argument written)."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out: set[int] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        schema = n.target._schema
        if not schema.is_mutable:
            continue
        for j, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            val = n.args[j] if j < len(n.args) else n.kwargs.get(arg.name)
            if isinstance(val, fx.Node) and val in index:
                out.add(index[val])
    return frozenset(out)


def _why(rule: str, op: str) -> str:
    return REASONS[rule].format(op=op)


def _name(target: Any) -> str:
    return str(getattr(target, "__name__", target))


def _on_device(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in example_inputs)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _has_symbols(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride()))


def _unbacked(val: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    vals = val if isinstance(val, (list, tuple)) else [val]
    for v in vals:
        if isinstance(v, torch.Tensor | torch.SymInt) and free_unbacked_symbols(v):
            return True
    return False
