"""Symbolic sizes in the retraced backward: batch and sequence length varying, alone
and together, through an inlined stoker-capture AOT backward (``aot_module`` with
symbolic sizes) and through the plain eager autograd graph; gradients equal eager's
on fresh inputs, the backward is compiled (no fallback warning) and recompiles as
the rules say (docs/autograd.md, *Guards*).

The model views the incoming gradient to ``batch x 10`` rows: the retrace solves
``s_rows == 10*s_batch`` for ``s_batch``, which failed while a Dim without max had
the finite bound 2**62 (divided by 10 in floats: ``tgt_bound=VR[20,
4611686018427388160] not a subset of src_bound=VR[20, 4611686018427387904]``) and
the backward ran uncompiled."""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import sympy
import torch
import torch.nn as nn
from torch.utils._sympy.functions import FloorDiv, Mod

import stoker_autograd
from stoker_autograd._internal import ops
from stoker_autograd._internal.aot_inline import aot_backward_prologue

stoker_capture = pytest.importorskip("stoker_capture")


class Attention(nn.Module):
    """Layer norm, heads split by views of ``(B, T, C)``, causal attention, a residual."""

    def __init__(self, c: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln(x)).split(c, dim=-1)
        )
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return out


def _segmented(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return gm  # a compiler: the retraced graph arrives cut into segments


def _train(
    sizes: list[tuple[int, int]],
    aot: str | None,
    compiler: Any = None,
    dynamic: bool = True,
    build: Callable[[nn.Module], Any] | None = None,
) -> tuple[stoker_autograd.Session, list[dict[str, int]]]:
    """One step per (batch, T): the model (AOT-compiled unless ``aot`` is None, or what
    ``build`` makes of it) under stoker-autograd and a copy on the eager engine, on the
    same fresh input; checks every gradient and that stoker-autograd never warned (a
    fallback warns)."""
    stoker_autograd.reset_stats()
    torch.manual_seed(0)
    model = Attention()
    ref = copy.deepcopy(model)
    if build is not None:
        fn = build(model)
    else:
        fn = model if aot is None else stoker_capture.aot_module(model, dynamic=aot)
    after: list[dict[str, int]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stoker_autograd.enable(compiler=compiler, dynamic=dynamic) as session:
            for b, t in sizes:
                x = torch.randn(b, t, 16)
                model.zero_grad()
                ref.zero_grad()
                fn(x).pow(2).sum().backward()
                with stoker_autograd.disabled():
                    ref(x).pow(2).sum().backward()
                for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                    assert p.grad is not None and q.grad is not None, name
                    torch.testing.assert_close(
                        p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=f"{name} at {(b, t)}"
                    )
                after.append(dict(stoker_autograd.stats()))
    ours = [str(w.message) for w in caught if "stoker-autograd" in str(w.message)]
    assert not ours, ours
    return session, after


def _inlined(session: stoker_autograd.Session) -> None:
    """Every captured graph inlined the AOT backward (no opaque custom-backward call)
    and was compiled (no variant given up)."""
    for g in session.graphs:
        nodes = list(g.gm.graph.nodes)
        assert not [n for n in nodes if n.target is ops.call_backward]
        assert any(n.meta.get("stoker_aot") for n in nodes)
        assert g.failed is None, g.failed


# (batch, T): the batch changes (one symbolic recompile), then T (another: the
# positions seen to change grow), then both together (batch x T rows: no recompile)
SIZES = [(2, 10), (3, 10), (2, 12), (4, 7), (5, 9)]


# per AOT mode: captures and compiles after each step.  "dynamic": one AOT forward,
# one capture; its backward compiles once, with the sizes the forward held symbolic
# (batch and T) symbolic from the start.  "auto": the AOT forward recompiles when the
# batch, then T, changes (another Function: another capture), and each capture's
# backward compiles once with the sizes its forward held symbolic: static, then the
# batch, then both; never a recompile.  (Before the backward took the forward's
# dynamism, it compiled static first: "dynamic" took 3 compiles, "auto" 4.)
EXPECTED = {
    "dynamic": ([1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1], 0),
    "auto": ([1, 2, 3, 3, 3], [1, 2, 3, 3, 3], [1, 1, 1], 0),
}


@pytest.mark.parametrize("compiler", [None, _segmented], ids=["aten", "segmented"])
@pytest.mark.parametrize("dynamic", sorted(EXPECTED))
def test_inlined_aot_backward_with_symbolic_batch_and_length(dynamic: str, compiler: Any) -> None:
    session, after = _train(SIZES, dynamic, compiler)
    _inlined(session)
    captures, compiles, variants, recompiles = EXPECTED[dynamic]
    assert [s["captures"] for s in after] == captures, after
    assert [s["compiles"] for s in after] == compiles, after
    assert [len(g.variants) for g in session.graphs] == variants
    assert after[-1]["fallbacks"] == 0 and after[-1]["recompiles"] == recompiles, after


def test_eager_graph_backward_with_symbolic_batch_and_length() -> None:
    """The same backward without stoker-capture: the engine's own nodes view the
    gradient to ``batch x 10`` too (it fell back the same way)."""
    session, after = _train(SIZES, None)
    assert [s["compiles"] for s in after] == [1, 2, 3, 3, 3], after
    assert after[-1]["captures"] == 1 and after[-1]["fallbacks"] == 0, after
    assert session.graphs[0].failed is None


def test_sizes_0_and_1_specialize_and_the_symbolic_variant_still_serves() -> None:
    """Batch 1 is never symbolic: it recompiles a static variant (the engine graph) or
    recaptures (the AOT forward specialized it too: another Function); batch 5 after it
    runs the symbolic variant compiled before, with nothing new.  Batch 0 likewise.  The
    AOT forward's backward is symbolic from its first compile (its forward was): one
    compile per capture."""
    sizes = [(2, 10), (3, 10), (1, 10), (5, 10), (0, 10), (6, 10)]
    session, after = _train(sizes, None)
    assert [s["compiles"] for s in after] == [1, 2, 3, 3, 4, 4], after
    assert after[-1]["fallbacks"] == 0, after
    session, after = _train(sizes, "dynamic")
    _inlined(session)
    assert [s["captures"] for s in after] == [1, 1, 2, 2, 3, 3], after
    assert [s["compiles"] for s in after] == [1, 1, 2, 2, 3, 3], after
    assert after[-1]["fallbacks"] == 0 and after[-1]["recompiles"] == 0, after


def test_the_sizes_the_forward_held_symbolic_are_symbolic_from_the_first_compile() -> None:
    """A symbolic AOT forward: the first compile makes symbolic the batch and T (and
    the eager loss's sizes holding them), nothing else: the parameters' and the
    channel sizes stay static, so their guards stay exact.  Then no recompile."""
    session, after = _train([(6, 10), (9, 10), (4, 7)], "dynamic")
    _inlined(session)
    assert [s["compiles"] for s in after] == [1, 1, 1], after
    (g,) = session.graphs
    (v,) = g.variants
    held = {v.values[p] for p in g.dynamic}
    assert held == {6, 10, 60}, held  # batch, T, batch x T rows
    params = [n for n in v.gm.graph.nodes if n.target is ops.accumulate_grad]
    assert params and all(
        all(isinstance(d, int) for d in n.args[0].meta["val"].shape) for n in params
    )


def test_a_static_forward_compiles_static_first() -> None:
    """The forward compiled static ("auto" AOT at its first call): nothing to take from
    it, the backward compiles static as before (the AOT forward then recompiles
    symbolic, another capture, whose backward is symbolic from its first compile)."""
    session, after = _train([(6, 10)], "auto")
    assert session.graphs[0].dynamic == set() and after[-1]["compiles"] == 1, after


def test_dynamic_false_never_makes_a_size_symbolic() -> None:
    """``enable(dynamic=False)``: one static compile per batch (the engine recaptures
    when a size first changes), even under a symbolic forward."""
    session, after = _train([(6, 10), (9, 10), (4, 10)], "dynamic", dynamic=False)
    assert [s["compiles"] for s in after] == [1, 2, 3], after
    assert all(g.dynamic == set() for g in session.graphs), after


def test_a_static_width_equal_to_the_batch_stays_static() -> None:
    """An output width of 4 at batch 4: the eager loss's sizes (``MseLossBackward0``) hold
    4 twice, one the batch, one the width.  Each gets a symbol of its own at the first
    compile; the retrace ties one to the batch and specializes the other: batches 6 and
    3 run the same variant, gradients equal eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    fn = stoker_capture.aot_module(model, dynamic="dynamic")
    stoker_autograd.reset_stats()
    with stoker_autograd.enable() as session:
        for n in (4, 6, 3):
            x, y = torch.randn(n, 8), torch.randn(n, 4)
            model.zero_grad()
            ref.zero_grad()
            nn.functional.mse_loss(fn(x), y).backward()
            with stoker_autograd.disabled():
                nn.functional.mse_loss(ref(x), y).backward()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    st = stoker_autograd.stats()
    assert (st["captures"], st["compiles"], st["fallbacks"]) == (1, 1, 0), st
    assert len(session.graphs[0].variants) == 1


class TinyLM(nn.Module):
    """Embedding, `Attention`, a head; the loss views the logits to ``batch x T`` rows
    outside the AOT-compiled module (eager ``ViewBackward0`` and cross-entropy)."""

    def __init__(self, vocab: int = 12, c: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, c)
        self.att = Attention(c)
        self.head = nn.Linear(c, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.att(self.emb(ids)))
        return out


def _has_floor_or_mod(v: Any) -> bool:
    sizes = [*v.shape, *v.stride()] if isinstance(v, torch.Tensor) else [v]
    return any(
        isinstance(s, torch.SymInt) and s.node.expr.has(FloorDiv, Mod, sympy.floor) for s in sizes
    )


def test_a_dynamic_backward_keeps_its_sizes_as_products_of_its_symbols() -> None:
    """One backward graph of a dynamic AOT forward runs batch and T changing alone and
    together (``(6, 5)`` after ``(2, 8)``), gradients equal eager's at each size, with
    one compile.  Its retrace relates sizes one at a time where the forward knows them
    (the gradient entering the AOT backward, the gradients it returns) and a view's
    input and output dim group by dim group (``rows == B*T``), so every size of the
    retraced graph is a product of its input symbols: no ``rows // B``, which the trace
    made (one ``(s3*s7)//s2`` per later size, each evaluated through sympy) while the
    eager loss's sizes were symbols of their own related only by the numel of a view."""
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    fn = stoker_capture.aot_module(model, dynamic="dynamic")
    stoker_autograd.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stoker_autograd.enable() as session:
            for b, t in [(2, 8), (3, 8), (3, 5), (6, 5), (2, 8)]:
                seq = torch.randint(0, 12, (b, t + 1))
                ids, tgt = seq[:, :-1], seq[:, 1:]
                model.zero_grad()
                ref.zero_grad()
                nn.functional.cross_entropy(fn(ids).view(-1, 12), tgt.reshape(-1)).backward()
                with stoker_autograd.disabled():
                    out = ref(ids).view(-1, 12)
                    nn.functional.cross_entropy(out, tgt.reshape(-1)).backward()
                for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                    assert p.grad is not None and q.grad is not None, name
                    torch.testing.assert_close(
                        p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=f"{name} at {(b, t)}"
                    )
    assert not [str(w.message) for w in caught if "stoker-autograd" in str(w.message)]
    st = stoker_autograd.stats()
    assert (st["captures"], st["compiles"], st["fallbacks"], st["cache_hits"]) == (1, 1, 0, 4), st
    _inlined(session)
    (v,) = session.graphs[0].variants
    vals = [n.meta.get("val") for n in v.gm.graph.nodes]
    assert any(isinstance(x, torch.Tensor) and _has_floor_or_mod(x) is False for x in vals)
    assert not [str(x.shape) for x in vals if _has_floor_or_mod(x)]


def test_two_forward_sizes_equal_by_chance_keep_their_own_symbols() -> None:
    """Batch and T are two symbols of the forward that both hold 4 at the first call.
    The backward's first compile gives them one symbol per forward symbol, not one per
    value: one symbol for both would guard them equal, and batch 3 then recompiled the
    backward.  Gradients equal eager's at each size; one compile."""
    session, after = _train([(4, 4), (3, 4), (4, 6), (5, 5)], "dynamic")
    _inlined(session)
    assert [s["compiles"] for s in after] == [1, 1, 1, 1], after
    assert after[-1]["recompiles"] == 0 and after[-1]["captures"] == 1, after
    (g,) = session.graphs
    held = {g.groups[p] for p in g.dynamic if g.variants[0].values[p] == 4}
    assert len(held) == 2, held  # batch's and T's


def test_a_module_int_the_forward_held_symbolic_is_static_in_the_backward() -> None:
    """Dynamo keeps a module's int attribute static, except on a module FSDP2 manages or
    with ``allow_unspec_int_on_nn_module``: then the head count is a symbol of the
    forward, and the head size ``C // heads`` and width ``heads * (C // heads)``
    expressions over it, which every head-split view of the backward took to sympy.
    They are the model's sizes, not the batch's: the backward's first compile makes
    symbolic the batch, T and ``batch x T`` only, and runs every later batch and
    length without a recompile, gradients equal eager's."""
    backend = stoker_capture.dynamo_backend(lazy_backward=True)
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
        torch._dynamo.reset()
        try:
            session, _ = _train(  # Attention: 16 channels, 2 heads of 8
                [(3, 5), (5, 5), (3, 7)],
                None,
                build=lambda m: torch.compile(m, backend=backend, dynamic=True),
            )
        finally:
            torch._dynamo.reset()
    st = stoker_autograd.stats()
    assert (st["compiles"], st["recompiles"], st["fallbacks"]) == (1, 0, 0), st
    _inlined(session)
    (g,) = session.graphs
    held = {g.variants[0].values[p] for p in g.dynamic}
    assert held == {3, 5, 15}, held  # batch, T, batch x T rows: not 2 heads, 8, 16


def _aot_steps(
    model: nn.Module,
    sizes: list[tuple[int, int]],
    batch: Callable[[int, int], Any],
    loss: Callable[[Any, Any, bool], torch.Tensor],
) -> stoker_autograd.Session:
    """``model`` AOT-compiled with dynamic sizes under stoker-autograd, beside a copy on
    the eager engine: one step per (batch, T) on the same ``batch(b, t)``, the loss
    ``loss(module, inputs, compiled)``; every gradient equal eager's."""
    ref = copy.deepcopy(model)
    fn = stoker_capture.aot_module(model, dynamic="dynamic")
    stoker_autograd.reset_stats()
    with stoker_autograd.enable() as session:
        for b, t in sizes:
            inputs = batch(b, t)
            model.zero_grad()
            ref.zero_grad()
            loss(fn, inputs, True).backward()
            with stoker_autograd.disabled():
                loss(ref, inputs, False).backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None, name
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    return session


def _tokens(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, 12, (b, t + 1))
    return seq[:, :-1], seq[:, 1:]


def _lm_loss(m: Any, batch: tuple[torch.Tensor, torch.Tensor], compiled: bool) -> torch.Tensor:
    ids, tgt = batch
    return nn.functional.cross_entropy(m(ids).view(-1, 12), tgt.reshape(-1))


def test_a_value_only_the_forwards_static_sizes_hold_is_not_a_free_symbol() -> None:
    """The eager loss around a dynamic AOT forward views the logits to ``(batch x T,
    vocab)``; its sizes are of no known kind.  ``batch x T`` rows get a symbol of their
    own (the retrace ties it to the forward's), the vocabulary 12 does not: only the
    forward's static sizes hold 12 (the head's weight), so it is static from the start,
    not a symbol that the trace specializes.  One compile for every batch and length,
    gradients equal eager's."""
    torch.manual_seed(0)
    session = _aot_steps(TinyLM(), [(2, 5), (3, 5), (4, 7)], _tokens, _lm_loss)
    st = stoker_autograd.stats()
    assert (st["captures"], st["compiles"], st["fallbacks"]) == (1, 1, 0), st
    (g,) = session.graphs
    values = g.variants[0].values
    free = sorted(values[p] for p in g.free)
    assert 12 in values.values() and 12 not in free, free  # the vocabulary: static
    assert 10 in free, free  # batch x T rows: a symbol


class WithCache(nn.Module):
    """`Attention`, and a second output the loss does not read (as a transformer's key
    and value cache): ``(B, 3, T, 16)``, the QKV projection with its parts transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.att = Attention()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        cache = self.att.qkv(x).view(b, t, 3, c).transpose(1, 2)
        return self.att(x), cache


def test_the_zeros_for_an_unread_output_take_the_forwards_symbols() -> None:
    """The loss reads one output of a dynamic AOT forward; the engine hands the backward
    zeros for the other, of sizes it lifts as graph inputs.  Those are the forward's
    sizes of that output, so the first compile makes them the forward's batch and T
    symbols (`ForwardDims`), not a symbol each that the retrace then ties to them.  One
    compile for every batch and length, gradients equal eager's."""
    torch.manual_seed(0)
    session = _aot_steps(
        WithCache(),
        [(2, 5), (4, 5), (4, 7)],
        lambda b, t: torch.randn(b, t, 16),
        lambda m, x, compiled: m(x)[0].pow(2).sum(),
    )
    st = stoker_autograd.stats()
    assert (st["captures"], st["compiles"], st["fallbacks"]) == (1, 1, 0), st
    _inlined(session)
    (g,) = session.graphs
    zeros = [n for n in g.gm.graph.nodes if n.target is torch.ops.aten.zeros.default]
    assert zeros, "the engine made no zeros for the unread output"
    positions = [
        (1, d.args[1], -1)
        for n in zeros
        for d in n.args[0]
        if isinstance(d, torch.fx.Node) and d.target is operator.getitem
    ]
    values = g.variants[0].values
    batch_and_t = [p for p in positions if values[p] in (2, 5)]
    assert len(batch_and_t) == 2 * len(zeros), positions
    assert all(p in g.dynamic and p not in g.free for p in batch_and_t), (g.dynamic, g.free)


def test_a_validated_gradient_into_an_aot_backward_takes_the_forwards_symbols() -> None:
    """The eager loss views a dynamic AOT forward's logits to ``batch x T`` rows; its
    ``ViewBackward0`` hands the AOT backward the gradient, checked by the engine
    (``validate_outputs``) against the logits' sizes and passed through a tensor
    pre-hook (as FSDP2's at a block's boundary).  Those checked sizes are the
    forward's batch and T, so the first compile makes them the forward's symbols, not a
    symbol each that the retrace then ties to them.  One compile for every batch and
    length, gradients equal eager's."""
    seen: list[int] = []

    def loss(m: Any, batch: tuple[torch.Tensor, torch.Tensor], compiled: bool) -> torch.Tensor:
        ids, tgt = batch
        logits = m(ids)
        if compiled:  # a tensor pre-hook on the compiled logits' gradient
            logits.register_hook(lambda g: seen.append(g.shape[0]) or g)  # type: ignore[func-returns-value]
        return nn.functional.cross_entropy(logits.view(-1, 12), tgt.reshape(-1))

    torch.manual_seed(0)
    session = _aot_steps(TinyLM(), [(2, 5), (3, 5), (4, 7)], _tokens, loss)
    assert seen == [2, 3, 4], seen
    st = stoker_autograd.stats()
    assert (st["captures"], st["compiles"], st["fallbacks"]) == (1, 1, 0), st
    _inlined(session)
    (g,) = session.graphs
    nodes = list(g.gm.graph.nodes)
    (pro,) = [n for n in nodes if n.target is aot_backward_prologue]
    (hook,) = pro.args[2]  # the logits' gradient, through the pre-hook
    assert hook.target is ops.call_hook, hook.format_node()
    check = hook.args[1].args[0]
    assert check.target.__name__ == "validate_outputs", check.format_node()
    positions = [(1, d.args[1], -1) for d in check.args[1][0][1] if isinstance(d, torch.fx.Node)]
    values = g.variants[0].values
    batch_and_t = [p for p in positions if values[p] in (2, 5)]
    assert len(batch_and_t) == 2, (positions, values)
    assert all(p in g.dynamic and p not in g.free for p in batch_and_t), (g.dynamic, g.free)
