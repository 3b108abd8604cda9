from collections.abc import Iterator

import pytest
import torch

import stoker_autograd


@pytest.fixture(autouse=True)
def _fresh_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test starts with an empty engine cache, zeroed counters and an empty
    disk cache (a backward compiled by an earlier test is not loaded)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("STOKER_CACHE_DIR", str(tmp_path_factory.mktemp("stoker-cache")))
    torch._C._dynamo.compiled_autograd.clear_cache()
    stoker_autograd.reset_stats()
    yield
    mp.undo()
    assert not stoker_autograd.is_enabled(), "a test left stoker_autograd enabled"
    torch._C._dynamo.compiled_autograd.clear_cache()
