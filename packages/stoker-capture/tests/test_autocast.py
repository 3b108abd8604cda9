"""Autocast: graphs traced under the caller's autocast, run with it off, keyed on it.

Eager reference: the forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``,
the backward outside autocast (as torch recommends).  Compiled outputs and
gradients must have eager's dtypes and values (bf16 tolerances where eager
rounds to bf16, fp32 tolerances where it does not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from capture_compare import clone_inputs, grads_of

from stoker_capture import (
    aot_function,
    aot_module,
    autocast_off,
    autocast_state,
    dynamo_backend,
    export,
    load,
)

BF16 = {"atol": 2e-2, "rtol": 2e-2}
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def bf16_autocast() -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def no_autocast() -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def disabled_region(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotary embedding: an fp32 matmul + cos inside autocast(enabled=False)."""
    with torch.autocast("cpu", enabled=False):
        return torch.cos(a.float() @ b.float())


def mixed(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A bf16 matmul, then an fp32 region (exact in eager), then a bf16 matmul again."""
    h = torch.tanh(x @ w)  # bf16 under autocast
    with torch.autocast("cpu", enabled=False):
        r = torch.sin(h.float() @ v)  # fp32: eager keeps these gradients exact
    return r @ v  # bf16 again


def inner_autocast(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Autocast entered inside the function, not around the call; a nested fp32 region."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w
        with torch.autocast("cpu", enabled=False):
            g = torch.exp(h.float() @ w)
        return h.float() + g


def nested_dtypes(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp16 autocast region inside the caller's bf16 region (eager's weight-cast cache
    would hand the inner region the outer region's bf16 casts: it is off there)."""
    h = x @ w  # bf16
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        g = torch.relu(x @ w) @ w  # fp16
    return h, g


def _args(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def run(
    fn: Callable[..., Any], args: list[torch.Tensor], ctx: Callable[[], Any]
) -> tuple[Any, list[Any]]:
    """Forward inside ``ctx()``, gradients of every input outside it."""
    args = clone_inputs(args)
    with ctx():
        out = fn(*args)
    return out, grads_of(out, args)


def assert_like_eager(
    fn: Callable[..., Any],
    compiled: Callable[..., Any],
    args: list[torch.Tensor],
    ctx: Callable[[], Any],
    out_tol: dict[str, float],
    grad_tol: dict[str, float],
) -> None:
    out_e, g_e = run(fn, args, ctx)
    out_c, g_c = run(compiled, args, ctx)
    assert out_c.dtype == out_e.dtype, (out_c.dtype, out_e.dtype)
    torch.testing.assert_close(out_c, out_e, **out_tol)
    for k, (gc, ge) in enumerate(zip(g_c, g_e)):
        assert gc.dtype == ge.dtype, (k, gc.dtype, ge.dtype)
        torch.testing.assert_close(gc, ge, **grad_tol, msg=lambda m, k=k: f"grad {k}: {m}")


# ---------------------------------------------------------------------- the helper


def test_autocast_off_turns_every_device_off_and_restores() -> None:
    assert autocast_state() == ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_state() == (("cpu", torch.bfloat16),)
        with autocast_off():
            assert not torch.is_autocast_enabled("cpu")
            assert autocast_state() == ()
            with torch.autocast("cpu", dtype=torch.float16):  # re-entering works inside
                assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float16
            assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast_off():  # nothing on: nothing changes
        assert autocast_state() == ()


def test_autocast_off_restores_after_an_error() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError), autocast_off():
            raise ValueError
        assert torch.is_autocast_enabled("cpu")


# ---------------------------------------------------------------------- aot_function


def test_disabled_region_keeps_fp32_under_autocast() -> None:
    """The issue's repro: eager returns float32; the graph must not be autocast again."""
    args = _args((8, 8), (8, 8))
    assert_like_eager(
        disabled_region, aot_function(disabled_region), args, bf16_autocast, FP32, FP32
    )


def test_disabled_region_inference_under_autocast() -> None:
    args = [t.detach() for t in _args((8, 8), (8, 8))]
    compiled = aot_function(disabled_region)
    with bf16_autocast(), torch.no_grad():
        out_e, out_c = disabled_region(*args), compiled(*args)
    assert out_c.dtype == torch.float32
    torch.testing.assert_close(out_c, out_e, **FP32)


def test_mixed_regions_forward_and_gradients_match_eager() -> None:
    """bf16 outside the region, fp32 inside: the backward must not add bf16 casts."""
    args = _args((6, 8), (8, 8), (8, 8))
    assert_like_eager(mixed, aot_function(mixed), args, bf16_autocast, BF16, BF16)
    # the fp32 region's own gradient path: v's gradient through sin(h @ v) is exact in
    # eager; compare it alone at fp32 tolerance (the bf16 path through `r @ v` adds
    # only bf16 products that are themselves exact in both)
    h = torch.randn(6, 8)

    def region(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return torch.sin(h.float() @ v)

    assert_like_eager(
        region, aot_function(region), [h.requires_grad_(), args[2]], bf16_autocast, FP32, FP32
    )


def test_nested_autocast_dtypes() -> None:
    args = _args((4, 8), (8, 8))
    compiled = aot_function(nested_dtypes)
    a_e, a_c = clone_inputs(args), clone_inputs(args)
    with bf16_autocast():
        want, got = nested_dtypes(*a_e), compiled(*a_c)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        torch.testing.assert_close(g, w, **BF16)
    for g, w in zip(grads_of(got, a_c), grads_of(want, a_e)):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, **BF16)


def test_autocast_inside_the_function() -> None:
    args = _args((4, 8), (8, 8))
    assert_like_eager(inner_autocast, aot_function(inner_autocast), args, no_autocast, BF16, BF16)


def test_same_compiled_fn_inside_and_outside_autocast() -> None:
    """The cache is keyed on the autocast state: each context gets its own graph."""
    compiled = aot_function(mixed)
    args = _args((6, 8), (8, 8), (8, 8))
    for ctx, tol in ((bf16_autocast, BF16), (no_autocast, FP32), (bf16_autocast, BF16)):
        assert_like_eager(mixed, compiled, args, ctx, tol, tol)
    with torch.autocast("cpu", dtype=torch.float16):
        out = compiled(*args)
    assert out.dtype == torch.float16


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)
        self.rot = torch.nn.Parameter(torch.randn(16, 16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.ln(x))
        with torch.autocast("cpu", enabled=False):
            h = h.float() + torch.cos(h.float() @ self.rot)
        return F.gelu(h)


def test_module_parameter_gradients_match_eager() -> None:
    torch.manual_seed(0)
    m = _Block()
    ref = _Block()
    ref.load_state_dict(m.state_dict())
    compiled = aot_module(m)
    x = torch.randn(4, 16)
    for _ in range(2):
        with bf16_autocast():
            out_c, out_e = compiled(x), ref(x)
        assert out_c.dtype == out_e.dtype == torch.float32
        torch.testing.assert_close(out_c, out_e, **BF16)
        out_c.square().sum().backward()
        out_e.square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        assert q.grad is not None and q.grad.dtype == p.grad.dtype == torch.float32, name
        torch.testing.assert_close(q.grad, p.grad, **BF16, msg=lambda s, n=name: f"{n}: {s}")


# ---------------------------------------------------------------------- dynamo_backend


def test_dynamo_backend_disabled_region_and_both_contexts() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(mixed, backend=dynamo_backend())
    args = _args((6, 8), (8, 8), (8, 8))
    for ctx, tol in ((bf16_autocast, BF16), (no_autocast, FP32)):
        assert_like_eager(mixed, compiled, args, ctx, tol, tol)
    compiled_r = torch.compile(disabled_region, backend=dynamo_backend())
    assert_like_eager(disabled_region, compiled_r, _args((8, 8), (8, 8)), bf16_autocast, FP32, FP32)
    # autocast entered inside the compiled function: _enter_autocast nodes in Dynamo's graph
    compiled_i = torch.compile(inner_autocast, backend=dynamo_backend())
    assert_like_eager(inner_autocast, compiled_i, _args((4, 8), (8, 8)), no_autocast, BF16, BF16)


# ---------------------------------------------------------------------- export / load


@contextlib.contextmanager
def _saved_and_loaded(ep: Any, tmp_path: Path) -> Iterator[Any]:
    path = tmp_path / "g.stoker"
    ep.save(path)
    yield load(path)


@pytest.mark.parametrize("traced_under", ["autocast", "none"])
def test_export_runs_its_traced_dtypes_under_any_autocast(
    traced_under: str, tmp_path: Path
) -> None:
    """An export holds the casts it was traced with; autocast at run time adds none."""
    args = [t.detach() for t in _args((6, 8), (8, 8), (8, 8))]
    ctx = bf16_autocast if traced_under == "autocast" else no_autocast
    with ctx():
        ep = export(mixed, args)
        want = mixed(*args)
    with _saved_and_loaded(ep, tmp_path) as loaded:
        for run_ctx in (bf16_autocast, no_autocast):
            for g in (ep, loaded):
                with run_ctx():
                    got = g(*args)
                assert got.dtype == want.dtype, (traced_under, got.dtype, want.dtype)
                torch.testing.assert_close(got, want, **FP32)
        with bf16_autocast():
            tep = ep.to_torch_export()
        got = tep.module()(*args)  # traced without autocast again: the graph as exported
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **FP32)


def test_export_of_disabled_region_under_autocast() -> None:
    args = [t.detach() for t in _args((8, 8), (8, 8))]
    with bf16_autocast():
        ep = export(disabled_region, args)
        got, want = ep(*args), disabled_region(*args)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **FP32)


def test_backward_called_inside_autocast_runs_without_it() -> None:
    """Eager casts a backward called inside autocast again (torch advises against it);
    stoker's compiled backward holds the casts of the forward and runs as eager runs a
    backward called outside autocast."""
    args = _args((6, 8), (8, 8))
    compiled = aot_function(disabled_region)
    (ae, be), (ac, bc) = clone_inputs(args), clone_inputs(args)
    with bf16_autocast():
        out_c = compiled(ac, bc)
        gc = torch.autograd.grad(out_c.sum(), [ac, bc])
        out_e = disabled_region(ae, be)
    ge = torch.autograd.grad(out_e.sum(), [ae, be])
    for x, y in zip(gc, ge):
        torch.testing.assert_close(x, y, **FP32)


def test_compilers_run_without_autocast() -> None:
    """A compiler that runs its graph (fake propagation, autotuning, a self-check) sees
    the dtypes the graph was traced with, not ones autocast would cast again."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def checking_compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        assert not torch.is_autocast_enabled("cpu")
        out = next(n for n in gm.graph.nodes if n.op == "output")
        outs = gm(*example_inputs)
        for node, v in zip(out.args[0], outs):
            if isinstance(v, torch.Tensor) and isinstance(node, torch.fx.Node):
                seen.append((v.dtype, node.meta["val"].dtype))
        return gm

    args = _args((8, 8), (8, 8))
    compiled = aot_function(disabled_region, checking_compiler)
    assert_like_eager(disabled_region, compiled, args, bf16_autocast, FP32, FP32)
    assert seen and all(a == b for a, b in seen), seen


def test_captured_graph_holds_the_casts_not_the_autocast_calls() -> None:
    """Dynamo hands ``_enter_autocast``/``_exit_autocast`` nodes for a region inside the
    function (none for autocast around the call: it guards that state); stoker's trace
    runs them, so its core-aten graph holds only casts: bf16 matmuls outside the
    region, an fp32 matmul inside it."""
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm

    dynamo_graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        dynamo_graphs.append(gm)
        return dynamo_backend(recording)(gm, example_inputs)

    args = [t.detach() for t in _args((6, 8), (8, 8), (8, 8))]
    with bf16_autocast():
        torch.compile(mixed, backend=backend)(*args)
    names = [str(n.target) for n in dynamo_graphs[0].graph.nodes]
    assert any("_enter_autocast" in t for t in names) and any("_exit_autocast" in t for t in names)
    (fw,) = graphs
    assert not [n for n in fw.graph.nodes if "autocast" in str(n.target)]
    mm = [n.meta["val"].dtype for n in fw.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert mm == [torch.bfloat16, torch.float32, torch.bfloat16], mm
    casts = [n for n in fw.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert any(n.kwargs.get("dtype") == torch.bfloat16 for n in casts)
