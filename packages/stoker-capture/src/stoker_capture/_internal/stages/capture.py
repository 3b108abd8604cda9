"""Stage 1: `aot_stage1_graph_capture` traces a functional core-aten graph.

Inference: ``(*primals) -> (*fw_outputs)``.  Joint (the partitioner's contract):
placeholders ``primals_1..n`` then ``tangents_1..m`` (one per forward output
that gets a gradient); output ``(*fw_outputs, *grads)`` with one grad per
primal (None where none).  Forward outputs: mutated inputs' new values, user
outputs, intermediate bases (see `ForwardMeta.graph_outputs`).  Every node is
tagged ``node.meta["stoker_phase"] = "forward" | "backward"``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._decomp import core_aten_decompositions
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from stoker_shapes import timing

from ..autocast import autocast_off
from ..graphs.lint import lint_graph
from ..tracing.functional import from_fun, functionalized, keep_node, to_fun
from ..tracing.node_meta import backward_meta, module_path, recording_node_meta
from .state import AOTState


@functools.cache
def _core_aten_table() -> dict[Any, Any]:
    """torch's core-aten decompositions, materialized once per process (~0.3 s)."""
    return dict(core_aten_decompositions())


# Backward ops that core aten decomposes but that eager runs as one fused kernel:
# a joint graph (and compiled autograd's backward graph) keeps them whole, so the
# aten executor runs the kernel eager runs (the layer norm backward as 1 op instead
# of 12, GELU's as 1 instead of 10), and stoker-triton decomposes them itself into
# what it fuses (its own table lists each: tested).  Functional, with meta kernels
# that take symbolic sizes; only backward ops, so an inference graph (an export)
# stays core aten.
KEEP_WHOLE_IN_BACKWARD: tuple[str, ...] = (
    "native_layer_norm_backward",
    "native_batch_norm_backward",
    "native_group_norm_backward",
    "gelu_backward",
    "_softmax_backward_data",
    "_log_softmax_backward_data",
    "nll_loss_backward",
    "threshold_backward",
    "sigmoid_backward",
    "tanh_backward",
    "silu_backward",
)
# Of those, the ones whose eager kernel takes a low-precision input with float32
# parameters and statistics (what autocast hands a batch norm): whole even then.
KEEP_WHOLE_WITH_MIXED_DTYPES: frozenset[str] = frozenset({"native_batch_norm_backward"})


@functools.cache
def joint_table() -> dict[Any, Any]:
    """The default decompositions of a joint or backward graph: core aten, where the
    overloads of `KEEP_WHOLE_IN_BACKWARD` decompose only when their tensors' dtypes
    differ (autocast hands a bf16 gradient to a float32 layer norm's backward, which
    the fused kernel rejects and the decomposition promotes), and those of
    `KEEP_WHOLE_WITH_MIXED_DTYPES` never (the batch norm's backward: eager's kernel
    takes a bf16 input with float32 statistics, in one pass, where the decomposition
    holds float32 copies of the activations); built once."""
    keep: dict[Any, bool] = {
        getattr(packet, name): op in KEEP_WHOLE_WITH_MIXED_DTYPES
        for op, packet in ((op, getattr(torch.ops.aten, op)) for op in KEEP_WHOLE_IN_BACKWARD)
        for name in packet.overloads()
    }
    table = {op: fn for op, fn in _core_aten_table().items() if not keep.get(op, False)}
    table = {op: _only_mixed_dtypes(fn) if op in keep else fn for op, fn in table.items()}
    for op in keep:
        if keep[op] and op == torch.ops.aten.native_batch_norm_backward.default:
            table[op] = _batch_norm_stats_as_weight
    return table


def _batch_norm_stats_as_weight(*args: Any, **kwargs: Any) -> Any:
    """``native_batch_norm_backward`` kept whole, its statistics in the weight's dtype.

    torch's meta kernel (and decomposition) of a batch norm with a bf16 input and
    float32 parameters gives bf16 saved statistics, where eager's CPU kernel gives
    float32, and that kernel's backward rejects bf16 statistics beside a float32
    weight ("mixed dtype (CPU): expect parameter to have scalar type of Float"): an
    uncompiled run of the graph (compiled autograd's first backward) would fail. The
    small per-channel statistics are cast to the weight's dtype, and the op recorded
    whole (this function again, now with nothing to cast)."""
    op = torch.ops.aten.native_batch_norm_backward.default
    bound = list(args)
    if kwargs or len(bound) < 7:
        return NotImplemented
    weight, stats = bound[2], bound[3:7]
    known = [t for t in stats if isinstance(t, torch.Tensor)]
    want = weight.dtype if isinstance(weight, torch.Tensor) else (known[0].dtype if known else None)
    if want is None or all(t.dtype == want for t in known):
        return NotImplemented
    cast = [t.to(want) if isinstance(t, torch.Tensor) else t for t in stats]
    return op(*bound[:3], *cast, *bound[7:])


def _only_mixed_dtypes(decomp: Any) -> Any:
    """``decomp`` where the op's floating tensor arguments mix dtypes; else NotImplemented,
    which makes the tracer record the op whole."""

    def maybe(*args: Any, **kwargs: Any) -> Any:
        leaves = [*args, *kwargs.values()]
        dtypes = {a.dtype for a in leaves if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return decomp(*args, **kwargs) if len(dtypes) > 1 else NotImplemented

    return maybe


_KEEP_FUSED_IN_JOINT = [
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
]


@dataclass(slots=True)
class CapturedGraph:
    """A functional core-aten graph of the function, inference or joint.

    Edit ``gm`` (keeping the contract above) and resume with `aot_stage2_compile`.
    """

    gm: fx.GraphModule  # the graph; placeholders primals_* (then tangents_* when joint)
    joint: bool  # forward + backward (else forward only)
    num_fw_outputs: int  # forward outputs at the front of the output tuple
    num_tangents: int  # tangents_* placeholders (0 for inference)
    tangent_mask: list[bool]  # per forward output: does it have a tangent?

    def as_text(self) -> str:
        """The graph's code, each node annotated with its phase and module path."""
        kind = "joint" if self.joint else "inference"
        head = (
            f"# CapturedGraph ({kind}): {self.num_fw_outputs} forward outputs, "
            f"{self.num_tangents} tangents"
        )
        lines = [head]
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                lines.append(f"{n.name}: {_val_text(n)}  # input, {n.meta.get('stoker_phase')}")
            elif n.op == "output":
                lines.append(f"return {n.args[0]}")
            else:
                args = ", ".join(map(str, n.args))
                where = module_path(n)
                note = f"{n.meta.get('stoker_phase', '?')}" + (f", {where}" if where else "")
                lines.append(f"{n.name}: {_val_text(n)} = {n.target}({args})  # {note}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.as_text()


def _val_text(n: fx.Node) -> str:
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    return type(v).__name__ if v is not None else "?"


def aot_stage1_graph_capture(state: AOTState) -> CapturedGraph:
    """Trace ``state.flat_fn`` through functionalization and core-aten decompositions."""
    decomp = state.config.decompositions
    if decomp is not None:
        table = dict(decomp)
    else:
        table = dict(joint_table() if state.joint else _core_aten_table())
    if state.joint:
        # The fused attention forward's decomposition returns the attention weights
        # where its backward formula expects logsumexp: keep the fused op (and its
        # backward op) whole in joint graphs.
        for op in _KEEP_FUSED_IN_JOINT:
            table.pop(op, None)
    meta = state.meta
    mask = meta.tangent_mask()
    fw_names: set[str] = set()

    def inference_fn(*primals: Any) -> tuple[Any, ...]:
        with functionalized():
            fp = [to_fun(p) for p in primals]
            outs = state.flat_fn(*fp)
            return tuple(from_fun(v) for v in meta.forward_values(fp, outs))

    def joint_fn(primals: list[Any], tangents: list[Any]) -> tuple[Any, ...]:
        with functionalized():
            fp = [to_fun(p) for p in primals]
            ft = [to_fun(t) for t in tangents]
            with torch.enable_grad():
                # a mutated input that needs a gradient is cloned first, so the primal
                # keeps its identity for autograd.grad
                f_in = [
                    f.clone() if inp.mutates_data and inp.requires_grad else f
                    for f, inp in zip(fp, meta.inputs)
                ]
                outs = state.flat_fn(*f_in)
            vals = meta.forward_values(f_in, outs)
            fw_out = [from_fun(v) for v in vals]
            mode = get_proxy_mode()
            assert mode is not None
            fw_names.update(n.name for n in mode.tracer.graph.nodes)
            diff = [
                (v, t)
                for v, t, m in zip(vals, _spread_tangents(ft, mask), mask)
                if m and v.requires_grad
            ]
            want = [
                i
                for i, (f, inp) in enumerate(zip(fp, meta.inputs))
                if inp.is_tensor and inp.requires_grad
            ]
            grads: list[Any] = [None] * len(primals)
            if diff and want:
                # the backward as eager runs it outside autocast (see autocast.py); and
                # outside anomaly mode, whose NaN check of each node's outputs would branch
                # on tracing tensors' values (the compiled backward's outputs are checked
                # at run time by the engine, under the caller's anomaly mode)
                with (
                    backward_meta(),
                    eager_autograd_engine(),
                    autocast_off(),
                    torch.autograd.set_detect_anomaly(False),
                ):
                    got = torch.autograd.grad(
                        [v for v, _ in diff],
                        [fp[i] for i in want],
                        [t for _, t in diff],
                        allow_unused=True,
                    )
                for i, g in zip(want, got):
                    grads[i] = from_fun(g)
            return (*fw_out, *grads)

    ctx = state.ctx
    # a lazy graph module: its Python code is generated when first run or printed
    with ctx.tracing(), recording_node_meta(state.module), _use_lazy_graph_module(True):
        if state.joint:
            tangents = [_tangent_like(spec) for spec, m in zip(meta.fw_specs, mask) if m]
            gm = make_fx(joint_fn, decomposition_table=table, record_module_stack=True)(
                list(state.fake_primals), tangents
            )
        else:
            with torch.no_grad():
                gm = make_fx(inference_fn, decomposition_table=table, record_module_stack=True)(
                    *state.fake_primals
                )
    _flatten_signature(gm, state, len(tangents) if state.joint else 0)
    _tag_phases(gm, fw_names if state.joint else None)
    n_fw = len(meta.graph_outputs())
    graph = CapturedGraph(
        gm,
        state.joint,
        n_fw,
        sum(mask) if state.joint else 0,
        mask if state.joint else [False] * n_fw,
    )
    if state.config.debug_checks:
        lint_graph(gm, "stage 1 (capture)")
    if state.config.graph_passes:
        with timing.timed("capture", "capture: graph passes"):
            for graph_pass in state.config.graph_passes:
                graph_pass(gm)
        if state.config.debug_checks:
            lint_graph(gm, "stage 1 (graph passes)")
    return graph


def _spread_tangents(ft: list[Any], mask: list[bool]) -> list[Any]:
    """Tangents spread over the forward outputs (None where an output has none)."""
    it = iter(ft)
    return [next(it) if m else None for m in mask]


def _tangent_like(spec: tuple[tuple[Any, ...], torch.dtype, torch.device] | None) -> torch.Tensor:
    assert spec is not None
    size, dtype, device = spec
    return torch.empty(size, dtype=dtype, device=device)


def _flatten_signature(gm: fx.GraphModule, state: AOTState, n_tangents: int) -> None:
    """Flat placeholders primals_1..n, tangents_1..m and a flat output tuple."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [f"primals_{i + 1}" for i in range(len(state.fake_primals))]
    names += [f"tangents_{i + 1}" for i in range(n_tangents)]
    assert len(phs) == len(names), (len(phs), len(names))
    for n, want in zip(phs, names):
        if n.name != want:
            n.name = want
        n.target = want
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0]
    out.args = (tuple(vals) if isinstance(vals, list | tuple) else (vals,),)
    gm.graph._codegen = fx.graph.CodeGen()
    gm.graph.eliminate_dead_code(is_impure_node=keep_node)
    gm.recompile()


def _tag_phases(gm: fx.GraphModule, fw_names: set[str] | None) -> None:
    for n in gm.graph.nodes:
        if fw_names is None:
            phase = "forward"
        elif n.op == "placeholder":
            phase = "forward" if n.name.startswith("primals_") else "backward"
        elif n.op == "output":
            phase = "backward"
        else:
            phase = "forward" if n.name in fw_names else "backward"
        n.meta["stoker_phase"] = phase
        path = module_path(n)
        if path is not None:
            n.meta["stoker_module_path"] = path


EAGER_DEPTH = [0]
"""How many `eager_autograd_engine` blocks are open (stoker-autograd's router runs every
backward inside one on the eager engine, whatever scope is active)."""


class eager_autograd_engine:  # a class used like a function: ``with eager_autograd_engine():``
    """Unset the compiled-autograd engine hook for a block (its cache is kept).

    The joint trace's ``autograd.grad`` must run on the eager engine: a compiled-autograd
    hook (stoker-autograd's or torch's) would otherwise capture it, on tracing tensors.
    stoker-autograd runs compiled backwards under it too (hooks may call backward), once
    per step: a slotted class, not a generator context manager.  stoker-autograd sets
    its hook per backward call (not for a block), so the block also counts itself in
    `EAGER_DEPTH`, which stoker-autograd reads before it routes a backward."""

    __slots__ = ("_prior",)

    def __enter__(self) -> None:
        self._prior = torch._C._dynamo.compiled_autograd.set_autograd_compiler(None, False)
        EAGER_DEPTH[0] += 1

    def __exit__(self, *exc: object) -> None:
        EAGER_DEPTH[0] -= 1
        torch._C._dynamo.compiled_autograd.set_autograd_compiler(*self._prior)
