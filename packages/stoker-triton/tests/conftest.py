"""Run every generated kernel under Triton's interpreter unless a GPU run asks otherwise.

TRITON_INTERPRET must be set before any @triton.jit function runs, so it is
set here at import time. Kernel sources go to a per-session cache dir.
"""

import os
import sys
import tempfile

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
# Under the interpreter, also compile every kernel the tests generate for an
# H100 (sm_90) with Triton's real compiler: no GPU needed, and it catches what
# the interpreter forgives. Set STOKER_TRITON_CHECK_TARGETS="" to skip.
if os.environ["TRITON_INTERPRET"] == "1":
    os.environ.setdefault("STOKER_TRITON_CHECK_TARGETS", "cuda:90")
os.environ.setdefault("STOKER_CACHE_DIR", tempfile.mkdtemp(prefix="stoker-triton-tests-"))
# pytest runs in importlib mode: make the helpers module beside this file importable
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# A native GPU run (TRITON_INTERPRET=0 with CUDA): the same tests on the device.
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0":
    torch.set_default_device("cuda")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with native Triton (TRITON_INTERPRET=0)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
