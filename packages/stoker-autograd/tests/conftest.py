from collections.abc import Iterator

import pytest
import torch

import stoker_autograd


@pytest.fixture(autouse=True)
def _fresh_engine() -> Iterator[None]:
    """Each test starts with an empty engine cache and zeroed counters."""
    torch._C._dynamo.compiled_autograd.clear_cache()
    stoker_autograd.reset_stats()
    yield
    assert not stoker_autograd.is_enabled(), "a test left stoker_autograd enabled"
    torch._C._dynamo.compiled_autograd.clear_cache()
