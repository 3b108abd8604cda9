"""Backwards of forwards that another compiler compiled, under stoker_autograd.

``torch.compile`` with Inductor or ``aot_eager`` makes a ``CompiledFunction`` (torch's
AOTAutograd; ``_aot_id`` on its class).  Inside ``stoker_autograd.enable()`` its
backward is an opaque ``call_backward`` that runs torch's real compiled backward
with its real ctx, beside stoker's own AOT backwards (inlined) and the eager nodes
around them.  Every test trains against an eager copy of the same model.
"""

from __future__ import annotations

import copy
import pickle
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import stoker_autograd
from stoker_autograd._internal import graphstore, ops
from stoker_autograd._internal.functions import function_key, is_torch_compiled
from stoker_autograd._internal.graph import check_sizes

stoker_capture = pytest.importorskip("stoker_capture")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Dynamo's state (automatic-dynamic sizes seen, compiled frames) is per process:
    each test starts without another test's."""
    torch._dynamo.reset()


def _segmented(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return gm  # segments handed to a compiler, as stoker-triton gets them


def mlp(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))


def _train(
    pairs: list[tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module, nn.Module]],
    steps: int,
    batch: Callable[[int], int] = lambda i: 5,
    **enable: Any,
) -> stoker_autograd.Session:
    """Train every (compiled callable, its module, eager copy) pair ``steps`` SGD steps
    inside one ``enable()``; parameters and gradients equal eager's after each step."""
    opts = [
        (torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(r.parameters(), lr=0.1))
        for _, m, r in pairs
    ]
    with stoker_autograd.enable(**enable) as session:
        for i in range(steps):
            for (fn, m, ref), (opt, ref_opt) in zip(pairs, opts):
                x = torch.randn(batch(i), 4)
                opt.zero_grad()
                ref_opt.zero_grad()
                fn(x).pow(2).mean().backward()
                with stoker_autograd.disabled():
                    ref(x).pow(2).mean().backward()
                for p, q in zip(m.parameters(), ref.parameters()):
                    assert p.grad is not None
                    torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
                opt.step()
                ref_opt.step()
                for p, q in zip(m.parameters(), ref.parameters()):
                    torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
    return session


def _pair(backend: str | None, **kw: Any) -> tuple[Any, nn.Module, nn.Module]:
    m = mlp()
    ref = copy.deepcopy(m)
    if backend is None:
        return stoker_capture.aot_module(m), m, ref
    return torch.compile(m, backend=backend, **kw), m, ref


def _foreign_calls(session: stoker_autograd.Session) -> list[torch.fx.Node]:
    return [
        n
        for g in session.graphs
        for n in g.gm.graph.nodes
        if n.target is ops.call_backward
        and str(n.meta.get("stoker_fn", "")).startswith("CompiledFunction[torch.compile")
    ]


@pytest.mark.slow  # Inductor compiles C++ on the CPU: tens of seconds in a cold cache
def test_inductor_aot_eager_and_stoker_models_train_in_one_process() -> None:
    """A model compiled by Inductor, one by aot_eager and one by stoker, trained side by
    side inside one enable(): each torch-compiled backward is proxied (Inductor's
    backward compiled lazily, at the first backward, inside stoker's run of it)."""
    torch.manual_seed(0)
    pairs = [_pair("inductor"), _pair("aot_eager"), _pair(None)]
    session = _train(pairs, steps=3)
    calls = _foreign_calls(session)
    assert len({n.meta["stoker_fn"] for n in calls}) == 2, [n.meta["stoker_fn"] for n in calls]
    stoker_inlined = [
        n for g in session.graphs for n in g.gm.graph.nodes if n.meta.get("stoker_aot")
    ]
    assert stoker_inlined, "stoker's own AOT backward is inlined"
    st = stoker_autograd.stats()
    # one capture per model (zero_grad sets .grad to None), then every step replays
    assert st["captures"] == 3 and st["cache_hits"] == 6, st


@pytest.mark.slow  # Inductor compiles C++ on the CPU
def test_stoker_module_feeding_an_inductor_module_is_one_backward_graph() -> None:
    """stoker's compiled module's output feeds an Inductor-compiled module: one captured
    backward holds torch's compiled backward (a call) and stoker's (inlined) in order."""
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(4, 6), nn.GELU()), nn.Sequential(nn.Linear(6, 3), nn.Tanh())
    ra, rb = copy.deepcopy(a), copy.deepcopy(b)
    ca, cb = stoker_capture.aot_module(a), torch.compile(b, backend="inductor")
    both, ref = nn.Sequential(a, b), nn.Sequential(ra, rb)
    session = _train([(lambda x: cb(ca(x)), both, ref)], steps=3)
    assert len(session.graphs) == 1
    graph = session.graphs[-1].gm.graph
    nodes = list(graph.nodes)
    calls = [i for i, n in enumerate(nodes) if n in set(_foreign_calls(session))]
    inlined = [i for i, n in enumerate(nodes) if n.meta.get("stoker_aot")]
    assert len(calls) == 1 and inlined
    assert calls[0] < min(inlined), "torch's backward runs first: it makes stoker's gradient"


@pytest.mark.parametrize("compiler", [None, _segmented], ids=["aten", "segmented"])
def test_aot_eager_model_trains_with_stoker_compiled_model(compiler: Any) -> None:
    torch.manual_seed(0)
    session = _train([_pair("aot_eager"), _pair(None)], steps=3, compiler=compiler)
    (call,) = {n.meta["stoker_fn"] for n in _foreign_calls(session)}
    # the retrace checks every gradient torch's backward returns against what the
    # rest of the compiled graph was traced for
    (node,) = _foreign_calls(session)
    (graph,) = [g for g in session.graphs if node in set(g.gm.graph.nodes)]
    rt = graph.last_retraced
    assert rt is not None
    checks = [n for n in rt.gm.graph.nodes if n.target is check_sizes and call in str(n.args[2])]
    returned = [m for m in node.meta["stoker_out_meta"] if m is not None]
    assert len(checks) == len(returned) >= 4, [n.format_node() for n in rt.gm.graph.nodes]


def test_aot_eager_dynamic_shapes_one_capture_per_grad_state() -> None:
    """A forward torch compiled with dynamic shapes: its saved symints reach the engine
    as lifted sizes, so new batch sizes replay one captured graph; the retrace's
    size checks are symbolic."""
    torch.manual_seed(0)
    pair = _pair("aot_eager", dynamic=True)
    session = _train([pair], steps=5, batch=lambda i: (3, 5, 7, 4, 9)[i])
    st = stoker_autograd.stats()
    assert st["captures"] == 1 and st["cache_hits"] == 4, st
    assert st["compiles"] <= 3 and st["fallbacks"] == 0, st
    assert _foreign_calls(session)


def test_aot_eager_automatic_dynamic_recapture_is_named() -> None:
    """Dynamo recompiles the forward when the batch changes (automatic dynamic): another
    CompiledFunction, so another capture, whose reason names the two compiled
    functions."""
    torch.manual_seed(0)
    pair = _pair("aot_eager")
    stoker_autograd.reset_stats()
    _train([pair], steps=3, batch=lambda i: (4, 4, 6)[i])
    reasons = stoker_autograd.recapture_reasons()
    assert any(
        "CompiledFunctionBackward[torch.compile aot_id" in r and " -> " in r for r in reasons
    ), reasons


def test_aot_eager_create_graph() -> None:
    """create_graph=True: torch's backward builds its double-backward node, as in eager
    (torch refuses create_graph for a backward with donated buffers, eager or not)."""
    torch.manual_seed(0)
    m = mlp()
    ref = copy.deepcopy(m)
    cm = torch.compile(m, backend="aot_eager")
    x = torch.randn(5, 4)
    with torch._functorch.config.patch(donated_buffer=False), stoker_autograd.enable():
        grads = torch.autograd.grad(cm(x).pow(2).sum(), list(m.parameters()), create_graph=True)
    expected = torch.autograd.grad(ref(x).pow(2).sum(), list(ref.parameters()), create_graph=True)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    assert all(g.requires_grad for g in grads)


def test_hook_inside_a_torch_compiled_function_runs_as_in_eager() -> None:
    """A tensor hook registered inside a torch.compile'd function: Dynamo makes a
    BackwardState for it only while torch's own compiled autograd is on, so under
    stoker it graph-breaks and the hook runs (once per backward, with eager's value)."""
    seen: list[torch.Tensor] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin() * 2
        y.register_hook(lambda g: seen.append(g.clone()) or g * 3)  # type: ignore[func-returns-value]
        return (y * y).sum()

    cfn = torch.compile(fn, backend="aot_eager")
    x = torch.randn(6, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    with stoker_autograd.enable():
        cfn(x).backward()
    fn(x2).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], seen[1])


def test_the_key_tells_torch_compiled_functions_apart() -> None:
    """Two torch-compiled functions with the same inputs and outputs differ in the
    disk-cache key (torch names every such class alike); after the first is stored, the
    second misses and computes its own gradients; the first hits."""

    def f1(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * w).sin()

    def f2(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * w).cos()

    def step(f: Callable[..., torch.Tensor]) -> None:
        w = torch.randn(5, requires_grad=True)
        x = torch.randn(3, 5)
        w_ref = w.detach().clone().requires_grad_(True)
        cf = torch.compile(f, backend="aot_eager")
        y = cf(x, w)
        assert is_torch_compiled(type(y.grad_fn)._forward_cls)  # type: ignore[union-attr]
        with stoker_autograd.enable():
            y.pow(2).sum().backward()
        f(x, w_ref).pow(2).sum().backward()
        torch.testing.assert_close(w.grad, w_ref.grad)

    step(f1)
    assert graphstore.outcomes.get("write", 0) >= 1
    before = dict(graphstore.outcomes)
    step(f2)
    assert graphstore.outcomes.get("hit", 0) == before.get("hit", 0), graphstore.outcomes
    torch._C._dynamo.compiled_autograd.clear_cache()
    torch._dynamo.reset()
    step(f1)  # the same function again (a new class, the same backward graph): a hit
    assert graphstore.outcomes.get("hit", 0) == before.get("hit", 0) + 1, graphstore.outcomes


def test_function_key_is_the_backward_graph_not_the_class() -> None:
    """The key of a torch-compiled Function is a digest of its backward graph: the
    same for the module torch keeps and for the one its AOTAutograd cache deserializes
    (a warm process), different for another backward, None without a graph."""
    x = torch.randn(3, requires_grad=True)
    cls = type(torch.compile(lambda t: t.sin() * t, backend="aot_eager")(x).grad_fn)._forward_cls  # type: ignore[union-attr]
    other = type(torch.compile(lambda t: t.cos() * t, backend="aot_eager")(x).grad_fn)._forward_cls  # type: ignore[union-attr]
    bw = cls._lazy_backward_info.bw_module
    reloaded = pickle.loads(pickle.dumps(bw))  # what torch's cache does to it
    as_cached = types.new_class("CompiledFunction", (torch.autograd.Function,))
    as_cached._aot_id = 99  # type: ignore[attr-defined]
    as_cached._lazy_backward_info = types.SimpleNamespace(bw_module_fn=lambda: reloaded)  # type: ignore[attr-defined]
    as_cached.num_symints_saved_for_bw = cls.num_symints_saved_for_bw  # type: ignore[attr-defined]
    as_cached.__qualname__ = cls.__qualname__
    as_cached.__module__ = cls.__module__
    key = function_key(cls)
    assert key is not None and "#bw=" in key
    assert function_key(as_cached) == key
    assert function_key(other) not in (None, key)
    bare = types.new_class("CompiledFunction", (torch.autograd.Function,))
    bare._aot_id = 98  # type: ignore[attr-defined]
    bare._lazy_backward_info = None  # type: ignore[attr-defined]
    assert function_key(bare) is None


def test_backward_state_is_a_clear_error() -> None:
    """A forward compiled while torch's own compiled autograd was on carries a Dynamo
    BackwardState (the hook registered inside it is deferred to torch's compiled
    autograd), which only torch's compiled autograd can run: one clear error saying
    what to do, and the engine keeps working.  Only Dynamo's flag is set while the
    forward compiles: torch's compiled autograd never runs in this process."""
    import torch._dynamo.compiled_autograd as torch_ca

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.register_hook(lambda g: g * 3)
        return (y * y).sum()

    cfn = torch.compile(fn, backend="aot_eager")
    torch_ca.compiled_autograd_enabled = True
    try:
        loss = cfn(torch.randn(4, requires_grad=True))
    finally:
        torch_ca.compiled_autograd_enabled = False
    with pytest.raises(NotImplementedError) as err, stoker_autograd.enable():
        loss.backward()
    msg = str(err.value)
    assert "CompiledFunction[torch.compile aot_id" in msg and "BackwardState" in msg, msg
    assert "Compile that forward without torch's compiled autograd" in msg, msg
    torch.manual_seed(0)
    _train([_pair("aot_eager")], steps=2)  # the engine and stoker work afterwards


@pytest.mark.parametrize("transform", ["grad", "vmap_grad"])
def test_functorch_transforms_inside_enable_run_on_the_eager_engine(transform: str) -> None:
    """``torch.func`` transforms call ``autograd.grad`` on tensors wrapped at a transform
    level, which compiled autograd cannot capture: they run as in eager, while a plain
    backward in the same scope is still compiled."""
    m = mlp()
    params = {k: v.detach() for k, v in m.named_parameters()}
    xs = torch.randn(3, 5, 4)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(m, p, (x,)).pow(2).sum()

    fn = torch.func.grad(loss)
    if transform == "vmap_grad":
        fn = torch.func.vmap(fn, in_dims=(None, 0))
    x = xs if transform == "vmap_grad" else xs[0]
    expected = fn(params, x)
    with stoker_autograd.enable() as session:
        got = fn(params, x)
        assert session.stats.captures == 0
        m(xs[0]).sum().backward()  # a plain backward: compiled
        assert session.stats.captures == 1
    torch.testing.assert_close(got, expected)
