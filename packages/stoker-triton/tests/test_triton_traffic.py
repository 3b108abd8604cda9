"""Memory traffic of generated kernels (`_internal/traffic.py`, `stoker bench traffic`)
and the rules that cut it: a stored value is read back rather than recomputed, a
matmul operand is a view of a stored value rather than a transposed copy, per-row
operands of a reduction are loaded once per row, and a reduction kernel takes only
work that shares data with it. Each compares with eager on fresh inputs too."""

from __future__ import annotations

import torch
from triton_helpers import check, trace

from stoker_triton._internal.traffic import analyze_graph


def _traffic(f, *args, **kw):
    return analyze_graph(trace(f, *args), list(args), **kw)


def _reads(g, kernel_kind=None):
    return [k for k in g.kernels if kernel_kind is None or k.kind == kernel_kind]


def test_a_stored_value_is_read_back_not_recomputed():
    # v reads two tensors per element; stored for the matmul, the later sum(0) reads it
    # (one tensor) instead of recomputing it from a and b (two)
    def f(a, b, w):
        v = a * b
        return v @ w, v.sum(0)

    a, b, w = torch.randn(32, 16), torch.randn(32, 16), torch.randn(16, 8)
    check(f, a, b, w, rtol=1e-4, atol=1e-4)
    g = _traffic(f, a, b, w)
    sums = [k for k in g.kernels if k.rnumel > 1 or "aten.sum" in k.origins]
    assert sums, g.kernels
    read = sum(k.read for k in sums)
    assert read == 32 * 16 * 4, [(k.name, k.reads) for k in g.kernels]


def test_a_matmul_gets_a_transposed_view_not_a_transposed_copy():
    # a linear layer's weight gradient, mm(v.t(), x): v is stored once, in its own
    # layout, and the matmul reads it transposed; no kernel recomputes v across rows
    def f(a, b, x):
        v = a * b
        return v.t() @ x, x.t() @ v

    a, b, x = torch.randn(32, 16), torch.randn(32, 16), torch.randn(32, 8)
    check(f, a, b, x, kernels=1, rtol=1e-4, atol=1e-4)
    g = _traffic(f, a, b, x)
    assert len(g.kernels) == 1 and g.kernels[0].uncoalesced == 0, g.kernels
    assert sum(k.written for k in g.kernels) == 32 * 16 * 4


def test_a_copy_a_matmul_reads_through_a_view_is_stored_once_as_an_output_too():
    # attention's output: a transposed copy, read by the projection's addmm through one
    # reshape and returned (saved for the backward) through another: one store
    def f(a, w):
        y = a.view(2, 8, 4, 4).transpose(1, 2).contiguous()
        return y.view(2, 4, 32), y.view(8, 32) @ w

    a, w = torch.randn(16, 16), torch.randn(32, 8)
    check(f, a, w, kernels=1, rtol=1e-4, atol=1e-4)
    g = _traffic(f, a, w)
    assert sum(k.written for k in g.kernels) == 256 * 4, [(k.name, k.writes) for k in g.kernels]


def test_per_row_and_per_column_operands_load_once_per_row_or_column():
    def f(x, m, w):
        return ((x - m[:, None]) * w).sum(-1)

    x, m, w = torch.randn(16, 64), torch.randn(16), torch.randn(64)
    fn = check(f, x, m, w, kernels=1, rtol=1e-4, atol=1e-4)
    src = fn.report.kernels[0].source
    loads = [ln for ln in src.splitlines() if "tl.load(" in ln]
    assert any(ln.endswith("xmask, other=0)") and "rindex" not in ln for ln in loads), src
    assert any(ln.endswith("rmask, other=0)") and "xindex" not in ln for ln in loads), src
    assert sum("xrmask" in ln for ln in loads) == 1, src  # only x is a full tile


def test_a_reduction_kernel_takes_only_work_that_shares_its_data():
    # y * 2 fits the reduction's space but shares nothing with it: its own kernel
    # (a reduction tile mixing unrelated loads reads one of them against the grain)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    check(lambda x, y: (x.sum(-1), y * 2), x, y, kernels=2)
    check(lambda x, y: (x.sum(-1), x * 2), x, y, kernels=1)  # shares x: one kernel
    # unrelated pointwise work still shares a pointwise kernel (a launch less)
    check(lambda x, y: (x * 3, y * 2), x, y, kernels=1)


def test_kernels_are_named_by_their_source_and_know_their_aten_ops():
    def f(x):
        return torch.softmax(x * 1.5, -1)

    x = torch.randn(8, 32)
    one = check(f, x, kernels=1)
    two = check(lambda x: (torch.softmax(x * 1.5, -1), x.sum()), x)
    k = one.report.kernels[0]
    assert k.fn_name.startswith("stoker_per_") and len(k.fn_name) == len("stoker_per_") + 12
    assert f"def {k.fn_name}(" in open(k.path).read()
    assert "aten._softmax" in k.origins and "aten.mul" in k.origins
    assert k.fn_name in {kk.fn_name for kk in two.report.kernels}  # the same source, name
    from stoker_triton._internal.report import KERNELS

    assert KERNELS[k.fn_name].origins == k.origins


def test_traffic_counts_bytes_and_passes():
    x = torch.randn(64, 128)
    g = _traffic(lambda x: torch.softmax(x, -1), x)
    (k,) = g.kernels
    n = 64 * 128 * 4
    assert (k.kind, k.read, k.written, k.passes) == ("persistent", n, n, 1.0)
    assert g.minimum == 2 * n and g.ratio == 1.0
    # a row longer than a block: the max and sum in one loop (online), the output in a
    # second, so the row is read twice
    g = _traffic(lambda x: torch.softmax(x, -1), x, persistent_rnumel_max=16)
    (k,) = g.kernels
    assert (k.kind, k.read, k.written, k.passes) == ("looped", 2 * n, n, 2.0)
    assert g.ratio == 1.5
    # a broadcast operand counts once; a transposed read is uncoalesced
    g = _traffic(lambda x, b: (x + b).t().contiguous(), x, torch.randn(128))
    (k,) = g.kernels
    assert k.read == n + 128 * 4 and k.uncoalesced > 0
