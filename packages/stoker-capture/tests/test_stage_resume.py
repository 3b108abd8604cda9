"""The researcher's path: capture the joint graph, edit the backward, resume, train."""

from __future__ import annotations

import torch

from stoker_capture import aot_stage2_compile, export


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _halve_grad_of(gm: torch.fx.GraphModule, primal: str) -> None:
    """Edit the backward: the gradient of ``primal`` is multiplied by 0.5."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(out.args[0])
    phs = [n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    n_fw = len(outputs) - len(phs)
    k = n_fw + phs.index(primal)
    with gm.graph.inserting_before(out):
        half = gm.graph.call_function(torch.ops.aten.mul.Tensor, (outputs[k], 0.5))
        half.meta["val"] = outputs[k].meta["val"]
        half.meta["stoker_phase"] = "backward"
    outputs[k] = half
    out.args = (tuple(outputs),)
    gm.recompile()


def test_capture_edit_backward_resume_and_train() -> None:
    model, ref = _model(), _model()
    x, target = torch.randn(5, 4), torch.randn(5, 2)
    ep = export(model, (x,), joint=True)  # stop after capture: the joint graph
    assert ep.captured is not None and ep.state is not None
    assert "backward" in ep.captured.as_text()
    _halve_grad_of(ep.captured.gm, "primals_1")  # primals_1 is model[0].weight
    compiled = aot_stage2_compile(ep.state, ep.captured)  # resume the pipeline

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        loss = torch.nn.functional.mse_loss(compiled(x), target)
        loss.backward()
        loss_ref = torch.nn.functional.mse_loss(ref(x), target)
        loss_ref.backward()
        ref[0].weight.grad *= 0.5  # what the edit means, done eagerly
        torch.testing.assert_close(loss, loss_ref)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    torch.testing.assert_close(model[0].weight, ref[0].weight)


def test_a_resumed_compiled_function_checks_its_guards() -> None:
    import pytest

    from stoker_capture import GuardViolationError

    model = _model()
    ep = export(model, (torch.randn(5, 4),), joint=True)  # static batch of 5
    compiled = aot_stage2_compile(ep.state, ep.captured)
    compiled(torch.randn(5, 4)).sum().backward()
    with pytest.raises(GuardViolationError, match=r"args\[0\]\.size\(\)\[0\] == 5"):
        compiled(torch.randn(6, 4))
    assert "args[0]" in str(compiled.guards())
