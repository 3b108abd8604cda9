"""`stoker_shapes.timing`: stage marks reach the listener, and nothing happens without one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stoker_shapes import timing


@pytest.fixture
def heard() -> Iterator[list[tuple[str, str, int, int, str]]]:
    got: list[tuple[str, str, int, int, str]] = []
    prior = timing.listen(lambda *a: got.append(a))
    yield got
    timing.listen(prior)


def test_marks_reach_the_listener_in_end_order(heard: list[tuple[str, str, int, int, str]]) -> None:
    with timing.timed("capture", "outer", graph="g0"):
        t0 = timing.start()
        timing.done("partition", t0)
    with pytest.raises(ValueError), timing.timed("codegen"):
        raise ValueError("ended by an exception: still marked")
    assert [(s, n, g) for s, n, _, _, g in heard] == [
        ("partition", "partition", ""),
        ("capture", "outer", "g0"),
        ("codegen", "codegen", ""),
    ]
    (_, _, a0, a1, _), (_, _, b0, b1, _) = heard[0], heard[1]
    assert b0 <= a0 <= a1 <= b1, "the inner mark lies inside the outer one"


def test_nobody_listening_costs_nothing_and_records_nothing() -> None:
    prior = timing.listen(None)
    try:
        assert not timing.listening() and timing.start() == 0
        timing.done("capture", 0)  # no listener, no start: nothing to call
        with timing.timed("capture"):
            pass
    finally:
        timing.listen(prior)


def test_every_stage_has_a_label() -> None:
    assert all(isinstance(v, str) and v for v in timing.STAGES.values())
    assert {"dynamo", "capture", "partition", "codegen", "run forward", "run backward"} <= set(
        timing.STAGES
    )
