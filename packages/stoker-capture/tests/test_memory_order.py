"""Backward graphs that hold less at once: boxed calls and recomputation at first use."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.fx as fx

from stoker_capture._internal.partition.core import sink_recomputed
from stoker_capture._internal.runtime.boxed import call_boxed, mark_boxed

aten = torch.ops.aten


def _node(g: fx.Graph, op: object, args: tuple[object, ...], val: torch.Tensor) -> fx.Node:
    n = g.call_function(op, args)  # type: ignore[arg-type]
    n.meta["val"] = val
    return n


_alive: list[weakref.ref[torch.Tensor]] = []


def _probe() -> torch.Tensor:
    """Runs inside the graph after the input's last reader: is the input gone yet?"""
    return torch.tensor(float(_alive[0]() is None))


def test_boxed_graph_frees_an_input_after_its_last_reader() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    s = g.call_function(torch.sin, (x,))
    freed = g.call_function(_probe, ())
    g.output(g.call_function(torch.add, (s, freed)))
    gm = mark_boxed(fx.GraphModule(torch.nn.Module(), g))
    args = [torch.ones(4)]
    _alive[:] = [weakref.ref(args[0])]
    got = call_boxed(gm, args)
    assert args == []
    # freed before the call returned: the output is sin(1) + 1
    torch.testing.assert_close(got, torch.ones(4).sin() + 1)
    # and an unboxed call of the same graph keeps it (the argument tuple holds it)
    plain = fx.GraphModule(torch.nn.Module(), g)
    a = torch.ones(4)
    _alive[:] = [weakref.ref(a)]
    torch.testing.assert_close(plain(a), torch.ones(4).sin())


def test_boxed_graph_drops_input_before_later_ops() -> None:
    """In the generated code the input's name is released right after its last reader."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    s = g.call_function(torch.sin, (x,))
    t = g.call_function(torch.cos, (y,))
    g.output(g.call_function(torch.add, (s, t)))
    gm = mark_boxed(fx.GraphModule(torch.nn.Module(), g))
    code = gm.code
    assert "args.clear()" in code
    # x is released before cos runs
    assert code.index("x = None") < code.index("torch.cos")
    torch.testing.assert_close(
        call_boxed(gm, [torch.ones(2), torch.zeros(2)]), torch.ones(2).sin() + 1
    )


def test_unboxed_callable_still_gets_its_arguments_and_list_is_emptied() -> None:
    args = [torch.ones(2), torch.ones(2)]
    out = call_boxed(lambda p, q: p + q, args)
    assert args == [] and out.tolist() == [2.0, 2.0]


def test_recomputed_nodes_move_to_their_first_reader() -> None:
    """An fp32 upcast and its sigmoid, recomputed, run where the backward reads them,
    not at its start; a recomputed reduction (its input is larger) stays where it is."""
    g = fx.Graph()
    saved = g.placeholder("saved")
    saved.meta["val"] = torch.empty(64, dtype=torch.bfloat16)
    big = g.placeholder("big")
    big.meta["val"] = torch.empty(64)
    tangent = g.placeholder("tangent")
    tangent.meta["val"] = torch.empty(64)
    up = _node(g, aten._to_copy.default, (saved,), torch.empty(64))
    sig = _node(g, aten.sigmoid.default, (up,), torch.empty(64))
    red = _node(g, aten.sum.default, (big,), torch.empty(()))
    for n in (up, sig, red):
        n.meta["stoker_recomputed"] = True
    first = _node(g, aten.mul.Tensor, (tangent, 2), torch.empty(64))
    second = _node(g, aten.mul.Tensor, (first, red), torch.empty(64))
    third = _node(g, aten.mul.Tensor, (second, sig), torch.empty(64))
    g.output((third,))
    sink_recomputed(g)
    g.lint()
    order = [n for n in g.nodes if n.op == "call_function"]
    assert order.index(red) < order.index(first)  # the reduction stayed
    assert order.index(second) < order.index(up) < order.index(sig)
    assert order.index(sig) == order.index(third) - 1


def test_a_wrapper_forwarding_attributes_is_called_unpacked() -> None:
    """A wrapper whose __getattr__ forwards to the callable it wraps (a CUDA-graph
    replayer) is itself called, unpacked: its own boxed-ness counts, not the inner's."""

    class Inner:
        def call_boxed(self, args: list[torch.Tensor]) -> str:
            return "inner"

    class Wrapper:
        def __init__(self, fn: object) -> None:
            self.fn = fn

        def __getattr__(self, name: str) -> object:
            return getattr(self.__dict__["fn"], name)

        def __call__(self, *args: torch.Tensor) -> str:
            return f"wrapper({len(args)})"

    g = fx.Graph()
    g.output(g.placeholder("x"))
    boxed = mark_boxed(fx.GraphModule(torch.nn.Module(), g))
    assert call_boxed(Wrapper(Inner()), [torch.ones(1)]) == "wrapper(1)"
    assert call_boxed(Wrapper(boxed), [torch.ones(1), torch.ones(1)]) == "wrapper(2)"
    assert call_boxed(Inner(), [torch.ones(1)]) == "inner"


def test_a_lazy_backward_is_called_boxed() -> None:
    """lazy_backward: the backward compiled at its first call still takes the list, so
    it can free each saved tensor after its last reader (it was called unpacked)."""
    from stoker_capture import aot_function

    calls: list[str] = []

    class Boxed:
        def __init__(self, gm: fx.GraphModule) -> None:
            self.gm = gm

        def __call__(self, *args: torch.Tensor) -> object:
            calls.append("unpacked")
            return self.gm(*args)

        def call_boxed(self, args: list[torch.Tensor]) -> object:
            calls.append("boxed")
            a = list(args)
            args.clear()
            return self.gm(*a)

    for lazy in (False, True):
        calls.clear()
        f = aot_function(
            lambda x: (x.sin() * x).sum(), bw_compiler=lambda gm, ex: Boxed(gm), lazy_backward=lazy
        )
        x = torch.randn(5, requires_grad=True)
        f(x).backward()
        torch.testing.assert_close(x.grad, x.detach().cos() * x.detach() + x.detach().sin())
        assert calls == ["boxed"], (lazy, calls)


def test_boxing_shares_the_graph_and_generates_its_code_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`mark_boxed` copies no graph (a warm start boxes every loaded backward) and
    generates the boxed code once, at the first call; results match the graph's own."""
    made = _count_codegen(monkeypatch)
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    g.output((g.call_function(aten.mul.Tensor, (g.call_function(aten.sin.default, (x,)), y)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    boxed = mark_boxed(gm)
    assert boxed.graph is gm.graph and made == []
    for _ in range(3):
        a, b = torch.randn(5), torch.randn(5)
        args = [a, b]
        (got,) = call_boxed(boxed, args)
        assert args == []
        torch.testing.assert_close(got, gm(a, b)[0])
    assert len(made) == 1 and "args.clear()" in made[0] and "args.clear()" in boxed.code


def test_a_boxed_input_nobody_reads_is_not_held_during_the_call() -> None:
    g = fx.Graph()
    g.placeholder("unused")
    x = g.placeholder("x")
    freed = g.call_function(_probe, ())
    g.output(g.call_function(torch.add, (x, freed)))
    boxed = mark_boxed(fx.GraphModule(torch.nn.Module(), g))
    args = [torch.ones(3), torch.zeros(3)]
    _alive[:] = [weakref.ref(args[0])]
    torch.testing.assert_close(call_boxed(boxed, args), torch.ones(3))


def test_a_graph_with_a_default_argument_is_boxed_by_a_copy() -> None:
    """A placeholder with a default cannot be bound from the list by position alone:
    such a graph is boxed as a copy whose first node reads the list."""
    g = fx.Graph()
    x = g.placeholder("x")
    k = g.placeholder("k", default_value=2.0)
    g.output(g.call_function(torch.mul, (x, k)))
    boxed = mark_boxed(fx.GraphModule(torch.nn.Module(), g))
    assert boxed.graph is not g
    t = torch.randn(4)
    torch.testing.assert_close(call_boxed(boxed, [t, 3.0]), t * 3)


def _twin_graphs() -> tuple[fx.GraphModule, fx.GraphModule]:
    """The same graph built twice (as a warm process rebuilds a stored one)."""

    def build() -> fx.GraphModule:
        g = fx.Graph()
        x, y = g.placeholder("x"), g.placeholder("y")
        s = g.call_function(aten.sin.default, (x,))
        g.output((g.call_function(aten.mul.Tensor, (s, y)),))
        return fx.GraphModule(torch.nn.Module(), g)

    return build(), build()


def _count_codegen(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from stoker_capture._internal.runtime import boxed as boxed_mod

    made: list[str] = []
    real = boxed_mod._BoxedCodeGen.gen_fn_def

    def counted(self: object, *a: object, **k: object) -> str:
        out: str = real(self, *a, **k)  # type: ignore[arg-type]
        made.append(out)
        return out

    monkeypatch.setattr(boxed_mod._BoxedCodeGen, "gen_fn_def", counted)
    return made


def test_stored_boxed_code_is_loaded_without_generating_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm start takes the boxed code stored with the graph: neither generated nor
    compiled again (the bytecode is this Python's), and it computes the same."""
    import json

    first, second = _twin_graphs()
    stored = mark_boxed(first).stored()  # type: ignore[attr-defined]
    assert stored is not None
    stored = json.loads(json.dumps(stored))  # as an entry holds it
    made = _count_codegen(monkeypatch)
    compiled: list[object] = []
    real_compile = compile
    monkeypatch.setattr(
        "builtins.compile", lambda *a, **k: compiled.append(a) or real_compile(*a, **k)
    )
    boxed = mark_boxed(second)
    assert boxed.load(stored)  # type: ignore[attr-defined]
    a, b = torch.randn(6), torch.randn(6)
    (got,) = call_boxed(boxed, [a, b])
    monkeypatch.undo()
    assert made == [] and compiled == []
    torch.testing.assert_close(got, a.sin() * b)


def test_stored_boxed_code_of_another_python_or_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytecode of another bytecode format: compiled from the stored source. A stored
    code of another graph is refused (generated instead); so is a broken one."""
    first, second = _twin_graphs()
    stored = mark_boxed(first).stored()  # type: ignore[attr-defined]
    assert stored is not None
    boxed = mark_boxed(second)
    assert boxed.load({**stored, "magic": "0000", "bytecode": "bm90IGJ5dGVjb2Rl"})  # type: ignore[attr-defined]
    a, b = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(call_boxed(boxed, [a, b])[0], a.sin() * b)

    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    g.output((g.call_function(aten.add.Tensor, (x, y)),))  # another graph, same names
    other = mark_boxed(fx.GraphModule(torch.nn.Module(), g))
    assert not other.load(stored)  # type: ignore[attr-defined]
    assert not other.load({"graph": stored["graph"]})  # type: ignore[attr-defined]
    old_format = mark_boxed(_twin_graphs()[0])
    assert not old_format.load({**stored, "format": "0"})  # type: ignore[attr-defined]
    made = _count_codegen(monkeypatch)
    torch.testing.assert_close(call_boxed(other, [a, b])[0], a + b)
    assert len(made) == 1


def test_boxed_code_calling_an_unnamed_function_is_not_stored() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(lambda t: t + 1, (x,)),))
    boxed = mark_boxed(fx.GraphModule(torch.nn.Module(), g))
    assert boxed.stored() is None  # type: ignore[attr-defined]
    torch.testing.assert_close(call_boxed(boxed, [torch.zeros(2)])[0], torch.ones(2))
