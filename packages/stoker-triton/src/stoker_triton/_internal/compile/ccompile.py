"""Building generated C kernels with the system's compiler (the CPU's compiler step).

The compiler is found at run time: ``$STOKER_CC`` (a path or a name on ``PATH``),
else ``cc``, ``gcc``, ``clang``. Flags: ``$STOKER_CFLAGS`` replaces `DEFAULT_FLAGS`
(``-O3 -march=native -mprefer-vector-width=256``, and what every build needs: OpenMP, position-independent
code, no FMA contraction, so a sum is rounded where eager rounds it).

Each kernel is one shared object, stored under ``$STOKER_CACHE_DIR/c/`` (or
``$STOKER_C_OBJECT_DIR``) by the hash of its source, the compiler's identity and the
flags (`object_key`): a warm start finds every object built and compiles nothing. Objects are written through a
temporary file and a rename, so a half-written one is never loaded. The compiler
is its own process, so builds run side by side from a thread pool (`build_all`),
one per core; nothing here imports torch.

The objects link against ``libgomp.so.1`` by name; loaded into a process that has
imported torch, whose wheel brings its own ``libgomp.so.1``, the loader finds that
name loaded and shares torch's OpenMP runtime (one thread pool, set by
``torch.set_num_threads``), as `runtime/cload.py` checks.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# 256-bit vectors even where AVX-512 is there: a row of 32 floats is four whole vectors of
# 8 (two of 16 leave the compiler peeling and tailing it in scalar code; measured on a
# causal softmax of 1024 x 32: 96 us against 212)
DEFAULT_FLAGS = "-O3 -march=native -mprefer-vector-width=256"
# what every build needs, whatever STOKER_CFLAGS says
REQUIRED_FLAGS = (
    "-shared -fPIC -fopenmp -std=gnu11 -ffp-contract=off -fno-math-errno -fno-trapping-math"
)
CANDIDATES = ("cc", "gcc", "clang")
FORMAT = "2"  # bump when the objects' calling convention changes


class CCompilerMissing(RuntimeError):
    """No C compiler was found."""


class CCompileError(RuntimeError):
    """A generated kernel did not compile."""


def find_compiler() -> str | None:
    """The C compiler's path (``$STOKER_CC``, else the first of `CANDIDATES` on PATH)."""
    env = os.environ.get("STOKER_CC")
    if env:
        return shutil.which(env) or (env if os.access(env, os.X_OK) else None)
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def compiler_or_raise() -> str:
    cc = find_compiler()
    if cc is None:
        env = os.environ.get("STOKER_CC")
        what = f"STOKER_CC={env!r} is not an executable" if env else "no cc, gcc or clang on PATH"
        raise CCompilerMissing(
            f"stoker's CPU backend needs a C compiler with OpenMP: {what}. Install one "
            "(Debian/Ubuntu: `apt-get install gcc`), or set STOKER_CC to its path."
        )
    return cc


def flags() -> list[str]:
    """The compile flags: ``$STOKER_CFLAGS`` (else `DEFAULT_FLAGS`), the required ones, and
    ``-DSTOKER_MVEC`` where glibc's vector math library is there to link."""
    own = shlex.split(os.environ.get("STOKER_CFLAGS", DEFAULT_FLAGS)) + REQUIRED_FLAGS.split()
    cc = find_compiler()
    if cc is not None and _has_libmvec(cc):
        own.append("-DSTOKER_MVEC=1")
    return own


def libraries() -> list[str]:
    """What each object links, after its source."""
    cc = find_compiler()
    return (["-lmvec"] if cc is not None and _has_libmvec(cc) else []) + ["-lm"]


@functools.cache
def _has_libmvec(cc: str) -> bool:
    """glibc's vector math library (``libmvec``: sinf, cosf, powf, ... on 4 or 8 lanes)
    is there for `cc` to link, on x86-64, where the prelude declares its functions
    ``omp declare simd`` so that the vectorizer calls them instead of looping libm."""
    if os.uname().machine not in ("x86_64", "amd64"):
        return False
    try:
        found = subprocess.run(
            [cc, "-print-file-name=libmvec.so"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return os.path.isabs(found) and os.path.exists(found)


@functools.cache
def _identity(cc: str, flag_text: str) -> str:
    """What a built object depends on besides its source: the compiler's version, the
    flags, and (for ``-march=native``) this machine's CPU."""
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        raise CCompilerMissing(f"the C compiler {cc} does not run: {e}") from e
    cpu = ""
    if "native" in flag_text:
        try:
            info = Path("/proc/cpuinfo").read_text()
            cpu = "\n".join(
                sorted({ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))})
            )
        except OSError:
            cpu = os.uname().machine
    return "\n".join([FORMAT, cc, *version, flag_text, cpu])


def identity() -> str:
    cc = compiler_or_raise()
    return _identity(cc, " ".join(flags()))


def object_key(source: str) -> str:
    return hashlib.sha256((identity() + "\n" + source).encode()).hexdigest()[:32]


def object_dir(root: Path) -> Path:
    """Where the objects live: ``$STOKER_C_OBJECT_DIR`` if set (one folder several
    caches share: the objects are keyed by everything they depend on), else
    ``<root>/c``."""
    shared = os.environ.get("STOKER_C_OBJECT_DIR")
    return Path(shared) if shared else root / "c"


def build(source: str, key: str, root: Path) -> Path:
    """The shared object of `source` under `root` (built now unless it is there)."""
    out_dir = object_dir(root)
    so = out_dir / f"{key}.so"
    if so.exists():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    c_file = out_dir / f"{key}.c"
    if not c_file.exists():
        _write_atomic(c_file, source.encode())
    cc = compiler_or_raise()
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cc, *flags(), str(c_file), "-o", tmp, *libraries()]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise CCompileError(
                f"{shlex.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
            )
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return so


def build_all(
    jobs: Sequence[tuple[str, str]], root: Path, workers: int
) -> list[Path | BaseException]:
    """`build` of each (source, key), side by side: each build's object, or its error."""
    todo = [(s, k) for s, k in jobs if not (object_dir(root) / f"{k}.so").exists()]
    out: list[Path | BaseException] = []
    if len(todo) > 1 and workers > 1:
        with ThreadPoolExecutor(min(workers, len(todo))) as pool:
            futs = {k: pool.submit(build, s, k, root) for s, k in todo}
            for f in futs.values():
                f.exception()
    else:
        futs = {}
    for source, key in jobs:
        try:
            fut = futs.get(key)
            out.append(fut.result() if fut is not None else build(source, key, root))
        except BaseException as e:  # (reported by the caller with the kernel's name)
            out.append(e)
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
