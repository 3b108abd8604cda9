"""Backward ops with a fused eager kernel stay whole in a joint graph (`KEEP_WHOLE_IN_BACKWARD`):
the aten executor runs eager's kernel instead of core aten's pointwise decomposition,
forward and gradients equal to eager's; an inference graph and a user's table are as before."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from capture_compare import check_fn
from torch._decomp import core_aten_decompositions

from stoker_capture import AOTConfig, aot_function, aot_stage1_graph_capture, create_aot_state
from stoker_capture._internal.stages.capture import KEEP_WHOLE_IN_BACKWARD

aten = torch.ops.aten


def _f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Every op of `KEEP_WHOLE_IN_BACKWARD` through its forward: layer norm, batch
    norm, group norm, GELU, softmax, log-softmax + NLL (cross entropy), ReLU, sigmoid,
    tanh, SiLU."""
    h = F.layer_norm(x, (x.shape[-1],), w, b)
    h = F.batch_norm(h, None, None, w, b, training=True)
    h = F.group_norm(h, 1, w, b)
    h = F.gelu(h) + torch.relu(h) * torch.sigmoid(h) + torch.tanh(h) + F.silu(h)
    att = torch.softmax(h @ h.transpose(0, 1), dim=-1) @ h
    return F.cross_entropy(att, y)


def _args() -> list[Any]:
    return [
        torch.randn(6, 5, requires_grad=True),
        torch.randn(5, requires_grad=True),
        torch.randn(5, requires_grad=True),
        torch.randint(0, 5, (6,)),
    ]


def _targets(fn: Any, args: list[Any], joint: bool, **cfg: Any) -> set[Any]:
    stack = contextlib.ExitStack()
    mode = "joint" if joint else "inference"
    state = create_aot_state(fn, args, None, AOTConfig(mode=mode, **cfg), stack)
    with stack:
        gm = aot_stage1_graph_capture(state).gm
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("dynamic", ["static", "dynamic"])
def test_joint_graph_keeps_fused_backward_ops_whole(dynamic: str) -> None:
    got = _targets(_f, _args(), joint=True, dynamic=dynamic)
    kept = {getattr(aten, name).default for name in KEEP_WHOLE_IN_BACKWARD}
    assert kept <= got, sorted(map(str, kept - got))


def test_a_table_of_the_users_decomposes_them() -> None:
    table = dict(core_aten_decompositions())
    got = _targets(_f, _args(), joint=True, decompositions=table)
    kept = {getattr(aten, name).default for name in KEEP_WHOLE_IN_BACKWARD}
    assert not kept & got, sorted(map(str, kept & got))


def test_inference_graph_is_core_aten_as_before() -> None:
    with torch.no_grad():
        got = _targets(_f, [a.detach() for a in _args()], joint=False)
    # nll_loss_forward is decomposed by core aten: the kept table is only for backward ops
    assert aten.nll_loss_forward.default not in got


@pytest.mark.parametrize("dynamic", ["static", "dynamic"])
def test_forward_and_gradients_equal_eager(dynamic: str) -> None:
    compiled = aot_function(_f, dynamic=dynamic)
    for _ in range(2):  # fresh inputs each call
        check_fn(_f, compiled, _args)


def test_batch_norm_backward_stays_whole_under_autocast() -> None:
    """Autocast hands the batch norm a bf16 activation with float32 parameters: eager's
    kernel takes that mix in one op, so the joint graph keeps it whole (the decomposition
    would hold float32 copies of the activations), and the gradients match eager's."""

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.conv2d(x, w[:, None, None, None].expand(4, 3, 1, 1).contiguous())
            return F.batch_norm(h, None, None, w, b, training=True).float().square().mean()

    def args() -> list[Any]:
        return [
            torch.randn(2, 3, 4, 4, requires_grad=True),
            torch.randn(4, requires_grad=True),
            torch.randn(4, requires_grad=True),
        ]

    got = _targets(f, args(), joint=True)
    assert aten.native_batch_norm_backward.default in got
    compiled = aot_function(f)
    a, b = args(), args()
    for t, u in zip(a, b):
        u.data.copy_(t.data)
    torch.testing.assert_close(compiled(*a), f(*b), rtol=2e-2, atol=1e-2)
    for x, y in zip(torch.autograd.grad(compiled(*a), a), torch.autograd.grad(f(*b), b)):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)


def test_batch_norm_backward_statistics_in_the_weights_dtype() -> None:
    """torch's meta kernel gives a bf16 input's saved mean and inverse std in bf16 (eager's
    CPU kernel: float32), and eager's backward kernel rejects bf16 statistics beside a
    float32 weight. A forward compiled from the graph saves what the graph says, so the
    kept-whole backward must take its statistics in the weight's dtype: run as is (as
    compiled autograd's first backward runs it), it would fail otherwise."""

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.conv2d(x, w[:, None, None, None].expand(4, 3, 1, 1).contiguous())
            return F.batch_norm(h, None, None, w, b, training=True).float().square().mean()

    x, w, b = (torch.randn(2, 3, 4, 4), torch.randn(4), torch.randn(4))
    stack = contextlib.ExitStack()
    args = [t.requires_grad_() for t in (x, w, b)]
    state = create_aot_state(f, args, None, AOTConfig(mode="joint"), stack)
    with stack:
        gm = aot_stage1_graph_capture(state).gm
    nodes = [n for n in gm.graph.nodes if n.target is aten.native_batch_norm_backward.default]
    assert nodes
    for n in nodes:
        weight, stats = n.args[2], n.args[3:7]
        want = weight.meta["val"].dtype
        got = [s.meta["val"].dtype for s in stats if isinstance(s, torch.fx.Node)]
        assert got and all(d == want for d in got), (want, got)
        # the op as recorded, on real tensors of the recorded dtypes, runs
        real = [
            torch.randn(a.meta["val"].shape, dtype=a.meta["val"].dtype).abs() + 0.5
            if isinstance(a, torch.fx.Node)
            else a
            for a in n.args
        ]
        outs = n.target(*real)
        assert outs[0].dtype == real[1].dtype and outs[1].dtype == want
