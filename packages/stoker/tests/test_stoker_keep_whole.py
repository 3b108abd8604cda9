"""The backward ops stoker-capture keeps whole in a joint graph (`KEEP_WHOLE_IN_BACKWARD`,
for the aten executor) reach stoker-triton whole: its own table decomposes each into
what it fuses, and the compiled backward matches eager.  Here in the umbrella's tests:
stoker-triton's own suite runs where stoker-capture is not installed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stoker_capture import aot_function
from stoker_capture._internal.stages.capture import KEEP_WHOLE_IN_BACKWARD
from stoker_triton import compile_graph
from stoker_triton._internal.pipeline import decomposition_table


def test_every_op_kept_whole_is_one_stoker_triton_decomposes() -> None:
    table = decomposition_table()
    for name in KEEP_WHOLE_IN_BACKWARD:
        packet = getattr(torch.ops.aten, name)
        missing = [o for o in packet.overloads() if getattr(packet, o) not in table]
        assert not missing, f"aten.{name}: overloads {missing} reach Triton undecomposed"


def _f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(x, (x.shape[-1],), w, b)
    h = F.gelu(h) * torch.sigmoid(h) + torch.tanh(h) + torch.relu(h) + F.silu(h)
    return torch.softmax(h, dim=-1).sum() + torch.log_softmax(h, dim=-1).mean()


def test_backward_of_kept_ops_compiled_by_triton_matches_eager() -> None:
    compiled = aot_function(_f, compile_graph, dynamic="static")
    args = [torch.randn(4, 8), torch.randn(8), torch.randn(8)]
    eager = [a.clone().requires_grad_() for a in args]
    comp = [a.clone().requires_grad_() for a in args]
    out_e, out_c = _f(*eager), compiled(*comp)
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    ge = torch.autograd.grad(out_e, eager)
    gc = torch.autograd.grad(out_c, comp)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_hook_on_the_layer_norm_bias_sees_its_weight_accumulated_as_in_eager() -> None:
    """The layer norm's weight and bias gradients leave its backward together, kept
    whole: the compiled backward accumulates them in the engine's order, so a
    post-accumulate-grad hook on the later one (stoker's DDP reducer hooks only a
    bucket's last gradient) finds the earlier one in ``.grad``, as eager does."""
    import copy

    import torch.nn as nn

    import stoker

    def run(model: nn.Sequential, compiled: bool, hooked: str) -> list[bool]:
        # one hook, on `hooked` only: a hook on each would place each accumulate
        seen: list[bool] = []
        norm = model[1]
        other = norm.weight if hooked == "bias" else norm.bias
        getattr(norm, hooked).register_post_accumulate_grad_hook(
            lambda _p: seen.append(other.grad is not None)
        )
        fn = stoker.compile(model) if compiled else model
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            fn(torch.randn(4, 6)).sum().backward()
        return seen

    for hooked in ("bias", "weight"):
        stoker.reset()
        try:
            eager = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
            model = copy.deepcopy(eager)
            with stoker.autograd_enabled(False):
                want = run(eager, False, hooked)
            assert run(model, True, hooked) == want, (hooked, want)
        finally:
            stoker.reset()


@pytest.mark.parametrize("norm", ["layernorm", "batchnorm", "groupnorm", "linear"])
def test_hooks_on_every_parameter_fire_in_eager_order(norm: str) -> None:
    """A tensor hook and a post-accumulate-grad hook on every parameter, a full backward
    hook on the layer after the norm: through stoker.compile the hooks fire in eager's
    order (the norm's weight's pair, then its bias's: the norm's backward yields both
    gradients from one node, kept whole, and eager runs them in its output order)."""
    import copy

    import torch.nn as nn

    import stoker

    layers = {
        "layernorm": lambda: nn.LayerNorm(8),
        "batchnorm": lambda: nn.BatchNorm1d(8),
        "groupnorm": lambda: nn.GroupNorm(2, 8),
        "linear": lambda: nn.Linear(8, 8),
    }

    def run(model: nn.Sequential, compiled: bool) -> list[str]:
        log: list[str] = []
        for name, p in model.named_parameters():
            p.register_hook(lambda g, n=name: log.append(f"tensor {n}") or None)  # type: ignore[func-returns-value]
            p.register_post_accumulate_grad_hook(lambda _p, n=name: log.append(f"acc {n}"))
        model[2].register_full_backward_hook(lambda m, gi, go: log.append("full") or None)  # type: ignore[func-returns-value]
        fn = stoker.compile(model) if compiled else model
        for step in range(2):
            log.append(f"-- step {step}")
            model.zero_grad(set_to_none=True)
            fn(torch.randn(5, 4)).pow(2).sum().backward()
        return log

    stoker.reset()
    try:
        torch.manual_seed(0)
        eager = nn.Sequential(nn.Linear(4, 8), layers[norm](), nn.Linear(8, 3))
        model = copy.deepcopy(eager)
        with stoker.autograd_enabled(False):
            want = run(eager, False)
        if norm != "linear":  # a norm's weight, then its bias (a Linear: bias, then weight)
            assert want.index("acc 1.weight") < want.index("tensor 1.bias")
        assert run(model, True) == want
    finally:
        stoker.reset()
