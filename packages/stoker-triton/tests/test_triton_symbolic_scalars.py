"""Symbolic scalars the wrapper must bind: a SymFloat input, and `.item()` of a 0-d
input (how Dynamo hands a Python float it made dynamic). Each symbol reaches its
kernel as an argument, in float (not truncated to an integer), and a symbol
nothing binds is a compile-time error naming it, never a NameError at a call."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from triton_helpers import assert_same

from stoker_shapes import Dim, ShapeContext, Source
from stoker_triton import compile_graph


def _trace(ctx: ShapeContext, f: Any, *fakes: Any) -> torch.fx.GraphModule:
    with ctx.tracing():
        return make_fx(f, decomposition_table=core_aten_decompositions())(*fakes)


def _item_input(ctx: ShapeContext, value: float, i: int) -> tuple[torch.Tensor, Any]:
    """A 0-d float64 fake whose `.item()` is a backed SymFloat, as Dynamo makes one."""
    sym = ctx.fakeify(value, Source.arg(i), dynamic=True)
    assert isinstance(sym, torch.SymFloat)
    fake = ctx.fake_mode.from_tensor(torch.tensor(value, dtype=torch.float64))
    fake.item_memo = sym
    return fake, sym


def _x_and_grad(f: Any) -> Any:
    """f(x, s) and its gradient, as one graph to compile."""

    def fg(x: torch.Tensor, s: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_(True)
        y = f(x, s)
        (g,) = torch.autograd.grad((y * y).sum(), [x])
        return y, g

    return fg


def _scale_tanh(x: torch.Tensor, s: Any) -> torch.Tensor:
    return (x * s + s).tanh() / (1.5 + 0 * s) + x.sum(0) * s


def test_symfloat_placeholder_reaches_the_kernel_as_a_float() -> None:
    ctx = ShapeContext(policy="dynamic")
    fx = ctx.fakeify(torch.randn(3, 4), Source.arg(0), dynamic={0: Dim("b", max=32)})
    fs = ctx.fakeify(0.75, Source.arg(1), dynamic=True)
    assert isinstance(fs, torch.SymFloat)
    f = _x_and_grad(_scale_tanh)
    fn = compile_graph(_trace(ctx, f, fx, fs), [fx, fs])
    assert not fn.report.fallback_ops, str(fn.report)
    for n, s in ((3, 0.75), (5, -1.3), (2, 0.37)):
        x = torch.randn(n, 4)
        assert_same(fn(x, s), f(x, s), rtol=1e-4, atol=1e-5)


def _derived_floats(x: torch.Tensor, s: Any) -> torch.Tensor:
    # floats computed from the symbol: the wrapper computes them in Python
    return x * (1.0 / s) + (x * (s * s + 1.0)).sin() * (s / 3.0)


def test_floats_computed_from_a_symfloat_are_computed_by_the_wrapper() -> None:
    ctx = ShapeContext(policy="dynamic")
    fx = ctx.fakeify(torch.randn(3, 4), Source.arg(0))
    fs = ctx.fakeify(0.75, Source.arg(1), dynamic=True)
    f = _x_and_grad(_derived_floats)
    fn = compile_graph(_trace(ctx, f, fx, fs), [fx, fs])
    assert not fn.report.fallback_ops, str(fn.report)
    for s in (0.75, -1.3, 2.5):
        x = torch.randn(3, 4)
        assert_same(fn(x, s), f(x, s), rtol=1e-4, atol=1e-5)


def _item_graph(f: Any) -> tuple[Any, Any, Any]:
    ctx = ShapeContext(policy="dynamic")
    fx = ctx.fakeify(torch.randn(3, 4), Source.arg(0))
    ft, _ = _item_input(ctx, 0.75, 1)
    gm = _trace(ctx, lambda x, t: f(x, t.item()), fx, ft)
    assert any(n.target is torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes)
    return gm, fx, ft


@pytest.mark.parametrize("body", [_scale_tanh, _derived_floats])
def test_item_of_a_0d_input_is_bound_from_that_input(body: Any) -> None:
    f = _x_and_grad(body)
    gm, fx, ft = _item_graph(f)
    fn = compile_graph(gm, [fx, ft])
    assert ".item()" in fn.wrapper_source, fn.wrapper_source
    assert not fn.report.fallback_ops, str(fn.report)
    for s in (0.75, -1.3, 0.37):
        x, t = torch.randn(3, 4), torch.tensor(s, dtype=torch.float64)
        assert_same(fn(x, t), f(x, s), rtol=1e-4, atol=1e-5)


def test_a_symbol_nothing_binds_is_a_compile_error_naming_it() -> None:
    from stoker_triton._internal.codegen.wrapper import UnboundSymbolError

    # the 0-d tensor is computed in the graph (not an input): its .item() symbol
    # cannot be read before the kernels run, so compiling must say so
    ctx = ShapeContext(policy="dynamic")
    fx = ctx.fakeify(torch.randn(3, 4), Source.arg(0))
    ft, sym = _item_input(ctx, 0.75, 1)

    def f(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x * (t * 2).item()

    with ctx.tracing():
        gm = make_fx(f, decomposition_table=core_aten_decompositions())(fx, ft)
    # stand the doubled tensor's item in for the input's symbol (what a graph whose
    # backed symbol comes from a computed tensor looks like)
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten._local_scalar_dense.default:
            n.meta["val"] = sym
    with pytest.raises(
        UnboundSymbolError,
        match=rf"{sym.node.expr}: from graph node _local_scalar_dense = aten\._local_scalar_dense",
    ):
        compile_graph(gm, [fx, ft])


def test_check_bound_reads_names_in_every_scope() -> None:
    """A name is bound by any binding in any scope (arguments, assignments, ``for``,
    ``with``, imports, ``def``, a comprehension's variable, ``del``), as the wrapper's
    closures use them; a name read and bound nowhere is reported."""
    from types import SimpleNamespace

    from stoker_triton._internal.codegen.wrapper import UnboundSymbolError, check_bound

    ok = (
        "import math as m\n"
        "def make_call(launchers, consts):\n"
        "    C0 = consts['C0']\n"
        "    def call(args):\n"
        "        a, = args\n"
        "        for i in range(2):\n"
        "            with open('x') as f:\n"
        "                b = [j * i for j in (a, C0, m.pi)]\n"
        "        del a\n"
        "        return b, launchers, f\n"
        "    return call\n"
    )
    program: Any = SimpleNamespace(symbol_origins={})
    check_bound(ok, program)
    for unbound in ("s7", "u0"):
        src = ok.replace("return b, launchers, f", f"return b, launchers, f, {unbound} * 2")
        with pytest.raises(UnboundSymbolError, match=rf"  {unbound}: from an unknown source"):
            check_bound(src, program)
