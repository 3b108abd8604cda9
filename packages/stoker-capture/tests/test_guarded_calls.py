"""Guarded compilation: automatic dynamic shapes, explicit policies, unsupported features."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from capture_compare import check_fn

from stoker_capture import (
    AOTBackwardInfo,
    AOTConfig,
    GraphLintError,
    StokerCaptureError,
    UnsupportedError,
    aot_function,
    aot_module,
    aot_stage1_graph_capture,
    aot_stage2_compile,
    create_aot_state,
)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))


def test_automatic_dynamic_recompiles_once_then_stays_symbolic() -> None:
    m = _mlp()
    compiled = aot_module(m)
    for n in (4, 8, 16, 5):
        x = torch.randn(n, 6, requires_grad=True)
        check_fn(lambda x: m(x), compiled, lambda x=x: [x], atol=1e-5, rtol=1e-5)
    stats = compiled.cache_stats()
    assert stats["misses"] == 2 and stats["entries"] == 2, stats
    assert "args[0].size()[0] == 4" in stats["reasons"][0]
    assert stats["hits"] == 2


def test_static_policy_recompiles_every_new_size() -> None:
    f = lambda x: (x * 2).sum(0)  # noqa: E731
    compiled = aot_function(f, dynamic="static")
    for n in (3, 4, 5, 3):
        check_fn(f, compiled, lambda n=n: [torch.randn(n, 2, requires_grad=True)])
    assert compiled.cache_stats()["misses"] == 3


def test_dynamic_policy_compiles_once() -> None:
    f = lambda x, y: (x @ y).relu()  # noqa: E731
    compiled = aot_function(f, dynamic="dynamic")
    for n in (3, 7, 12):
        check_fn(
            f,
            compiled,
            lambda n=n: [
                torch.randn(n, 4, requires_grad=True),
                torch.randn(4, n + 1, requires_grad=True),
            ],
        )
    assert compiled.cache_stats()["misses"] == 1


def test_replacing_a_parameter_recompiles() -> None:
    m = torch.nn.Linear(3, 3)
    compiled = aot_module(m)
    compiled(torch.randn(2, 3))
    m.weight = torch.nn.Parameter(torch.randn(4, 3))
    m.bias = torch.nn.Parameter(torch.randn(4))
    out = compiled(torch.randn(2, 3))
    assert out.shape == (2, 4)
    assert "self.weight" in compiled.cache_stats()["reasons"][0]


def test_double_backward_is_a_clear_error() -> None:
    compiled = aot_function(lambda x: x.pow(3).sum())
    x = torch.randn(3, requires_grad=True)
    y = compiled(x)
    with pytest.raises(UnsupportedError, match="create_graph"):
        torch.autograd.grad(y, x, create_graph=True)


def test_tensor_subclass_is_a_clear_error() -> None:
    class Sub(torch.Tensor):
        pass

    compiled = aot_function(lambda x: x + 1)
    with pytest.raises(TypeError, match="subclass"):
        compiled(torch.randn(2).as_subclass(Sub))


def test_function_class_carries_backward_info() -> None:
    f = lambda x, w: (x @ w).tanh()  # noqa: E731
    with contextlib.ExitStack() as stack:
        args = (torch.randn(3, 4), torch.randn(4, 2, requires_grad=True))
        state = create_aot_state(f, args, None, AOTConfig(), stack)
        c1 = aot_stage2_compile(state, aot_stage1_graph_capture(state))
        state2 = create_aot_state(f, args, None, AOTConfig(), stack)
        c2 = aot_stage2_compile(state2, aot_stage1_graph_capture(state2))
    cls = c1.function_class
    assert cls is not None and not hasattr(cls, "_aot_id")
    info = cls._stoker_aot
    assert isinstance(info, AOTBackwardInfo)
    assert info.aot_id != c2.function_class._stoker_aot.aot_id
    bw_inputs = [n for n in info.bw_module.graph.nodes if n.op == "placeholder"]
    assert len(bw_inputs) == info.num_saved_symints + info.num_saved_tensors + info.num_tangents
    # run: saved tensors and symints are where the contract says
    out = c1(*args)
    assert out.grad_fn is not None
    assert len(out.grad_fn.saved_tensors) == info.num_saved_tensors
    assert len(out.grad_fn._stoker_symints) == info.num_saved_symints


def test_lazy_backward_matches_and_frozen_env_rejects_new_guards() -> None:
    f = lambda x, w: (x @ w).sigmoid()  # noqa: E731
    compiled = aot_function(f, lazy_backward=True, dynamic="dynamic")
    check_fn(
        f,
        compiled,
        lambda: [torch.randn(5, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)],
    )

    def specializing(gm, example_inputs):  # a backward compiler that assumes a size
        for t in example_inputs:
            if isinstance(t, torch.Tensor) and t.dim() == 2:
                int(t.shape[0])  # guard_int: specializes a dynamic size
        return gm

    def guarding(gm, example_inputs):  # a backward compiler that branches on a size
        for t in example_inputs:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] % 2 == 0:
                pass
        return gm

    for bad in (specializing, guarding):
        compiled = aot_function(f, bw_compiler=bad, lazy_backward=True, dynamic="dynamic")
        y = compiled(torch.randn(5, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True))
        with pytest.raises(StokerCaptureError, match="lazy_backward=False"):
            y.sum().backward()


def test_lazy_backward_fallback_runs_the_graph_uncompiled_where_it_needs_a_guard() -> None:
    """With ``lazy_backward_fallback`` the backward whose late compile needs a guard runs
    its graph as it is, with a warning, and its gradients are eager's at every size."""
    f = lambda x, w: (x @ w).sigmoid()  # noqa: E731
    compiles: list[int] = []

    def guarding(gm, example_inputs):  # a backward compiler that branches on a size
        compiles.append(len(compiles))
        for t in example_inputs:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] % 2 == 0:
                pass
        return gm

    compiled = aot_function(
        f, bw_compiler=guarding, lazy_backward=True, lazy_backward_fallback=True, dynamic="dynamic"
    )
    for n, warns in ((5, True), (6, False), (9, False)):  # one compile attempt, one warning
        x, w = torch.randn(n, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)
        x0, w0 = x.detach().requires_grad_(), w.detach().requires_grad_()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            compiled(x, w).square().sum().backward()
        assert any("runs uncompiled" in str(m.message) for m in seen) == warns, seen
        f(x0, w0).square().sum().backward()
        torch.testing.assert_close(x.grad, x0.grad)
        torch.testing.assert_close(w.grad, w0.grad)
    assert compiles == [0]


def test_debug_checks_lint_every_stage() -> None:
    f = lambda x: x.sin()  # noqa: E731
    with contextlib.ExitStack() as stack:
        state = create_aot_state(
            f, (torch.randn(3, requires_grad=True),), None, AOTConfig(debug_checks=True), stack
        )
        graph = aot_stage1_graph_capture(state)
        sin = next(n for n in graph.gm.graph.nodes if n.target == torch.ops.aten.sin.default)
        sin.target = torch.ops.aten.sin_.default  # an in-place op sneaks in
        with pytest.raises(GraphLintError, match="mutates"):
            aot_stage2_compile(state, graph)


def test_debug_checks_accept_tensor_constants() -> None:
    # a tensor made inside fn is lifted as a get_attr constant: valid in every stage
    def f(x):
        return x[torch.tensor([0, 2])] * torch.tensor(2.0)

    compiled = aot_function(f, debug_checks=True)
    check_fn(f, compiled, lambda: [torch.randn(4, 3, requires_grad=True)])
    with torch.no_grad():
        x = torch.randn(4, 3)
        torch.testing.assert_close(compiled(x), f(x))


def test_debug_checks_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("STOKER_CHECK", "1")
    assert AOTConfig().debug_checks
    monkeypatch.setenv("STOKER_CHECK", "0")
    assert not AOTConfig().debug_checks


def test_size_one_dims_stay_static_under_dynamic_policies() -> None:
    f = lambda x: x.expand(3, -1) * 2  # noqa: E731
    check_fn(f, aot_function(f, dynamic="dynamic"), lambda: [torch.randn(1, 4, requires_grad=True)])
    g = lambda x: x.sum(0) * 2  # noqa: E731
    compiled = aot_function(g)  # auto: a size that changes to 1 stays static at 1
    for n in (4, 5, 1, 7):
        check_fn(g, compiled, lambda n=n: [torch.randn(n, 3, requires_grad=True)])
    assert compiled.cache_stats()["misses"] == 3


def test_compiler_specialization_is_guarded_by_the_cache() -> None:
    """Seed 002: a guard the (backward) compiler adds at lowering time keys the cache."""
    seen: list[int] = []

    def specializing(gm, example_inputs):
        sizes = [
            int(t.shape[0]) for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2
        ]
        seen.append(sizes[0])
        n = sizes[0]

        def run(*args):
            got = [a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() == 2]
            assert got[0] == n, "reused with a size it was specialized away from"
            return gm(*args)

        return run

    f = lambda x, w: (x @ w).relu()  # noqa: E731
    compiled = aot_function(f, bw_compiler=specializing, dynamic="dynamic")
    w = torch.randn(3, 2, requires_grad=True)
    for n in (4, 4, 6):
        check_fn(f, compiled, lambda n=n: [torch.randn(n, 3, requires_grad=True), w])
    stats = compiled.cache_stats()
    assert stats["misses"] == 2 and "== 4" in stats["reasons"][0], stats
