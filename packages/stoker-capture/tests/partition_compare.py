"""Helpers for the partitioner tests (no tests here): build joint graphs, run partitions.

The partitioner tests build joint graphs themselves with make_fx over a
joint function (core-aten decompositions), so they do not depend on the
capture pipeline.  Imported by name like capture_compare.py (conftest.py puts
this folder on sys.path; pytest's importlib mode does not).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from stoker_capture._internal.partition.core import Partition
from stoker_capture._internal.partition.ops import classify
from stoker_capture._internal.tracing.functional import keep_node


def make_joint(
    f: Callable[..., Any], primals: Sequence[torch.Tensor], *, tracing_mode: str = "real"
) -> tuple[fx.GraphModule, int]:
    """Joint graph of `f` in the partitioner's contract form, and its number of forward outputs.

    Placeholders are ``primals_1..n`` then ``tangents_1..m`` (one per output
    that requires grad); the output is ``(*outs, *grads)``; nodes carry
    ``meta["stoker_phase"]``.
    """
    mask = [p.requires_grad for p in primals]

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> tuple[Any, ...]:
        outs = f(*primals)
        outs = outs if isinstance(outs, tuple) else (outs,)
        diff = [o for o in outs if o.requires_grad]
        wrt = [p for p, m in zip(primals, mask) if m]
        grads = iter(torch.autograd.grad(diff, wrt, tangents, allow_unused=True))
        return (*outs, *[next(grads) if m else None for m in mask])

    with torch.enable_grad():
        outs = f(*primals)
    outs = outs if isinstance(outs, tuple) else (outs,)
    tangents = [torch.randn_like(o) for o in outs if o.requires_grad]
    gm = make_fx(joint, decomposition_table=core_aten_decompositions(), tracing_mode=tracing_mode)(
        list(primals), tangents
    )
    # Flatten the pytree output into the contract's flat tuple.
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out_node.args[0]
    if not isinstance(flat, (tuple, list)):
        flat = (flat,)
    out_node.args = (tuple(flat),)
    gm.graph._codegen = fx.graph.CodeGen()
    tag_phases(gm, len(outs))
    gm.recompile()
    return gm, len(outs)


def tag_phases(gm: fx.GraphModule, num_fw_outputs: int) -> None:
    """meta["stoker_phase"]: "forward" for what the outputs need, else "backward"."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    fw: set[fx.Node] = set()
    stack = [o for o in out_node.args[0][:num_fw_outputs] if isinstance(o, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in fw:
            fw.add(n)
            stack.extend(n.all_input_nodes)
    for n in gm.graph.nodes:
        if n.op != "output":
            n.meta["stoker_phase"] = "forward" if n in fw else "backward"


def eager(
    f: Callable[..., Any], primals: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Outputs and gradients of `f` in eager mode."""
    ps = [p.detach().requires_grad_(p.requires_grad) for p in primals]
    with torch.enable_grad():
        outs = f(*ps)
    outs = outs if isinstance(outs, tuple) else (outs,)
    diff = [o for o in outs if o.requires_grad]
    wrt = [p for p in ps if p.requires_grad]
    gs = iter(torch.autograd.grad(diff, wrt, list(tangents), allow_unused=True))
    return [o.detach() for o in outs], [next(gs) if p.requires_grad else None for p in ps]


def run_partition(
    part: Partition, primals: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Run the forward graph, then the backward graph on what it saved."""
    with torch.no_grad():
        fw_out = part.fw(*[p.detach() for p in primals])
        n = part.num_fw_outputs
        ns = len(part.saved_tensors)
        outs = list(fw_out[:n])
        saved_tensors = list(fw_out[n : n + ns])
        saved_symints = list(fw_out[n + ns :])
        assert len(saved_symints) == len(part.saved_symints)
        # only integers cross (a SymFloat is recomputed from them in the backward)
        assert all(type(s) is int for s in saved_symints), saved_symints
        grads = part.bw(*saved_symints, *saved_tensors, *tangents)
    return outs, list(grads)


def check_against_eager(
    part: Partition,
    f: Callable[..., Any],
    primals: Sequence[torch.Tensor],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """fw then bw reproduce eager outputs and gradients on these (fresh) inputs."""
    with torch.enable_grad():
        outs = f(*[p.detach().requires_grad_(p.requires_grad) for p in primals])
    outs = outs if isinstance(outs, tuple) else (outs,)
    tangents = [torch.randn_like(o) for o in outs if o.requires_grad]
    ref_out, ref_grads = eager(f, primals, tangents)
    got_out, got_grads = run_partition(part, primals, tangents)
    assert len(got_out) == len(ref_out)
    for g, r in zip(got_out, ref_out):
        torch.testing.assert_close(g, r, rtol=rtol, atol=_scaled(atol, r))
    assert len(got_grads) == len(ref_grads)
    for i, (g, r) in enumerate(zip(got_grads, ref_grads)):
        if r is None:
            assert g is None, f"grad {i}: expected None"
        else:
            assert g is not None, f"grad {i}: missing"
            torch.testing.assert_close(g, r, rtol=rtol, atol=_scaled(atol, r))


def _scaled(atol: float, ref: torch.Tensor) -> float:
    """`atol` per unit of the reference's largest magnitude (at least 1): a gradient that
    sums many terms of size ~50 carries fp32 rounding of ~50 * 2**-24 per term in every
    element, so its small elements (cancellations) miss a fixed 1e-5 by chance.  Measured
    on the attention case over 150 seeds: the error stays under 1e-6 of the tensor's
    largest element while reaching 2.5e-5 in absolute terms."""
    return atol * max(1.0, ref.detach().abs().max().item() if ref.numel() else 0.0)


def check_graphs(part: Partition, joint: fx.GraphModule) -> None:
    """Both graphs lint, have no dead code, and keep the joint's node meta."""
    joint_nodes = {n.name: n for n in joint.graph.nodes}
    for gm in (part.fw, part.bw):
        gm.graph.lint()
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            assert n.users or keep_node(n), f"dead node {n.name} in {gm.__class__.__name__}"
            src = joint_nodes[n.name]
            for key in ("val", "stoker_phase", "stack_trace"):
                if key in src.meta:
                    assert key in n.meta, f"{n.name} lost meta[{key!r}]"
    fw_ph = [n.name for n in part.fw.graph.nodes if n.op == "placeholder"]
    assert fw_ph == [n.name for n in joint.graph.nodes if n.name.startswith("primals")]
    bw_ph = [n.name for n in part.bw.graph.nodes if n.op == "placeholder"]
    tangents = [n.name for n in joint.graph.nodes if n.name.startswith("tangents")]
    assert bw_ph == [*part.saved_symints, *part.saved_tensors, *tangents]


def recomputed_kinds(part: Partition) -> dict[str, str]:
    """Kind (partition_ops table) of every node the backward recomputes."""
    return {
        n.name: classify(n)
        for n in part.bw.graph.nodes
        if n.meta.get("stoker_recomputed") and n.name in part.recomputed
    }


def torch_min_cut_saved_bytes(joint: fx.GraphModule, num_fw_outputs: int) -> int:
    """Activation bytes (saved tensors that are not primals) of torch's own min-cut partitioner."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from stoker_capture._internal.partition.core import node_bytes

    gm = copy.deepcopy(joint)
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    fw, _bw = min_cut_rematerialization_partition(gm, inputs, num_fwd_outputs=num_fw_outputs)
    out = next(n for n in fw.graph.nodes if n.op == "output")
    saved = out.args[0][num_fw_outputs:]
    return sum(
        node_bytes(s)
        for s in set(saved)
        if isinstance(s, fx.Node)
        and s.op != "placeholder"
        and isinstance(s.meta.get("val"), torch.Tensor)
    )
