"""The dtype sweep: every lowering rule, in every dtype it takes, forward and
backward, with every generated kernel compiled for an H100 (sm_90) by
Triton's real compiler and run under the interpreter against eager.

What the GPU would refuse to compile (an op on bfloat16 that PTX only has
for fp32, an atomic on int8) fails here on a CPU. Samples live in
dtype_sweep_samples.py, the machinery in dtype_sweep.py; docs/triton.md
("The dtype sweep") says what it covers and what it costs.

`KNOWN` is a strict list: a failure not in it fails the test, and so does an
entry that passes (remove it) or fails for another reason. Under the
interpreter it includes `INTERPRETER_LIMITS` (kernels that compile for sm_90
but that Triton's interpreter cannot run).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import triton
from dtype_sweep import ALL, Outcome, registered_packets, sweep
from dtype_sweep_samples import NO_CPU_SAMPLE, SAMPLES
from triton_helpers import device

from stoker_triton._internal.compile import xcompile

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])

# (sample id, dtype, phase) -> (why it fails, a regex its error matches)
KNOWN: dict[tuple[str, str, str], tuple[str, str]] = {}

ACCUMULATING = ("aten::index_put[accumulate]", "aten::scatter.reduce")
ACCUMULATING += ("aten::scatter.value_reduce", "aten::scatter_add")

# Triton interpreter limits: the kernel compiles for sm_90 (cross-compiled before
# its launch), but Triton 3.9's interpreter cannot run it, so values are unchecked.
# A native GPU run expects them to pass.
INTERPRETER_LIMITS: dict[tuple[str, str, str], tuple[str, str]] = {}
_NO_BF16_ATOMICS = "the interpreter has no bfloat16 atomic_add (NumPy has no bfloat16)"
for _sid in ACCUMULATING:
    INTERPRETER_LIMITS[_sid, "bfloat16", "forward"] = (_NO_BF16_ATOMICS, "Unsupported data type")
for _sid in ("gather", "index_select", "index.Tensor", "index.Tensor[dim1]"):
    INTERPRETER_LIMITS[f"aten::{_sid}", "bfloat16", "backward"] = (
        _NO_BF16_ATOMICS,
        "Unsupported data type",
    )
for _sid in ("aten::index_put[accumulate]", "aten::scatter_add"):
    INTERPRETER_LIMITS[_sid, "bfloat16", "backward"] = (
        _NO_BF16_ATOMICS,
        "Unsupported data type",
    )
if _TRITON > (3, 6):  # Triton 3.6's interpreter casts it right (`nox -s compat`)
    INTERPRETER_LIMITS["aten::bernoulli.p", "bfloat16", "forward"] = (
        "the interpreter's bool -> float32 cast (create_ui_to_fp) mis-sizes its result",
        "cannot reshape array of size 16 into shape",
    )

if INTERPRET:
    KNOWN.update(INTERPRETER_LIMITS)

KINDS = sorted({s.kind for s in SAMPLES})


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def test_every_lowering_rule_has_a_sample():
    sampled = {s.packet for s in SAMPLES}
    missing = registered_packets() - sampled - set(NO_CPU_SAMPLE)
    assert not missing, (
        f"lowering rules with no sample in dtype_sweep_samples.py: {sorted(missing)}"
    )
    stale = (sampled | set(NO_CPU_SAMPLE)) - registered_packets()
    assert not stale, f"samples of ops that have no lowering rule: {sorted(stale)}"
    assert not set(NO_CPU_SAMPLE) & sampled, "an op both sampled and listed as unsampleable"


def test_samples_are_distinct_and_call_registered_overloads():
    ids = [s.id for s in SAMPLES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert all(s.kind != "unregistered" for s in SAMPLES), [
        s.id for s in SAMPLES if s.kind == "unregistered"
    ]


def test_known_failures_name_real_samples():
    by_id = {s.id: s for s in SAMPLES}
    for (sid, dt, phase), (reason, pattern) in {**KNOWN, **INTERPRETER_LIMITS}.items():
        assert sid in by_id, f"KNOWN names no sample {sid!r}"
        assert dt in {_name(d) for d in by_id[sid].dtypes}, f"{sid}: not swept in {dt}"
        assert phase in ("forward", "backward") and reason and re.compile(pattern)


def _check(outcomes: list[Outcome], kind: str) -> list[str]:
    """Problems: new failures, known failures that pass or fail otherwise, stale entries."""
    problems = []
    seen = set()
    for o in outcomes:
        seen.add(o.key)
        known = KNOWN.get(o.key)
        if o.error is None and known is not None:
            problems.append(f"{o.key}: passes now; remove it from KNOWN ({known[0]})")
        elif o.error is not None and known is None:
            problems.append(f"{o.key}: {o.error}")
        elif o.error is not None and known is not None and not re.search(known[1], o.error):
            problems.append(f"{o.key}: fails otherwise than KNOWN says ({known[1]!r}): {o.error}")
    kind_ids = {s.id for s in SAMPLES if s.kind == kind}
    for key in KNOWN:
        if key[0] in kind_ids and key not in seen:
            problems.append(f"{key}: in KNOWN but did not run (eager lacks it, or no gradient)")
    return problems


@pytest.mark.parametrize("kind", KINDS)
def test_dtype_sweep(kind, monkeypatch):
    if INTERPRET:  # every kernel also goes through Triton's compiler for an H100
        monkeypatch.setenv(xcompile.ENV, "cuda:90")
    samples = [s for s in SAMPLES if s.kind == kind]
    outcomes, eager_lacks = sweep(samples, ALL, torch.device(device()), alone=set(KNOWN))
    for dt in ALL:
        mine = [o for o in outcomes if o.dtype == dt]
        print(
            f"\n{kind} {_name(dt)}: {sum(o.phase == 'forward' for o in mine)} forward, "
            f"{sum(o.phase == 'backward' for o in mine)} backward, "
            f"{sum(o.error is not None for o in mine)} failures"
        )
    problems = _check(outcomes, kind)
    problems += [
        f"{case}: eager cannot run it ({err}); take the dtype out of the sample's dtypes"
        for case, err in eager_lacks.items()
    ]
    assert not problems, "\n".join(problems)
