"""`frozen_heap`: the heap alive at its start frozen while the body runs, given back after."""

from __future__ import annotations

import gc
import weakref

import pytest

from stoker_shapes._internal.gcfreeze import frozen_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _collector_on():  # type: ignore[no-untyped-def]
    was = gc.isenabled()
    gc.enable()
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()
    if not was:
        gc.disable()


def test_frozen_inside_given_back_after() -> None:
    before = _Cycle()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        with frozen_heap():  # nested: one freeze, given back by the outermost
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0
        made = _Cycle()
        ref_made = weakref.ref(made)
        del made
        gc.collect()
        assert ref_made() is None  # what the body made is collected as before
    assert gc.get_freeze_count() == 0
    ref = weakref.ref(before)
    del before
    gc.collect()
    assert ref() is None  # the frozen objects' garbage is collected after


def test_given_back_on_error() -> None:
    with pytest.raises(ValueError), frozen_heap():
        raise ValueError("boom")
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_its_heap_is_left_alone() -> None:
    gc.freeze()
    n = gc.get_freeze_count()
    with frozen_heap():
        pass
    assert gc.get_freeze_count() == n  # not unfrozen by stoker
    gc.unfreeze()


def test_collector_off_is_left_alone() -> None:
    gc.disable()
    try:
        with frozen_heap():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("collect", [False, True])
def test_collect_first_freezes_no_garbage(collect: bool) -> None:
    # cyclic garbage made before the freeze: frozen with it unless collected first
    gc.collect()
    garbage = _Cycle()
    ref = weakref.ref(garbage)
    del garbage
    with frozen_heap(collect=collect):
        gc.collect()  # a collection inside walks only what was not frozen
        assert (ref() is None) is collect
