"""The CPU's C emitter (`options={"target": "c"}`): the scheduler's kernels as C loops,
built by the system compiler for real, against eager PyTorch on fresh inputs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from stoker_triton import compile_graph
from stoker_triton._internal.compile import ccompile
from stoker_triton._internal.runtime.cload import CKernelError, loaded_openmp_runtimes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from triton_helpers import assert_same, compile_dynamic, fresh, trace

C = {"target": "c"}
SIGN_TEST = re.compile(r"[<>]=? \(\(\(int64_t\)0LL\)\)")  # `i < 0`, `i >= 0` in a kernel


def check(f: Any, *args: Any, atol: float = 1e-5, rtol: float = 1e-5, runs: int = 2) -> Any:
    """Compile `f` to C kernels, compare with eager on the example and on fresh inputs."""
    fn = compile_graph(trace(f, *args), list(args), options=C)
    assert fn.report.target == "c"
    assert fn.report.kernels, "no C kernel was generated"
    for i in range(runs):
        a = list(args) if i == 0 else fresh(args)
        assert_same(fn(*a), f(*a), atol=atol, rtol=rtol)
    return fn


def test_pointwise_broadcast_and_strided_inputs() -> None:
    def f(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x * y + z).exp() - torch.tanh(x).abs().sqrt()

    x = torch.randn(8, 6, 33)
    y = torch.randn(33)  # broadcast along the last dim
    z = torch.randn(33, 6, 8).permute(2, 1, 0)  # strided, not contiguous
    check(f, x, y, z)


def test_inner_and_outer_reductions() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            x.sum(-1),
            x.sum(0),
            x.amax(1),
            x.amin(-1),
            x.mean((0, 2)),
            x.var(-1),
            x.argmax(-1),
            x.argmin(0),
            x.prod(-1),
            (x > 0).any(-1),
            (x > -3).all(0),
        )

    check(f, torch.randn(5, 37, 19), atol=1e-4, rtol=1e-4)


def test_batch_norm_rows_walked_run_by_run() -> None:
    """A BatchNorm over NCHW reduces, per channel, N runs of H*W contiguous values: the
    row is walked run by run (ro, ri); mean, variance, an arg-max's index and the
    backward agree with eager."""

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = F.batch_norm(x, None, None, w, None, training=True)
        (g,) = torch.autograd.grad((y.relu() * x).sum(), [w])
        flat = x.transpose(0, 1).flatten(1)
        return y, g, x.var((0, 2, 3)), x.permute(1, 0, 2, 3).flatten(1).argmax(-1), flat.amax(1)

    fn = check(f, torch.randn(3, 5, 6, 7), torch.randn(5, requires_grad=True), atol=1e-4)
    assert any("ro < rnumel / RI" in k.source for k in fn.report.kernels)


def test_softmax_layer_norm_gelu_fuse_into_few_kernels() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = F.gelu(F.layer_norm(x, (64,), w, b))
        return torch.softmax(y, -1) + F.log_softmax(x, -1)

    fn = check(f, torch.randn(12, 64), torch.randn(64), torch.randn(64), atol=1e-5, rtol=1e-4)
    assert len(fn.report.kernels) <= 3, [k.name for k in fn.report.kernels]


def test_nan_and_inf_propagate_as_in_eager() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.amax(-1), x.amin(0), torch.maximum(x, x.flip(0)), x.sum(-1), x.argmax(-1)

    x = torch.randn(6, 9)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[4, 5] = -float("inf")
    fn = compile_graph(trace(f, x), [x], options=C)
    for out, ref in zip(fn(x), f(x)):
        torch.testing.assert_close(out, ref, equal_nan=True)


def test_zero_size_tensors() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x * 2 + 1, x.sum(-1), y.sum(0)

    x, y = torch.randn(0, 5), torch.randn(0, 3)
    fn = compile_graph(trace(f, x, y), [x, y], options=C)
    for out, ref in zip(fn(x, y), f(x, y)):
        torch.testing.assert_close(out, ref)


def test_bfloat16_and_float16_compute_in_float32() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.silu(F.layer_norm(x, (48,), w)) * 3 + x.sum(-1, keepdim=True)

    for dt in (torch.bfloat16, torch.float16):
        x, w = torch.randn(16, 48, dtype=dt), torch.randn(48, dtype=dt)
        fn = compile_graph(trace(f, x, w), [x, w], options=C)
        out, ref = fn(x, w), f(x, w)
        assert out.dtype == dt
        # eager rounds each op to the half type; fused, only the graph's stores round
        torch.testing.assert_close(out.float(), ref.float(), atol=0.1, rtol=0.05)
        exact = compile_graph(trace(lambda a: a * 2 - 1, x), [x], options=C)
        assert torch.equal(exact(x), x * 2 - 1)


def test_indexing_gather_scatter_and_padding() -> None:
    def f(w: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        e = F.embedding(idx, w)
        padded = F.pad(x, (1, 2, 0, 3), value=-1.5)
        cat = torch.cat([x, x * 2], dim=1)
        acc = torch.zeros(10, 4).index_add(0, idx.flatten(), e.reshape(-1, 4))
        return e, padded, cat, acc

    w, idx, x = torch.randn(10, 4), torch.randint(0, 10, (3, 5)), torch.randn(5, 7)
    check(f, w, idx, x, atol=1e-5, rtol=1e-5)


def test_tests_the_loop_ranges_decide_fold_and_the_others_stay() -> None:
    """A 2x2 max-pool's window positions lie inside the input: no wrap, no bounds test.
    Its tile of 8 outputs (a row of the pooled plane) reads the window with a stride,
    not a gather, and the fused BatchNorm's per-channel values are computed once per
    tile, before the window loop. A padded pool keeps its bounds test; a gather through
    negative indices keeps its wrap, and reads through int32 offsets (which gcc
    vectorizes). All agree with eager, indices included."""

    def pool(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.batch_norm(x, None, None, w, None, training=True).relu()
        return F.max_pool2d_with_indices(y, 2)

    def padded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.max_pool2d_with_indices(x, 3, stride=2, padding=1, ceil_mode=True)

    def negative(x: torch.Tensor, idx: torch.Tensor, jdx: torch.Tensor) -> torch.Tensor:
        return x[idx, jdx] * 2

    fn = check(pool, torch.randn(4, 8, 16, 16), torch.randn(8))
    (k,) = [k for k in fn.report.kernels if "rnumel = 4;" in k.source]
    assert not SIGN_TEST.search(k.source), k.source
    assert "xn = ST_MIN(8," in k.source and "xi /" not in k.source and "xi %" not in k.source
    assert k.source.index("sqrtf") < k.source.index("for (int64_t r = 0"), k.source
    fn = check(padded, torch.randn(2, 3, 9, 11))
    assert any(SIGN_TEST.search(k.source) for k in fn.report.kernels)
    ij = torch.randint(-10, 10, (6, 64)), torch.randint(-5, 5, (6, 64))
    fn = check(negative, torch.randn(10, 5), *ij)
    assert any(SIGN_TEST.search(k.source) and "(int32_t)(" in k.source for k in fn.report.kernels)


def test_a_load_under_nested_masks_stays_in_its_loop() -> None:
    """A padded concatenation of broadcast columns: each load's index is the same for
    the whole row (it could move out of the inner loop) but its mask, two conditions,
    is not; the load stays where its mask is defined."""

    def f(x: torch.Tensor) -> torch.Tensor:
        cat = torch.cat([x[:, :1].expand(-1, 8), x[:, 1:2].expand(-1, 8)], 1)
        return F.pad(cat, (3, 5), value=2.0) * 3

    check(f, torch.randn(8, 4))


def test_a_head_split_loops_along_its_runs() -> None:
    """Attention heads merged back (`o.transpose(1, 2).reshape(B, T, H * D)`): the rows
    of the output are H*D long but the input runs only D; the inner loop walks one run
    (unit stride, no gather)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(2, 16, 128) * 2

    fn = check(f, torch.randn(2, 4, 16, 32))
    (k,) = fn.report.kernels
    assert "XI = 32;" in k.source, k.source
    assert "xi /" not in k.source and "xi %" not in k.source, k.source


def test_a_channels_last_tensor_is_walked_in_memory_order() -> None:
    """A channels-last input (a model moved `.to(memory_format=torch.channels_last)`):
    eager returns channels-last outputs, and the kernel walks them in memory order, so
    its loads and stores have unit stride in the inner loop. Walked in NCHW order, each
    lane read and wrote C elements apart (gathers and scatters, 40x slower)."""

    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 2 + b.view(1, -1, 1, 1))

    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    fn = check(f, x, torch.randn(16))
    out = fn(x, torch.randn(16))
    assert out.stride() == f(x, torch.randn(16)).stride() == (1024, 1, 128, 16)
    (k,) = fn.report.kernels
    loads = re.findall(r"in_ptr0\[([^\]]*)\]", k.source)
    stores = re.findall(r"out_ptr0\[([^\]]*)\]", k.source)
    assert loads and stores and set(loads) == set(stores), k.source
    assert all("/" not in i and "%" not in i for i in stores), k.source
    # the bias is read along the channels: the innermost dim of the walk
    assert re.search(r"in_ptr1\[\(?\(?xi\b", k.source) or "in_ptr1[x" in k.source, k.source


def test_a_channels_last_value_an_extern_reads_is_stored_channels_last() -> None:
    """A value the graph does not return, stored for an extern (the activation a
    convolution reads): channels-last where eager's is, written in memory order, so the
    convolution gets the layout eager gives it and the kernel no scatter."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv2d(torch.relu(x * 2 - 1), w, padding=1)

    cl = torch.channels_last
    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=cl)
    w = torch.randn(8, 16, 3, 3).contiguous(memory_format=cl)
    fn = check(f, x, w, atol=1e-4, rtol=1e-4)
    (k,) = fn.report.kernels
    # x read and the activation written at one index, unit stride in xi (stored NCHW,
    # the read of x was `16*xi + 1024*(xo / 16) + xo % 16`)
    walks = re.findall(r"(?:in|out)_ptr0\[([^\]]*)\]", k.source)
    assert len(walks) == 2 and len(set(walks)) == 1, k.source
    assert all("/" not in i and "%" not in i for i in walks), k.source


def test_a_scatter_is_simd_only_where_its_lanes_write_apart() -> None:
    """An embedding's backward adds whole rows (repeated indices among them): serial
    over rows, one fixed order, and simd along a row, whose lanes write distinct
    elements. A scatter_add whose index moves along the row stays serial."""

    def f(w: torch.Tensor, idx: torch.Tensor, j: torch.Tensor, s: torch.Tensor) -> Any:
        (g,) = torch.autograd.grad((F.embedding(idx, w) * torch.arange(64.0)).sum(), [w])
        return g, torch.zeros(4, 64).scatter_add(1, j, s)

    w, idx = torch.randn(100, 64, requires_grad=True), torch.randint(0, 20, (8, 33))
    j, s = torch.randint(0, 64, (4, 64)), torch.randn(4, 64)
    fn = check(f, w, idx, j, s)
    simd = ["#pragma omp simd" in k.source for k in fn.report.kernels if k.kind == "scatter"]
    assert sorted(simd) == [False, True], [k.source for k in fn.report.kernels]


def test_one_index_per_line_scatter_is_a_pointwise_select() -> None:
    """nll_loss's backward scatters one value per row into zeros: no scatter kernel, the
    softmax backward reads the select in its own loop; ignore_index, a scatter along
    dim 0 and a tensor source agree with eager."""

    def f(x: torch.Tensor, t: torch.Tensor, j: torch.Tensor, s: torch.Tensor) -> Any:
        loss = F.cross_entropy(x, t, ignore_index=3)
        (g,) = torch.autograd.grad(loss, [x])
        return g, torch.zeros(5, 9).scatter(0, j, s), x.scatter(1, j[:, :1].T.repeat(6, 1), 2.5)

    x = torch.randn(6, 9, requires_grad=True)
    t = torch.tensor([0, 3, 8, 3, 1, 7])
    j = torch.tensor([[4, 1, 0, 2, 2, 0, 1, 0, 3]])
    s = torch.randn(1, 9)
    fn = compile_graph(trace(f, x, t, j, s), [x, t, j, s], options=C)
    assert "scatter" not in [k.kind for k in fn.report.kernels]
    for a in ([x, t, j, s], [torch.randn(6, 9, requires_grad=True), t.flip(0), 4 - j, s * 3]):
        assert_same(fn(*a), f(*a), atol=1e-6, rtol=1e-5)


def test_libm_calls_vectorize_and_agree_with_eager() -> None:
    """sin, cos, pow, atan2, ... over the vector math library agree with eager's CPU
    kernels in float32 and float64, special values included."""
    special = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, 3e38, 1e10, 0.5]

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x.abs()
        return (
            torch.sin(x) * torch.cos(x * 3),
            torch.tan(x),
            torch.atan2(x, x.flip(0) + 0.5),
            torch.pow(y, x * 0.37),
            torch.expm1(x.clamp(max=80)),
            torch.log1p(y) + torch.log2(y) + torch.log10(y),
            torch.asinh(x) + torch.atan(x),
        )

    for dt in (torch.float32, torch.float64):
        x = torch.cat([torch.randn(2000, dtype=dt) * 30, torch.tensor(special, dtype=dt)])
        fn = compile_graph(trace(f, x), [x], options=C)
        tol = 2e-6 if dt == torch.float32 else 1e-12
        for a in (x, torch.randn_like(x) * 300):
            assert_same(fn(a), f(a), atol=tol, rtol=tol)


def test_random_numbers_follow_the_seed_and_the_distribution() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.dropout(x, 0.3, training=True), torch.randn_like(x)

    x = torch.ones(64, 128)
    fn = compile_graph(trace(f, x), [x], options=C)
    torch.manual_seed(1)
    a, n = fn(x)
    torch.manual_seed(1)
    b, _ = fn(x)
    assert torch.equal(a, b)
    kept = (a != 0).float().mean().item()
    assert abs(kept - 0.7) < 0.02, kept
    assert torch.allclose(a[a != 0], torch.full_like(a[a != 0], 1 / 0.7))
    assert abs(n.mean().item()) < 0.03 and abs(n.std().item() - 1) < 0.03


def test_dynamic_sizes_are_arguments_of_one_object() -> None:
    from stoker_shapes import Dim

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * w, -1).sum(0)

    n = Dim("n", max=100000)
    ctx, fn = compile_dynamic(
        f, [torch.randn(6, 40), torch.randn(40)], [{0: Dim("b"), 1: n}, {0: n}], options=C
    )
    assert any("s" in k.xnumel + k.rnumel for k in fn.report.kernels), fn.report.kernels
    # no guard on a row's length: a CPU loops over a row of any length
    assert not [g for g in fn.report.guards_added if "<=" in g], fn.report.guards_added
    guards = ctx.produce_guards()
    for b, m in ((6, 40), (3, 9000), (17, 2)):
        x, w = torch.randn(b, m), torch.randn(m)
        assert guards.check([x, w], {}, None)
        assert_same(fn(x, w), f(x, w), atol=1e-5, rtol=1e-4)


def test_int64_indexing_past_two_to_the_31() -> None:
    """A shape test: the kernels of a tensor of more than 2**31 elements index in
    int64 (traced with fake tensors: nothing of that size is allocated), and build."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stoker_triton._internal.pipeline import compile_graph_impl

    rows, cols = 2**16 + 1, 2**15 + 3
    assert rows * cols > 2**31
    with FakeTensorMode():
        x = torch.empty(rows, cols)
        pointwise = trace(lambda a: a * 2, x)
        reduction = trace(lambda a: a.exp().sum(-1), x)
    fn = compile_graph_impl(pointwise, [x], options=C)
    (k,) = fn.report.kernels
    assert "int64_t xnumel" in k.source and "int64_t xo" in k.source, k.source
    assert f"{rows * cols}" in fn.wrapper_source  # the element count, passed as int64
    fn = compile_graph_impl(reduction, [x], options=C)
    (k,) = fn.report.kernels
    assert "int64_t x = 0" in k.source and "int64_t r = 0" in k.source, k.source
    assert f"{cols}*x" in k.source.replace(" ", ""), k.source  # row * 32771: past 2**31


def test_reductions_repeat_bit_for_bit_at_any_thread_count() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x.sum(), x.sum(0), torch.softmax(x, -1)

    x = torch.randn(700, 300)
    fn = compile_graph(trace(f, x), [x], options=C)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn(x)
        torch.set_num_threads(2)
        two = fn(x)
        again = fn(x)
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(one, two, again):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert_same(one, f(x), atol=1e-3, rtol=1e-4)


def test_one_openmp_runtime_torchs() -> None:
    fn = compile_graph(trace(lambda a: a + 1, torch.randn(4)), [torch.randn(4)], options=C)
    fn(torch.randn(4))
    runtimes = loaded_openmp_runtimes()
    assert len(runtimes) == 1, runtimes
    assert "torch" in runtimes[0], runtimes


def _vectorized_lines(source: str, tmp_path: Any) -> set[int]:
    """Lines of `source` whose loops the compiler reports vectorized."""
    c = tmp_path / "k.c"
    c.write_text(source)
    cmd = [ccompile.compiler_or_raise(), *ccompile.flags()]
    cmd += ["-fopt-info-vec-optimized", str(c), "-o", str(tmp_path / "k.so")]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {int(m) for m in re.findall(r"k\.c:(\d+):\d+: optimized: loop vectorized", done.stderr)}


def _simd_loop_lines(source: str) -> list[range]:
    """The lines (1-based, `for` to closing brace) of the simd loops that read memory
    (the hot loops; a tile's finishing loop over its few outputs is not one)."""
    lines = source.splitlines()
    out = []
    for i, ln in enumerate(lines):
        if "#pragma omp simd" not in ln and "parallel for simd" not in ln:
            continue
        loop = lines[i + 1]
        close = loop[: len(loop) - len(loop.lstrip())] + "}"
        end = next(j for j in range(i + 2, len(lines)) if lines[j] == close)
        if any("in_ptr" in b for b in lines[i + 2 : end]):
            out.append(range(i + 2, end + 2))
    return out


def test_inner_loops_vectorize(tmp_path: Any) -> None:
    """The compiler's own report: every simd loop of a pointwise kernel (with exp), of
    an inner and an outer reduction, of a kernel with masked loads and sin, of a
    max-pool (a reduction over rows shorter than a vector; NCHW and channels-last, with
    its arg-max) and of a BatchNorm (rows walked run by run) is vectorized."""
    from stoker_triton._internal.codegen.c_kernel import kernel_file_source

    version = subprocess.run(
        [ccompile.compiler_or_raise(), "--version"], capture_output=True, text=True
    ).stdout
    if "clang" in version.lower():  # clang reports with -Rpass=loop-vectorize instead
        pytest.skip("the vectorization report is read in gcc's -fopt-info format")

    x, b = torch.randn(256, 128), torch.randn(128)
    kernels = []
    for f in (lambda x, b: torch.exp(x * 2 + b), lambda x, b: torch.softmax(x, -1) * b):
        kernels += compile_graph(trace(f, x, b), [x, b], options=C).report.kernels
    kernels += compile_graph(trace(lambda x: x.sum(0), x), [x], options=C).report.kernels
    kinds = [k.kind for k in kernels]
    assert kinds == ["pointwise", "persistent-reduction", "persistent-reduction"], kinds
    # masked loads (padding, a concatenation), libm through libmvec, a 2x2 window
    img = torch.randn(4, 8, 16, 16)
    for g, a in (
        (lambda x, b: torch.sin(torch.cat([F.pad(x, (1, 2)), b.expand(256, 128)], 1)), (x, b)),
        (lambda y: F.max_pool2d(torch.relu(y), 2), (img,)),
        (lambda y: F.batch_norm(y, None, None, training=True), (img,)),  # run by run
        (lambda y: F.max_pool2d(F.batch_norm(y, None, None, training=True).relu(), 2), (img,)),
        # a training max-pool: its arg-max index too, over a tile of 8 outputs
        (
            lambda y: F.max_pool2d_with_indices(F.batch_norm(y, None, None, training=True), 2),
            (img,),
        ),
        # channels-last: each lane its own channel (its own BatchNorm scale and shift)
        (
            lambda y, w, b: F.max_pool2d_with_indices(
                F.batch_norm(y, None, None, w, b, training=True).relu(), 2
            ),
            (img.contiguous(memory_format=torch.channels_last), torch.rand(8), torch.randn(8)),
        ),
    ):
        kernels += compile_graph(trace(g, *a), list(a), options=C).report.kernels
    assert len(kernels) == 13, [k.kind for k in kernels]
    for k in kernels:
        src = kernel_file_source(type("K", (), {"source": k.source, "name": k.name})(), "kern")
        want = _simd_loop_lines(src)
        assert want, k.source
        got = _vectorized_lines(src, tmp_path)
        # (gcc names a loop by its `for` line or a line of its body)
        missed = [lines.start for lines in want if not set(lines) & got]
        assert not missed, (k.name, missed, sorted(got), k.source)


def test_a_missing_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CC", "/nonexistent/cc")
    ccompile._identity.cache_clear()
    x = torch.randn(3, 5)
    with pytest.raises(
        ccompile.CCompilerMissing, match=r"STOKER_CC='/nonexistent/cc'.*apt-get install gcc"
    ):
        compile_graph(trace(lambda a: a * 3 + 1, x), [x], options=C)


def test_a_failing_compile_names_graph_kernel_and_source(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("STOKER_C_OBJECT_DIR", raising=False)
    monkeypatch.setenv("STOKER_CFLAGS", "-O1 -fno-such-flag-for-stoker")
    ccompile._identity.cache_clear()
    x = torch.randn(3, 7)
    with pytest.raises(CKernelError) as err:
        compile_graph(trace(lambda a: a.cos() * 5, x), [x], options=C)
    msg = str(err.value)
    assert "kernel kernel0 of graph" in msg and "-fno-such-flag-for-stoker" in msg
    path = re.search(r"source: (\S+\.c)\)", msg)
    assert path is not None and os.path.exists(path.group(1)), msg
    monkeypatch.delenv("STOKER_CFLAGS")
    ccompile._identity.cache_clear()


def test_a_warm_process_compiles_nothing(tmp_path: Any) -> None:
    script = r"""
import torch, json, sys
sys.path.insert(0, HERE)
from triton_helpers import trace
from stoker_triton import compile_graph
def f(x, w):
    return torch.nn.functional.layer_norm(x, (32,), w).relu().sum(0)
x, w = torch.randn(9, 32), torch.randn(32)
fn = compile_graph(trace(f, x, w), [x, w], options={"target": "c"})
torch.testing.assert_close(fn(x, w), f(x, w), atol=1e-5, rtol=1e-4)
print(json.dumps({"cache": fn.report.cache, "ms": fn.report.timings_ms.get("c compile", 0.0)}))
""".replace("HERE", repr(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "STOKER_CACHE_DIR": str(tmp_path), "STOKER_TRITON_GRAPH_CACHE": "1"}
    env.pop("TRITON_INTERPRET", None)
    env.pop("STOKER_C_OBJECT_DIR", None)  # the objects in this cache, built by the first
    import json

    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["cache"].startswith("miss") and runs[0]["ms"] > 0, runs
    assert runs[1]["cache"] == "hit", runs
    assert list((tmp_path / "c").glob("*.so")), "no object stored"
