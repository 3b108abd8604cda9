"""The prepare stage's per-node decompositions: one trace per (op, input metadata), inlined
into every node that matches, with the same results as eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import check

from stoker_triton._internal import pipeline

aten = torch.ops.aten


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every decomposition `decompose` traces (the op's node target is not passed: the
    decomposition function is recorded)."""
    seen: list[Any] = []
    real = pipeline._trace_decomposition

    def counting(decomp: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(decomp)
        return real(decomp, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_trace_decomposition", counting)
    return seen


def test_layers_with_the_same_metadata_share_one_trace(traces: list[Any]) -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for _ in range(3):  # three layer norms on the same sizes: one trace
            x = F.layer_norm(x, (8,), w, b) * 2 + 1
        return F.layer_norm(x[:, :4], (4,), w[:4], b[:4])  # other sizes: a trace of its own

    check(f, torch.randn(5, 8), torch.randn(8), torch.randn(8))
    assert len(traces) == 2, traces


def test_one_value_object_at_two_positions_is_traced_as_two_inputs(traces: list[Any]) -> None:
    # The layer norms of p and q share a trace, so their inlined outputs w and b share
    # one fake value object; layer_norm(x, w, b) must still read w and b, not b twice.
    def f(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> Any:
        w = F.layer_norm(p, (8,))
        b = F.layer_norm(q, (8,))
        return (
            F.layer_norm(x, (8,), w, b),
            F.layer_norm(x, (8,), b, w),
            F.layer_norm(x, (8,), w, w),
        )

    check(f, torch.randn(4, 8), torch.randn(8), torch.randn(8))
    # p and q: one trace; (w, b) and (b, w): one; (w, w), one input twice: its own
    assert len(traces) == 3, traces


def _max_pool_backward(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    _, idx = aten.max_pool2d_with_indices(x, [2, 2], [2, 2], [1, 1], [1, 1], True)
    return aten.max_pool2d_with_indices_backward(g, x, [2, 2], [2, 2], [1, 1], [1, 1], True, idx)


# Ops the zoo sweep (test_stoker_sweep_modules.py) saw fall back to aten; decomposed
# now into ops the rule table lowers: Triton kernels only, eager's numbers.
_DECOMPOSED_NOW: dict[str, tuple[Any, ...]] = {
    "repeat": (lambda x: x.repeat(2, 1, 3) * 2, torch.randn(3, 4)),
    "select_scatter": (
        lambda x, y: torch.select_scatter(x, y.cos(), 0, 1),
        torch.randn(3, 5),
        torch.randn(5),
    ),
    "vector_norm": (
        lambda x: (
            torch.linalg.vector_norm(x, 2, dim=1),
            torch.linalg.vector_norm(x, 1),
            torch.linalg.vector_norm(x, float("inf"), dim=0, keepdim=True),
            torch.linalg.vector_norm(x, 3.0, dim=1),
        ),
        torch.randn(4, 5),
    ),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (3, 2)), torch.randn(2, 3, 6, 7)),
    "max_pool2d": (
        lambda x: F.max_pool2d(x, 2, 2, padding=1, ceil_mode=True, return_indices=True),
        torch.randn(2, 3, 6, 7),
    ),
    "max_pool2d_backward": (_max_pool_backward, torch.randn(2, 3, 6, 7), torch.randn(2, 3, 4, 4)),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2, 1, padding=1), torch.randn(2, 2, 4, 3, 3)),
}


@pytest.mark.parametrize("name", list(_DECOMPOSED_NOW))
def test_ops_the_module_sweep_saw_fall_back_compile_to_kernels(name: str) -> None:
    f, *args = _DECOMPOSED_NOW[name]
    fn = check(f, *args)
    assert not fn.report.fallback_ops, fn.report.fallback_ops
    assert fn.report.n_kernels >= 1


_POOLS = ["max_pool2d", "max_pool2d_backward", "max_pool3d"]


@pytest.mark.parametrize("name", _POOLS)
def test_stokers_own_max_pool_decompositions_compile_to_kernels(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decompositions used where torch has none (before torch 2.12, as on the GPU
    machine's torch 2.11): the table with stoker's in place of torch's."""
    from stoker_triton._internal import pool_decomp

    table = {**pipeline.decomposition_table(), **pool_decomp.OWN}
    monkeypatch.setattr(pipeline, "_table", table)
    f, *args = _DECOMPOSED_NOW[name]
    fn = check(f, *args)
    assert not fn.report.fallback_ops, fn.report.fallback_ops
    assert fn.report.n_kernels >= 1


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
@pytest.mark.parametrize(
    "kernel,stride,padding,dilation,ceil",
    [
        ([2], [2], [1], [1], True),
        ([3], [1], [1], [1], False),
        ([3], [2], [1], [2], True),
        ([2], [], [0], [1], False),
        ([3], [3], [1], [1], True),
    ],
)
def test_stokers_own_max_pool_matches_aten(
    n: int,
    dtype: torch.dtype,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil: bool,
) -> None:
    """Values and indices as aten's (every window, ceil mode, dilation, padding, an
    unbatched input, integers), and the backward's scatter as aten's."""
    from stoker_triton._internal import pool_decomp

    torch.manual_seed(0)
    for shape in ((2, 3, 7, 6, 5)[: 2 + n], (3, 7, 6, 5)[: 1 + n]):
        x = (
            torch.randint(-50, 50, shape, dtype=dtype)
            if dtype == torch.int32
            else torch.randn(shape)
        )
        op = aten.max_pool2d_with_indices if n == 2 else aten.max_pool3d_with_indices
        want = op(x.float(), kernel, stride, padding, dilation, ceil)  # aten has no int pool
        got = pool_decomp.max_pool_nd_with_indices(x, kernel, stride, padding, dilation, ceil, n)
        assert got[0].dtype == dtype
        torch.testing.assert_close(got[0].float(), want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        if n == 2 and dtype == torch.float32:
            g = torch.randn_like(want[0])
            args = (kernel, stride, padding, dilation, ceil, want[1])
            torch.testing.assert_close(
                pool_decomp.max_pool2d_with_indices_backward(g, x, *args),
                aten.max_pool2d_with_indices_backward(g, x, *args),
            )


def _overlapping_pool_backward(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    _, idx = aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
    return aten.max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, idx)


@pytest.mark.parametrize("target", ["triton", "c"])
def test_a_channels_last_pool_backward_stays_channels_last(target: str) -> None:
    """A max-pool's backward over a channels-last input (overlapping windows: gradients
    add up) scatters into a channels-last buffer: eager's values and eager's layout, so
    the BatchNorm or ReLU backward that reads it walks it in memory order."""
    cl = torch.channels_last
    x = torch.randn(2, 8, 7, 9).contiguous(memory_format=cl)
    g = torch.randn(2, 8, 4, 5).contiguous(memory_format=cl)
    fn = check(_overlapping_pool_backward, x, g, options={"target": target})
    assert not fn.report.fallback_ops, fn.report.fallback_ops
    out, ref = fn(x, g), _overlapping_pool_backward(x, g)
    torch.testing.assert_close(out, ref)
    assert out.stride() == ref.stride() == x.stride()
    # the output is the scatter's own buffer: no kernel copies an NCHW scatter into it
    assert fn.report.kernels[-1].kind == "scatter", [k.kind for k in fn.report.kernels]


def _bn_relu_pool(x: torch.Tensor) -> Any:
    y = F.batch_norm(x, None, None, training=True).relu()
    return aten.max_pool2d_with_indices(y, [3, 3], [2, 2], [1, 1], [1, 1], False)


@pytest.mark.parametrize("target", ["triton", "c"])
def test_a_channels_last_max_pool_stays_channels_last(target: str) -> None:
    """A max-pool over a channels-last input reduces (N, H, W, C) rows, walked in memory
    order, into channels-last values and indices (eager's layout): one reduction kernel
    (the BatchNorm and ReLU before it fused in), no copy into another layout."""
    cl = torch.channels_last
    x = torch.randn(2, 8, 9, 7).contiguous(memory_format=cl)
    fn = check(_bn_relu_pool, x, options={"target": target})
    out, ref = fn(x), _bn_relu_pool(x)
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
        assert o.stride() == r.stride() and o.is_contiguous(memory_format=cl)
    pool = [k for k in fn.report.kernels if "aten.max_pool2d_with_indices" in k.origins]
    assert len(pool) == 1 and "reduction" in pool[0].kind, [k.kind for k in fn.report.kernels]
    assert fn.report.kernels[-1] is pool[0], [k.origins for k in fn.report.kernels]
    if target == "c":
        # a 2x2 window reduced outputs side by side, each lane its own channel: the
        # BatchNorm's per-channel scale is computed once per lane, by a loop over the
        # tile before the loop over the window, not once per element
        def pool2(x: torch.Tensor) -> Any:
            y = F.batch_norm(x, None, None, training=True).relu()
            return aten.max_pool2d_with_indices(y, [2, 2], [2, 2])

        img = torch.randn(2, 16, 8, 8).contiguous(memory_format=cl)
        fn = check(pool2, img, options={"target": "c"})
        (src,) = [
            k.source for k in fn.report.kernels if "aten.max_pool2d_with_indices" in k.origins
        ]
        assert "xi < xn" in src and src.index("sqrtf(") < src.index("for (int64_t r = 0"), src
