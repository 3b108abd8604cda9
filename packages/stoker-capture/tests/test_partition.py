"""default_partition and min_cut_partition on joint graphs built with make_fx.

Every model is checked the same way: forward graph then backward graph
reproduce eager outputs and gradients on fresh random inputs; both graphs
lint, have no dead code and keep node meta.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import partition_compare as H
import pytest
import torch
import torch.nn.functional as F

from stoker_capture._internal.partition.core import PartitionError, default_partition
from stoker_capture._internal.partition.mincut import min_cut_partition

# --------------------------------------------------------------------------- models
# Each returns (f, make_primals): f(*primals) -> output(s); make_primals(batch) -> fresh inputs.


def mlp() -> tuple[Callable[..., Any], Callable[[int], list[torch.Tensor]]]:
    def f(w1, b1, w2, b2, x):  # type: ignore[no-untyped-def]
        h = F.gelu(F.linear(x, w1, b1))
        return F.linear(h, w2, b2).tanh()

    def make(batch: int) -> list[torch.Tensor]:
        return [
            torch.randn(32, 16, requires_grad=True),
            torch.randn(32, requires_grad=True),
            torch.randn(8, 32, requires_grad=True),
            torch.randn(8, requires_grad=True),
            torch.randn(batch, 16),
        ]

    return f, make


def attention() -> tuple[Callable[..., Any], Callable[[int], list[torch.Tensor]]]:
    C, T, H_ = 16, 6, 2

    def f(g, b, wqkv, wo, x):  # type: ignore[no-untyped-def]
        B = x.shape[0]
        h = F.layer_norm(x, (C,), g, b)
        q, k, v = F.linear(h, wqkv).split(C, dim=-1)
        q = q.view(B, T, H_, C // H_).transpose(1, 2)
        k = k.view(B, T, H_, C // H_).transpose(1, 2)
        v = v.view(B, T, H_, C // H_).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H_)
        att = att.softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return x + F.linear(y, wo)

    def make(batch: int) -> list[torch.Tensor]:
        return [
            1 + 0.1 * torch.randn(C, requires_grad=True),
            torch.randn(C, requires_grad=True),
            0.3 * torch.randn(3 * C, C, requires_grad=True),
            0.3 * torch.randn(C, C, requires_grad=True),
            torch.randn(batch, T, C),
        ]

    return f, make


def cnn() -> tuple[Callable[..., Any], Callable[[int], list[torch.Tensor]]]:
    def f(w1, b1, w2, x):  # type: ignore[no-untyped-def]
        h = F.relu(F.conv2d(x, w1, b1, padding=1))
        h = torch.sigmoid(F.conv2d(h, w2, stride=2)) * h[:, :4, ::2, ::2]
        return h.mean(dim=(2, 3))

    def make(batch: int) -> list[torch.Tensor]:
        return [
            0.3 * torch.randn(8, 3, 3, 3, requires_grad=True),
            torch.randn(8, requires_grad=True),
            0.3 * torch.randn(4, 8, 2, 2, requires_grad=True),
            torch.randn(batch, 3, 8, 8),
        ]

    return f, make


def batchnorm() -> tuple[Callable[..., Any], Callable[[int], list[torch.Tensor]]]:
    """Training BatchNorm (no running stats): its backward divides by N*H*W (a SymFloat)."""

    def f(w, g, b, x):  # type: ignore[no-untyped-def]
        h = F.conv2d(x, w, padding=1)
        return F.silu(F.batch_norm(h, None, None, g, b, training=True)).mean(dim=(2, 3))

    def make(batch: int) -> list[torch.Tensor]:
        return [
            0.3 * torch.randn(4, 3, 3, 3, requires_grad=True),
            1 + 0.1 * torch.randn(4, requires_grad=True),
            torch.randn(4, requires_grad=True),
            torch.randn(batch, 3, 6, 6),
        ]

    return f, make


def pointwise_heavy() -> tuple[Callable[..., Any], Callable[[int], list[torch.Tensor]]]:
    def f(w, x):  # type: ignore[no-untyped-def]
        h = x @ w
        for _ in range(4):
            h = torch.sin(h) * torch.sigmoid(h) + h.tanh().exp().mul(0.1)
        return h

    def make(batch: int) -> list[torch.Tensor]:
        return [0.3 * torch.randn(16, 16, requires_grad=True), torch.randn(batch, 16)]

    return f, make


MODELS = {
    "mlp": mlp,
    "attention": attention,
    "cnn": cnn,
    "batchnorm": batchnorm,
    "pointwise": pointwise_heavy,
}
PARTITIONERS = {
    "default": lambda gm, n: default_partition(gm, num_fw_outputs=n),
    "min_cut": lambda gm, n: min_cut_partition(gm, num_fw_outputs=n),
    "min_cut_half": lambda gm, n: min_cut_partition(gm, num_fw_outputs=n, memory_budget=0.5),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("partitioner", list(PARTITIONERS))
def test_matches_eager(model: str, partitioner: str) -> None:
    f, make = MODELS[model]()
    gm, n = H.make_joint(f, make(4))
    part = PARTITIONERS[partitioner](gm, n)
    H.check_graphs(part, gm)
    H.check_against_eager(part, f, make(4))
    assert part.report().startswith("Partition (")


@pytest.mark.parametrize("model", ["mlp", "attention", "batchnorm", "pointwise"])
@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_dynamic_batch(model: str, partitioner: str) -> None:
    """Traced with a symbolic batch: saved symints carry the batch to the backward."""
    f, make = MODELS[model]()
    gm, n = H.make_joint(f, make(5), tracing_mode="symbolic")
    part = PARTITIONERS[partitioner](gm, n)
    H.check_graphs(part, gm)
    if model != "pointwise":  # its backward has no view or expand that names a size
        assert part.saved_symints, "the backward needs the symbolic batch size"
    for batch in (3, 7):
        H.check_against_eager(part, f, make(batch))


@pytest.mark.parametrize("model", list(MODELS))
def test_min_cut_never_recomputes_expensive_or_random(model: str) -> None:
    f, make = MODELS[model]()
    gm, n = H.make_joint(f, make(4))
    part = min_cut_partition(gm, num_fw_outputs=n)
    kinds = H.recomputed_kinds(part)
    assert set(kinds) == set(part.recomputed)
    bad = {k: v for k, v in kinds.items() if v in ("extern", "reduction", "random", "other")}
    assert not bad, bad


def test_min_cut_saves_fewer_bytes_on_pointwise_heavy() -> None:
    for model in ("pointwise", "mlp", "attention"):
        f, make = MODELS[model]()
        gm, n = H.make_joint(f, make(4))
        d = default_partition(gm, num_fw_outputs=n)
        m = min_cut_partition(gm, num_fw_outputs=n)
        assert m.saved_bytes < d.saved_bytes, (model, m.report(), d.report())
        assert m.recomputed, model


def test_memory_budget_one_is_default() -> None:
    f, make = MODELS["attention"]()
    gm, n = H.make_joint(f, make(4))
    d = default_partition(gm, num_fw_outputs=n)
    m = min_cut_partition(gm, num_fw_outputs=n, memory_budget=1.0)
    assert m.saved_tensors == d.saved_tensors
    assert m.saved_symints == d.saved_symints
    assert m.recomputed == [] and m.saved_bytes == d.saved_bytes
    assert str(m.fw.code) == str(d.fw.code) and str(m.bw.code) == str(d.bw.code)


def test_memory_budget_is_monotone() -> None:
    f, make = MODELS["pointwise"]()
    gm, n = H.make_joint(f, make(4))
    sizes = [
        min_cut_partition(gm, num_fw_outputs=n, memory_budget=b).saved_bytes
        for b in (0.0, 0.3, 0.7, 1.0)
    ]
    assert sizes == sorted(sizes), sizes
    assert sizes[0] < sizes[-1]
    lo, hi = sizes[0], sizes[-1]
    for b, s in zip((0.3, 0.7), sizes[1:3]):
        assert s <= lo + b * (hi - lo) + 1e-6, (b, s, sizes)


def test_memory_budget_out_of_range() -> None:
    f, make = MODELS["mlp"]()
    gm, n = H.make_joint(f, make(2))
    with pytest.raises(ValueError, match="memory_budget must be in"):
        min_cut_partition(gm, num_fw_outputs=n, memory_budget=1.5)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tracing_mode", ["real", "symbolic"])
def test_no_more_bytes_than_torch_min_cut(model: str, tracing_mode: str) -> None:
    f, make = MODELS[model]()
    gm, n = H.make_joint(f, make(4), tracing_mode=tracing_mode)
    ours = min_cut_partition(gm, num_fw_outputs=n).saved_bytes
    theirs = H.torch_min_cut_saved_bytes(gm, n)
    assert ours <= theirs, (ours, theirs)


def test_dropout_is_not_recomputed() -> None:
    def f(w, x):  # type: ignore[no-untyped-def]
        return (F.dropout(x @ w, p=0.5, training=True) * 2).sigmoid()

    w = torch.randn(8, 8, requires_grad=True)
    gm, n = H.make_joint(f, [w, torch.randn(4, 8)])
    part = min_cut_partition(gm, num_fw_outputs=n)
    random_in_bw = [
        nd.name
        for nd in part.bw.graph.nodes
        if nd.op == "call_function"
        and torch.Tag.nondeterministic_seeded in getattr(nd.target, "tags", ())
    ]
    assert random_in_bw == []
    # Forward then backward on the same seed reproduce the joint graph run on that seed.
    x = torch.randn(4, 8)
    t = torch.randn(4, 8)
    torch.manual_seed(0)
    ref = gm(w.detach(), x, t)
    torch.manual_seed(0)
    fw_out = part.fw(w.detach(), x)
    k = len(part.saved_tensors)
    grads = part.bw(*fw_out[1 + k :], *fw_out[1 : 1 + k], t)
    torch.testing.assert_close(fw_out[0], ref[0])
    torch.testing.assert_close(grads[0], ref[1])


def test_unused_input_and_no_grad_output() -> None:
    def f(w, unused, x):  # type: ignore[no-untyped-def]
        y = (x @ w).relu()
        return y, y.detach().sum(), x.shape[0] * y

    prims = [
        torch.randn(4, 4, requires_grad=True),
        torch.randn(3, requires_grad=True),
        torch.randn(2, 4),
    ]
    gm, n = H.make_joint(f, prims)
    for part in (default_partition(gm, num_fw_outputs=n), min_cut_partition(gm, num_fw_outputs=n)):
        H.check_graphs(part, gm)
        H.check_against_eager(part, f, prims)
        assert part.bw.graph.output_node().args[0][1] is None


def test_bad_joint_graphs_are_rejected() -> None:
    f, make = MODELS["mlp"]()
    gm, n = H.make_joint(f, make(2))
    with pytest.raises(PartitionError, match="expected num_fw_outputs"):
        default_partition(gm, num_fw_outputs=n + 1)
    gm.graph.find_nodes(op="placeholder")[0].name = "weight"
    with pytest.raises(PartitionError, match="neither primals_\\* nor tangents_\\*"):
        min_cut_partition(gm, num_fw_outputs=n)


def test_report_lists_saved_and_recomputed() -> None:
    f, make = MODELS["pointwise"]()
    gm, n = H.make_joint(f, make(4))
    part = min_cut_partition(gm, num_fw_outputs=n)
    text = part.report()
    for name in part.saved_tensors + part.recomputed:
        assert name in text
    assert "cheaper to recompute" in text
    assert "float32[4, 16]" in text


def test_constant_tensor_attribute() -> None:
    """A captured constant (get_attr) used on both sides reaches the backward graph."""
    const = torch.randn(4, 4)

    def f(w, x):  # type: ignore[no-untyped-def]
        return ((x @ w) * const).sin() * const

    prims = [torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)]
    gm, n = H.make_joint(f, prims)
    assert any(nd.op == "get_attr" for nd in gm.graph.nodes)
    for part in (default_partition(gm, num_fw_outputs=n), min_cut_partition(gm, num_fw_outputs=n)):
        H.check_graphs(part, gm)
        H.check_against_eager(part, f, [torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)])


def test_cse_merges_pure_duplicates_only() -> None:
    from stoker_capture._internal.partition.core import cse

    def f(w, x):  # type: ignore[no-untyped-def]
        a = (x * w).sin()
        b = (x * w).sin()
        noise = torch.rand_like(x) + torch.rand_like(x)  # two draws: never merged
        return a + b + noise * 0 + (x * w + 1.0) + (x * w + 1)

    prims = [torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)]
    gm, n = H.make_joint(f, prims)

    def count(g: torch.fx.GraphModule, name: str) -> int:
        return sum(1 for nd in g.graph.nodes if nd.op == "call_function" and name in str(nd.target))

    merged = cse(gm)
    merged.graph.lint()
    assert count(gm, "aten.sin") >= 2 and count(merged, "aten.sin") == 1
    assert count(merged, "aten.rand_like") == count(gm, "aten.rand_like") == 2
    # `+ 1.0` and `+ 1` are different ops on an integer-typed scalar: both kept
    plus_one = [
        nd.args[1]
        for nd in merged.graph.nodes
        if nd.target is torch.ops.aten.add.Tensor and nd.args[1] in (1, 1.0)
    ]
    assert sorted(type(v).__name__ for v in plus_one) == ["float", "int"], plus_one
    t = torch.randn(4, 4)
    torch.manual_seed(0)
    ref = gm(*prims, t)
    torch.manual_seed(0)
    got = merged(*prims, t)
    for r, g in zip(ref, got):
        if r is not None:
            torch.testing.assert_close(g, r)
    # min-cut partitions the merged graph: the duplicate sin is computed (and saved) once
    part = min_cut_partition(gm, num_fw_outputs=n)
    H.check_graphs(part, gm)
    H.check_against_eager(part, f, [torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)])
    assert count(part.fw, "aten.sin") == 1


def test_runtime_asserts_stay_on_their_side() -> None:
    """Impure nodes nothing uses (runtime asserts) are kept: forward ones in fw, others in bw."""
    f, make = MODELS["mlp"]()
    gm, n = H.make_joint(f, make(4))
    aten = torch.ops.aten
    g = gm.graph
    out = g.output_node()
    tangent = next(nd for nd in g.nodes if nd.name == "tangents_1")
    primal = next(nd for nd in g.nodes if nd.name == "primals_4")  # b2: not saved otherwise
    with g.inserting_before(out):
        # a tangent-independent value only the backward assert reads
        fw_val = g.call_function(aten.exp.default, (primal,))
        s = g.call_function(aten.sum.default, (g.call_function(aten.mul.Tensor, (tangent, 0.0)),))
        bw_check = g.call_function(
            aten.ne.Scalar, (g.call_function(aten.add.Tensor, (s, fw_val)), 1e9)
        )
        g.call_function(
            aten._assert_async.msg, (g.call_function(aten.all.default, (bw_check,)), "bw")
        )
        fw_check = g.call_function(
            aten.ne.Scalar, (g.call_function(aten.sum.default, (primal,)), 1e9)
        )
        g.call_function(aten._assert_async.msg, (fw_check, "fw"))
    gm.recompile()
    for part in (default_partition(gm, num_fw_outputs=n), min_cut_partition(gm, num_fw_outputs=n)):
        fw_msgs = [nd.args[1] for nd in part.fw.graph.nodes if nd.target is aten._assert_async.msg]
        bw_msgs = [nd.args[1] for nd in part.bw.graph.nodes if nd.target is aten._assert_async.msg]
        assert (fw_msgs, bw_msgs) == (["fw"], ["bw"]), part.kind
        H.check_graphs(part, gm)
        H.check_against_eager(part, f, make(4))


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_a_float_read_with_item_is_reread_in_the_backward(partitioner: str) -> None:
    # Dynamo passes a changing Python float as a 0-d tensor and reads it with .item():
    # the backward needs that SymFloat, which cannot be saved as a size; it re-reads it
    # from the saved input instead of failing with "no finite cut".
    def f(w, s, x):  # type: ignore[no-untyped-def]
        return (x @ w) ** 3 * s.item()

    def make(batch: int) -> list[torch.Tensor]:
        return [
            torch.randn(6, 4, requires_grad=True),
            torch.tensor(0.5 + batch, dtype=torch.float64),
            torch.randn(batch, 6),
        ]

    gm, n = H.make_joint(f, make(3), tracing_mode="symbolic")
    part = PARTITIONERS[partitioner](gm, n)
    H.check_graphs(part, gm)
    H.check_against_eager(part, f, make(3))


# --------------------------------------------------------------------------- checkpointing


def _checkpointed_blocks(
    dropout: bool = False,
) -> tuple[Callable[..., Any], Callable[[int], list[torch.Tensor]]]:
    """Two MLP blocks, each tagged as `torch.utils.checkpoint` tags a region when it is
    traced for a compiler (``meta["recompute"]``, ``meta["ac_graph_id"]``), then an
    untagged head.  Run under ``fx_traceback.preserve_node_meta()`` to keep the tags."""
    import torch.fx.traceback as fx_traceback
    from torch.utils.checkpoint import CheckpointPolicy

    def block(gid: int, w1: torch.Tensor, w2: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        meta = fx_traceback.current_meta
        meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=gid)
        try:
            y = F.gelu(F.layer_norm(h, h.shape[-1:]) @ w1)
            if dropout:
                y = F.dropout(y, p=0.3, training=True)
            return h + y @ w2
        finally:
            del meta["recompute"], meta["ac_graph_id"]

    def f(w0, w1, w2, w3, w4, head, x):  # type: ignore[no-untyped-def]
        h = x @ w0
        h = block(1, w1, w2, h)
        h = block(2, w3, w4, h)
        return (h @ head).tanh()

    def make(batch: int) -> list[torch.Tensor]:
        ws = [0.3 * torch.randn(s, requires_grad=True) for s in [(8, 16), (16, 32), (32, 16)] * 2]
        return [*ws[:1], *ws[1:3], *ws[4:6], 0.3 * torch.randn(16, 4, requires_grad=True),
                torch.randn(batch, 8)]  # fmt: skip

    return f, make


def test_checkpointed_regions_are_recomputed_and_their_inputs_saved() -> None:
    """A checkpointed region is recomputed in the backward, matmuls and layer norms
    included; what is saved is each region's input (the first one's, and the output of
    the first region that the second reads), as eager's checkpoint saves them."""
    import torch.fx.traceback as fx_traceback

    f, make = _checkpointed_blocks()
    prims = make(4)
    with fx_traceback.preserve_node_meta():
        gm, n = H.make_joint(f, prims)
    tagged = {nd.name for nd in gm.graph.nodes if "recompute" in nd.meta}
    assert tagged, "the tracer dropped the checkpoint tags"
    part = min_cut_partition(gm, num_fw_outputs=n)
    H.check_graphs(part, gm)
    H.check_against_eager(part, f, make(4))
    H.check_against_eager(part, f, make(4))
    kinds = H.recomputed_kinds(part)
    assert {"extern", "reduction"} <= set(kinds.values()), part.report()
    # of the regions' values only the first region's output is saved (the second region
    # reads it), as torch.utils.checkpoint asks; the second region's output is recomputed
    # for the head; besides that, only untagged values (x @ w0, the head's tanh)
    saved_tagged = [s for s in part.saved_tensors if s in tagged]
    assert len(saved_tagged) == 1, part.report()
    assert "torch.utils.checkpoint" in part.notes[saved_tagged[0]][2], part.report()
    for name in tagged & set(part.recomputed):
        assert "checkpointed region" in part.notes[name][2], part.notes[name]
    # the same graph without the tags saves more: the checkpoint is what saves memory
    for nd in gm.graph.nodes:
        nd.meta.pop("recompute", None)
    untagged = min_cut_partition(gm, num_fw_outputs=n)
    assert part.saved_bytes < untagged.saved_bytes, (part.report(), untagged.report())


def test_random_ops_in_a_checkpointed_region_are_saved_not_recomputed() -> None:
    import torch.fx.traceback as fx_traceback

    f, make = _checkpointed_blocks(dropout=True)
    with fx_traceback.preserve_node_meta():
        gm, n = H.make_joint(f, make(4))
    part = min_cut_partition(gm, num_fw_outputs=n)
    H.check_graphs(part, gm)
    kinds = H.recomputed_kinds(part)
    assert "random" not in kinds.values(), part.report()
    assert "extern" in kinds.values(), part.report()
