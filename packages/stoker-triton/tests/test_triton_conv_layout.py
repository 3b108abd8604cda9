"""`channels_last_convolutions`: a captured graph's 2-d convolutions run channels-last,
with the same results and the same output layouts as the graph before."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from triton_helpers import assert_same, fresh

from stoker_triton import compile_graph, graph_passes
from stoker_triton._internal import conv_layout
from stoker_triton._internal.conv_layout import channels_last_convolutions

aten = torch.ops.aten
CL = torch.channels_last


@pytest.fixture
def every_conv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every convolution wants channels-last (the tests' sizes are below the bars)."""
    monkeypatch.setattr(conv_layout, "MIN_PLANE", 0)
    monkeypatch.setattr(conv_layout, "MIN_MACS", 0)


def _joint(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b: torch.Tensor) -> Any:
    """A forward (conv, BatchNorm, ReLU, max-pool, conv) and its gradients: what a joint
    graph holds, outputs of every kind (a 4-d user output, a loss, weight gradients)."""
    y = F.conv2d(x, w1, padding=1)
    y = F.max_pool2d(F.batch_norm(y, None, None, training=True).relu(), 2)
    z = F.conv2d(y, w2, b)
    loss = z.float().pow(2).mean()
    gx, g1, g2 = torch.autograd.grad(loss, [x, w1, w2])
    return z, loss, gx, g1, g2


def _args() -> list[torch.Tensor]:
    return [
        torch.randn(2, 3, 10, 10, requires_grad=True),
        torch.randn(8, 3, 3, 3, requires_grad=True),
        torch.randn(6, 8, 3, 3, requires_grad=True),
        torch.randn(6),
    ]


def _graph(mode: str = "fake", args: list[torch.Tensor] | None = None) -> torch.fx.GraphModule:
    return make_fx(_joint, decomposition_table=core_aten_decompositions(), tracing_mode=mode)(
        *(args or _args())
    )


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    return [a.meta.get("val") for a in gm.graph.output_node().all_input_nodes]


def _conv_args(gm: torch.fx.GraphModule) -> list[Any]:
    out = []
    for n in gm.graph.nodes:
        if n.target is aten.convolution.default:
            out += [n.args[0], n.args[1]]
        elif n.target is aten.convolution_backward.default:
            out += [n.args[0], n.args[1], n.args[2]]
    return [a.meta["val"] for a in out]


@pytest.mark.usefixtures("every_conv")
def test_convolutions_run_channels_last_and_outputs_keep_their_layouts() -> None:
    gm = _graph()
    before = [(tuple(v.shape), v.stride()) for v in _outputs(gm)]
    assert not all(v.is_contiguous(memory_format=CL) for v in _conv_args(gm))
    assert channels_last_convolutions(gm)
    gm.graph.lint()
    # every operand of a convolution, forward and backward, is channels-last now
    assert all(v.is_contiguous(memory_format=CL) for v in _conv_args(gm))
    # and the activations between them: the ReLU and the max-pool computed channels-last
    pooled = [n for n in gm.graph.nodes if n.target is aten.max_pool2d_with_indices.default]
    assert pooled and all(v.is_contiguous(memory_format=CL) for v in pooled[0].meta["val"])
    # a 4-d user output and the weight gradients come out as they did
    assert [(tuple(v.shape), v.stride()) for v in _outputs(gm)] == before
    # run: eager's values and layouts on fresh inputs
    args = fresh(_args())
    ref, got = _joint(*args), gm(*args)
    assert_same(list(got), list(ref), atol=1e-4, rtol=1e-4)
    assert [t.stride() for t in got] == [t.stride() for t in ref]
    assert not channels_last_convolutions(gm)  # nothing left to change


@pytest.mark.usefixtures("every_conv")
def test_the_c_kernels_run_the_channels_last_graph() -> None:
    gm = _graph()
    assert graph_passes("c") == (channels_last_convolutions,) and graph_passes("triton") == ()
    assert channels_last_convolutions(gm)
    args = _args()
    fn = compile_graph(gm, args, options={"target": "c"})
    for a in (args, fresh(args)):
        ref, got = _joint(*a), fn(*a)
        assert_same(list(got), list(ref), atol=1e-4, rtol=1e-4)
        assert [t.stride() for t in got] == [t.stride() for t in ref]


@pytest.mark.usefixtures("every_conv")
def test_graphs_it_leaves_alone() -> None:
    # symbolic sizes: computing the values again could add guards capture did not need
    assert not channels_last_convolutions(_graph("symbolic"))
    # no convolution
    gm = make_fx(lambda x: (x.relu() * 2,), tracing_mode="fake")(torch.randn(2, 3, 4, 4))
    assert not channels_last_convolutions(gm)
    # a forward already channels-last throughout: nothing to clone
    x, w1, w2 = (a.detach().contiguous(memory_format=CL) for a in _args()[:3])
    gm = make_fx(lambda x, w1, w2: (F.conv2d(F.conv2d(x, w1).relu(), w2),), tracing_mode="fake")(
        x, w1, w2
    )
    assert not channels_last_convolutions(gm)


def test_each_convolution_gets_the_layout_that_suits_it() -> None:
    """Large planes run channels-last, small ones NCHW: a network that pools from 32² to
    4² runs its first convolution channels-last and its last NCHW, the activation
    between copied once; the user's channels-last input of a small convolution is
    copied to NCHW. The results are eager's."""

    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> Any:
        y = F.max_pool2d(F.conv2d(x, w1, padding=1).relu(), 8)
        return (F.conv2d(y, w2, padding=1),)

    x, w1, w2 = torch.randn(8, 16, 32, 32), torch.randn(32, 16, 3, 3), torch.randn(64, 32, 3, 3)
    gm = make_fx(f, tracing_mode="fake")(x, w1, w2)
    convs = [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    assert [conv_layout.wants_channels_last(n) for n in convs] == [True, False]
    assert channels_last_convolutions(gm)
    big, small = convs
    assert big.meta["val"].is_contiguous(memory_format=CL) and not big.meta["val"].is_contiguous()
    assert small.args[0].meta["val"].is_contiguous() and small.meta["val"].is_contiguous()
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert [n.kwargs["memory_format"] for n in clones] == [CL, CL, torch.contiguous_format]
    args = fresh([x, w1, w2])
    assert_same(list(gm(*args)), list(f(*args)), atol=1e-4, rtol=1e-4)
    # a channels-last model whose convolutions are all small: NCHW inside, CL outside
    xs = torch.randn(2, 8, 6, 6).contiguous(memory_format=CL)
    ws = torch.randn(8, 8, 3, 3).contiguous(memory_format=CL)
    gm = make_fx(lambda x, w: (F.conv2d(x, w).relu(),), tracing_mode="fake")(xs, ws)
    assert channels_last_convolutions(gm)
    (conv,) = [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    assert conv.meta["val"].is_contiguous()
    (out,) = gm(xs, ws)
    assert out.stride() == F.conv2d(xs, ws).relu().stride()


@pytest.mark.usefixtures("every_conv")
def test_a_flatten_after_a_channels_last_convolution_views_an_nchw_copy() -> None:
    """A classifier flattens its last activation with a view capture saw contiguous: the
    convolution still runs channels-last, and the view reads an NCHW copy (eager's
    `reshape` of a channels-last tensor copies too). Forward and gradients are eager's."""

    def f(x: torch.Tensor, w: torch.Tensor, fc: torch.Tensor) -> Any:
        y = F.conv2d(x, w, padding=1).relu().flatten(1) @ fc
        return (y, *torch.autograd.grad(y.pow(2).sum(), [x, w, fc]))

    args = [
        torch.randn(2, 3, 8, 8, requires_grad=True),
        torch.randn(4, 3, 3, 3, requires_grad=True),
        torch.randn(256, 5, requires_grad=True),
    ]
    gm = make_fx(f, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*args)
    assert channels_last_convolutions(gm)
    (conv,) = [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    assert conv.meta["val"].is_contiguous(memory_format=CL)
    views = [n for n in gm.graph.nodes if n.target is aten.view.default and n.args[1] == [2, 256]]
    assert views and all(v.args[0].meta["val"].is_contiguous() for v in views)
    a = fresh(args)
    got, ref = gm(*a), f(*a)
    assert_same(list(got), list(ref), atol=1e-4, rtol=1e-4)
    assert [t.stride() for t in got] == [t.stride() for t in ref]
