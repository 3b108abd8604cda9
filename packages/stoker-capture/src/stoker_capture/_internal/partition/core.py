"""Split a joint forward+backward graph into a forward and a backward graph.

The joint graph (stage 1's output) is the contract:

* placeholders ``primals_1..n`` (parameters and buffers first, then user
  inputs), then ``tangents_1..m`` (one per forward output that requires grad);
* one output, a flat tuple ``(*fw_outputs, *grads)`` with one grad per primal
  (``None`` where the primal gets no gradient);
* functional core-aten nodes, ``node.meta["val"]`` holding fake tensors or
  SymInts (sizes may be symbolic).

A partition decides which forward values the backward receives ("saved")
and which it computes again ("recomputed").  Both partitioners here build
their graphs with `build_partition`, which copies the nodes each side needs
(so neither graph has dead code) and keeps every node's meta.

Invariants of the result:

* ``fw``: inputs are the primals (joint order); outputs are
  ``(*fw_outputs, *saved_tensors, *saved_symints)``.
* ``bw``: inputs are ``(*saved_symints, *saved_tensors, *tangents)``; outputs
  are one grad per primal (``None`` allowed).
* ``saved_bytes`` counts saved tensors that are not primals (activations the
  partition keeps alive; primals are alive anyway), symbolic sizes evaluated
  at their hints.  ``saved_input_bytes`` counts the saved primals.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Container, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental import symbolic_shapes

from ..errors import StokerCaptureError
from ..tracing.functional import keep_node

__all__ = [
    "JointInfo",
    "Partition",
    "PartitionError",
    "analyze_joint",
    "build_partition",
    "cse",
    "default_partition",
    "hint_int",
    "node_bytes",
]

# Size used for an unbacked symbol (no hint) when estimating bytes.
_UNBACKED_FALLBACK = 4096

_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


class PartitionError(StokerCaptureError, ValueError):
    """The joint graph breaks the partitioner's contract (see module docstring)."""


# --------------------------------------------------------------------------- sizes


def hint_int(x: int | torch.SymInt) -> int:
    """A concrete value for a (possibly symbolic) size: its hint, for estimates only."""
    if isinstance(x, int):
        return x
    # torch 2.13 has `optimization_hint` (no guard added); torch 2.11 has `size_hint`
    # with the same meaning (its `hint_int` warns that it is deprecated for it); older
    # torches have `hint_int`.  Branch on what exists.
    for name in ("optimization_hint", "size_hint", "hint_int"):
        fn = getattr(symbolic_shapes, name, None)
        if fn is not None:
            return int(fn(x, fallback=_UNBACKED_FALLBACK))
    hint = getattr(x.node, "hint", None)  # older SymNode attribute
    return int(hint) if hint is not None else _UNBACKED_FALLBACK


def _tensor_bytes(t: torch.Tensor) -> int:
    numel = 1
    for s in t.shape:
        numel *= hint_int(s)
    return numel * t.element_size()


def node_bytes(node: fx.Node) -> int:
    """Bytes of a node's tensor value (or tensors, for a tuple), at size hints; 0 otherwise."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _tensor_bytes(val)
    if isinstance(val, (tuple, list)):
        return sum(_tensor_bytes(v) for v in val if isinstance(v, torch.Tensor))
    return 0


def is_sym_node(node: fx.Node) -> bool:
    """A node whose value is a SymInt/SymFloat/SymBool (or a plain Python scalar)."""
    val = node.meta.get("val")
    return isinstance(val, (*_SYM_TYPES, int, float, bool)) and not isinstance(val, torch.Tensor)


def is_symint_node(node: fx.Node) -> bool:
    """A node whose value is a SymInt or int: the only scalars a partition saves.

    SymFloats and SymBools (e.g. ``1 / (N * H * W)`` in BatchNorm's backward)
    are recomputed in the backward from saved SymInts instead.
    """
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool)


def is_tensor_node(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _shape_str(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(s) for s in val.shape)}]"
    return type(val).__name__ if val is not None else "?"


# --------------------------------------------------------------------------- result


@dataclasses.dataclass(slots=True)
class Partition:
    """A forward graph, a backward graph, and what passes between them."""

    # inputs: primals (joint order); outputs: (*fw_outputs, *saved_tensors, *saved_symints)
    fw: fx.GraphModule
    # inputs: (*saved_symints, *saved_tensors, *tangents); outputs: one grad per primal
    bw: fx.GraphModule
    # number of leading fw outputs that are the user's outputs
    num_fw_outputs: int
    # joint-graph node names, in fw output order
    saved_tensors: list[str]
    # joint-graph node names of SymInt values the backward needs
    saved_symints: list[str]
    # joint-graph node names computed in the forward and again in the backward
    recomputed: list[str]
    # bytes of saved tensors that are not primals, symbolic sizes at their hints
    saved_bytes: int
    # bytes of saved primals (kept alive by the caller anyway)
    saved_input_bytes: int = 0
    # which partitioner made this ("default", "min_cut", "min_cut(budget=0.5)")
    kind: str = "default"
    # per node name: (shape string, bytes, why saved / why recomputed)
    notes: dict[str, tuple[str, int, str]] = dataclasses.field(default_factory=dict)

    @property
    def num_saved(self) -> int:
        return len(self.saved_tensors) + len(self.saved_symints)

    def report(self) -> str:
        """What is saved (name, shape, bytes, why) and what is recomputed (and why)."""
        lines = [
            f"Partition ({self.kind}): {len(self.saved_tensors)} saved tensors, "
            f"{len(self.saved_symints)} saved symints, {len(self.recomputed)} recomputed; "
            f"saved activations {_fmt_bytes(self.saved_bytes)}"
            f" (+ {_fmt_bytes(self.saved_input_bytes)} of inputs, free)",
            "saved tensors:",
        ]
        for name in self.saved_tensors:
            shape, nbytes, why = self.notes.get(name, ("?", 0, ""))
            lines.append(f"  {name:<28} {shape:<28} {_fmt_bytes(nbytes):>10}  {why}")
        if self.saved_symints:
            lines.append("saved symints:")
            for name in self.saved_symints:
                shape, _, why = self.notes.get(name, ("?", 0, ""))
                lines.append(f"  {name:<28} {shape:<28} {'':>10}  {why}")
        if self.recomputed:
            lines.append("recomputed in the backward:")
            for name in self.recomputed:
                shape, nbytes, why = self.notes.get(name, ("?", 0, ""))
                lines.append(f"  {name:<28} {shape:<28} {_fmt_bytes(nbytes):>10}  {why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def _fmt_bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


# --------------------------------------------------------------------------- CSE


def _hashable(x: Any) -> Any:
    """A hashable key for an argument; leaves carry their type (1, 1.0 and True differ)."""
    if isinstance(x, fx.Node):
        return ("node", x)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_hashable(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, _hashable(v)) for k, v in x.items())))
    return (type(x), x)


def cse(joint: fx.GraphModule) -> fx.GraphModule:
    """A copy of `joint` in which identical pure nodes are computed once.

    The backward often recomputes what the forward already has (``eq(x, max)``
    in both); merged, the value is saved once instead of twice.  Random and
    impure ops are never merged.  Kept nodes keep their names and meta.
    """
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    seen: dict[Any, fx.Node] = {}
    for n in joint.graph.nodes:
        if n.op == "call_function" and not _never_merge(n):
            args = fx.node.map_arg(n.args, lambda a: env[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
            try:
                key: Any = (n.target, _hashable(args), _hashable(kwargs))
                hash(key)
            except TypeError:
                key = None
            if key is not None and key in seen:
                env[n] = seen[key]
                continue
            env[n] = g.node_copy(n, lambda a: env[a])
            if key is not None:
                seen[key] = env[n]
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    # lazy: its Python code is generated when first run or printed, not for every pass
    return _LazyGraphModule(joint, g, class_name=type(joint).__name__)


def _never_merge(n: fx.Node) -> bool:
    target = n.target
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or keep_node(n)


# --------------------------------------------------------------------------- analysis


@dataclasses.dataclass(slots=True)
class JointInfo:
    """What a partitioner needs to know about a joint graph."""

    graph: fx.Graph
    primals: list[fx.Node]
    tangents: list[fx.Node]
    # the joint output tuple, split (entries may be None or constants)
    fw_outputs: list[Any]
    grads: list[Any]
    # nodes that depend on a tangent: they can only run in the backward
    tangent_dependent: set[fx.Node]
    # ancestors of the forward outputs (the forward must compute them)
    required_fw: set[fx.Node]
    # ancestors of the grads and of backward asserts (what the backward needs)
    needed_bw: set[fx.Node]
    # impure nodes (runtime asserts) that nothing uses; kept on their side
    impure: list[fx.Node]
    # node -> index in graph order
    order: dict[fx.Node, int]


def _ancestors(roots: Iterable[Any], stop: Container[fx.Node] = frozenset()) -> set[fx.Node]:
    """The nodes among `roots` and their inputs, transitively; the walk does not
    go past a node in `stop` (that node is included)."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stop:
            continue
        stack.extend(n.all_input_nodes)
    return seen


def analyze_joint(joint: fx.GraphModule, num_fw_outputs: int) -> JointInfo:
    """Check the joint graph against the contract and classify its nodes."""
    graph = joint.graph
    primals: list[fx.Node] = []
    tangents: list[fx.Node] = []
    for n in graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name.startswith("primals"):
            if tangents:
                raise PartitionError(
                    f"joint graph: placeholder {n.name!r} comes after a tangent; primals must "
                    "come first (primals_1..n, then tangents_1..m)"
                )
            primals.append(n)
        elif n.name.startswith("tangents"):
            tangents.append(n)
        else:
            raise PartitionError(
                f"joint graph: placeholder {n.name!r} is neither primals_* nor tangents_*; "
                "rename the joint graph's inputs to the contract names"
            )
    outs = [n for n in graph.nodes if n.op == "output"]
    if len(outs) != 1:
        raise PartitionError(f"joint graph has {len(outs)} output nodes, expected 1")
    flat = outs[0].args[0]
    if not isinstance(flat, (tuple, list)):
        flat = (flat,)
    flat = list(flat)
    if num_fw_outputs < 0 or len(flat) != num_fw_outputs + len(primals):
        raise PartitionError(
            f"joint graph returns {len(flat)} values; expected num_fw_outputs "
            f"({num_fw_outputs}) + one grad per primal ({len(primals)}) = "
            f"{num_fw_outputs + len(primals)}"
        )
    fw_outputs, grads = flat[:num_fw_outputs], flat[num_fw_outputs:]

    order = {n: i for i, n in enumerate(graph.nodes)}
    tangent_dependent: set[fx.Node] = set(tangents)
    for n in graph.nodes:
        if n.op == "placeholder" or n.op == "output":
            continue
        if any(a in tangent_dependent for a in n.all_input_nodes):
            tangent_dependent.add(n)

    fw_roots = [o for o in fw_outputs if isinstance(o, fx.Node)]
    required_fw = _ancestors(fw_roots)
    bad = required_fw & tangent_dependent
    if bad:
        first = min(bad, key=order.__getitem__)
        raise PartitionError(
            f"joint graph: forward output depends on a tangent through {first.name!r}; "
            "forward outputs must be computable from the primals alone"
        )
    impure = [
        n
        for n in graph.nodes
        if n.op == "call_function" and not n.users and keep_node(n) and n not in required_fw
    ]
    # what the backward computes: the grads and its runtime asserts
    bw_roots = [g for g in grads if isinstance(g, fx.Node)]
    needed_bw = _ancestors([*bw_roots, *(n for n in impure if n in tangent_dependent)])
    return JointInfo(
        graph=graph,
        primals=primals,
        tangents=tangents,
        fw_outputs=fw_outputs,
        grads=grads,
        tangent_dependent=tangent_dependent,
        required_fw=required_fw,
        needed_bw=needed_bw,
        impure=impure,
        order=order,
    )


# --------------------------------------------------------------------------- building


def _extract(
    owner: fx.GraphModule,
    info: JointInfo,
    inputs: Sequence[fx.Node],
    outputs: Sequence[Any],
    extra_roots: Sequence[fx.Node],
    *,
    what: str,
    mark_recomputed: set[fx.Node] | None = None,
) -> fx.GraphModule:
    """Copy the nodes `outputs` need, starting from `inputs`, into a new graph module."""
    input_set = set(inputs)
    needed = _ancestors((*outputs, *extra_roots), stop=input_set)
    missing = [n for n in needed if n.op == "placeholder" and n not in input_set]
    if missing:
        first = min(missing, key=info.order.__getitem__)
        raise PartitionError(
            f"internal error building the {what} graph: it needs {first.name!r}, "
            "which is not among its inputs"
        )

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        p = g.placeholder(n.name)
        p.meta = copy.copy(n.meta)
        env[n] = p
    for n in info.graph.nodes:
        if n in needed and n not in input_set and n.op not in ("placeholder", "output"):
            new = g.node_copy(n, lambda a: env[a])
            if mark_recomputed is not None and n in mark_recomputed:
                new.meta["stoker_recomputed"] = True
            env[n] = new
    g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    if mark_recomputed:
        sink_recomputed(g)
    g.lint()
    # lazy: a compiler that never runs the graph module skips generating its code
    return _LazyGraphModule(owner, g, class_name=f"Stoker{what.capitalize()}")


def sink_recomputed(g: fx.Graph) -> None:
    """Move each recomputed node of a backward graph to just before its first reader.

    Copied in joint order, the forward nodes a backward recomputes would all run
    at its start, and their results (often fp32 upcasts under autocast, the
    sigmoid of a SiLU) would stay alive until the layer that reads them, where
    eager computes nothing early. The latest node moves first, so a chain follows
    its last link down. A node whose result is less than half its largest input
    (a reduction) stays: moved, it would keep that input alive longer instead.
    """
    nodes = [n for n in g.nodes if n.meta.get("stoker_recomputed")]
    for n in reversed(nodes):
        if n.op != "call_function" or n.is_impure() or not n.users:
            continue
        ins = [node_bytes(a) for a in n.all_input_nodes]
        if ins and 2 * node_bytes(n) < max(ins):
            continue
        first = min(n.users)
        if first.op != "output" and first.prev is not n:
            first.prepend(n)


def build_partition(
    joint: fx.GraphModule,
    info: JointInfo,
    saved: Iterable[fx.Node],
    *,
    kind: str,
    why: dict[fx.Node, str] | None = None,
) -> Partition:
    """Forward and backward graphs that pass exactly `saved` between them.

    `saved` may hold tensor nodes and SymInt nodes; none may depend on a
    tangent.  Everything else the backward needs it computes from the saved
    values and the tangents (a forward node computed there is "recomputed").
    """
    why = why or {}
    saved_list = sorted(set(saved), key=info.order.__getitem__)
    for n in saved_list:
        if n in info.tangent_dependent:
            raise PartitionError(f"internal error: saved value {n.name!r} depends on a tangent")
        if not (is_tensor_node(n) or is_symint_node(n)):
            raise PartitionError(
                f"internal error: saved value {n.name!r} is neither a tensor nor a SymInt "
                f"(meta val {type(n.meta.get('val')).__name__})"
            )
    saved_tensors = [n for n in saved_list if is_tensor_node(n)]
    saved_symints = [n for n in saved_list if not is_tensor_node(n)]

    bw_inputs = [*saved_symints, *saved_tensors, *info.tangents]
    bw_impure = [n for n in info.impure if n in info.tangent_dependent]
    fw_impure = [n for n in info.impure if n not in info.tangent_dependent]

    # Nodes the backward computes: ancestors of the grads stopping at its inputs.
    bw_nodes = _ancestors(info.grads, set(bw_inputs))
    fw_nodes = _ancestors([*info.fw_outputs, *saved_list, *fw_impure], set(info.primals))
    recomputed = sorted(
        (n for n in bw_nodes if n in fw_nodes and n.op != "placeholder" and n not in bw_inputs),
        key=info.order.__getitem__,
    )
    fw = _extract(
        joint,
        info,
        info.primals,
        [*info.fw_outputs, *saved_tensors, *saved_symints],
        fw_impure,
        what="forward",
    )
    bw = _extract(
        joint,
        info,
        bw_inputs,
        info.grads,
        bw_impure,
        what="backward",
        mark_recomputed=set(recomputed),
    )
    notes: dict[str, tuple[str, int, str]] = {}
    primal_set = set(info.primals)
    saved_bytes = 0
    saved_input_bytes = 0
    for n in saved_tensors:
        b = node_bytes(n)
        if n in primal_set:
            saved_input_bytes += b
            reason = why.get(n, "input (alive anyway)")
        else:
            saved_bytes += b
            reason = why.get(n, _default_why(n))
        notes[n.name] = (_shape_str(n), b, reason)
    for n in saved_symints:
        notes[n.name] = (str(n.meta.get("val")), 0, why.get(n, "size used by the backward"))
    for n in recomputed:
        notes[n.name] = (_shape_str(n), node_bytes(n), why.get(n, "recomputed"))
    return Partition(
        fw=fw,
        bw=bw,
        num_fw_outputs=len(info.fw_outputs),
        saved_tensors=[n.name for n in saved_tensors],
        saved_symints=[n.name for n in saved_symints],
        recomputed=[n.name for n in recomputed],
        saved_bytes=saved_bytes,
        saved_input_bytes=saved_input_bytes,
        kind=kind,
        notes=notes,
    )


def _default_why(n: fx.Node) -> str:
    target = n.target
    name = getattr(target, "__name__", str(target)) if n.op == "call_function" else n.op
    return f"{name} output used by the backward"


# --------------------------------------------------------------------------- default


def default_partition(
    joint: fx.GraphModule, *, num_fw_outputs: int, memory_budget: float | None = None
) -> Partition:
    """Save every forward value the backward needs; recompute nothing.

    The forward computes what its outputs need from the primals, plus the
    SymInts the backward uses (saved as symints) and the items of forward
    multi-output ops the backward reads.  Every forward value used by a
    backward node is saved.  `memory_budget` is accepted for signature
    compatibility with `min_cut_partition` and ignored (this is budget 1).
    """
    del memory_budget
    info = analyze_joint(joint, num_fw_outputs)
    fw_set = set(info.required_fw) | set(info.primals)
    for n in info.graph.nodes:
        if n in info.tangent_dependent or n in fw_set or n not in info.needed_bw:
            continue
        if is_symint_node(n):
            # sizes the backward needs: computed in the forward, saved as symints
            fw_set.add(n)
        elif (
            n.op == "call_function"
            and n.target is operator.getitem
            and isinstance(n.args[0], fx.Node)
            and n.args[0] in fw_set
        ):
            # an item of a forward multi-output op (a tuple cannot be saved)
            fw_set.add(n)
    # Walk back from the grads; a forward value stops the walk and is saved,
    # except SymFloat/SymBool scalars, which the backward recomputes.
    savable = {n for n in fw_set if not (is_sym_node(n) and not is_symint_node(n))}
    roots = [*info.grads, *(n for n in info.impure if n in info.tangent_dependent)]
    saved = _ancestors(roots, stop=savable) & savable
    return build_partition(joint, info, saved, kind="default")
