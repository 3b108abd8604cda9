"""What decides the warm-start key (docs/autograd.md, "Warm start"): the key is the
text of the engine's walk (`graph.Walk`: a record per node, no FX graph made), so each
thing the compiled backward depends on is checked here to still change the key, a hit
to give eager's gradients and to make no node of the captured graph, and the walk's
text to be the text of the graph made of it.

In one process: clearing the engine's cache makes the next backward capture again and
look its graph up on disk, as a new process would (the conftest gives each test an
empty cache directory)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import stoker_autograd
from stoker_autograd._internal import graphstore, runtime
from stoker_autograd._internal.capture import CaptureInstance
from stoker_autograd._internal.graph import Walk


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class Thrice(torch.autograd.Function):  # the same signature as Twice, another backward
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 3


class Net(nn.Module):
    def __init__(
        self,
        width: int = 16,
        act: Callable[[torch.Tensor], torch.Tensor] = torch.tanh,
        fn: Any = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.act, self.fn = nn.Linear(8, width), nn.Linear(width, 4), act, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        return self.b(h if self.fn is None else self.fn.apply(h))


def backward_once(make: Callable[[], nn.Module], x: torch.Tensor) -> tuple[dict[str, int], float]:
    """(cache outcomes of one captured backward, largest gradient difference to eager)."""
    torch._C._dynamo.compiled_autograd.clear_cache()
    graphstore.outcomes.clear()
    eager, model = make(), make()
    eager(x).pow(2).sum().backward()
    with stoker_autograd.enable():
        model(x).pow(2).sum().backward()
    diff = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(eager.parameters(), model.parameters(), strict=True)
        if p.grad is not None and q.grad is not None
    )
    return dict(graphstore.outcomes), diff


MISS = {"miss (new key)": 1, "write": 1}


def test_the_same_graph_hits_and_matches_eager_on_a_fresh_input() -> None:
    assert backward_once(Net, torch.randn(5, 8))[0] == MISS
    outcomes, diff = backward_once(Net, torch.randn(5, 8))  # fresh values, same sizes
    assert outcomes == {"hit": 1} and diff < 1e-5


def _hooked(kind: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        m = Net()
        if kind == "tensor hook on a.weight":
            m.a.weight.register_hook(lambda g: g * 2.0)
        elif kind == "tensor hook on b.weight":
            m.b.weight.register_hook(lambda g: g * 2.0)
        elif kind == "post-accumulate-grad hook":
            m.a.bias.register_post_accumulate_grad_hook(lambda p: None)
        elif kind == "module backward hook":
            m.b.register_full_backward_hook(lambda mod, gi, go: None)
        return m

    return make


@pytest.mark.parametrize(
    ("first", "second", "x2"),
    [
        pytest.param(Net, lambda: Net(act=torch.sigmoid), None, id="another op"),
        pytest.param(Net, lambda: Net(width=24), None, id="another parameter size"),
        pytest.param(Net, Net, (7, 8), id="another input size"),
        pytest.param(Net, lambda: Net().double(), "double", id="another dtype"),
        pytest.param(Net, _hooked("tensor hook on a.weight"), None, id="a tensor hook"),
        pytest.param(
            _hooked("tensor hook on a.weight"),
            _hooked("tensor hook on b.weight"),
            None,
            id="a hook on another tensor",
        ),
        pytest.param(Net, _hooked("post-accumulate-grad hook"), None, id="a post-acc hook"),
        pytest.param(Net, _hooked("module backward hook"), None, id="a module hook"),
        pytest.param(
            lambda: Net(fn=Twice), lambda: Net(fn=Thrice), None, id="another custom Function"
        ),
    ],
)
def test_what_decides_the_compile_misses(
    first: Callable[[], nn.Module], second: Callable[[], nn.Module], x2: Any
) -> None:
    x = torch.randn(5, 8)
    assert backward_once(first, x)[0] == MISS
    if x2 == "double":
        x = x.double()
    elif x2 is not None:
        x = torch.randn(*x2)
    outcomes, diff = backward_once(second, x)
    assert outcomes == MISS, outcomes
    assert diff < 1e-5
    again, diff = backward_once(second, x)  # and the entry it wrote is found
    assert again == {"hit": 1} and diff < 1e-5


def test_another_hook_function_at_the_same_place_hits_and_runs_live() -> None:
    """Hooks are graph inputs read at every call: a new hook is no new compile, and the
    hit runs the hook it is given (here one that scales by 3, not 2)."""

    def scaled(k: float) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            m = Net()
            m.a.weight.register_hook(lambda g: g * k)
            return m

        return make

    assert backward_once(scaled(2.0), torch.randn(5, 8))[0] == MISS
    outcomes, diff = backward_once(scaled(3.0), torch.randn(5, 8))
    assert outcomes == {"hit": 1} and diff < 1e-5


def test_a_custom_function_stays_a_live_call_on_a_hit() -> None:
    assert backward_once(lambda: Net(fn=Twice), torch.randn(5, 8))[0] == MISS
    outcomes, diff = backward_once(lambda: Net(fn=Twice), torch.randn(5, 8))
    assert outcomes == {"hit": 1} and diff < 1e-5


def test_a_dummy_is_laid_out_as_empty_like() -> None:
    """The capture builds ``empty_like`` results directly for dense inputs: the same
    sizes and strides as ``torch.empty_like`` (which the engine's checks see)."""
    from stoker_autograd._internal.capture import CaptureInstance
    from stoker_autograd._internal.runtime import finish_capture
    from stoker_autograd._internal.session import Session

    cap = CaptureInstance(Session(), finish_capture)
    for x in (
        torch.empty(3, 4),
        torch.empty(4, 3).t(),
        torch.empty(2, 1, 5).as_strided((2, 1, 5), (5, 7, 1)),  # size-1 dim, odd stride
        torch.empty(6, 4)[:, :2],  # not dense
        torch.empty(0, 3),
        torch.empty(2, 3, dtype=torch.float16),
    ):
        fake = cap.fake_mode.from_tensor(x)
        with cap.fake_mode:
            want = torch.empty_like(fake)
        got = cap._dummy_like(fake)
        assert (got.shape, got.stride(), got.dtype, got.device) == (
            want.shape,
            want.stride(),
            want.dtype,
            want.device,
        ), x


def test_a_hit_makes_no_node_of_the_captured_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """No capture makes an FX node; a miss makes the captured graph of its walk once (to
    run it eagerly and retrace it), a hit never does."""
    counts = {"nodes": 0, "graphs": 0}
    capturing = [False]
    create_node, to_graph = fx.Graph.create_node, Walk.to_graph
    begin, end = CaptureInstance.begin_capture, CaptureInstance.end_capture

    def counted_create_node(*a: Any, **k: Any) -> Any:
        counts["nodes"] += capturing[0]
        return create_node(*a, **k)

    def counted_to_graph(self: Walk) -> fx.Graph:
        counts["graphs"] += self._graph is None
        return to_graph(self)

    def counted_begin(self: CaptureInstance, *a: Any) -> Any:
        capturing[0] = True
        return begin(self, *a)

    def counted_end(self: CaptureInstance, *a: Any) -> Any:
        try:
            return end(self, *a)
        finally:
            capturing[0] = False

    monkeypatch.setattr(fx.Graph, "create_node", counted_create_node)
    monkeypatch.setattr(Walk, "to_graph", counted_to_graph)
    monkeypatch.setattr(CaptureInstance, "begin_capture", counted_begin)
    monkeypatch.setattr(CaptureInstance, "end_capture", counted_end)
    make = _hooked("tensor hook on a.weight")
    assert backward_once(make, torch.randn(5, 8))[0] == MISS
    assert counts == {"nodes": 0, "graphs": 1}, counts
    outcomes, diff = backward_once(make, torch.randn(5, 8))
    assert outcomes == {"hit": 1} and diff < 1e-5
    assert counts == {"nodes": 0, "graphs": 1}, counts  # the hit made none


class Aot(nn.Module):
    """A stoker-capture forward (its backward inlined into the capture) beside eager
    ops, a custom Function and a hook."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        import stoker_capture

        self.inner = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.fwd = stoker_capture.aot_module(self.inner, dynamic="dynamic")
        self.head = nn.Linear(8, 4)
        self.head.weight.register_hook(lambda g: g * 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(Twice.apply(torch.tanh(self.fwd(x))))


def test_the_walk_is_the_graph_made_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph made of a walk has the walk's nodes in its order, with the same ops,
    targets, names and arguments, so the key's text of either is the same (an inlined
    AOT backward's copied nodes, lifted symbolic sizes inserted among the inputs, a
    custom Function's call, a hook); the backward is eager's."""
    made: list[runtime.CompiledBackward] = []
    init = runtime.CompiledBackward.__init__

    def kept(self: runtime.CompiledBackward, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(runtime.CompiledBackward, "__init__", kept)
    outcomes, diff = backward_once(Aot, torch.randn(5, 8))
    assert outcomes == MISS and diff < 1e-5
    (compiled,) = made
    assert compiled._captured is not None
    root, walk, _ = compiled._captured
    graph = walk.to_graph()
    assert compiled.gm is not None  # the passes ran on it
    walked, nodes = list(walk.nodes), list(graph.nodes)
    assert len(walked) == len(nodes) == len(walk)
    position = {w: i for i, w in enumerate(walked)}
    for w, n in zip(walked, nodes, strict=True):
        assert (w.op, w.target, w.name) == (n.op, n.target, n.name)
        assert w.node is n
        assert [position[i] for i in w.all_input_nodes] == [
            nodes.index(i) for i in n.all_input_nodes
        ], n.format_node()
    assert any(w.meta.get("stoker_aot") for w in walked)  # an AOT backward was inlined
    # a lifted size was read (its node inserted among the inputs)
    assert any(isinstance(a, fx.Node) and a.name == "sizes" for n in nodes for a in n.args)
    assert graphstore.graph_text(walk, compiled.sym_sources, root) == graphstore.graph_text(
        graph, compiled.sym_sources, root
    )
