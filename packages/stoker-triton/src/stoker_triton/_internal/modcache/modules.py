"""Generated modules (kernels, wrappers) in the disk cache, imported from memory."""

from __future__ import annotations

import hashlib
import importlib.util
import linecache
import marshal
import os
import sys
from pathlib import Path
from types import CodeType, ModuleType

from stoker_shapes import DiskCache
from stoker_shapes._internal.diskcache import cache_root

from .srcmodule import exec_module

# Bump when the generated modules' layout changes: older entries become misses.
MODULE_FORMAT = "2"  # 2: wrappers launch by `Launcher.go(target, ...)`


def cache_dir() -> Path:
    return cache_root() / "triton"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def module_store(kind: str) -> DiskCache:
    """The cache of generated modules of one kind ("kernels", "wrappers")."""
    return DiskCache(cache_dir, kind, MODULE_FORMAT, ".py")


def load_module(kind: str, source: str) -> tuple[ModuleType, Path]:
    """Store `source` in the cache (keyed by content) and import it."""
    sha, path = store_module(kind, source)
    return import_stored(kind, sha, path, source), path


def store_module(kind: str, source: str) -> tuple[str, Path]:
    """Store `source` in the cache (keyed by content) without importing it: its
    content key and file (`import_stored` imports it when it is needed)."""
    sha = hashlib.sha256(source.encode()).hexdigest()[:24]
    mod = sys.modules.get(f"stoker_triton_{kind}_{sha}")
    if mod is not None and mod.__file__ is not None:
        return sha, Path(mod.__file__)
    store = module_store(kind)
    found = store.get_entry(sha)
    if found is not None and found[1] == source.encode():
        return sha, found[0]
    return sha, store.put(sha, source.encode())


def read_stored(kind: str, sha: str) -> tuple[Path, str] | None:
    """The file and source stored under content key ``sha``, checked (None: missing or
    broken); a module this process imported already is found as `load_stored` finds it."""
    mod = sys.modules.get(f"stoker_triton_{kind}_{sha}")
    if mod is not None and mod.__file__ is not None:
        entry = linecache.cache.get(mod.__file__)  # `exec_module` registered its source
        if entry is not None and len(entry) == 4:
            return Path(mod.__file__), "".join(entry[2])
    found = module_store(kind).get_entry(sha)
    if found is None or hashlib.sha256(found[1]).hexdigest()[:24] != sha:
        return None
    return found[0], found[1].decode()


def import_stored(kind: str, sha: str, path: Path, source: str) -> ModuleType:
    """Import a module `read_stored` returned (once per process). A wrapper's code
    object comes from the bytecode cache when an earlier process compiled it."""
    mod = sys.modules.get(f"stoker_triton_{kind}_{sha}")
    if mod is not None:
        return mod
    code = cached_code(kind, sha, path, source) if kind == "wrappers" else None
    return exec_module(f"stoker_triton_{kind}_{sha}", path, source, code)


def code_store() -> DiskCache:
    """Compiled generated modules (`marshal`), per Python bytecode version: a warm
    process loads a wrapper's code instead of compiling its source again (a
    gpt-m backward wrapper is over a thousand lines; a GPU image may have no
    bytecode cache at all, so this is the only one).

    Quiet: an entry is derived from its wrapper's source, under the same content
    key, so its miss and write follow the wrapper's own and would only repeat
    them in `STOKER_LOGS=cache`; a broken entry is still warned about."""
    tag = f"{MODULE_FORMAT}.{sys.implementation.cache_tag}.{importlib.util.MAGIC_NUMBER.hex()}"
    return DiskCache(cache_dir, "code", tag, ".bin", quiet=True)


def cached_code(kind: str, sha: str, path: Path, source: str) -> CodeType:
    """The code object of module `source` (content key `sha`, file `path`): loaded from
    `code_store`, else compiled and stored. A code object made for another file (the
    cache directory moved) or one that does not load is compiled again."""
    store = code_store()
    key = f"{kind}-{sha}"
    body = store.get(key)
    if body is not None:
        try:
            code = marshal.loads(body)
        except (EOFError, ValueError, TypeError):
            code = None
        if isinstance(code, CodeType) and code.co_filename == str(path):
            return code
    code = compile(source, str(path), "exec")
    store.put(key, marshal.dumps(code))
    return code


def load_stored(kind: str, sha: str) -> tuple[ModuleType, Path] | None:
    """Import the module stored under content key ``sha`` (None: missing or broken)."""
    name = f"stoker_triton_{kind}_{sha}"
    mod = sys.modules.get(name)
    if mod is not None and mod.__file__ is not None:
        return mod, Path(mod.__file__)
    found = read_stored(kind, sha)
    if found is None:
        return None
    return import_stored(kind, sha, *found), found[0]
