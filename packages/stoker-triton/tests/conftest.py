"""Native kernels on a machine with CUDA, Triton's interpreter elsewhere.

TRITON_INTERPRET must be set before any @triton.jit function runs, so it is
chosen here at import time (`triton_mode.select_triton_mode`: unset means
native with CUDA, the interpreter without; TRITON_INTERPRET=1 forces the
interpreter). Kernel sources go to a per-session cache dir.
"""

import os
import sys
import tempfile

import pytest
import torch

# pytest runs in importlib mode: make the helpers modules beside this file importable
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from triton_mode import select_triton_mode

select_triton_mode(os.environ, torch.cuda.is_available())
os.environ.setdefault("STOKER_CACHE_DIR", tempfile.mkdtemp(prefix="stoker-triton-tests-"))


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
