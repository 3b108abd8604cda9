"""SegmentedBackward hands the compiler tensors, never the tuple of a multi-output op."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from stoker_autograd._internal.ops import call_hook
from stoker_autograd._internal.segments import SegmentedBackward


def test_items_of_a_multi_output_op_stay_in_its_segment() -> None:
    # x -> var_mean (a tuple) -> an opaque hook -> items of the tuple used after the hook
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 3)
    hook = g.placeholder("hook")  # hooks reach the graph as inputs
    vm = g.call_function(torch.ops.aten.var_mean.correction, (x, [1]), {"keepdim": True})
    hooked = g.call_function(call_hook, (hook, x), {"hook_type": "tensor_pre_hook"})
    var = g.call_function(operator.getitem, (vm, 0))
    mean = g.call_function(operator.getitem, (vm, 1))
    out = g.call_function(torch.ops.aten.add.Tensor, (var, mean))
    out2 = g.call_function(torch.ops.aten.mul.Tensor, (out, hooked))
    g.output((out2,))
    gm = fx.GraphModule(torch.nn.Module(), g)

    seen: list[list[Any]] = []

    def compiler(sub: fx.GraphModule, examples: list[Any]) -> Any:
        seen.append(list(examples))
        for node in sub.graph.nodes:
            if node.op == "output":
                targets = [a.target for a in node.args[0]]
                assert torch.ops.aten.var_mean.correction not in targets, "returned the tuple"
        return sub

    run = SegmentedBackward(gm, compiler)
    assert len(seen) == 2 and not any(isinstance(e, tuple) for ex in seen for e in ex)
    t = torch.randn(4, 3)
    v, m = torch.var_mean(t, 1, keepdim=True)
    torch.testing.assert_close(run(t, lambda a: a * 2)[0], (v + m) * (t * 2))
