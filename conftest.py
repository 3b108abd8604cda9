"""Shared by every suite: each test starts from a random state fixed by its own id.

Tests draw fresh random inputs from torch's global generator.  Run serially, a test
used to see whatever state the tests before it left, so its inputs depended on the
order; under pytest-xdist (`nox -s tests` runs each suite on every core) that order
changes from run to run.  Seeding from the test's id gives each test the same inputs
whichever worker runs it, and a failure reproduces with `pytest <that test id>`.
"""

from __future__ import annotations

import random
import zlib

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
