"""Accumulate-grad under stoker_autograd follows eager's AccumulateGrad, case by case.

Eager's rules (``accumulateGrad`` in torch/csrc/autograd/functions/accumulate_grad.h):
``.grad`` undefined: steal the gradient or copy it with the parameter's layout (the
layout contract), a sparse gradient shallow or cloned; ``.grad`` defined: add in
place (``.grad`` stays the same tensor), or ``new + .grad`` when ``.grad`` is sparse
and the gradient dense; under ``create_graph=True``: out of place, keeping history.
Each case below runs eagerly and under stoker (the captured graph's first run, then
the compiled graph) and compares values, layout, strides, coalescing, whether
``.grad`` is the tensor it was before, and ``.grad.requires_grad``.
"""

from __future__ import annotations

import copy
import itertools
import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch import fx

import stoker_autograd
from stoker_autograd._internal import ops, retrace


def _segmented(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return gm  # segments handed to a compiler, as stoker-triton gets them


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*create_graph=True will create a reference cycle.*"
        )
        # eager's own notes: the layout contract not obeyed, sparse invariants unchecked
        warnings.filterwarnings("ignore", message=".*gradient layout contract.*")
        warnings.filterwarnings("ignore", message=".*Sparse invariant checks.*")
        yield


def _describe(p: torch.Tensor, before: torch.Tensor | None) -> dict[str, Any] | None:
    g = p.grad
    if g is None:
        return None
    d: dict[str, Any] = {
        "layout": g.layout,
        "dtype": g.dtype,
        "requires_grad": g.requires_grad,
        "same tensor as before": g is before,
    }
    if g.layout == torch.strided:
        d["stride"] = g.stride()
        d["value"] = g.detach().clone()
    else:
        d["coalesced"] = g.is_coalesced()
        d["value"] = g.detach().to_dense()
    return d


def _assert_same(eager: dict[str, Any] | None, got: dict[str, Any] | None, what: str) -> None:
    assert (eager is None) == (got is None), what
    if eager is None or got is None:
        return
    ev, gv = eager.pop("value"), got.pop("value")
    assert got == eager, what
    torch.testing.assert_close(gv, ev, msg=what)


# ------------------------------------------------------------------------------------
# every combination, with a gradient of a chosen layout from a custom backward

_INCOMING: dict[str, Callable[[tuple[int, ...]], torch.Tensor]] = {
    "dense": lambda s: torch.randn(s),
    # dense but not contiguous: laid out backwards
    "noncontiguous": lambda s: torch.randn(tuple(reversed(s))).permute(*reversed(range(len(s)))),
    "sparse": lambda s: torch.sparse_coo_tensor(
        torch.tensor([[0, 1, 1]] + [[0, 1, 1]] * (len(s) - 1)), torch.randn(3), s
    ),  # index (1, ...) twice: not coalesced
}


def _param(kind: str) -> nn.Parameter:
    if kind == "contiguous":
        return nn.Parameter(torch.randn(4, 3))
    if kind == "transposed":  # dense, not contiguous: .grad takes its strides
        return nn.Parameter(torch.randn(3, 4).t())
    if kind == "nondense":  # every other column: .grad is row-major contiguous
        return nn.Parameter(torch.randn(4, 6)[:, ::2])
    if kind == "channels_last":
        return nn.Parameter(torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last))
    raise ValueError(kind)


class _Give(torch.autograd.Function):
    """``x + 0 * p``: ``p`` gets the gradient ``make(g)`` returns (any layout)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: torch.Tensor, make: Any) -> torch.Tensor:
        ctx.make = make
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g, ctx.make(g), None


def _one_case(
    incoming: str, existing: str, create_graph: bool, param: str, compiled: bool, compiler: Any
) -> list[dict[str, Any] | None]:
    """Two backwards (under stoker: the captured graph's run, then the compiled one)."""
    torch.manual_seed(0)
    p = _param(param)
    shape = tuple(p.shape)
    seen = []
    enable = stoker_autograd.enable(compiler=compiler) if compiled else None
    with enable if enable is not None else torch.enable_grad():
        for _ in range(2):
            if existing == "dense":
                p.grad = torch.randn(shape)
            elif existing == "sparse":
                p.grad = _INCOMING["sparse"](shape).coalesce()
            else:
                p.grad = None
            before = p.grad
            new = _INCOMING[incoming](shape)
            x = torch.randn(3, requires_grad=True)

            def make(g: torch.Tensor, new: torch.Tensor = new) -> torch.Tensor:
                # under create_graph the gradient carries history (it reads g)
                return new * (g.sum() * 0 + 1) if create_graph and not new.is_sparse else new

            _Give.apply(x, p, make).sum().backward(create_graph=create_graph)
            seen.append(_describe(p, before))
    return seen


_CASES = list(
    itertools.product(
        ["dense", "noncontiguous", "sparse"],
        ["none", "dense", "sparse"],
        [False, True],
        ["contiguous", "transposed", "nondense", "channels_last"],
    )
)


@pytest.mark.parametrize(
    "incoming,existing,create_graph,param",
    _CASES,
    ids=[
        "-".join(map(str, c)).replace("True", "create_graph").replace("False", "plain")
        for c in _CASES
    ],
)
def test_accumulate_grad_case(incoming: str, existing: str, create_graph: bool, param: str) -> None:
    eager = _one_case(incoming, existing, create_graph, param, compiled=False, compiler=None)
    for compiler in (None, _segmented):
        got = _one_case(incoming, existing, create_graph, param, compiled=True, compiler=compiler)
        for step, (e, g) in enumerate(zip(copy.deepcopy(eager), got)):
            _assert_same(e, g, f"step {step}, compiler {compiler}")
    assert stoker_autograd.stats()["fallbacks"] == 0


# ------------------------------------------------------------------------------------
# a gradient someone else holds is never stolen; a fresh one may be


def test_a_gradient_a_hook_holds_is_copied_as_in_eager() -> None:
    """A tensor hook keeps the gradient: eager copies it into .grad (its use count
    forbids stealing), so .grad shares no memory with what the hook holds."""

    def run(compiled: bool) -> list[bool]:
        torch.manual_seed(0)
        m = nn.Linear(4, 3)
        held: list[torch.Tensor] = []
        m.weight.register_hook(lambda g: held.append(g) or None)  # type: ignore[func-returns-value]
        shares = []
        with stoker_autograd.enable() if compiled else torch.enable_grad():
            for _ in range(3):
                m.zero_grad()
                held.clear()
                m(torch.randn(5, 4)).pow(2).sum().backward()
                assert m.weight.grad is not None
                shares.append(m.weight.grad.data_ptr() == held[0].data_ptr())
        return shares

    assert run(True) == run(False) == [False, False, False]


def test_accumulate_grad_steals_only_a_fresh_gradient_outside_grad_mode() -> None:
    """The function itself: a stealable gradient becomes .grad without a copy, unless
    grad mode is on (create_graph: eager copies, keeping history) or it breaks the
    layout contract (copied into the parameter's layout)."""
    p = nn.Parameter(torch.randn(3, 4))
    g = torch.randn(3, 4)
    with torch.no_grad():  # as the engine runs a backward without create_graph
        ops.accumulate_grad(p, None, g, False, True)
    assert p.grad is not None and p.grad.data_ptr() == g.data_ptr()
    p.grad = None
    h = torch.randn(3, 4, requires_grad=True) * 2
    ops.accumulate_grad(p, None, h, False, True)  # grad mode on: create_graph
    assert p.grad.data_ptr() != h.data_ptr() and p.grad.requires_grad
    q = nn.Parameter(torch.randn(4, 3).t())  # dense, transposed
    g = torch.randn(3, 4)  # row-major: not q's layout
    with torch.no_grad():
        ops.accumulate_grad(q, None, g, False, True)
    assert (
        q.grad is not None and q.grad.stride() == q.stride() and q.grad.data_ptr() != g.data_ptr()
    )
    s = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.randn(2, 3), (4, 3))
    e = nn.Parameter(torch.randn(4, 3))
    with torch.no_grad():  # a shallow copy: the same indices and values
        ops.accumulate_grad(e, None, s, False, True)
    assert e.grad is not None and e.grad._values().data_ptr() == s._values().data_ptr()
    e.grad = None
    with torch.no_grad():  # not proved fresh: cloned
        ops.accumulate_grad(e, None, s, False, False)
    assert e.grad is not None and e.grad._values().data_ptr() != s._values().data_ptr()


# ------------------------------------------------------------------------------------
# nn.Embedding(sparse=True) trained, with dense and sparse incoming gradients


class _Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.lin = nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        out = self.lin(self.emb(idx)).pow(2).sum()
        if extra is not None:  # a dense gradient into the embedding's weight as well
            out = out + (self.emb.weight * extra).sum()
        return out


@pytest.mark.parametrize("compiler", [None, _segmented], ids=["aten", "segmented"])
@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "create_graph"])
@pytest.mark.parametrize("dense_too", [False, True], ids=["sparse", "sparse+dense"])
@pytest.mark.parametrize("zero", ["none", "keep"], ids=["grad-None", "accumulating"])
def test_sparse_embedding_trains_as_in_eager(
    compiler: Any, create_graph: bool, dense_too: bool, zero: str
) -> None:
    """Embedding(sparse=True): its sparse gradient (and a dense one beside it) reach a
    .grad that is None every step or accumulates (sparse + sparse, sparse + dense,
    dense + sparse), with and without create_graph; trained with SGD, which takes
    sparse gradients.  A post-accumulate-grad hook sees eager's .grad."""
    torch.manual_seed(0)
    m = _Lookup()
    ref = copy.deepcopy(m)
    seen: dict[str, list[dict[str, Any] | None]] = {"eager": [], "stoker": []}
    for name, model in (("eager", ref), ("stoker", m)):
        model.emb.weight.register_post_accumulate_grad_hook(
            lambda p, name=name: seen[name].append(_describe(p, None))
        )
    opt, ref_opt = (torch.optim.SGD(x.parameters(), lr=0.1) for x in (m, ref))
    with stoker_autograd.enable(compiler=compiler):
        for step in range(4):
            idx = torch.randint(0, 10, (6,))
            extra = torch.randn(10, 4) if dense_too else None
            if zero == "none":
                opt.zero_grad()
                ref_opt.zero_grad()
            before = [p.grad for p in m.parameters()]
            ref_before = [p.grad for p in ref.parameters()]
            m(idx, extra).backward(create_graph=create_graph)
            with stoker_autograd.disabled():
                ref(idx, extra).backward(create_graph=create_graph)
            for p, q, b, rb in zip(m.parameters(), ref.parameters(), before, ref_before):
                _assert_same(_describe(q, rb), _describe(p, b), f"step {step}")
            if not create_graph:  # SGD's step with graphs attached to .grad is not the point
                opt.step()
                ref_opt.step()
                for p, q in zip(m.parameters(), ref.parameters()):
                    torch.testing.assert_close(p, q)
    assert len(seen["stoker"]) == len(seen["eager"]) == 4
    for e, g in zip(seen["eager"], seen["stoker"]):
        _assert_same(e, g, "post-accumulate-grad hook")
    st = stoker_autograd.stats()
    assert st["fallbacks"] == 0 and st["compiles"] >= 1, st


def test_sparse_grad_existing_is_not_in_the_guards() -> None:
    """A sparse .grad that only its accumulate-grad reads does not stop the compile
    (its nnz changes every step): one compile serves every step."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    ref = copy.deepcopy(emb)
    with stoker_autograd.enable():
        for _ in range(4):
            idx = torch.randint(0, 10, (6,))  # the accumulated .grad's nnz grows
            emb(idx).pow(2).sum().backward()
            with stoker_autograd.disabled():
                ref(idx).pow(2).sum().backward()
            assert emb.weight.grad is not None and ref.weight.grad is not None
            torch.testing.assert_close(emb.weight.grad.to_dense(), ref.weight.grad.to_dense())
    st = stoker_autograd.stats()
    # .grad None, then sparse: one capture and one compile each, never again
    assert st["captures"] == 2 and st["compiles"] == 2 and st["recompiles"] == 0, st
    assert st["fallbacks"] == 0, st


def test_the_inputs_no_traced_op_reads_are_kept_out_of_the_shape_context() -> None:
    """A sparse ``.grad`` in the graph's inputs gets no guard when nothing traced reads
    it: only its accumulate-grad (torch 2.13 passes it there), or nothing at all (torch
    2.11 collects it as an input and its accumulate-grad reads ``.grad`` at run time)."""
    g = fx.Graph()
    inputs = g.placeholder("inputs")
    a, grad, _unread = (g.call_function(operator.getitem, (inputs, i)) for i in (0, 1, 3))
    total = g.call_function(torch.add, (a, a))
    g.call_function(ops.accumulate_grad, (a, grad, total, False))
    g.output(None)
    # 0 is read by add; 1 only by the accumulate-grad; 2 and 4 by no node; 3 by nothing
    assert retrace.opaque_only_inputs(g, 5) == {1, 2, 3, 4}
    g.call_function(len, (inputs,))  # the list read whole: every input may be traced
    assert retrace.opaque_only_inputs(g, 5) == frozenset()
