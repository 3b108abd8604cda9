"""The retrace records an inlined AOT backward's core-aten ops without dispatching
through the proxy mode (`retrace._record`): the graph it makes must be the one the
proxy mode makes, node for node, values (sizes, strides, symbols) included, for
static and symbolic sizes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import stoker_autograd
from stoker_autograd._internal import retrace

stoker_capture = pytest.importorskip("stoker_capture")


class Block(nn.Module):
    """Attention-like: layer norm, views, matmuls, softmax, GELU, a residual."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.d = d
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).split(self.d, dim=-1)
        att = (q @ k.transpose(-2, -1) / self.d**0.5).softmax(-1)
        x = x + self.out(att @ v)
        return x + self.mlp(x)


def _describe(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype, v.device)
    if isinstance(v, list | tuple):
        return type(v).__name__, [_describe(x) for x in v]
    return str(v)


def _graph(gm: torch.fx.GraphModule) -> Any:
    """The graph's code and each node's name, target, arguments and value."""
    nodes = [
        (n.name, str(n.target), str(n.args), str(n.kwargs), _describe(n.meta.get("val")))
        for n in gm.graph.nodes
    ]
    return gm.code, nodes


def _run(batches: list[int]) -> Any:
    """Train `Block` (AOT-compiled: its backward is inlined) under stoker-autograd,
    checking its gradients against eager's; the session."""
    torch.manual_seed(0)
    m = Block()
    ref = copy.deepcopy(m)
    cm = stoker_capture.aot_module(m, dynamic="static")
    with stoker_autograd.enable() as session:
        for b in batches:
            m.zero_grad()
            ref.zero_grad()
            x = torch.randn(b, 5, 8)
            cm(x).pow(2).sum().backward()
            with stoker_autograd.disabled():
                ref(x).pow(2).sum().backward()
            for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    return session


def _variants(session: Any) -> list[Any]:
    return [_graph(var.gm) for g in session.graphs for var in g.variants]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ops `retrace._record` recorded."""
    ops: list[str] = []
    record = retrace._record

    def counting(rp: Any, op: Any, *a: Any) -> Any:
        ops.append(str(op))
        return record(rp, op, *a)

    monkeypatch.setattr(retrace, "_record", counting)
    return ops


def test_recorded_ops_make_the_proxy_modes_graph(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = _variants(_run([3, 3, 4, 4]))
    assert len(fast) == 2  # one static AOT function per batch size
    assert "aten.mm.default" in recorded and "aten.view.default" in recorded
    monkeypatch.setattr(retrace, "_recorded_as_is", lambda op: False)  # the proxy mode only
    monkeypatch.setattr(retrace, "_kept_whole", lambda op: False)
    slow = _variants(_run([3, 3, 4, 4]))
    assert fast == slow


def test_recorded_ops_with_symbolic_sizes(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every input size symbolic (as in the retrace of sizes that changed)."""
    from stoker_autograd._internal import runtime

    calls: list[tuple[Any, ...]] = []
    real = runtime.retrace

    def keep(*a: Any) -> Any:
        calls.append(a)
        return real(*a)

    monkeypatch.setattr(runtime, "retrace", keep)
    _run([3, 3])
    gm, inputs, sizes, scalars, sources, unpack, *_ = calls[0]
    dynamic = frozenset(retrace.concrete_values(inputs, sizes, scalars))
    recorded.clear()
    fast = retrace.retrace(gm, inputs, sizes, scalars, sources, unpack, dynamic)
    assert "aten.mm.default" in recorded
    vals = [n.meta.get("val") for n in fast.gm.graph.nodes]
    assert any(
        isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], torch.SymInt)
        for v in vals
    )
    real_as_is, real_whole = retrace._recorded_as_is, retrace._kept_whole
    monkeypatch.setattr(retrace, "_recorded_as_is", lambda op: False)
    monkeypatch.setattr(retrace, "_kept_whole", lambda op: False)
    slow = retrace.retrace(gm, inputs, sizes, scalars, sources, unpack, dynamic)
    assert _graph(fast.gm) == _graph(slow.gm)
    guards = [[(g.kind, g.code) for g in rt.guards().guards] for rt in (fast, slow)]
    # torch's node metadata asks the shape env whether each result is contiguous, and
    # that may add a guard (here ``s != 8`` for a permute): the recorded nodes' metadata
    # (`retrace._tensor_meta`) asks nothing, so its guards are a subset of those ...
    assert set(guards[0]) <= set(guards[1])
    # ... and, with that metadata for every node, the very guards of the proxy mode
    from torch.fx.experimental import proxy_tensor

    monkeypatch.setattr(proxy_tensor, "_extract_tensor_metadata", retrace._tensor_meta)
    slow = retrace.retrace(gm, inputs, sizes, scalars, sources, unpack, dynamic)
    monkeypatch.setattr(retrace, "_recorded_as_is", real_as_is)
    monkeypatch.setattr(retrace, "_kept_whole", real_whole)
    fast = retrace.retrace(gm, inputs, sizes, scalars, sources, unpack, dynamic)
    assert _graph(fast.gm) == _graph(slow.gm)
    guards = [[(g.kind, g.code) for g in rt.guards().guards] for rt in (fast, slow)]
    assert guards[0] == guards[1]


def test_ops_the_proxy_mode_changes_are_not_recorded_as_is() -> None:
    aten = torch.ops.aten
    assert retrace._recorded_as_is(aten.mm.default)
    assert retrace._recorded_as_is(aten.view.default)
    assert not retrace._recorded_as_is(aten.linear.default)  # CompositeImplicitAutograd
    assert not retrace._recorded_as_is(aten.add_.Tensor)  # mutates an input
    assert not retrace._recorded_as_is(aten._softmax_backward_data.default)  # decomposed
    assert not retrace._recorded_as_is(aten.native_layer_norm_backward.default)
    # fused backwards kept whole unless their dtypes mix: recorded after their table entry
    assert retrace._kept_whole(aten.native_layer_norm_backward.default)
    assert retrace._kept_whole(aten._softmax_backward_data.default)
    assert not retrace._kept_whole(aten.silu_backward.default)  # CompositeImplicitAutograd
    assert not retrace._kept_whole(aten.mm.default)  # recorded as is
    assert not retrace._recorded_as_is(aten.lift_fresh.default)
    assert not retrace._recorded_as_is(aten._local_scalar_dense.default)  # data-dependent
    assert not retrace._recorded_as_is(torch.tanh)  # not an OpOverload
