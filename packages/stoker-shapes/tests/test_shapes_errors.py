"""Bad input gets a clear error naming the source (and the op and line, where one exists)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from stoker_shapes import (
    DataDependentError,
    Dim,
    GuardSet,
    ShapeContext,
    ShapeInputError,
    Source,
    SpecializationError,
    StokerShapesError,
)

Tracer = Callable[..., Any]


def test_unsupported_input_type_names_the_source() -> None:
    ctx = ShapeContext()
    with pytest.raises(ShapeInputError, match=r"kwargs\['cfg'\]\[1\]: inputs of type object"):
        ctx.fakeify([1, object()], Source.kwarg("cfg"))


def test_tensor_subclass_is_rejected_with_a_fix() -> None:
    class MyT(torch.Tensor):
        pass

    t = torch.randn(2).as_subclass(MyT)
    with pytest.raises(ShapeInputError, match=r"args\[0\]: tensor subclass MyT.*as_subclass"):
        ShapeContext().fakeify(t, Source.arg(0))


def test_dim_min_greater_than_max() -> None:
    with pytest.raises(ShapeInputError, match=r"Dim 'batch': min=8 > max=4"):
        Dim("batch", min=8, max=4)


def test_size_outside_dim_range() -> None:
    with pytest.raises(ShapeInputError, match=r"args\[0\].size\(\)\[0\] = 100 is outside"):
        ShapeContext().fakeify(torch.randn(100), Source.arg(0), {0: Dim("n", max=64)})


def test_dynamic_spec_for_wrong_rank() -> None:
    with pytest.raises(ShapeInputError, match=r"args\[0\]: dynamic spec names dims \[2\]"):
        ShapeContext().fakeify(torch.randn(3, 4), Source.arg(0), {2: Dim("n")})


def view_as_eight_rows(x: torch.Tensor) -> torch.Tensor:
    return x.view(8, 4) * 2


def test_specialized_dim_names_op_and_line(trace: Tracer) -> None:
    ctx = ShapeContext()
    trace(ctx, view_as_eight_rows, torch.randn(8, 4), dynamic=[{0: Dim("batch")}])
    with pytest.raises(SpecializationError) as err:
        ctx.check_dims()
    msg = str(err.value)
    assert "Dim('batch') on args[0].size()[0] was specialized to the constant 8" in msg
    assert "aten.view.default" in msg
    assert "test_shapes_errors.py" in msg and "x.view(8, 4)" in msg
    assert "Remove the Dim" in msg


def test_narrowed_dim_is_an_error_only_when_strict(trace: Tracer) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] > 10 else x

    ctx = ShapeContext()
    trace(ctx, f, torch.randn(16), dynamic=[{0: Dim("n")}])
    ctx.check_dims(strict=False)
    with pytest.raises(SpecializationError, match=r"only supports sizes in \[11, "):
        ctx.check_dims(strict=True)


def test_dim_without_max_narrowed_from_above_is_an_error_when_strict(trace: Tracer) -> None:
    """No max: the range is unbounded (int_oo, which says it is finite but has no int
    value); a branch that caps it is reported, an unbranched trace is not."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] < 100 else x

    ctx = ShapeContext()
    trace(ctx, f, torch.randn(16), dynamic=[{0: Dim("n")}])
    with pytest.raises(SpecializationError, match=r"only supports sizes in \[2, 99\]"):
        ctx.check_dims(strict=True)
    ctx = ShapeContext()
    trace(ctx, lambda x: x * 2, torch.randn(16), dynamic=[{0: Dim("n")}])
    ctx.check_dims(strict=True)


def branch_on_data(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:
        return x
    return -x


def test_data_dependent_branch_names_the_line(trace: Tracer) -> None:
    ctx = ShapeContext()
    with pytest.raises(DataDependentError) as err:
        trace(ctx, branch_on_data, torch.randn(4))
    msg = str(err.value)
    assert "test_shapes_errors.py" in msg and "if x.sum() > 0" in msg
    assert "torch.cond" in msg


@pytest.mark.parametrize(
    "text",
    ["", "not json", '{"format": "stoker-guards", "version": 99}', '{"format": "other"}'],
)
def test_bad_guard_json_is_a_clear_error(text: str) -> None:
    with pytest.raises(StokerShapesError, match="guard JSON"):
        GuardSet.from_json(text)
