"""Generated source imported as a module, from memory: torch-free, so the compile
workers (`compile/workers.py`), which import only this, Triton and `xcompile`, start fast."""

from __future__ import annotations

import linecache
import sys
from pathlib import Path
from types import CodeType, ModuleType


def exec_module(
    name: str, path: Path | str, source: str, code: CodeType | None = None
) -> ModuleType:
    """Import `source` as module `name` whose file is `path` (a cache entry).

    The source runs from memory (no `__pycache__`, no second read of the file)
    and is registered with `linecache`, where `inspect.getsource` (hence
    `@triton.jit`) reads it: the code, its line numbers and what Triton
    hashes are the validated source's, whatever happens to the file later.
    `code`: the source's code object, compiled before (else compiled here)."""
    mod = ModuleType(name)
    mod.__file__ = str(path)
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    if code is None:
        code = compile(source, str(path), "exec")
    sys.modules[name] = mod
    try:
        exec(code, mod.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
