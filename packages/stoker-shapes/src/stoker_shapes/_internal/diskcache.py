"""Files on disk that a crash, a full disk or a second process cannot break.

Every on-disk cache in stoker goes through `DiskCache`; user files
(``ExportedGraph.save``) go through `atomic_write`.

Rules (each a test in ``tests/test_shapes_diskcache.py``):

| what happens | what the cache does |
|---|---|
| write | a unique temporary file in the same directory, then ``os.replace``: a reader sees the old entry, the new one, or none; never half of one |
| two processes write one key | both succeed; the last rename wins; both wrote the same content |
| read: the file is missing | a miss |
| read: empty, truncated, random bytes, another format or version, a checksum that does not match | a miss: one warning naming the file (once per file and process); the caller recompiles and the next `put` rewrites it |
| write: the directory is read-only (or the disk is full) | one warning naming the cache root; the entry goes to a private temporary directory for the rest of the process, so the run still succeeds |

An entry is one header line then the body::

    # stoker-cache <kind> <version> <sha256 of the body>\\n<body>

The header is a comment, so a cached Python module stays importable as it is.
Logs go to the ``stoker.cache`` logger (``STOKER_LOGS=cache``): a warning per
broken file, INFO for misses and writes, DEBUG for hits.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("stoker.cache")
QUIET = logging.DEBUG - 5  # the level of a quiet cache's hits, misses and writes

_MAGIC = b"# stoker-cache "
_lock = threading.Lock()
_warned: set[str] = set()  # files and directories already warned about, once per process
_fallback_dir: Path | None = None


def cache_root() -> Path:
    """stoker's cache directory: ``$STOKER_CACHE_DIR``, else ``~/.cache/stoker``."""
    root = os.environ.get("STOKER_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "stoker"
    )
    return Path(root)


def _split(data: bytes) -> tuple[str, str, bytes] | str:
    """(kind, version, body) of a sound entry (header and checksum), else what is wrong."""
    if not data:
        return "empty file"
    nl = data.find(b"\n")
    if not data.startswith(_MAGIC) or nl < 0:
        return "not a stoker cache entry: corrupt or written by an older stoker"
    parts = data[len(_MAGIC) : nl].decode(errors="replace").split(" ")
    if len(parts) != 3:
        return "a malformed header"
    body = data[nl + 1 :]
    if hashlib.sha256(body).hexdigest() != parts[2]:
        return "checksum mismatch: truncated or corrupt"
    return parts[0], parts[1], body


def inspect_file(path: str | os.PathLike[str]) -> tuple[str, str, str | None]:
    """(kind, version, problem) of a cache file; problem is None for a sound entry
    (whether its version is current is the reader's call)."""
    try:
        got = _split(Path(path).read_bytes())
    except OSError as e:
        return "?", "?", f"unreadable: {e}"
    return ("?", "?", got) if isinstance(got, str) else (got[0], got[1], None)


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``.

    Raises `OSError` (read-only directory, full disk); on any error the
    temporary file is removed and ``path`` is left as it was.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def warn_once(key: str, msg: str, *args: object) -> None:
    """Log ``msg`` as a warning the first time ``key`` is seen in this process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(msg, *args)


def _private_dir() -> Path:
    """Where entries go when the cache directory cannot be written (one per process)."""
    global _fallback_dir
    with _lock:
        if _fallback_dir is None:
            import atexit

            _fallback_dir = Path(tempfile.mkdtemp(prefix="stoker-cache-"))
            atexit.register(shutil.rmtree, _fallback_dir, True)
        return _fallback_dir


class DiskCache:
    """One directory of validated entries, one file per key.

    ``root``: the cache root, or a function returning it (read at each use, so
    a changed ``STOKER_CACHE_DIR`` takes effect). ``kind``: the subdirectory
    and the tag in each header. ``version``: entries with another version are
    misses (bump it when the body's meaning changes; include the versions of
    whatever the body depends on).
    """

    def __init__(
        self,
        root: Path | str | Callable[[], Path],
        kind: str,
        version: str,
        suffix: str = "",
        quiet: bool = False,
    ) -> None:
        if any(c.isspace() for c in kind + version):
            raise ValueError(
                f"DiskCache: kind and version must have no spaces: {kind!r} {version!r}"
            )
        self._root = root
        self.kind = kind
        self.version = version
        self.suffix = suffix
        # quiet: hits, misses and writes are logged below DEBUG (bookkeeping entries,
        # such as stoker-triton's "already compiled" markers, whose misses are expected);
        # a broken entry is still warned about
        self._level = QUIET if quiet else logging.INFO
        self._hit_level = QUIET if quiet else logging.DEBUG

    @property
    def dir(self) -> Path:
        root = self._root() if callable(self._root) else Path(self._root)
        return Path(root) / self.kind

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{self.suffix}"

    def header(self, body: bytes) -> bytes:
        digest = hashlib.sha256(body).hexdigest()
        return _MAGIC + f"{self.kind} {self.version} {digest}\n".encode()

    def get(self, key: str) -> bytes | None:
        """The body stored under ``key``, or None (missing or broken: see the module doc)."""
        found = self.get_entry(key)
        return None if found is None else found[1]

    def get_entry(self, key: str) -> tuple[Path, bytes] | None:
        """(the file, its body) for ``key``, or None: `get` with the file it came from."""
        why = "not on disk"
        for path in (self.path(key), self._fallback_path(key)):
            if path is None:
                continue
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            except OSError as e:
                why = f"cannot read {path}: {e}"
                warn_once(str(path), "stoker cache: %s; compiling again", why)
                continue
            body, why = self._parse(data)
            if body is not None:
                log.log(self._hit_level, "cache hit: %s", path)
                return path, body
            why = f"{path}: {why}"
            warn_once(str(path), "stoker cache: ignoring %s; compiling again and rewriting it", why)
        log.log(self._level, "cache miss: %s/%s (%s)", self.kind, key, why)
        return None

    def put(self, key: str, body: bytes) -> Path:
        """Store ``body`` under ``key`` atomically; returns the file now holding it.

        A directory that cannot be written (read-only, full) is warned about
        once and the entry goes to a private temporary directory instead.
        """
        data = self.header(body) + body
        path = self.path(key)
        try:
            atomic_write(path, data)
            log.log(self._level, "cache write: %s", path)
            return path
        except OSError as e:
            root = self.dir.parent  # one warning for the whole cache, not one per kind
            top = cache_root()
            if top == root or top in root.parents:  # nor one per package (triton/, capture/)
                root = top
            warn_once(
                str(root),
                "stoker cache: cannot write to %s (%s); caching in %s for this process instead. "
                "Set STOKER_CACHE_DIR to a writable directory to keep compiled artifacts.",
                root,
                e,
                _private_dir(),
            )
        fallback = self._fallback_path(key, create=True)
        assert fallback is not None
        atomic_write(fallback, data)
        return fallback

    def read_valid(self, path: str | os.PathLike[str]) -> bytes:
        """The body of the entry at ``path`` (a file `put` returned); raises `ValueError`
        naming the file when it is missing or broken (for readers in other processes)."""
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"stoker cache: cannot read {path}: {e}") from e
        body, why = self._parse(data)
        if body is None:
            raise ValueError(f"stoker cache: {path} is not a valid {self.kind} entry ({why})")
        return body

    def _parse(self, data: bytes) -> tuple[bytes | None, str]:
        """(body, "") for a valid entry, else (None, why not)."""
        got = _split(data)
        if isinstance(got, str):
            return None, got
        kind, version, body = got
        if kind != self.kind:
            return None, f"an entry of kind {kind!r}, not {self.kind!r}"
        if version != self.version:
            return None, f"version {version!r}, this stoker writes {self.version!r}"
        return body, ""

    def _fallback_path(self, key: str, create: bool = False) -> Path | None:
        if _fallback_dir is None and not create:
            return None
        return _private_dir() / self.kind / f"{key}{self.suffix}"

    def clear(self) -> int:
        """Remove every entry (and stray temporary file); returns how many files went."""
        n = 0
        d = self.dir
        if d.is_dir():
            for p in d.iterdir():
                if p.is_file():
                    with contextlib.suppress(OSError):
                        p.unlink()
                        n += 1
        return n
