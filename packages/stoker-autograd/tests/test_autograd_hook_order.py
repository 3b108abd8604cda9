"""Hooks on the leaves of a multi-output node fire in eager's order under stoker_autograd.

A norm layer's backward yields its weight's and bias's gradients together; eager runs
their accumulate-grads in the node's output order (weight, then bias), each with its
tensor hooks, ``retain_grad`` and post-accumulate-grad hooks, before any other node.
Each test records every hook's call over training steps, eagerly and under stoker
(the model as it is, and compiled by stoker-capture, whose backward keeps the norm's
backward op whole), with module full backward hooks beside them, and compares the
logs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

import stoker_autograd

stoker_capture = pytest.importorskip("stoker_capture")


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*full_backward_hook.*")
        yield


def _segmented(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return gm  # segments handed to a compiler, as stoker-triton gets them


_NORMS: dict[str, Callable[[], nn.Module]] = {
    "layernorm": lambda: nn.LayerNorm(8),
    "batchnorm": lambda: nn.BatchNorm1d(8),
    "groupnorm": lambda: nn.GroupNorm(2, 8),
    "linear": lambda: nn.Linear(8, 8),  # a plain Linear: bias, then weight (via its t())
}


def _body(norm: str) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), _NORMS[norm](), nn.Linear(8, 3))


def _instrument(params: list[tuple[str, nn.Parameter]], mix: str, log: list[str]) -> None:
    """Hooks on the parameters, by ``mix``: every parameter with a tensor hook and a
    post-accumulate-grad hook, or some of them, or one kind."""
    for name, p in params:
        is_norm = name.startswith("1.")
        if mix == "norm-weight-only" and name != "1.weight":
            continue
        if mix == "norm-bias-only" and name != "1.bias":
            continue
        if mix != "post-acc-only":
            p.register_hook(lambda g, n=name: log.append(f"tensor {n}") or None)  # type: ignore[func-returns-value]
        if mix != "tensor-only" and (mix != "mixed" or is_norm):
            p.register_post_accumulate_grad_hook(lambda _p, n=name: log.append(f"acc {n}"))


def _full_hook(module: nn.Module, name: str, log: list[str]) -> None:
    module.register_full_backward_hook(lambda m, gi, go: log.append(f"full {name}") or None)  # type: ignore[func-returns-value]


def _run(
    norm: str, mix: str, compiled: bool, compiler: Any = None, aot_body: bool = False
) -> list[str]:
    """Two training steps, eagerly or under enable().  ``aot_body``: the body compiled
    by stoker-capture (under enable()), or its eager reference: the same hooks, a
    full backward hook only on the head that follows it (stoker-capture traces a
    module's own backward hooks into its forward)."""
    torch.manual_seed(0)
    body, head = _body(norm), nn.Linear(3, 2)
    log: list[str] = []
    _instrument(list(body.named_parameters()), mix, log)
    _full_hook(head, "head", log)
    if not aot_body:
        _full_hook(body[2], "after the norm", log)
        _full_hook(body[1], "norm", log)
    fn = stoker_capture.aot_module(body) if aot_body and compiled else body
    opt = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
    enable = stoker_autograd.enable(compiler=compiler) if compiled else None
    with enable if enable is not None else torch.enable_grad():
        for step in range(2):
            log.append(f"-- step {step}")
            opt.zero_grad()
            head(fn(torch.randn(5, 4))).pow(2).sum().backward()
            opt.step()
    return log


_MIXES = ["all", "post-acc-only", "tensor-only", "norm-weight-only", "norm-bias-only", "mixed"]


@pytest.mark.parametrize("mix", _MIXES)
@pytest.mark.parametrize("norm", list(_NORMS))
def test_hooks_fire_in_eager_order(norm: str, mix: str) -> None:
    eager = _run(norm, mix, compiled=False)
    assert _run(norm, mix, compiled=True) == eager
    assert _run(norm, mix, compiled=True, compiler=_segmented) == eager


@pytest.mark.parametrize("norm", list(_NORMS))
def test_hooks_fire_in_eager_order_through_a_stoker_compiled_body(norm: str) -> None:
    eager = _run(norm, "all", compiled=False, aot_body=True)
    assert _run(norm, "all", compiled=True, aot_body=True) == eager
    assert _run(norm, "all", compiled=True, compiler=_segmented, aot_body=True) == eager
    if norm != "linear":  # the norm's backward stays one op: its two gradients are items
        torch.manual_seed(0)
        body = _body(norm)
        cm = stoker_capture.aot_module(body)
        with stoker_autograd.enable() as session:
            cm(torch.randn(5, 4)).sum().backward()
        rt = session.graphs[-1].last_retraced
        assert rt is not None
        ops = {str(n.target) for n in rt.gm.graph.nodes if n.op == "call_function"}
        kept = {
            "layernorm": "native_layer_norm_backward",
            "batchnorm": "native_batch_norm_backward",
        }
        want = kept.get(norm, "native_group_norm_backward")
        assert any(want in o for o in ops), sorted(ops)


def test_retain_grad_and_hooks_on_a_norm_output() -> None:
    """``retain_grad`` and a tensor hook on the norm's output (non-leaf), beside the
    parameters' hooks."""

    def run(compiled: bool) -> list[str]:
        torch.manual_seed(0)
        body = _body("layernorm")
        log: list[str] = []
        _instrument(list(body.named_parameters()), "all", log)
        seen: list[torch.Tensor] = []
        with stoker_autograd.enable() if compiled else torch.enable_grad():
            for _ in range(2):
                h = body[1](body[0](torch.randn(5, 4)))
                h.retain_grad()
                h.register_hook(lambda g: log.append("tensor h") or None)  # type: ignore[func-returns-value]
                body[2](h).pow(2).sum().backward()
                assert h.grad is not None
                seen.append(h.grad.clone())
        log += [f"{float(s.sum()):.5f}" for s in seen]
        return log

    assert run(True) == run(False)


def test_a_custom_backward_with_two_leaf_outputs_accumulates_in_output_order() -> None:
    """A custom Function yielding two parameters' gradients: eager accumulates them in
    its output order; the capture walks them the other way round."""

    class Affine(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x, w)
            return x * w + b

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
            x, w = ctx.saved_tensors
            return g * w, (g * x).sum(0), g.sum(0)

    def run(compiled: bool) -> list[str]:
        torch.manual_seed(0)
        w, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        log: list[str] = []
        _instrument([("1.weight", w), ("1.bias", b)], "all", log)
        with stoker_autograd.enable() if compiled else torch.enable_grad():
            for _ in range(2):
                w.grad = b.grad = None
                Affine.apply(torch.randn(3, 4), w, b).pow(2).sum().backward()
        return log

    eager = run(False)
    assert eager.index("acc 1.weight") < eager.index("tensor 1.bias")
    assert run(True) == eager
