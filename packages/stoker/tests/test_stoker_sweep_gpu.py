"""The training sweeps' cases natively on CUDA with stoker's Triton executor.

Our first H100 run found stoker wrong under bf16 autocast and FSDP2 on CUDA where the CPU
sweeps (aten executor, a few cases interpreted) passed: the same cases, through the same
harness (`sweep_cases.run_case(..., device="cuda", backend="triton")`), against eager on
the GPU with TF32 off, each over a few optimizer steps.  One autograd mode per case,
rotating (as the dynamic sweep's heavier models do), small shapes: the GPU subset takes
well under 3 minutes on an H100.  `bash tools/gpu_check.sh sweep` runs it (the `tests`
step leaves this file to it).  On the CPU the same cases run through the device parameter
with the aten executor, which checks the cases and the plumbing without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import test_stoker_sweep_dynamic as dy
import test_stoker_sweep_training as tr
import torch
from sweep_cases import MLP, Batch, Case, backward_step, mlp_batch, run_case, to_device

fresh_stoker = tr.fresh_stoker  # the training sweep's autouse fixture, shared
NATIVE = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
native_only = pytest.mark.skipif(
    not NATIVE, reason="needs a CUDA GPU with native Triton (TRITON_INTERPRET unset or 0)"
)


def _bt(b: int, t: int) -> tuple[int, ...]:
    """(B, T) sizes: T changes, then B, then both past any seen (packed by `dy.bt`)."""
    return dy.bt(b, t), dy.bt(b, t + 2), dy.bt(b + 1, t + 2), dy.bt(b + 2, t + 7)


# name -> the case; the training sweep's situations first, then the dynamic sweep's
CASES: dict[str, Callable[[], Case]] = {
    "bf16_autocast": lambda: Case(tr.Checkpointed, mlp_batch, tr.bf16_autocast_step, bf16=True),
    "fp16_autocast_grad_scaler": lambda: Case(
        tr.Checkpointed, mlp_batch, tr.fp16_grad_scaler_step, bf16=True
    ),
    "custom_function": lambda: Case(tr.CustomFn, mlp_batch, backward_step),
    "custom_function_no_grad": tr.fn_inside_case,
    "hooks": tr.hooks_case,
    "checkpoint_retain_graph": tr.retain_graph_case,
    "several_outputs": tr.multi_out_case,
    "batchnorm_batch_sizes": lambda: Case(tr.BN, mlp_batch, backward_step, (4, 6, 3, 6)),
    "norm_layers": lambda: Case(tr.Norms, mlp_batch, backward_step, (4, 6, 4)),
    "cnn_channels_last": lambda: Case(tr.ConvNet, tr.channels_last_batch, backward_step),
    "strided_inputs": tr.strided_case,
    "dynamic_mlp_batch": lambda: dy.sweep_case(
        MLP, dy.mlp_batch, dy.mse_input_grad_step, (4, 6, 3, 6, 4, 33), "dynamic_true"
    ),
    "dynamic_micro_batches": lambda: dy.sweep_case(
        MLP, dy.mlp_batch, dy.accumulate_step, (11, 10, 12, 7), "automatic"
    ),
    "dynamic_gpt_block_sdpa": lambda: dy.sweep_case(
        dy.Block, dy.seq_batch, dy.lm_step, _bt(2, 5), "dynamic_true", "adamw_eps"
    ),
    "dynamic_gpt_block_masked_softmax": lambda: dy.sweep_case(
        lambda: dy.Block(sdpa=False), dy.seq_batch, dy.lm_step, _bt(2, 5), "mark_batch", "adamw_eps"
    ),
    "dynamic_gpt_block_bf16_autocast": dy.bf16_gpt_case,
    "dynamic_cnn": lambda: dy.sweep_case(
        tr.ConvNet, dy.image_batch, dy.mse_input_grad_step, _bt(2, 6), "dynamic_true"
    ),
    "dynamic_masks": lambda: dy.sweep_case(
        dy.Masked, dy.masked_batch, dy.multi_out_step, dy.SEQ_SIZES, "dynamic_true"
    ),
    "dynamic_torch_compile": lambda: dy.sweep_case(
        dy.Reductions, dy.seq_features, dy.multi_out_step, dy.SEQ_SIZES, "torch_compile"
    ),
}
# the structural cases again with the batch dynamic
for _name in ("hooks", "custom_function", "checkpoint_retain_graph", "batchnorm_batch_sizes"):

    def _dynamic(make: Callable[[], Case] = CASES[_name]) -> Case:
        case = make()
        case.batch_sizes, case.compile_kw = (4, 6, 3, 9), {"dynamic": True}
        return case

    CASES[f"dynamic_{_name}"] = _dynamic

MODE_OF = {name: dy.MODE_NAMES[i % 3] for i, name in enumerate(CASES)}


def _run(name: str, device: str, backend: str) -> None:
    rep = dy.report_of(run_case(CASES[name](), backend, MODE_OF[name], device=device))
    assert rep.compiles and {c.executor for c in rep.compiles} == {backend}, rep.compiles


@pytest.mark.gpu
@native_only
@pytest.mark.parametrize("name", sorted(CASES))
def test_sweep_case_on_cuda_with_triton(name: str) -> None:
    _run(name, "cuda", "triton")


@pytest.mark.gpu
@native_only
@pytest.mark.parametrize(("mode", "budget"), [("ca", None), ("no_ca", 0.0), ("ca_paused", None)])
def test_dropout_mask_on_cuda_with_triton(mode: str, budget: float | None) -> None:
    tr.check_dropout_mask(mode, budget, device="cuda", backend="triton")


# --- the plumbing on the CPU --------------------------------------------------------------


def test_the_gpu_subset_covers_the_situations_asked_for() -> None:
    """bf16 / fp16 autocast (+ GradScaler), dynamic batch and sequence, custom Functions,
    hooks, checkpointing, BatchNorm, the GPT block, the CNN; every mode."""
    want = {
        "bf16_autocast",
        "fp16_autocast_grad_scaler",
        "dynamic_gpt_block_bf16_autocast",
        "dynamic_mlp_batch",
        "dynamic_gpt_block_sdpa",
        "custom_function",
        "hooks",
        "checkpoint_retain_graph",
        "batchnorm_batch_sizes",
        "cnn_channels_last",
        "dynamic_cnn",
        "dynamic_hooks",
    }
    assert want <= CASES.keys(), want - CASES.keys()
    assert set(MODE_OF.values()) == {"ca", "no_ca", "ca_paused"}
    for name, make in CASES.items():
        case = make()
        assert isinstance(case, Case) and len(case.batch_sizes) >= 3, name
    assert CASES["dynamic_hooks"]().compile_kw == {"dynamic": True}
    assert CASES["hooks"]().compile_kw == {}  # the loop's closures bound their own case


def test_to_device_moves_tensors_keeping_layout_and_requires_grad() -> None:
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    base = torch.randn(6, 12)
    views = [base.t(), base[:1].expand(6, 12), base[:, 3:9]]
    batch = (x, torch.arange(3), 5, *views)
    assert to_device(batch, "cpu") is batch  # the CPU sweep's own objects
    moved = to_device(batch, "meta")
    assert [t.device.type for t in moved if isinstance(t, torch.Tensor)] == ["meta"] * 5
    assert moved[2] == 5 and moved[0].requires_grad and not moved[1].requires_grad
    for a, b in zip(moved, batch):
        if isinstance(b, torch.Tensor):
            assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (
                b.shape,
                b.stride(),
                b.storage_offset(),
                b.dtype,
            )


@pytest.mark.parametrize("name", sorted(CASES))
def test_sweep_case_through_the_device_parameter_on_cpu(name: str) -> None:
    """The GPU subset's cases as the GPU runs them, on the CPU with the aten executor."""
    _run(name, "cpu", "aten")


def _flags_seen(device: str, backend: str) -> set[tuple[bool, bool]]:
    """(matmul, cuDNN) TF32 flags each step of a case saw."""
    seen: set[tuple[bool, bool]] = set()

    def step(model: Any, params: dict[str, torch.nn.Parameter], b: Batch) -> Any:
        seen.add((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        return backward_step(model, params, b)

    run_case(Case(MLP, mlp_batch, step, (3,)), backend, device=device)
    return seen


def test_the_cpu_path_leaves_the_tf32_flags_alone() -> None:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    assert _flags_seen("cpu", "aten") == {before}


@pytest.mark.gpu
@native_only
def test_cuda_runs_with_tf32_off_and_restores_the_flags() -> None:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        assert _flags_seen("cuda", "triton") == {(False, False)}
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
