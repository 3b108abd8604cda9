"""Stage 0 and stage 1: forward metadata and the captured graphs."""

from __future__ import annotations

import contextlib

import torch

from stoker_capture import (
    AOTConfig,
    OutputKind,
    aot_stage1_graph_capture,
    create_aot_state,
)


def _state(fn, args, **cfg):
    stack = contextlib.ExitStack()
    return create_aot_state(fn, args, None, AOTConfig(debug_checks=True, **cfg), stack)


def test_metadata_mutation_and_aliases() -> None:
    def f(x, y):
        x.mul_(2)
        y2 = y * 3
        return x + y, y.t(), x, y2, y2.view(-1)

    state = _state(f, (torch.randn(5, 3), torch.randn(5, 3, requires_grad=True)))
    ins, outs = state.meta.inputs, state.meta.outputs
    assert ins[0].mutates_data and not ins[0].mutates_metadata and not ins[1].mutated
    kinds = [o.kind for o in outs]
    assert kinds == [
        OutputKind.FRESH,
        OutputKind.ALIAS_OF_INPUT,
        OutputKind.IS_INPUT,
        OutputKind.FRESH,
        OutputKind.ALIAS_OF_OUTPUT,
    ]
    assert outs[1].base == 1 and outs[2].base == 0 and outs[4].base == 3
    assert [o.requires_grad for o in outs] == [True, True, False, True, True]


def test_metadata_mutation_of_metadata() -> None:
    def f(x):
        x.t_()
        return x + 1

    state = _state(f, (torch.randn(2, 3),))
    assert state.meta.inputs[0].mutates_metadata
    assert state.meta.inputs[0].new_layout is not None
    assert list(state.meta.inputs[0].new_layout.size) == [3, 2]


def test_joint_graph_contract() -> None:
    lin = torch.nn.Linear(3, 4)
    state = _state(lin, (torch.randn(5, 3),), dynamic="dynamic")
    g = aot_stage1_graph_capture(state)
    phs = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in phs] == ["primals_1", "primals_2", "primals_3", "tangents_1"]
    out = next(n for n in g.gm.graph.nodes if n.op == "output")
    assert len(out.args[0]) == g.num_fw_outputs + 3
    assert out.args[0][-1] is None  # the user input does not require grad
    phases = {n.meta["stoker_phase"] for n in g.gm.graph.nodes}
    assert phases == {"forward", "backward"}
    addmm = next(n for n in g.gm.graph.nodes if n.target == torch.ops.aten.addmm.default)
    assert addmm.meta["stoker_phase"] == "forward"
    x = phs[2].meta["val"]
    assert isinstance(x.shape[0], torch.SymInt)  # dynamic batch
    # runs like eager
    xin = torch.randn(7, 3)
    tangent = torch.randn(7, 4)
    res = g.gm(lin.weight.detach(), lin.bias.detach(), xin, tangent)
    w = lin.weight.detach().requires_grad_()
    b = lin.bias.detach().requires_grad_()
    y = torch.nn.functional.linear(xin, w, b)
    gw, gb = torch.autograd.grad(y, [w, b], tangent)
    torch.testing.assert_close(res[0], y)
    torch.testing.assert_close(res[1], gw)
    torch.testing.assert_close(res[2], gb)
    assert "addmm" in g.as_text()


def test_module_path_and_stack_trace() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())

        def forward(self, x):
            return self.inner(x) * 2  # the marker line

    state = _state(M(), (torch.randn(2, 3),), mode="inference")
    g = aot_stage1_graph_capture(state)
    paths = {n.meta.get("stoker_module_path") for n in g.gm.graph.nodes}
    assert "inner.0" in paths and "inner.1" in paths
    mul = next(n for n in g.gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    assert "the marker line" in mul.meta["stack_trace"]
    assert all(n.meta["stoker_phase"] == "forward" for n in g.gm.graph.nodes)


def test_inference_graph_is_functional() -> None:
    bn = torch.nn.BatchNorm1d(4)
    state = _state(bn, (torch.randn(8, 4),), mode="inference")
    g = aot_stage1_graph_capture(state)
    assert not g.joint and g.num_tangents == 0
    # the running stats come out as new values (functional), three buffers mutated
    assert sum(i.mutated for i in state.meta.inputs) == 3
    targets = {n.target for n in g.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten._native_batch_norm_legit_functional.default in targets


def test_a_convolution_is_captured_in_the_layout_it_runs_in() -> None:
    """oneDNN stays on while a joint graph without recurrent layers is captured: a
    channels-last convolution's fake output is channels-last, as its real one is (with
    oneDNN off, the fake took another backend's layout: NCHW at these sizes)."""
    cl = torch.channels_last
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 32, 3, padding=1).to(memory_format=cl)
    x = torch.randn(16, 3, 32, 32).contiguous(memory_format=cl)
    graph = aot_stage1_graph_capture(_state(conv, (x,), mode="joint"))
    (node,) = [n for n in graph.gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert node.meta["val"].stride() == conv(x).stride() == (32768, 1, 1024, 32)


def test_graph_passes_run_at_the_end_of_capture() -> None:
    """`AOTConfig.graph_passes` edit the captured graph in order, before stage 2."""
    seen: list[str] = []

    def to_tanh(gm: torch.fx.GraphModule) -> None:
        seen.append("to_tanh")
        for n in gm.graph.nodes:
            if n.target is torch.ops.aten.relu.default:
                n.target = torch.ops.aten.tanh.default
        gm.recompile()

    def count(gm: torch.fx.GraphModule) -> None:
        seen.append(f"{sum(n.target is torch.ops.aten.tanh.default for n in gm.graph.nodes)}")

    x = torch.randn(4, 3)
    state = _state(lambda t: (t.relu() * 2,), (x,), mode="inference", graph_passes=(to_tanh, count))
    graph = aot_stage1_graph_capture(state)
    assert seen == ["to_tanh", "1"]
    torch.testing.assert_close(graph.gm(x)[0], x.tanh() * 2)
