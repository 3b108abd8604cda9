"""`graph_text`, the graph part of the persistent caches' keys, against its definition.

`graph_text` memoizes value texts and spells common argument types directly; its
lines must stay exactly those of the plain definition below (`val_text` per node), or
every cache key changes meaning.  The graphs cover what keys meet: symbolic sizes,
in-place ops and views (aliases), shared fake values, kwargs with dtypes, devices and
memory formats, immutable lists, tensor constants, Dynamo's ``example_value``, a
subgraph of a higher-order op.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from stoker_shapes import Dim, ShapeContext
from stoker_shapes._internal.cachekey import graph_text, target_text, val_text


def reference_text(gm: fx.GraphModule) -> list[str]:
    """The definition: one line per node from `val_text`, subgraphs inline."""
    lines = []
    for n in gm.graph.nodes:
        val = n.meta.get("val", n.meta.get("example_value"))
        args = f"{val_text(n.args, data=True)} {val_text(n.kwargs, data=True)}"
        line = f"{n.op} {n.name} {target_text(n.target)} {args} :: {val_text(val)}"
        if n.op in ("get_attr", "call_module"):
            sub = getattr(gm, str(n.target), None)
            if isinstance(sub, fx.GraphModule):
                lines += [f"subgraph {n.target}:", *reference_text(sub)]
            elif isinstance(sub, torch.nn.Module):
                line += " = " + repr(sub)
            else:
                line += " = " + val_text(sub)
        lines.append(line)
    return lines


def mlp(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.layer_norm(x @ w + b, (w.shape[1],))
    return torch.softmax(torch.nn.functional.gelu(h), dim=-1).sum(0)


def mutate(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    v = x[1:].transpose(0, 1)  # a view of an input, then in-place ops on it
    v.mul_(2)
    y.add_(1)
    z = x.new_zeros(x.shape, dtype=torch.float64).contiguous(memory_format=torch.contiguous_format)
    return v, x.view(-1), z.to(device="cpu", dtype=torch.float16), torch.cat([x, x])


def shared_and_symbolic(x: torch.Tensor, n: int) -> torch.Tensor:
    a = x.reshape(-1, 2).flip([0]).clone()
    return torch.stack([a * n, a + n, a.new_full((a.shape[0], 2), 3.5)])


def _traced(fn: Any, *args: Any, dynamic: Any = None) -> fx.GraphModule:
    ctx = ShapeContext(policy="static" if dynamic is None else "auto")
    specs = dynamic or [None] * len(args)
    fakes = [
        ctx.fakeify(a, _src(i), s) if isinstance(a, torch.Tensor) else a
        for i, (a, s) in enumerate(zip(args, specs, strict=True))
    ]
    with ctx.tracing():
        return make_fx(fn, tracing_mode="real")(*fakes)


def _src(i: int) -> Any:
    from stoker_shapes import Source

    return Source.arg(i)


def _graphs() -> dict[str, fx.GraphModule]:
    out = {
        "mlp static": _traced(mlp, torch.randn(4, 8), torch.randn(8, 6), torch.randn(6)),
        "mlp symbolic": _traced(
            mlp,
            torch.randn(4, 8),
            torch.randn(8, 6),
            torch.randn(6),
            dynamic=[{0: Dim("b")}, None, None],
        ),
        "mutation and views": _traced(
            mutate, torch.randn(5, 3), torch.randn(3), dynamic=[{0: Dim("r")}, None]
        ),
        "shared values": _traced(
            shared_and_symbolic, torch.randn(6, 4), 3, dynamic=[{0: Dim("n")}, None]
        ),
    }
    # a graph with a tensor constant, a submodule, a subgraph, raw values and no "val"s
    sub = fx.symbolic_trace(lambda t: t.relu() + 1)
    g = fx.Graph()
    root = torch.nn.Module()
    root.const = torch.arange(6.0).reshape(2, 3)
    root.lin = torch.nn.Linear(3, 2)
    root.sub = sub
    x = g.placeholder("x")
    c = g.get_attr("const")
    s = g.call_module("sub", (x,))
    lin = g.call_module("lin", (c,))
    k = g.call_function(
        torch.ops.aten.new_zeros.default,
        (x, [2, 3]),
        {"dtype": torch.bfloat16, "device": torch.device("cpu"), "layout": torch.strided},
    )
    m = g.call_function(torch.clone, (s,), {"memory_format": torch.channels_last})
    result: Any = (s, lin, k, m, [x, (1.5, None, "txt", True)], {"a": x})
    g.output(result)
    out["constants and modules"] = fx.GraphModule(root, g)
    # Dynamo's graphs hold example_value, not val
    seen: list[fx.GraphModule] = []

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda a, b: (a @ b).tanh().split(2), backend=backend, dynamic=True)
    f(torch.randn(4, 3), torch.randn(3, 5))
    torch._dynamo.reset()
    out["dynamo example_value"] = seen[0]
    return out


GRAPHS = _graphs()


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_text_is_the_definition(name: str) -> None:
    gm = GRAPHS[name]
    assert graph_text(gm) == reference_text(gm)


def test_graph_text_sees_a_changed_shared_value() -> None:
    """Values are memoized within one call only: a later call sees a new value."""
    gm = GRAPHS["shared values"]
    before = graph_text(gm)
    n = next(n for n in gm.graph.nodes if n.op == "call_function")
    old = n.meta["val"]
    n.meta["val"] = old.new_empty((7, 2))
    try:
        assert graph_text(gm) != before
        assert graph_text(gm) == reference_text(gm)
    finally:
        n.meta["val"] = old
    assert graph_text(gm) == before


def test_graph_text_names_arguments_by_kind() -> None:
    """Equal-looking arguments of other types give other lines (1 vs True vs 1.0 vs "1")."""
    texts = set()
    for v in (1, True, 1.0, "1", [1], (1,), None):
        g = fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(torch.ops.aten.add.Tensor, (x, v)))
        texts.add("\n".join(graph_text(fx.GraphModule(torch.nn.Module(), g))))
    assert len(texts) == 7
