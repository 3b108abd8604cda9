"""Expected outcomes of the OpInfo sweep (tools/opinfo_sweep.py), one reason per op.

Keys are OpInfo names (`name` or `name.variant`).  Keep every entry honest:
the sweep prints "expected to fail but passed" when an entry is stale.
"""

from __future__ import annotations

# Random ops: values differ from eager by design (the compiled graph draws
# its own random numbers); shapes, dtypes and gradient shapes are still checked.
RANDOM: dict[str, str] = {
    name: "random output: only shapes and dtypes are compared"
    for name in [
        "bernoulli",
        "normal",
        "normal.number_mean",
        "normal.in_place",
        "rand_like",
        "randn_like",
        "randint_like",
        "randint",
        "multinomial",
        "uniform",
        "exponential",
        "cauchy",
        "geometric",
        "log_normal",
        "nn.functional.dropout",
        "nn.functional.dropout2d",
        "nn.functional.dropout3d",
        "nn.functional.alpha_dropout",
        "nn.functional.feature_alpha_dropout.with_train",
        "nn.functional.feature_alpha_dropout.without_train",
        "nn.functional.rrelu",
        "nn.functional.fractional_max_pool2d",
        "nn.functional.fractional_max_pool3d",
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
        "torch.empty",
        "randn",
        "rand",
    ]
}
RANDOM["nn.functional.multi_head_attention_forward"] = (
    "samples use dropout (random): only shapes and dtypes are compared"
)


def sample_is_random(key: str, kwargs: dict[str, object]) -> bool:
    """A sample of a deterministic op that draws random numbers: compare shapes only.

    scaled_dot_product_attention (and ops like it) take ``dropout_p``; with
    ``dropout_p > 0`` the compiled graph's dropout mask differs from eager's.
    """
    p = kwargs.get("dropout_p", 0.0)
    return isinstance(p, float) and p > 0.0


# Ops not run at all.
SKIP: dict[str, str] = {}

_DATA_VALUE = (
    "data-dependent value: the result is a Python scalar or a branch on tensor data, "
    "which a graph cannot capture (export raises DataDependentError)"
)
_DATA_SHAPE = "data-dependent output shape (unbacked size): not supported by capture yet"

# Ops that run and are known to fail, with why.
XFAIL: dict[str, str] = {
    # data-dependent values
    "allclose": _DATA_VALUE,
    "equal": _DATA_VALUE,
    "corrcoef": _DATA_VALUE + " (aten.equal inside)",
    "cov": _DATA_VALUE + " (aten.equal inside)",
    "nn.functional.gaussian_nll_loss": _DATA_VALUE + " (checks var >= 0 in Python)",
    # data-dependent shapes
    "tensor_split": _DATA_SHAPE + " (split points given as a tensor): outputs are views "
    "whose sizes no input determines",
    "narrow": _DATA_SHAPE + " (start given as a tensor): the output is a view whose size "
    "no input determines",
    "nn.functional.ctc_loss": _DATA_SHAPE + " (aten._ctc_loss has no fake kernel)",
    "linalg.lstsq": _DATA_SHAPE + " (aten.linalg_lstsq has no fake kernel)",
    "linalg.lstsq.grad_oriented": _DATA_SHAPE + " (aten.linalg_lstsq has no fake kernel)",
    # layouts and dtypes capture does not handle
    "sparse.sampled_addmm": "sparse CSR inputs: capture supports strided tensors only",
    "sparse.mm.reduce": "sparse CSR inputs: capture supports strided tensors only",
    "to_sparse": "sparse outputs: capture supports strided tensors only",
}

_INTERP_BF16_ATOMICS = (
    "Triton's interpreter has no bfloat16 atomics (NumPy has no bfloat16): the "
    "scatter kernel (a gather's or index's backward, or the op itself) compiles "
    "for sm_90 but cannot run here; a GPU run checks its values"
)
_BF16_TYPED_AS_F32 = (
    "a value typed float32 in the IR loads a bfloat16 buffer (the running statistics "
    "written in place), so the kernel casts with `_to_bf16`: the GPU build's plain "
    "cast compiles, the interpreter's bit-rounding refuses a 16-bit value (lowering)"
)
_EAGER_NO_BF16_BACKWARD = (
    "eager has no bfloat16 {}_backward on the CPU; capture traces the backward ahead "
    "of time and fails where eager's backward would"
)
_EAGER_NO_HALF_BACKWARD = _EAGER_NO_BF16_BACKWARD.replace("bfloat16", "float16")

# Known failures in one dtype only (`--dtype`), by dtype name.
XFAIL_BY_DTYPE: dict[str, dict[str, str]] = {
    "bfloat16": {
        **{
            name: _INTERP_BF16_ATOMICS
            for name in [
                "cummax",
                "cummin",
                "gather",
                "index_select",
                "index_add",
                "index_reduce.mean",
                "index_reduce.prod",
                "index_reduce.amin",
                "index_reduce.amax",
                "_unsafe_masked_index",
                "_unsafe_masked_index_put_accumulate",
                "__getitem__",
                "scatter_add",
                "take_along_dim",
                "scatter_reduce.prod",
                "scatter_reduce.mean",
                "scatter_reduce.amin",
                "scatter_reduce.amax",
            ]
        },
        "_batch_norm_with_update": _BF16_TYPED_AS_F32,
        "special.i1": _EAGER_NO_BF16_BACKWARD.format("i1"),
        "special.i1e": _EAGER_NO_BF16_BACKWARD.format("i1e"),
    },
    "float16": {
        "special.i1": _EAGER_NO_HALF_BACKWARD.format("i1"),
        "special.i1e": _EAGER_NO_HALF_BACKWARD.format("i1e"),
    },
}
