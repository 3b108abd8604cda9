"""Shared by every suite: each test starts from a random state fixed by its own id.

Tests draw fresh random inputs from torch's global generator.  Run serially, a test
used to see whatever state the tests before it left, so its inputs depended on the
order; under pytest-xdist (`nox -s tests` runs each suite on every core) that order
changes from run to run.  Seeding from the test's id gives each test the same inputs
whichever worker runs it, and a failure reproduces with `pytest <that test id>`.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import zlib
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_from_test_id(request: pytest.FixtureRequest) -> None:
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, tests marked ``slow`` start first (the order is otherwise kept).

    The workers take tests in collection order; a test of a minute collected near the
    end kept one worker busy alone after the other had run out of work.  Run serially,
    the order is left alone (moving a test away from its module would set up its
    module's fixtures twice)."""
    if not hasattr(config, "workerinput"):
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


SUPPORT = Path(__file__).with_name("tests-support")


def pytest_configure(config: pytest.Config) -> None:
    """Under Triton's interpreter, its reductions and scans with a combine function of
    their own run on whole blocks (tests-support/interpreter_reductions.py), not one
    element at a time: here, and (PYTHONPATH, its `sitecustomize`) in every Python
    process the tests start."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get(
        "STOKER_TEST_SLOW_REDUCE", ""
    ) not in ("", "0"):
        return
    if importlib.util.find_spec("triton") is None:
        return
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(SUPPORT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), *filter(None, paths)])
    if str(SUPPORT) not in sys.path:
        sys.path.append(str(SUPPORT))
    import interpreter_reductions

    interpreter_reductions.install()
