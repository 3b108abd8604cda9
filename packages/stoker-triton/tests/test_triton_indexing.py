"""Indexing: gathers through indirect loads, scatters (atomics) for the backwards."""

import torch
import torch.nn.functional as F
from triton_helpers import check


def test_gather_index_select_index():
    x = torch.randn(5, 8)
    i = torch.randint(-5, 5, (6,))
    j = torch.randint(0, 8, (5, 3))
    check(
        lambda x, i, j: (
            torch.gather(x, 1, j),
            x[i],
            x.index_select(1, j[0]),
            x[:, j[0]] * 2,
            x[i[:3], j[:3, 0]],
            x[i[:, None], j[0][None, :]],
        ),
        x,
        i,
        j,
        fresh_inputs=False,
    )


def test_embedding_forward():
    w = torch.randn(12, 6)
    idx = torch.randint(0, 12, (3, 4))
    check(lambda w, idx: F.embedding(idx, w) * 2, w, idx, kernels=1, fresh_inputs=False)


def test_embedding_backward_uses_atomics():
    w = torch.randn(10, 8, requires_grad=True)
    idx = torch.randint(0, 10, (4, 7))  # repeated indices: accumulation must be atomic

    def f(w, idx):
        y = F.embedding(idx, w)
        return torch.autograd.grad((y * y).sum(), [w])

    fn = check(f, w, idx, fresh_inputs=False, rtol=1e-4)
    assert any(k.kind == "scatter" for k in fn.report.kernels), str(fn.report)
    assert any("atomic_add" in k.source for k in fn.report.kernels)


def test_index_put_accumulate_and_store():
    x = torch.randn(6, 4)
    i = torch.tensor([0, 2, 2, 5])
    v = torch.randn(4, 4)
    check(
        lambda x, i, v: (
            torch.ops.aten.index_put(x, [i], v, True),
            torch.ops.aten.index_put(x, [i[:2]], v[:1] * 0 + 7.0, False),
        ),
        x,
        i,
        v,
        fresh_inputs=False,
    )


def test_scatter_add_and_scatter():
    x = torch.zeros(3, 5)
    idx = torch.tensor([[0, 1, 4], [2, 2, 2], [4, 3, 0]])
    src = torch.randn(3, 3)
    check(
        lambda x, idx, src: (x.scatter_add(1, idx, src), x.scatter(1, idx[:, :1], src[:, :1])),
        x,
        idx,
        src,
        fresh_inputs=False,
    )


def test_gather_backward():
    x = torch.randn(4, 6, requires_grad=True)
    j = torch.randint(0, 6, (4, 9))

    def f(x, j):
        return torch.autograd.grad(torch.gather(x, 1, j).sum(), [x])

    check(f, x, j, fresh_inputs=False)


def test_index_backward():
    x = torch.randn(7, 3, requires_grad=True)
    i = torch.tensor([1, 1, 6, 0, 1])

    def f(x, i):
        return torch.autograd.grad((x[i] * torch.arange(3.0)).sum(), [x])

    check(f, x, i, fresh_inputs=False)
