"""Shared by every suite: each test starts from a random state fixed by its own id.

Tests draw fresh random inputs from torch's global generator.  Run serially, a test
used to see whatever state the tests before it left, so its inputs depended on the
order; under pytest-xdist (`nox -s tests` runs each suite on every core) that order
changes from run to run.  Seeding from the test's id gives each test the same inputs
whichever worker runs it, and a failure reproduces with `pytest <that test id>`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

# The C backend's objects are keyed by their source, the compiler, its flags and the CPU,
# so the tests share one folder of them (many tests, each with a cache folder of its
# own, compile the same small kernels): each distinct kernel is built once per machine.
# A test that checks what a cold cache builds sets its own (or removes the variable).
os.environ.setdefault(
    "STOKER_C_OBJECT_DIR", os.path.join(tempfile.gettempdir(), f"stoker-test-c-{os.getuid()}")
)


@pytest.fixture(autouse=True)
def _seed_from_test_id(request: pytest.FixtureRequest) -> None:
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


# torch's structured trace (TORCH_TRACE) is formatted only when its logger has a handler:
# torch's own idle one removes itself on the first record when TORCH_TRACE is unset.
# pytest's logging plugin attaches its capture handlers to every logger that does not
# propagate, this one too, so under pytest every trace record of a compile (each symbol
# and guard with its stack, graphs printed) was built and captured, for nobody: about
# 7 % of a compile's time.  Each test phase starts without them on this logger.
_TORCH_TRACE_LOG = logging.getLogger("torch.__trace")


def _without_pytest_trace_handlers() -> None:
    for handler in list(_TORCH_TRACE_LOG.handlers):
        if type(handler).__module__ == "_pytest.logging":
            _TORCH_TRACE_LOG.removeHandler(handler)


@pytest.hookimpl(wrapper=True, trylast=True)  # inside the logging plugin's own wrapper
def pytest_runtest_setup(item: pytest.Item) -> object:
    _without_pytest_trace_handlers()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    _without_pytest_trace_handlers()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    _without_pytest_trace_handlers()
    return (yield)


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
    """tests-support/ goes first on the PYTHONPATH of every Python process the tests start,
    so that its `sitecustomize` runs there:

    - under Triton's interpreter, its reductions and scans with a combine function of their
      own run on whole blocks (tests-support/interpreter_reductions.py), not one element at
      a time: here, and in those processes;
    - those processes are forked from servers that have already imported torch
      (tests-support/preload.py), started here for the session: the controller's, whose
      environment the workers and their processes inherit."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(SUPPORT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), *filter(None, paths)])
    if str(SUPPORT) not in sys.path:
        sys.path.append(str(SUPPORT))
    if (
        os.environ.get("TRITON_INTERPRET") == "1"
        and os.environ.get("STOKER_TEST_SLOW_REDUCE", "") in ("", "0")
        and importlib.util.find_spec("triton") is not None
    ):
        import interpreter_reductions

        interpreter_reductions.install()
    if not hasattr(config, "workerinput") and "STOKER_TEST_PRELOAD" not in os.environ:
        import preload

        where = tempfile.mkdtemp(prefix="stoker-preload-")
        config.stash[_PRELOAD] = (where, preload.start_servers(where))
        os.environ[preload.ENV] = where


_PRELOAD = pytest.StashKey[tuple[str, list[subprocess.Popen[bytes]]]]()


def pytest_unconfigure(config: pytest.Config) -> None:
    started = config.stash.get(_PRELOAD, None)
    if started is None:
        return
    where, servers = started
    os.environ.pop("STOKER_TEST_PRELOAD", None)
    for server in servers:
        server.terminate()
    for server in servers:
        server.wait()
    shutil.rmtree(where, ignore_errors=True)
