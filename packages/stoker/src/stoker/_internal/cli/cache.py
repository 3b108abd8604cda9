"""``stoker cache info`` and ``stoker cache clear``: what stoker keeps on disk.

stoker's own cache is ``$STOKER_CACHE_DIR`` (default ``~/.cache/stoker``): one
folder per kind of entry (``capture/graphs``: stoker-capture's partitioned
forward and backward per Dynamo graph; ``triton/graphs``: compiled graphs, each naming its
modules in ``triton/kernels`` and ``triton/wrappers``; ``triton/autotune``; ``triton/binaries``: per kernel, the Triton binaries it launched;
``autograd/graphs``: compiled autograd's retraced backward graphs),
each file a checked `stoker_shapes.DiskCache` entry.
Triton keeps the compiled binaries in its own cache (``$TRITON_CACHE_DIR``,
default ``~/.triton/cache``), shared with every other Triton user (Inductor
too): ``info`` shows its size, ``clear --triton`` empties it as well.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TextIO

# what each folder of stoker's cache holds (`info` prints it beside the folder)
KINDS: dict[str, str] = {
    "capture/graphs": "captured graphs: a warm process skips capture and partition",
    "capture/sites": "the last captured graph's key per code site (names what a miss changed)",
    "triton/graphs": "compiled graphs: a warm process loads them instead of compiling",
    "triton/kernels": "generated kernel sources (Triton modules, the C backend's files)",
    "triton/wrappers": "generated wrapper modules",
    "triton/autotune": "max-autotune choices",
    "triton/binaries": "the Triton binary each kernel launched: a warm process loads it directly",
    "triton/compiled": "markers of kernels the compile workers built: a warm process starts none",
    "autograd/graphs": "compiled autograd's retraced backwards: a warm process skips the retrace",
    "c": "the CPU backend's C kernels: each source (.c) and its shared object (.so)",
}
PLAIN = {"c"}  # folders of plain files (not checked entries): counted, never inspected


def _versions() -> dict[str, tuple[str, str]]:
    """(kind, version) that this stoker reads each folder's entries with: an entry of
    another version (an older or newer stoker, another Triton) is a miss. Packages that
    are not installed (or fail to import) are left out: their folders are not judged."""
    import functools
    from collections.abc import Callable
    from typing import Any

    def capture(which: str) -> Any:
        from stoker_capture._internal import capcache

        return capcache.store() if which == "graphs" else capcache.sites()

    def triton(kind: str) -> Any:
        from stoker_triton._internal import graphcache
        from stoker_triton._internal.compile import xcompile
        from stoker_triton._internal.modcache import modules
        from stoker_triton._internal.runtime import autotune, warmload

        makers: dict[str, Callable[[], Any]] = {
            "graphs": graphcache.store,
            "kernels": lambda: modules.module_store("kernels"),
            "wrappers": lambda: modules.module_store("wrappers"),
            "autotune": autotune._Tuned._store,
            "binaries": warmload.store,
            "compiled": xcompile._markers,
        }
        return makers[kind]()

    def autograd() -> Any:
        from stoker_autograd._internal import graphstore

        return graphstore.store()

    makers: dict[str, Callable[[], Any]] = {
        "capture/graphs": lambda: capture("graphs"),
        "capture/sites": lambda: capture("sites"),
        "autograd/graphs": autograd,
        **{
            f"triton/{k}": functools.partial(triton, k)
            for k in ("graphs", "kernels", "wrappers", "autotune", "binaries", "compiled")
        },
    }
    out: dict[str, tuple[str, str]] = {}
    for folder, make in makers.items():
        try:
            store = make()
        except Exception:  # not installed here (stoker-triton without Triton, ...)
            continue
        out[folder] = (str(store.kind), str(store.version))
    return out


class CacheDirError(Exception):
    """A cache directory setting names something that is not a directory."""


def check_dir(root: Path, setting: str) -> None:
    """A `CacheDirError` when ``root`` (or a folder above it) exists but is not a
    directory; a directory that does not exist yet is fine (an empty cache)."""
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    if where.exists() and not where.is_dir():
        what = "is a file" if where == root else f"is under {where}, which is a file"
        default = "~/.cache/stoker" if setting == "STOKER_CACHE_DIR" else "~/.triton/cache"
        raise CacheDirError(
            f"{setting}={root} {what}, not a directory: point {setting} at a directory "
            f"(or unset it for {default})"
        )


def triton_cache_dir() -> Path:
    return Path(
        os.environ.get("TRITON_CACHE_DIR")
        or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    )


def _walk(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def info(out: TextIO | None = None) -> int:
    """Entries, bytes and broken files per folder of stoker's cache; Triton's cache size."""
    out = out or sys.stdout
    from stoker_shapes._internal.diskcache import cache_root, inspect_file

    root = cache_root()
    tri = triton_cache_dir()
    check_dir(root, "STOKER_CACHE_DIR")
    check_dir(tri, "TRITON_CACHE_DIR")
    print(f"stoker cache: {root}", file=out)
    groups: dict[str, list[Path]] = {}
    for p in _walk(root):
        groups.setdefault(str(p.parent.relative_to(root)), []).append(p)
    if not groups:
        print("  (empty)", file=out)
    current = _versions() if groups else {}
    for folder in sorted(groups):
        files = groups[folder]
        temps = [p for p in files if p.name.endswith(".tmp")]
        entries = [p for p in files if p not in temps]
        found = [inspect_file(p) for p in entries] if folder not in PLAIN else []
        broken = [f for f in found if f[2] is not None]
        want = current.get(folder)
        other = [f for f in found if f[2] is None and want is not None and f[:2] != want]
        size = sum(p.stat().st_size for p in files)
        line = f"  {folder:<20} {len(entries):>6} entries {_size(size):>10}"
        if broken or other:
            what = [f"{len(broken)} broken"] if broken else []
            what += [f"{len(other)} of another version"] if other else []
            line += f"  ({', '.join(what)}: read as misses, rewritten on the next compile)"
        if temps:
            line += f"  ({len(temps)} unfinished temporary files)"
        if folder in KINDS:
            line += f"  {KINDS[folder]}"
        print(line, file=out)
    tfiles = _walk(tri)
    print(
        f"triton cache: {tri}: {len(tfiles)} files, {_size(sum(p.stat().st_size for p in tfiles))}"
        " (compiled kernels; shared with other Triton users)",
        file=out,
    )
    return 0


def clear(triton: bool = False, out: TextIO | None = None) -> int:
    """Empty stoker's cache (and Triton's, with ``triton=True``)."""
    out = out or sys.stdout
    from stoker_shapes._internal.diskcache import cache_root

    roots = [cache_root()] + ([triton_cache_dir()] if triton else [])
    check_dir(roots[0], "STOKER_CACHE_DIR")
    if triton:
        check_dir(roots[1], "TRITON_CACHE_DIR")
    for root in roots:
        files = _walk(root)
        size = sum(p.stat().st_size for p in files)
        if root.is_dir():
            for child in root.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        print(f"cleared {root}: {len(files)} files, {_size(size)}", file=out)
    return 0
