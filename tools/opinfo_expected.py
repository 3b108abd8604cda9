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

# Ops not run at all.
SKIP: dict[str, str] = {}

# Ops that run and are known to fail, with why.
XFAIL: dict[str, str] = {}
