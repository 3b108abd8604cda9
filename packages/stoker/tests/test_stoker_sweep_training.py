"""A correctness sweep: training situations real code uses, through ``stoker.compile``
(default options, the aten executor on the CPU) against eager, over a few optimizer
steps on fresh random inputs.  The harness is `sweep_cases.py`."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from interpret_script import run_interpreted
from sweep_cases import (
    MLP,
    MODES,
    Batch,
    Case,
    backward_step,
    dot_grads,
    mlp_batch,
    run_case,
)

import stoker

Params = dict[str, nn.Parameter]


@pytest.fixture(autouse=True)
def fresh_stoker() -> Iterator[None]:
    stoker.reset()
    yield
    stoker.reset()


@pytest.fixture(params=["ca", "no_ca", "ca_paused"])
def mode(request: pytest.FixtureRequest) -> str:
    """Compiled autograd on, off at compile time, or paused around the backward."""
    return str(request.param)


# --- how the loss becomes gradients -------------------------------------------------------


def test_autograd_grad_instead_of_backward(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        out = model(b[0])
        loss = F.mse_loss(out, b[1])
        grads = torch.autograd.grad(loss, list(params.values()))
        for p, g in zip(params.values(), grads):
            p.grad = g
        return (out, loss), {k: g for k, g in zip(params, grads)}

    run_case(Case(MLP, mlp_batch, step), mode=mode)


def test_autograd_grad_of_some_params_and_an_input(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        x = b[0].requires_grad_()
        out = model(x)
        loss = F.mse_loss(out, b[1])
        gx, gw = torch.autograd.grad(loss, [x, params["fc1.weight"]])
        assert all(p.grad is None for p in params.values())
        params["fc1.weight"].grad = gw
        return (out, loss, gx), {"fc1.weight": gw}

    run_case(Case(MLP, mlp_batch, step), mode=mode)


def retain_graph_case() -> Case:
    def step(model: Any, params: Params, b: Batch) -> Any:
        out = model(b[0])
        loss = F.mse_loss(out, b[1])
        loss.backward(retain_graph=True)
        first = dot_grads(params)
        (loss * 0.5).backward()
        return (out, loss), {**{k + "@1": v for k, v in first.items()}, **dot_grads(params)}

    return Case(MLP, mlp_batch, step)


def test_backward_twice_with_retain_graph_accumulates(mode: str) -> None:
    run_case(retain_graph_case(), mode=mode)


def test_gradient_accumulation_over_micro_batches(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        outs = []
        for x, y in zip(b[0].chunk(3), b[1].chunk(3)):
            out = model(x)
            (F.mse_loss(out, y) / 3).backward()
            outs.append(out)
        return outs, dot_grads(params)

    run_case(Case(MLP, mlp_batch, step, batch_sizes=(6, 6, 6)), mode=mode)


def test_double_backward_works_or_raises_clearly(mode: str) -> None:
    """create_graph=True: a gradient penalty.  Either eager's numbers or a clear error."""

    def step(model: Any, params: Params, b: Batch) -> Any:
        x = b[0].requires_grad_()
        out = model(x)
        loss = F.mse_loss(out, b[1])
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        total = loss + gx.pow(2).sum()
        total.backward()
        return (out, loss, gx, total), dot_grads(params)

    try:
        run_case(Case(MLP, mlp_batch, step), mode=mode)
    except AssertionError:
        raise
    except Exception as e:  # a clear error names double backward and what to do
        msg = str(e)
        assert "double backward" in msg or "create_graph" in msg, repr(e)
        assert "Dynamo graph" in msg and "<locals>" not in msg, msg  # names the graph


# --- model structure ------------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b(torch.sin(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = ckpt.checkpoint(self.block, h, use_reentrant=False)
        return self.c(h)


def test_non_reentrant_checkpoint(mode: str) -> None:
    run_case(Case(Checkpointed, mlp_batch, backward_step), mode=mode)


class MultiOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.aux = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.fc1(x))
        # a user-held intermediate that the backward also saves, an unused head, an
        # alias of the input and a view of the input
        return self.fc2(h), h, self.aux(h), x, x.t()


def multi_out_case() -> Case:
    def step(model: Any, params: Params, b: Batch) -> Any:
        x = b[0].requires_grad_()
        out, h, aux, same, xt = model(x)
        assert same is x or same._base is x or torch.equal(same, x)
        loss = F.mse_loss(out, b[1]) + h.mean()
        loss.backward()
        return (out, h, aux, same, xt, loss, x.grad), dot_grads(params)

    return Case(MultiOut, mlp_batch, step)


def test_several_outputs_some_unused_and_aliases_of_the_input(mode: str) -> None:
    run_case(multi_out_case(), mode=mode)


def test_held_output_saved_for_backward_is_not_freed(mode: str) -> None:
    """`h` is returned to the caller and saved for the backward (tanh's output): freeing
    saved tensors after their last reader must not touch it, and the caller may read it
    after backward."""

    def step(model: Any, params: Params, b: Batch) -> Any:
        out, h, *_ = model(b[0])
        loss = F.mse_loss(out, b[1])
        loss.backward()
        return (out, h.clone(), h.sum()), dot_grads(params)

    run_case(Case(MultiOut, mlp_batch, step), mode=mode)


class BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


def test_batchnorm_running_stats_then_eval(mode: str) -> None:
    compiled = run_case(Case(BN, mlp_batch, backward_step), mode=mode)
    model = compiled._orig_mod
    eager = BN()
    eager.load_state_dict(model.state_dict())
    compiled.eval()
    eager.eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
    # eval with grad: running stats are read, not written
    before = model.bn.running_mean.clone()
    compiled(x).sum().backward()
    torch.testing.assert_close(model.bn.running_mean, before)


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.fc1.weight.register_hook(lambda g: g * 2.0)
        self.seen: list[float] = []
        self.fc2.bias.register_post_accumulate_grad_hook(
            lambda p: self.seen.append(float(p.grad.sum()))
        )
        self.fc2.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def hooks_case() -> Case:
    def step(model: Any, params: Params, b: Batch) -> Any:
        out = model(b[0])
        F.mse_loss(out, b[1]).backward()
        mod = getattr(model, "_orig_mod", model)
        return (out, torch.tensor(mod.seen[-1])), dot_grads(params)

    return Case(Hooked, mlp_batch, step)


def test_parameter_and_module_hooks(mode: str) -> None:
    run_case(hooks_case(), mode=mode)


class ScaledSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return (x * w) ** 2 * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        d = 2 * x * w * ctx.scale * g
        return d * w, (d * x).sum(0), None


class CustomFn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.w = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ScaledSquare.apply(self.fc1(x), self.w, 0.3))


def test_custom_autograd_function_with_saved_tensors_and_ctx_attributes(mode: str) -> None:
    run_case(Case(CustomFn, mlp_batch, backward_step), mode=mode)


class Frozen(nn.Module):
    """A frozen layer, a detached branch, and tied weights (an embedding and its head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = self.fc(self.frozen(h)) + self.fc(h).detach()
        return self.head(torch.tanh(h))


def tok_batch(n: int, gen: torch.Generator) -> Batch:
    return torch.randint(0, 10, (n, 5), generator=gen), torch.randint(0, 10, (n, 5), generator=gen)


def ce_step(model: Any, params: Params, b: Batch) -> Any:
    out = model(b[0])
    loss = F.cross_entropy(out.flatten(0, 1), b[1].flatten())
    loss.backward()
    return (out, loss), dot_grads(params)


def test_frozen_params_detach_and_tied_weights(mode: str) -> None:
    run_case(Case(Frozen, tok_batch, ce_step), mode=mode)


def test_no_grad_inference_and_eval_between_steps(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        mod = getattr(model, "_orig_mod", model)
        mod.eval()
        with torch.no_grad():
            pred = model(b[0])
        mod.train()
        out = model(b[0])
        F.mse_loss(out, b[1]).backward()
        return (pred, out), dot_grads(params)

    run_case(Case(BN, mlp_batch, step), mode=mode)


class Drop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def bf16_autocast_step(model: Any, params: Params, b: Batch) -> Any:
    """The forward under bf16 autocast on the batch's device."""
    with torch.autocast(b[0].device.type, dtype=torch.bfloat16):
        out = model(b[0])
        loss = F.mse_loss(out.float(), b[1])
    loss.backward()
    return (out, loss), dot_grads(params)


def test_bf16_autocast(mode: str) -> None:
    run_case(Case(Checkpointed, mlp_batch, bf16_autocast_step, bf16=True), mode=mode)


def test_batch_size_changes(mode: str) -> None:
    run_case(Case(BN, mlp_batch, backward_step, batch_sizes=(4, 6, 3, 6)), mode=mode)


def test_same_model_compiled_twice() -> None:
    torch.manual_seed(0)
    model = MLP()
    a, b = stoker.compile(model), stoker.compile(model, dynamic=True)
    x, y = mlp_batch(4, torch.Generator().manual_seed(0))
    with stoker.autograd_enabled(False):
        F.mse_loss(model(x), y).backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    for c in (a, b, a):
        model.zero_grad(set_to_none=True)
        F.mse_loss(c(x), y).backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[k], rtol=1e-4, atol=1e-5)


# --- mutation between forward and backward ------------------------------------------------


class SavesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * x)  # x saved for mul's backward


def test_input_mutated_after_forward_raises_like_eager() -> None:
    torch.manual_seed(0)
    model = SavesInput()
    compiled = stoker.compile(model)
    for m in (model, compiled):
        x = torch.randn(3, 8, requires_grad=True)
        y = x * 1.0  # non-leaf so it can be mutated in place
        out = m(y)
        with torch.no_grad():
            y.add_(1.0)
        with stoker.autograd_enabled(m is compiled):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()


def test_output_mutated_after_forward_raises_like_eager() -> None:
    """`h` (tanh's output) is returned and saved for the backward; changing it in place
    before backward raises in eager."""
    torch.manual_seed(0)
    model = MultiOut()
    # the aten executor: the backward saves the returned tensor itself, so its version
    # counter sees the write; a kernel executor may store the saved value in a buffer of
    # its own, and the backward then runs on the value before the write (docs/triton.md,
    # "Known limits")
    compiled = stoker.compile(model, backend="aten")
    for m in (model, compiled):
        out, h, *_ = m(torch.randn(3, 8))
        with torch.no_grad():
            h.mul_(2.0)
        with stoker.autograd_enabled(m is compiled):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()


def test_two_forwards_then_one_backward(mode: str) -> None:
    """Two graphs alive at once (a siamese loss): each keeps its own saved tensors."""

    def step(model: Any, params: Params, b: Batch) -> Any:
        o1, o2 = model(b[0]), model(b[0].flip(0))
        loss = F.mse_loss(o1 - o2, b[1])
        loss.backward()
        return (o1, o2, loss), dot_grads(params)

    run_case(Case(MLP, mlp_batch, step), mode=mode)


def test_backward_of_the_older_graph_after_a_newer_forward(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        o1 = model(b[0])
        o2 = model(b[0] * 2)
        F.mse_loss(o1, b[1]).backward()
        g1 = dot_grads(params)
        F.mse_loss(o2, b[1]).backward()
        return (o1, o2), {**{k + "@1": v for k, v in g1.items()}, **dot_grads(params)}

    run_case(Case(MLP, mlp_batch, step), mode=mode)


def test_retain_graph_with_checkpoint_and_changing_batch(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        out = model(b[0])
        loss = F.mse_loss(out, b[1])
        loss.backward(retain_graph=True)
        loss.backward()
        return (out, loss), dot_grads(params)

    run_case(Case(Checkpointed, mlp_batch, step, batch_sizes=(4, 6, 5)), mode=mode)


def test_input_mutated_after_forward_all_modes(mode: str) -> None:
    torch.manual_seed(0)
    model = SavesInput()
    compiled = stoker.compile(model, **MODES[mode][0])
    x = torch.randn(3, 8, requires_grad=True)
    y = x * 1.0
    out = compiled(y)
    with torch.no_grad():
        y.add_(1.0)
    with stoker.autograd_enabled(MODES[mode][1]):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.slow
def test_interpreted_triton_kernels_tiny_cases() -> None:
    """A few tiny cases with Triton kernels under the interpreter (a fresh process: the
    interpreter must be on before Triton jits anything)."""
    run_interpreted(
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        + textwrap.dedent(
            """
            import stoker, test_stoker_sweep_training as t
            for mode in ("ca", "no_ca"):
                for case in (
                    t.retain_graph_case(),
                    t.multi_out_case(),
                    t.hooks_case(),
                    t.strided_case(),
                    t.transposed_case(),
                ):
                    stoker.reset()
                    rep = t.run_case(case, backend="interpret", mode=mode).stoker_report
                    assert {c.executor for c in rep.compiles} == {"interpret"}, rep.compiles
            print("ok")
            """
        )
    )


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.dropout(torch.sin(x), 0.5, self.training) * self.w)


@pytest.mark.parametrize("budget", [None, 0.0])
def test_dropout_mask_of_backward_matches_forward(mode: str, budget: float | None) -> None:
    check_dropout_mask(mode, budget)


def check_dropout_mask(
    mode: str, budget: float | None, device: str = "cpu", backend: str = "aten"
) -> None:
    """Recomputed (budget 0) or saved, the backward must use the forward's dropout mask:
    d/dw sum(tanh(m * w)) = sum(m * (1 - out**2)), with m recovered from the output."""
    torch.manual_seed(0)
    model = Dropped().to(device)
    kw = {**MODES[mode][0], **({} if budget is None else {"memory_budget": budget})}
    compiled = stoker.compile(model, backend=backend, **kw)
    for n in (16, 16, 12):
        x = torch.randn(n, 8).to(device)
        model.w.grad = None
        with stoker.autograd_enabled(MODES[mode][1]) if mode == "ca_paused" else nullcontext():
            out = compiled(x)
            out.sum().backward()
        m = torch.atanh(out.detach()) / model.w.detach()  # 2*sin(x) where kept, else 0
        kept = m.abs() > 1e-6
        assert 0.2 < float(kept.float().mean()) < 0.8
        torch.testing.assert_close(m[kept], 2 * torch.sin(x)[kept], rtol=1e-3, atol=1e-4)
        want = (m * (1 - out.detach() ** 2)).sum(0)
        torch.testing.assert_close(model.w.grad, want, rtol=1e-4, atol=1e-5)


class Strided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.exp(x) * self.w + x
        return y, y.t(), y[:, 1:3], x.argmax(-1), y.sum(0).view(2, 3)


def strided_case() -> Case:
    """The same shape with other strides each step: contiguous, transposed, broadcast
    (stride 0), a slice with an offset."""
    layouts = iter(
        [
            lambda t: t,
            lambda t: t.t().contiguous().t(),
            lambda t: t[:1].expand(6, 6),
            lambda t: torch.cat([t, t], 1)[:, 3:9],
        ]
        * 4
    )

    def batch(n: int, gen: torch.Generator) -> Batch:
        return next(layouts)(torch.randn(6, 6, generator=gen)), torch.randn(6, 6, generator=gen)

    def step(model: Any, params: Params, b: Batch) -> Any:
        outs = model(b[0])
        loss = F.mse_loss(outs[0], b[1]) + outs[1].sum() + outs[2].pow(2).sum() + outs[4].sum()
        loss.backward()
        return outs, dot_grads(params)

    return Case(Strided, batch, step, batch_sizes=(6, 6, 6, 6))


def test_inputs_with_other_strides_and_view_outputs(mode: str) -> None:
    run_case(strided_case(), mode=mode)


def test_inference_mode_then_training(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        with torch.inference_mode():
            pred = model(b[0])
        out = model(b[0])
        F.mse_loss(out, b[1]).backward()
        return (pred.clone(), out), dot_grads(params)

    run_case(Case(MLP, mlp_batch, step), mode=mode)


class MutatesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        self.count += 1
        out = self.fc(torch.relu(x))
        acc.add_(out.detach())  # a user-visible in-place update of an input
        return out


def test_forward_that_mutates_an_input_and_a_buffer(mode: str) -> None:
    def batch(n: int, gen: torch.Generator) -> Batch:
        x, y = mlp_batch(n, gen)
        return x, torch.zeros(n, 4), y

    def step(model: Any, params: Params, b: Batch) -> Any:
        out = model(b[0], b[1])
        F.mse_loss(out, b[2]).backward()
        return (out, b[1]), dot_grads(params)

    run_case(Case(MutatesInput, batch, step), mode=mode)


class IntermediateHook(nn.Module):
    """A hook on an intermediate registered inside forward (grad clipping), a no_grad
    region and a layer applied twice; a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.fc1(x))
        if h.requires_grad:
            h.register_hook(lambda g: g.clamp(-0.01, 0.01))
        with torch.no_grad():
            target = self.fc1(x).sigmoid()
        h2 = torch.tanh(self.fc1(h))
        return {"out": self.fc2(h2), "target": target}


def test_hook_on_an_intermediate_no_grad_region_and_a_layer_used_twice(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        d = model(b[0])
        loss = F.mse_loss(d["out"], b[1]) + (d["out"].mean() - d["target"].mean()) ** 2
        loss.backward()
        return (d["out"], d["target"], loss), dot_grads(params)

    run_case(Case(IntermediateHook, mlp_batch, step), mode=mode)


def test_retain_grad_grad_outputs_allow_unused_and_set_to_none_false(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        for p in params.values():  # grads accumulate into existing tensors
            p.grad = torch.ones_like(p) * 0.01
        out = model(b[0])
        out.retain_grad()
        out.backward(gradient=b[1])
        gx = torch.autograd.grad(
            model(b[0]).sum(),
            [params["fc1.weight"], torch.zeros(1, requires_grad=True)],
            allow_unused=True,
        )
        assert gx[1] is None
        return (out, out.grad, gx[0]), dot_grads(params)

    run_case(Case(MLP, mlp_batch, step), mode=mode)


class CkptDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def block(h: torch.Tensor) -> torch.Tensor:
            return F.dropout(torch.relu(self.a(h)), 0.3, self.training)

        h = ckpt.checkpoint(block, x, use_reentrant=False)
        return h, self.b(h)


def test_checkpoint_with_dropout_replays_the_forward_mask(mode: str) -> None:
    """The recomputed block must draw the forward's dropout mask: with loss sum(c * h),
    h = dropout(relu(a(x))), a.bias's gradient is sum(c * (h > 0)) / 0.7."""
    torch.manual_seed(0)
    model = CkptDropout()
    compiled = stoker.compile(model, **MODES[mode][0])
    for n in (32, 32, 24):
        x, c = torch.randn(n, 8), torch.randn(n, 16)
        model.zero_grad(set_to_none=True)
        with stoker.autograd_enabled(MODES[mode][1]) if mode == "ca_paused" else nullcontext():
            h, out = compiled(x)
            ((h * c).sum() + out.sum()).backward()
        keep = (h.detach() > 0).float()
        g_h = c + model.b.weight.detach().sum(0)
        torch.testing.assert_close(
            model.a.bias.grad, (g_h * keep / 0.7).sum(0), rtol=1e-4, atol=1e-4
        )


class Zoo(nn.Module):
    """Embedding with max_norm (renormalises its weight in place in forward), attention
    through SDPA, LayerNorm, GELU, a label-smoothed cross-entropy with ignore_index."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, max_norm=1.0, padding_idx=0)
        self.qkv, self.ln = nn.Linear(8, 24), nn.LayerNorm(8)
        self.head = nn.Linear(8, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = self.ln(h + a.transpose(1, 2).flatten(2))
        return self.head(F.gelu(h))


def test_embedding_max_norm_sdpa_layernorm_label_smoothing(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        out = model(b[0])
        tgt = b[1].masked_fill(b[1] == 3, -100)
        loss = F.cross_entropy(out.flatten(0, 1), tgt.flatten(), label_smoothing=0.1)
        loss.backward()
        return (out, loss), dot_grads(params)

    run_case(Case(Zoo, tok_batch, step), mode=mode)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(h.mean((2, 3)))


def channels_last_batch(n: int, gen: torch.Generator) -> Batch:
    x = torch.randn(n, 3, 6, 6, generator=gen)
    return x.to(memory_format=torch.channels_last), torch.randn(n, 4, generator=gen)


def test_conv_batchnorm_channels_last_input(mode: str) -> None:
    run_case(Case(ConvNet, channels_last_batch, backward_step), mode=mode)


def test_conv_batchnorm_channels_last_input_on_c_kernels(mode: str) -> None:
    """The same through the C kernels, which store the channels-last activations
    channels-last and walk them in memory order (the max-pool's backward too): eager's
    losses and gradients with and without compiled autograd, whose backward gets the
    saved activations in that layout."""
    run_case(Case(ConvNet, channels_last_batch, backward_step), backend="c", mode=mode)


def test_freezing_and_unfreezing_parameters_between_steps(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        n_step = int(b[0].shape[0])  # batch sizes pick the phase
        params["fc1.weight"].requires_grad_(n_step != 5)
        params["fc2.bias"].requires_grad_(n_step == 4)
        return backward_step(model, params, b)

    run_case(Case(MLP, mlp_batch, step, batch_sizes=(4, 5, 5, 4)), mode=mode)


def test_bf16_parameters(mode: str) -> None:
    def build() -> nn.Module:
        return MLP().to(torch.bfloat16)

    def batch(n: int, gen: torch.Generator) -> Batch:
        return tuple(t.to(torch.bfloat16) for t in mlp_batch(n, gen))

    run_case(Case(build, batch, backward_step, bf16=True), mode=mode)


def test_backward_in_another_thread(mode: str) -> None:
    """On CUDA the engine runs backwards on its device threads: a backward compiled at its
    first call (lazy_backward) must compile there too."""
    import threading

    def step(model: Any, params: Params, b: Batch) -> Any:
        out = model(b[0])
        loss = F.mse_loss(out, b[1])
        err: list[BaseException] = []

        def run() -> None:
            try:  # the engine hook is process-wide: the caller's setting holds here
                loss.backward()
            except BaseException as e:  # re-raised in the test's thread
                err.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if err:
            raise err[0]
        return (out, loss), dot_grads(params)

    run_case(Case(MLP, mlp_batch, step, batch_sizes=(4, 4, 6)), mode=mode)


class TransposedOut(nn.Module):
    """Fresh outputs with non-contiguous strides (pointwise ops keep their input's
    transposed layout); their grads arrive contiguous, expanded, or transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.sin(x.t()) * self.w  # (6, 5), strides (1, 6)
        return a, torch.exp(a) + 1


def transposed_case() -> Case:
    def batch(n: int, gen: torch.Generator) -> Batch:
        return torch.randn(5, 6, generator=gen), torch.randn(5, 6, generator=gen)

    def step(model: Any, params: Params, b: Batch) -> Any:
        a, e = model(b[0])
        loss = (a * b[1].t()).sum() + e.sum() + (e.t() * b[1]).mean()
        loss.backward()
        return (a, e, torch.tensor(a.stride()), torch.tensor(e.stride())), dot_grads(params)

    return Case(TransposedOut, batch, step, batch_sizes=(5, 5, 5))


def test_non_contiguous_fresh_outputs(mode: str) -> None:
    run_case(transposed_case(), mode=mode)


class NoGradFor(torch.autograd.Function):
    """Passes its second input through with no gradient (returns None for it)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g, None


class Chained(nn.Module):
    """Two separately compiled models (stoker.compile'd parts), the first's auxiliary
    output fed to a custom Function that gives it no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = MultiOut(), MLP(d=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _h, aux, *_ = self.first(x)
        return NoGradFor.apply(self.second(out), aux[:, :1].expand(-1, 4))


def test_separately_compiled_parts_and_a_function_returning_no_grad(mode: str) -> None:
    def build() -> nn.Module:
        m = Chained()
        if build.compiled:  # type: ignore[attr-defined]
            m.first = stoker.compile(m.first, **MODES[mode][0])  # type: ignore[assignment]
            m.second = stoker.compile(m.second, **MODES[mode][0])  # type: ignore[assignment]
        build.compiled = True  # type: ignore[attr-defined]
        return m

    build.compiled = False  # type: ignore[attr-defined]

    def step(model: Any, params: Params, b: Batch) -> Any:
        out = getattr(model, "_orig_mod", model)(b[0])  # the parts are compiled, not the whole
        F.mse_loss(out, b[1]).backward()
        return (out,), dot_grads(params)

    # compiled autograd traced a tensor where the Function gives None; the parameters
    # that only it feeds (through the inlined AOT backward of `first`) keep .grad None,
    # as in eager (docs/autograd.md)
    run_case(Case(build, mlp_batch, step), mode=mode)


class NoMaterialize(torch.autograd.Function):
    """Two outputs, one non-differentiable, grads not materialized (None for an unused
    output, handled in the backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        idx = x.argmax(-1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return x.sin(), x.cos(), idx

    @staticmethod
    def backward(ctx: Any, gs: Any, gc: Any, gi: Any) -> torch.Tensor | None:
        (x,) = ctx.saved_tensors
        out = None if gs is None else gs * x.cos()
        if gc is not None:
            out = -gc * x.sin() if out is None else out - gc * x.sin()
        return out


class FnInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.c = (
            nn.Linear(8, 16),
            nn.Linear(16, 4),
            nn.Parameter(torch.randn(16)),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, _cos, idx = NoMaterialize.apply(self.fc1(x))
        h = NoGradFor.apply(s, self.c)
        return self.fc2(h), idx


def fn_inside_case() -> Case:
    def step(model: Any, params: Params, b: Batch) -> Any:
        out, idx = model(b[0])
        F.mse_loss(out, b[1]).backward()
        return (out, idx), dot_grads(params)

    return Case(FnInside, mlp_batch, step)


def test_custom_functions_inside_the_compiled_model(mode: str) -> None:
    run_case(fn_inside_case(), mode=mode)


def test_input_gradient_of_a_frozen_model(mode: str) -> None:
    """Saliency / adversarial steps: every parameter frozen, the gradient is the input's;
    then a loss of a model whose output needs no gradient raises as in eager."""

    def step(model: Any, params: Params, b: Batch) -> Any:
        mod = getattr(model, "_orig_mod", model)
        mod.requires_grad_(False)
        x = b[0].requires_grad_()
        out = model(x)
        F.mse_loss(out, b[1]).backward()
        with pytest.raises(RuntimeError, match="does not require grad"):
            F.mse_loss(model(b[0].detach()), b[1]).backward()
        mod.requires_grad_(True)
        return (out, x.grad), dot_grads(params)

    run_case(Case(BN, mlp_batch, step), mode=mode)


class SameTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.tanh(self.fc(x))
        return y, y, self.fc.weight, y.detach(), x


def test_the_same_tensor_returned_twice_a_parameter_and_a_detached_output(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        x = b[0].requires_grad_()
        y1, y2, w, yd, xx = model(x)
        assert (y1 is y2) and (xx is x) and (w is params["fc.weight"]), "eager returns these"
        assert not yd.requires_grad
        loss = F.mse_loss(y1, b[1]) + (y2 * 2).sum() + w.pow(2).sum() + (xx * 3).sum()
        loss.backward()
        return (y1, y2, yd, x.grad), dot_grads(params)

    run_case(Case(SameTwice, mlp_batch, step), mode=mode)


class DecaysInForward(nn.Module):
    """Updates a parameter and a buffer in place in forward (under no_grad), then uses
    both: the backward must read the updated values, as eager's does."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4))
        self.register_buffer("ema", torch.zeros(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.w.mul_(0.9)
            self.ema.mul_(0.5).add_(self.w)
        return torch.tanh(x @ self.w) * (x @ self.ema).sigmoid()


def test_parameter_and_buffer_updated_in_place_in_forward(mode: str) -> None:
    run_case(Case(DecaysInForward, mlp_batch, backward_step), mode=mode)


class CheckpointsCompiledParts(nn.Module):
    """Non-reentrant checkpointing around separately compiled blocks: their compiled
    forwards run again inside the backward."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLP(d=8, h=16, o=8) for _ in range(2)])
        self.head = nn.Linear(8, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + ckpt.checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_around_compiled_blocks(mode: str, reentrant: bool) -> None:
    def build() -> nn.Module:
        m = CheckpointsCompiledParts(reentrant)
        if build.compiled:  # type: ignore[attr-defined]
            for i, b in enumerate(m.blocks):
                m.blocks[i] = stoker.compile(b, **MODES[mode][0])
        build.compiled = True  # type: ignore[attr-defined]
        return m

    build.compiled = False  # type: ignore[attr-defined]

    def step(model: Any, params: Params, b: Batch) -> Any:
        return backward_step(getattr(model, "_orig_mod", model), params, b)  # the parts only

    run_case(Case(build, mlp_batch, step), mode=mode)


def fp16_grad_scaler_step(model: Any, params: Params, b: Batch) -> Any:
    """fp16 autocast and a GradScaler on the batch's device; the grads unscaled."""
    device = b[0].device.type
    scaler = torch.amp.GradScaler(device, init_scale=256.0)
    with torch.autocast(device, dtype=torch.float16):
        out = model(b[0])
        loss = F.mse_loss(out.float(), b[1])
    scaler.scale(loss).backward()
    opt = torch.optim.SGD(params.values(), lr=0.0)
    scaler.unscale_(opt)
    return (out, loss), dot_grads(params)


def test_fp16_autocast_with_grad_scaler(mode: str) -> None:
    run_case(Case(Checkpointed, mlp_batch, fp16_grad_scaler_step, bf16=True), mode=mode)


def test_retained_graph_backward_through_one_output_then_another(mode: str) -> None:
    """Each backward leaves undefined what its own outputs do not reach."""

    def step(model: Any, params: Params, b: Batch) -> Any:
        out, _h, aux, *_ = model(b[0])
        F.mse_loss(out, b[1]).backward(retain_graph=True)
        first = dot_grads(params)
        aux.pow(2).sum().backward()
        return (out, aux), {**{k + "@1": v for k, v in first.items()}, **dot_grads(params)}

    run_case(Case(MultiOut, mlp_batch, step), mode=mode)


class Breaks(nn.Module):
    """A graph break (a host read, data-dependent control flow): two compiled graphs per
    forward, eager code between, one backward through both; the loss made inside."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc1(x))
        head = self.fc2 if float(h.mean()) > 0 else self.fc3
        out = head(h * 2)
        return F.mse_loss(out, y), out


def test_graph_break_between_two_compiled_graphs(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        loss, out = model(*b)
        loss.backward()
        return (loss, out), dot_grads(params)

    def batch(n: int, gen: torch.Generator) -> Batch:
        x, y = mlp_batch(n, gen)
        return x + (1.0 if n % 2 else -1.0), y  # both branches over the steps

    run_case(Case(Breaks, batch, step, batch_sizes=(4, 5, 4, 5)), mode=mode)


def test_parameter_changed_between_forward_and_backward_raises_or_stays_right(
    mode: str,
) -> None:
    """An optimizer step (or EMA) between forward and backward: eager raises a version
    error; stoker must raise too or give the gradient of the forward that ran."""
    torch.manual_seed(0)
    model = MLP()
    compiled = stoker.compile(model, **MODES[mode][0])
    x, y = mlp_batch(4, torch.Generator().manual_seed(0))
    for _ in range(2):  # the compile, then the steady call
        model.zero_grad(set_to_none=True)
        with stoker.autograd_enabled(False):
            F.mse_loss(model(x), y).backward()
        want = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        with stoker.autograd_enabled(MODES[mode][1]) if mode == "ca_paused" else nullcontext():
            loss = F.mse_loss(compiled(x), y)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            try:
                loss.backward()
            except RuntimeError as e:
                assert "modified by an inplace operation" in str(e), e
            else:
                for k, p in model.named_parameters():
                    torch.testing.assert_close(p.grad, want[k], msg=k)
            finally:
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(0.5)


class Norms(nn.Module):
    """BatchNorm with a cumulative average (momentum=None: num_batches_tracked decides
    the factor), GroupNorm, InstanceNorm with running stats."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None)
        self.gn = nn.GroupNorm(4, 16)
        self.inn = nn.InstanceNorm1d(16, track_running_stats=True, affine=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gn(self.bn(self.fc(x)))
        h = self.inn(h.unsqueeze(-1).expand(-1, -1, 3)).mean(-1)
        return self.out(F.silu(h))


def test_norm_layers_with_running_stats_train_then_eval(mode: str) -> None:
    def step(model: Any, params: Params, b: Batch) -> Any:
        mod = getattr(model, "_orig_mod", model)
        out = model(b[0])
        F.mse_loss(out, b[1]).backward()
        mod.eval()
        with torch.no_grad():
            ev = model(b[0])
        mod.train()
        return (out, ev), dot_grads(params)

    run_case(Case(Norms, mlp_batch, step, batch_sizes=(4, 6, 4)), mode=mode)
