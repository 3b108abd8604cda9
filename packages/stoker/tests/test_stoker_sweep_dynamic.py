"""A dynamic-shapes training sweep: sizes that change between steps, the way torch.compile
users meet them (``dynamic=True``, automatic dynamic, ``mark_dynamic``, ``torch.compile(
backend="stoker", dynamic=True)``), against eager over several optimizer steps on fresh
random inputs, under the three autograd modes of `test_stoker_sweep_training.py` (the
harness is `sweep_cases.py`).  Each case also bounds the compiles: a dynamic graph does not
recompile per size, and a recompile's reason names the size that changed."""

from __future__ import annotations

import math
import os
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from itertools import product
from typing import Any

import pytest
import test_stoker_sweep_training as tr
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from interpret_script import run_interpreted
from sweep_cases import MLP, MODES, Batch, Case, backward_step, dot_grads, run_case
from test_stoker_sweep_training import ConvNet

import stoker
import stoker_autograd

# the training sweep's fixtures, shared: stoker reset around each test; the autograd modes
fresh_stoker, mode = tr.fresh_stoker, tr.mode

Params = dict[str, nn.Parameter]


MODE_NAMES = ("ca", "no_ca", "ca_paused")


def rotated(combos: Iterable[tuple[Any, ...]]) -> list[Any]:
    """Each combination once, under one autograd mode, rotating the modes: every value
    meets the modes over the list, at a third of the full product's cost (the heavier
    models; the MLP runs the full product)."""
    out = []
    for i, c in enumerate(combos):
        m = MODE_NAMES[i % 3]
        out.append(pytest.param(*c, m, id="-".join(map(_id, (*c, m)))))
    return out


def _id(v: Any) -> str:
    return getattr(v, "__name__", str(v))


# --- how the inputs are made dynamic --------------------------------------------------------
# A case's batch sizes are ints; sequence cases pack two sizes in one: `bt(B, T)`.


def bt(b: int, t: int) -> int:
    return 100 * b + t


def marking(dims: Sequence[int], step: Callable[..., Any]) -> Callable[..., Any]:
    """`step` with ``torch._dynamo.mark_dynamic`` on `dims` of every model input that has them
    (inputs sharing the batch dim are all marked, as torch.compile asks; eager ignores it)."""

    def marked(model: Any, params: Params, b: Batch) -> Any:
        for t in b[:-1]:
            for d in dims:
                if d < t.dim():
                    torch._dynamo.mark_dynamic(t, d)
        return step(model, params, b)

    return marked


def torch_compile(model: nn.Module, *, backend: str, **opts: Any) -> Any:
    """``torch.compile(model, backend="stoker", dynamic=True)`` with the mode's options."""
    if backend != "auto" or opts:
        return torch.compile(
            model, backend="stoker", dynamic=True, options=dict(opts, backend=backend)
        )
    return torch.compile(model, backend="stoker", dynamic=True)


# How each way of asking is compiled: (compile kwargs, step wrapper, compiler)
HOW: dict[str, tuple[dict[str, Any], Callable[[Callable[..., Any]], Callable[..., Any]], Any]] = {
    "dynamic_true": ({"dynamic": True}, lambda s: s, None),
    "automatic": ({}, lambda s: s, None),
    "mark_batch": ({}, lambda s: marking([0], s), None),
    "torch_compile": ({}, lambda s: s, torch_compile),
}


def sweep(
    build: Callable[[], nn.Module],
    batch: Callable[[int, torch.Generator], Batch],
    step: Callable[..., Any],
    sizes: Sequence[int],
    how: str,
    mode: str,
    backend: str = "aten",
    optimizer: str = "sgd",
    device: str = "cpu",
) -> Any:
    return run_case(
        sweep_case(build, batch, step, sizes, how, optimizer), backend, mode, device=device
    )


def sweep_case(
    build: Callable[[], nn.Module],
    batch: Callable[[int, torch.Generator], Batch],
    step: Callable[..., Any],
    sizes: Sequence[int],
    how: str,
    optimizer: str = "sgd",
) -> Case:
    """The case of `sweep`: `how` says how the sizes are made dynamic (`HOW`)."""
    kw, wrap, compiler = HOW[how]
    return Case(
        build, batch, wrap(step), sizes, compile_kw=kw, compiler=compiler, optimizer=optimizer
    )


def report_of(compiled: Any) -> Any:
    return getattr(compiled, "stoker_report", None) or stoker.backend.report


def check_compiles(
    compiled: Any,
    graphs: int,
    changed: Sequence[str] = (),
    backward_dims: int = 1,
    frames: int = 1,
) -> None:
    """`graphs` Dynamo graphs compiled; a reason per cached graph that missed before each
    recompile, each naming one of `changed` (the input whose size changed).  stoker-autograd
    recompiles a captured backward at most once per size position that changed
    (`backward_dims`: static, then that size symbolic), each with a reason naming the size.
    `frames`: Dynamo frames of the model (a graph break makes two), `graphs` each."""
    rep = report_of(compiled)
    reasons = [r.reason for r in rep.recompiles]
    assert len(rep.compiles) == graphs * frames, (len(rep.compiles), reasons)
    assert len(reasons) >= frames * (graphs - 1) and (graphs > 1 or not reasons), reasons
    for r in reasons:
        assert "size" in r and any(c in r for c in changed), reasons
    st = stoker_autograd.stats()
    assert st["fallbacks"] == 0 and st["recompiles"] <= backward_dims * st["captures"], st
    why = stoker_autograd.recompile_reasons()
    assert len(why) == st["recompiles"], (st, why)
    assert all("size()" in r and "failed: got" in r for r in why), why


def check_backward_compiled_once() -> None:
    """Each captured backward compiled once, never again: its forward (one capture per
    Dynamo graph) held the changing sizes symbolic, and its first compile took them so
    (docs/autograd.md, "A dynamic forward's backward compiles once").  With compiled
    autograd off, nothing is captured.  A compile an earlier case stored on disk is a
    ``disk_hits`` instead."""
    st = stoker_autograd.stats()
    assert st["compiles"] + st["disk_hits"] == st["captures"] and st["recompiles"] == 0, st
    assert not stoker_autograd.recompile_reasons(), stoker_autograd.recompile_reasons()


# --- steps ------------------------------------------------------------------------------------


def mse_input_grad_step(model: Any, params: Params, b: Batch) -> Any:
    x = b[0].requires_grad_()
    out = model(x)
    loss = F.mse_loss(out, b[-1])
    loss.backward()
    return (out, loss, x.grad), dot_grads(params)


def sum_step(model: Any, params: Params, b: Batch) -> Any:
    """A loss that is defined on an empty batch too (a sum)."""
    x = b[0].requires_grad_()
    out = model(x)
    loss = (out * b[-1]).sum()
    loss.backward()
    return (out, loss, x.grad), dot_grads(params)


def multi_out_step(model: Any, params: Params, b: Batch) -> Any:
    outs = model(*b[:-1])
    # (the auxiliary terms small: SGD at lr 0.1 must not amplify rounding over the steps)
    loss = 0.1 * sum((o * o).mean() for o in outs) + F.mse_loss(outs[0], b[-1])
    loss.backward()
    return (*outs, loss), dot_grads(params)


def lm_step(model: Any, params: Params, b: Batch) -> Any:
    logits = model(b[0])
    loss = F.cross_entropy(logits.flatten(0, 1), b[1].flatten())
    loss.backward()
    return (logits, loss), dot_grads(params)


def lm_prefix_step(model: Any, params: Params, b: Batch) -> Any:
    """`lm_step` over the first ``T // 2 + 1`` positions: a size of the eager loss alone."""
    logits = model(b[0])
    t = logits.shape[1] // 2 + 1
    loss = F.cross_entropy(logits[:, :t].flatten(0, 1), b[1][:, :t].flatten())
    loss.backward()
    return (logits, loss), dot_grads(params)


def mlp_batch(n: int, gen: torch.Generator) -> Batch:
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


# --- the MLP under every way of asking ------------------------------------------------------


@pytest.mark.parametrize("how", sorted(HOW))
def test_mlp_batch_sizes_new_back_and_larger(mode: str, how: str) -> None:
    """A new size, an earlier one (a cache hit) and one larger than any seen."""
    compiled = sweep(MLP, mlp_batch, mse_input_grad_step, (4, 6, 3, 6, 4, 33), how, mode)
    check_compiles(compiled, 2 if how == "automatic" else 1, ["x"])
    check_backward_compiled_once()


def test_mlp_automatic_stays_static_while_the_size_does() -> None:
    compiled = sweep(MLP, mlp_batch, mse_input_grad_step, (5, 5, 5), "automatic", "ca")
    check_compiles(compiled, 1)


@pytest.mark.parametrize("how", ["dynamic_true", "automatic"])
def test_batch_one_then_three_then_one(mode: str, how: str) -> None:
    """Size 1 is specialized (broadcasting): 1 and n>=2 are two graphs, each reused."""
    compiled = sweep(MLP, mlp_batch, mse_input_grad_step, (2, 1, 3, 1, 5), how, mode)
    check_compiles(compiled, 2 if how == "dynamic_true" else 3, ["x"])


def test_empty_batch_between_others(mode: str) -> None:
    compiled = sweep(MLP, mlp_batch, sum_step, (3, 0, 4, 0, 5), "dynamic_true", mode)
    check_compiles(compiled, 2, ["x"])


def accumulate_step(model: Any, params: Params, b: Batch) -> Any:
    """Micro-batches of 4, the last one partial: sizes change inside one optimizer step."""
    outs, n = [], b[0].shape[0]
    for x, y in zip(b[0].split(4), b[1].split(4)):
        out = model(x)
        (F.mse_loss(out, y, reduction="sum") / n).backward()
        outs.append(out)
    return outs, dot_grads(params)


@pytest.mark.parametrize("how", ["dynamic_true", "automatic"])
def test_micro_batches_with_a_partial_last_one(mode: str, how: str) -> None:
    compiled = sweep(MLP, mlp_batch, accumulate_step, (11, 10, 12, 7), how, mode)
    check_compiles(compiled, 2 if how == "automatic" else 1, ["x"])
    check_backward_compiled_once()


class Sliced(nn.Module):
    """A Python int argument that changes (Dynamo makes it a symbolic input)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        h = self.fc(x)[:, :n]
        return self.fc2(h.mean(1) * n), h


def test_an_int_argument_that_changes(mode: str) -> None:
    def batch(n: int, gen: torch.Generator) -> Batch:
        x, y = seq_features(n, gen)
        return x, (n % 100) // 2, y

    sweep(
        Sliced, batch, multi_out_step, (bt(2, 5), bt(2, 8), bt(3, 9), bt(2, 12)), "automatic", mode
    )


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * self.w, 0.5, self.training)


@pytest.mark.parametrize("how", ["dynamic_true", "automatic"])
def test_dropout_mask_of_a_dynamic_batch(mode: str, how: str) -> None:
    """Random masks differ from eager's: w's gradient must be the mask the forward used,
    sum((h != 0) * x / 0.5), at every size."""
    torch.manual_seed(0)
    model = Dropped()
    compiled = stoker.compile(model, **HOW[how][0], **MODES[mode][0])
    for n in (4, 6, 5, 9):
        x = torch.randn(n, 8)
        model.zero_grad()
        with stoker.autograd_enabled(MODES[mode][1]) if mode == "ca_paused" else nullcontext():
            h = compiled(x)
            h.sum().backward()
        want = ((h.detach() != 0).float() * x / 0.5).sum(0)
        torch.testing.assert_close(model.w.grad, want, rtol=1e-5, atol=1e-5)
        assert 0.2 < float((h != 0).float().mean()) < 0.8


def test_dynamic_false_recompiles_up_to_the_limit_then_runs_eager() -> None:
    """Always static: one graph per size until ``recompile_limit``, then Dynamo runs the
    frame eagerly; the numbers stay eager's throughout."""
    case = Case(
        MLP,
        mlp_batch,
        mse_input_grad_step,
        tuple(range(2, 9)),
        compile_kw={"dynamic": False, "recompile_limit": 3},
    )
    compiled = run_case(case)
    assert len(compiled.stoker_report.compiles) == 3


def bf16_lm_step(model: Any, params: Params, b: Batch) -> Any:
    """`lm_step` under bf16 autocast on the batch's device."""
    with torch.autocast(b[0].device.type, dtype=torch.bfloat16):
        logits = model(b[0])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b[1].flatten())
    loss.backward()
    return (logits, loss), dot_grads(params)


def bf16_gpt_case() -> Case:
    sizes = (bt(2, 5), bt(2, 7), bt(3, 7), bt(4, 12))
    return Case(Block, seq_batch, bf16_lm_step, sizes, bf16=True, compile_kw={"dynamic": True})


@pytest.mark.slow
def test_bf16_autocast_with_a_dynamic_sequence() -> None:
    check_compiles(run_case(bf16_gpt_case()), 1, backward_dims=2)


# the training sweep's structural cases (hooks, custom Functions, checkpointing, several
# outputs, retain_graph, norm layers' running stats) with the batch dynamic
STRUCTURAL = {
    "hooks": tr.hooks_case,
    "custom_function": lambda: Case(tr.CustomFn, mlp_batch, backward_step),
    "checkpoint": lambda: Case(tr.Checkpointed, mlp_batch, backward_step),
    "several_outputs": tr.multi_out_case,
    "retain_graph": tr.retain_graph_case,
    "norm_running_stats": lambda: Case(tr.Norms, mlp_batch, backward_step),
}


@pytest.mark.parametrize(("name", "mode"), rotated(product(STRUCTURAL)))
def test_training_sweep_structures_with_a_dynamic_batch(name: str, mode: str) -> None:
    case = STRUCTURAL[name]()
    case.batch_sizes, case.compile_kw = (4, 6, 3, 9, 4), {"dynamic": True}
    # BatchNorm(momentum=None) reads float(num_batches_tracked): a graph break, two graphs
    check_compiles(run_case(case, mode=mode), 1, frames=2 if name == "norm_running_stats" else 1)


# --- a tiny GPT block, sequence length dynamic ----------------------------------------------


class Block(nn.Module):
    """Embedding + learned positions sliced to T, causal attention (SDPA, or an explicit
    masked softmax with a tril buffer sliced to T), LayerNorm, GELU MLP, LM head."""

    def __init__(self, sdpa: bool = True, vocab: int = 11, c: int = 8, block: int = 16) -> None:
        super().__init__()
        self.sdpa, self.heads = sdpa, 2
        self.emb, self.pos = nn.Embedding(vocab, c), nn.Parameter(0.1 * torch.randn(block, c))
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.out = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.head = nn.Linear(c, vocab)
        self.register_buffer("tril", torch.tril(torch.ones(block, block, dtype=torch.bool)))

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
            s = s.masked_fill(~self.tril[:t, :t], float("-inf"))
            a = torch.softmax(s, dim=-1) @ v
        return self.proj(a.transpose(1, 2).reshape(b, t, c))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.emb(idx) + self.pos[:t]
        h = h + self.attend(self.ln1(h))
        h = h + self.out(F.gelu(self.fc(self.ln2(h))))
        return self.head(h)


def seq_batch(n: int, gen: torch.Generator) -> Batch:
    """Tokens of `bt(B, T)`: inputs and targets are slices of one sequence (as in nanoGPT)."""
    b, t = divmod(n, 100)
    seq = torch.randint(0, 11, (b, t + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


GPT_HOW: dict[str, tuple[str, Callable[[Callable[..., Any]], Callable[..., Any]] | None]] = {
    "dynamic_true": ("dynamic_true", None),
    "automatic": ("automatic", None),
    "mark_seq": ("automatic", lambda s: marking([1], s)),
    "mark_batch_and_seq": ("automatic", lambda s: marking([0, 1], s)),
    "torch_compile": ("torch_compile", None),
}


# each way once, SDPA and the explicit softmax alternating
GPT_CASES = [(how, k % 2 == 0) for k, how in enumerate(GPT_HOW)]


@pytest.mark.slow
@pytest.mark.parametrize(("how", "sdpa", "mode"), rotated(GPT_CASES))
def test_gpt_block_sequence_length(how: str, sdpa: bool, mode: str) -> None:
    """AdamW (eps 1e-3: the key bias's exact gradient is 0, see sweep_cases._OPTIMIZERS);
    T changes, then B, then both to sizes larger than any seen."""
    base, wrap = GPT_HOW[how]
    step = wrap(lm_step) if wrap else lm_step
    sizes = (bt(2, 5), bt(2, 7), bt(3, 7), bt(4, 12))
    compiled = sweep(lambda: Block(sdpa), seq_batch, step, sizes, base, mode, optimizer="adamw_eps")
    # marking only the sequence dim leaves the batch static until it changes (automatic)
    graphs = {"automatic": 3, "mark_seq": 2}.get(how, 1)
    check_compiles(compiled, graphs, ["idx"], backward_dims=2)


# --- a small CNN: dynamic batch and spatial size --------------------------------------------


def image_batch(n: int, gen: torch.Generator) -> Batch:
    """`bt(B, S)`: B images of S x S."""
    b, s = divmod(n, 100)
    return torch.randn(b, 3, s, s, generator=gen), torch.randn(b, 4, generator=gen)


@pytest.mark.parametrize(
    ("how", "mode"), rotated(product(["dynamic_true", "automatic", "torch_compile"]))
)
def test_cnn_batch_and_spatial_size(how: str, mode: str) -> None:
    sizes = (bt(2, 6), bt(3, 6), bt(3, 8), bt(2, 7), bt(2, 6))
    sweep(ConvNet, image_batch, mse_input_grad_step, sizes, how, mode)
    # (graph counts: Dynamo's choices for pooling of odd sizes, not bounded here)


# --- reductions, views and masks over dynamic dims ------------------------------------------


class Reductions(nn.Module):
    """mean / var / softmax / logsumexp / amax over the dynamic sequence dim, and a batch
    statistic over the dynamic batch dim."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.fc(x))  # (B, T, 8)
        pooled = h.mean(1) + h.var(1) + torch.logsumexp(h, 1) + h.amax(1)
        att = torch.softmax(h, dim=1)
        centred = h - h.mean((0, 1), keepdim=True)
        return self.fc2(pooled), (att * h).sum(1), centred.std(0)


class Views(nn.Module):
    """Views that combine and split dynamic dims: view(B*T, C), flatten, split and chunk
    by a size computed from T, reshape(B, -1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, c = x.shape
        h = torch.sin(self.fc(x.view(b * t, c))).view(b, t, c)
        first, rest = h.split([t // 2, t - t // 2], dim=1)
        halves = h.chunk(2, dim=1)
        mixed = first.mean(1) * rest.amax(1) + halves[-1].sum(1)
        flat = h.flatten(0, 1)
        wide = h.reshape(b, -1)
        return self.fc2(mixed), flat.mean(0), wide.sum(1), h.transpose(0, 1).contiguous()


class Masked(nn.Module):
    """Masks built from per-row lengths, and padding to a multiple of 4 of the dynamic T."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, c = x.shape
        keep = torch.arange(t, device=x.device)[None, :] < lengths[:, None]
        h = self.fc(x).masked_fill(~keep[..., None], 0.0)
        pooled = h.sum(1) / lengths[:, None].to(h.dtype)
        padded = F.pad(h, (0, 0, 0, (4 - t % 4) % 4))
        groups = padded.view(b, -1, 4, c).mean(2)
        scores = self.fc(x).sum(-1).masked_fill(~keep, float("-inf"))
        return self.fc2(pooled), groups, torch.softmax(scores, -1)


def seq_features(n: int, gen: torch.Generator) -> Batch:
    b, t = divmod(n, 100)
    return torch.randn(b, t, 8, generator=gen), torch.randn(b, 4, generator=gen)


def masked_batch(n: int, gen: torch.Generator) -> Batch:
    b, t = divmod(n, 100)
    x, y = seq_features(n, gen)
    return x, torch.randint(1, t + 1, (b,), generator=gen), y


SEQ_SIZES = (bt(2, 5), bt(2, 6), bt(3, 9), bt(4, 13))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "how", "mode"),
    rotated(product([Reductions, Views, Masked], ["dynamic_true", "automatic", "mark_batch"])),
)
def test_reductions_views_masks_over_dynamic_dims(
    model: type[nn.Module], how: str, mode: str
) -> None:
    batch = masked_batch if model is Masked else seq_features
    sweep(model, batch, multi_out_step, SEQ_SIZES, how, mode)


# --- recompile reasons ------------------------------------------------------------------------


def test_recompile_reasons_of_forward_and_backward_in_the_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Automatic dynamic: T changes (Dynamo recompiles the forward symbolic: another
    capture, whose backward takes T symbolic from its forward), then a size seen before
    (no forward recompile); the loss reads a prefix of ``T // 2 + 1`` positions, a size
    the eager code computes and the forward never held: the backward recompiles when it
    changes.  The report names both, and so does the ``recompiles`` log topic."""
    sizes = (bt(2, 5), bt(2, 7), bt(2, 5), bt(2, 9))
    try:
        stoker.set_logs("recompiles")
        compiled = sweep(Block, seq_batch, lm_prefix_step, sizes, "automatic", "ca")
    finally:
        stoker.set_logs("")
    err = capsys.readouterr().err
    check_compiles(compiled, 2, ["idx"])
    rep = compiled.stoker_report
    (reason,) = [r.reason for r in rep.recompiles]
    assert "idx" in reason and "size mismatch at index 1" in reason, reason
    why = stoker_autograd.recompile_reasons()
    assert why and rep.autograd["recompile reasons"] == why, (why, rep.autograd)
    html = rep.to_html()
    assert "backward (compiled autograd)" in html and "recompile reasons" not in html
    # the backward's reason in user terms: a dim of which autograd node's value, old -> new
    named = [
        re.search(r"dim \d+ of .* of (\w+Backward\d+) changed (\d+) -> (\d+) \(", r) for r in why
    ]
    assert all(m is not None and m[2] != m[3] for m in named), why
    assert all(m is not None and m[0].replace(">", "&gt;") in html for m in named), why
    assert all(f"[stoker.recompiles] recompiling {r}" in err for r in why), (why, err[-2000:])


def test_torch_compile_with_options_reports_into_the_fresh_report_after_reset() -> None:
    """``torch.compile(backend="stoker", options=...)`` keeps one backend per options; after
    ``stoker.reset()`` it wrote into the old report, so ``stoker.backend.report`` was empty."""
    for _ in range(2):
        stoker.reset()
        compiled = sweep(MLP, mlp_batch, mse_input_grad_step, (3, 5), "torch_compile", "no_ca")
        check_compiles(compiled, 1)


# --- Triton kernels under the interpreter (tiny) --------------------------------------------


@pytest.mark.slow
def test_interpreted_triton_dynamic_tiny_cases() -> None:
    """A fresh process: the interpreter must be on before Triton jits anything."""
    run_interpreted(
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        + textwrap.dedent(
            """
            import stoker, test_stoker_sweep_dynamic as t
            for mode, args in (
                ("ca", (t.MLP, t.mlp_batch, t.mse_input_grad_step, (3, 5, 3), "dynamic_true")),
                ("ca", (t.Masked, t.masked_batch, t.multi_out_step, (205, 306), "dynamic_true")),
                ("no_ca", (t.Reductions, t.seq_features, t.multi_out_step, (203, 305), "mark_batch")),
            ):
                stoker.reset()
                rep = t.sweep(*args, mode=mode, backend="interpret").stoker_report
                assert {r.executor for r in rep.compiles} == {"interpret"}, rep.compiles
            stoker.reset()  # hooks: compiled autograd cuts the backward at the Python calls
            case = t.STRUCTURAL["hooks"]()
            case.batch_sizes, case.compile_kw = (4, 6, 3), {"dynamic": True}
            rep = t.run_case(case, backend="interpret", mode="ca").stoker_report
            assert {r.executor for r in rep.compiles} == {"interpret"}, rep.compiles
            print("ok")
            """
        )
    )
