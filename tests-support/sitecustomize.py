"""Loaded at start-up by every Python process the tests start (the root conftest puts
this folder first on their PYTHONPATH):

- under Triton's interpreter, the whole-block reductions and scans of
  `interpreter_reductions` are installed as soon as the process imports Triton's
  interpreter, as in the test process itself; nothing is imported before that;
- with `STOKER_TEST_PRELOAD` set (by the root conftest), the process hands its program to
  a server that has torch imported and exits with its status (`preload`), or, where
  that could show, goes on and starts for real."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_TARGET = "triton.runtime.interpreter"


class _AfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of Triton's interpreter module so that
    `interpreter_reductions.install` runs right after the module is executed."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # once, and not for the lookup below
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec: Any = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            import interpreter_reductions

            interpreter_reductions.install()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("STOKER_TEST_SLOW_REDUCE", "") in (
    "",
    "0",
):
    sys.meta_path.insert(0, _AfterLoad())

if os.environ.get("STOKER_TEST_PRELOAD", "") not in ("", "0"):
    import preload

    preload.client()  # exits here if a server ran this process's program
