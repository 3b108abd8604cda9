"""Python processes the tests start, forked from a server that has already imported torch.

Each Python process a test starts (a second process that loads a cache, a benchmark's
smoke run, a DDP rank, the pytest-xdist workers) used to import torch and Dynamo again:
about 4 CPU s of each, on a machine with two cores.  The root conftest starts two
servers for the test session (`start_servers`); each imports them once (`PRELOAD`, and
what a first compile imports besides, `PRELOAD_IF_PRESENT`) and then forks a child per
request.  A process started with `sys.executable` finds the
servers through `STOKER_TEST_PRELOAD`, and its `sitecustomize` (`client`) hands over its
whole start: command line, working directory, environment, `sys.path`, standard streams
and every inherited file descriptor (waiting for servers that still import).  The
server forks; the child takes all of that over and runs the script, `-c` code or `-m`
module as `__main__`, exactly as the interpreter would; the process the test started
waits, forwards signals, and exits with the child's status.  From the test's side it is
the same process: same pid to wait on, same pipes, same exit code, and killing it kills
the child.

What the child starts with that a fresh interpreter would not: torch, Dynamo, AOT
autograd and what they import (Triton, where installed) already in `sys.modules`,
imported under the server's environment.  So a process is started for real, not forked, whenever that
could show:
- the environment differs from the server's in a variable read while they import
  (`_IMPORT_TIME_ENV`, and each one looked up then), or sets `PYTHONHASHSEED` (two runs
  with two seeds must be two real processes);
- the program's own text sets such a variable (`os.environ["TRITON_INTERPRET"] = "0"`
  before it imports Triton); one that does so from another module fails at the switch
  of `TRITON_INTERPRET`, saying why (`_guard_triton_mode`);
- it runs another interpreter or venv, other interpreter flags, or a `sys.path` on which
  a module the server imported would be found elsewhere;
- it runs as another user, with other capabilities (`setpriv`), resource limits, CPU
  affinity or priority;
- its command line is not `[-W ...] [-u] (script | -c code | -m module) args...`, or it
  is one of the library's processes that must start without torch (`LEAN`);
- `STOKER_TEST_FRESH_PROCESS=1` is set (for a test that checks what a process imports).

Where the environment differs in the thread count or Triton's mode (`_VARIANT_ENV`: the
DDP ranks' OMP_NUM_THREADS=1, Triton's real launch path's TRITON_INTERPRET=0), the second
process that asks with that environment has the server start a pair of servers with it
(`_Server.variant`), and is forked from one of those, as later ones are.  Each pair runs with two hash seeds and the requests
alternate between them, so two processes of one test (one writes a cache, the next
loads it) see different string hashes, as two real processes would.
`STOKER_TEST_PRELOAD=0` turns all this off.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any

ENV = "STOKER_TEST_PRELOAD"
FRESH = "STOKER_TEST_FRESH_PROCESS"
SERVERS = ("a", "b")
# What the servers import before they listen: torch, then Dynamo with all it imports
# (symbolic shapes, sympy, FSDP, Triton where it is installed).  Of the 4 CPU s a process
# took before it could compile, 2 were Dynamo's import.
PRELOAD = ("torch", "torch._dynamo")
# And, where they import, the torch modules (and networkx) that the first stoker compile
# of a process imports: AOT autograd and its partitioner, Inductor's cache keys, export's
# tracer, Dynamo's backend registry.  A forked child that compiles a small model then
# takes 0.55 CPU s instead of 0.8, and most of the processes the tests start compile.
PRELOAD_IF_PRESENT = (
    "networkx",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch._inductor.codecache",
    "torch._inductor.sizevars",
    "torch.export._trace",
    "torch.fx.experimental.validator",
    "torch.nn.attention.flex_attention",
    "torch._dynamo.testing",
    "torch._dynamo.backends.cudagraphs",
    "torch._dynamo.backends.distributed",
    "torch._dynamo.backends.inductor",
)
# Variables whose other values get servers of their own (`_Server.variant`), for the
# processes that set them again and again: the DDP ranks' thread count, Triton's real
# launch path.  (Inductor's compile checks, with their own LD_LIBRARY_PATH, import
# nothing: a pair of servers for them was only cost.)
_VARIANT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TRITON_INTERPRET")
# How long a process waits for a server that is still importing (it would start for real
# instead, and import the same modules on the same cores).
_WAIT_S = 120.0
# Read while torch imports: every variable not set in the server's environment that its
# Python code looks up in `os.environ` then (recorded by `main`), and these, read by its native libraries (OpenMP, MKL, CUDA, the
# loader, torch's C++), by the interpreter, and by this folder's sitecustomize.  A process
# whose value of one of them differs from the server's starts for real.
_IMPORT_TIME_ENV = (
    "TORCH_",
    "PYTORCH_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL",
    "OPENBLAS",
    "CUDA",
    "NVIDIA",
    "LD_",
    "MALLOC",
    "PYTHONHASHSEED",
    "PYTHONMALLOC",
    "PYTHONOPTIMIZE",
    "PYTHONSAFEPATH",
    "PYTHONDEVMODE",
    "PYTHONUTF8",
    "TRITON_INTERPRET",
    "STOKER_TEST_SLOW_REDUCE",
)
_READ_AT_IMPORT: set[str] = set()  # filled by `main`
# What the imports themselves set in `os.environ` (Dynamo's import sets
# TORCHINDUCTOR_CACHE_DIR to its default): a fresh process that imports them has these
# too, and a process that starts with one of these values is as one that starts without.
_SET_AT_IMPORT: dict[str, str] = {}  # filled by `main`
_READ_AGAIN_AT_USE = ("TORCHINDUCTOR_CACHE_DIR",)
_ENV_BEFORE_IMPORT: dict[str, str] = {}
# processes of the library that must start without torch: the Triton compile workers and
# their zygote (it forks only while single-threaded, and torch's import starts a thread)
LEAN = ("stoker_triton._internal.compile.",)
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_HEADER = struct.Struct("!I")
_THIS = __file__


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in _READ_AT_IMPORT or k.startswith(_IMPORT_TIME_ENV)}


def _flags() -> list[Any]:
    return [list(sys.flags), sorted(sys._xoptions.items())]


def _send(sock: socket.socket, message: Any, fds: Sequence[int] = ()) -> None:
    body = json.dumps(message).encode()
    data = _HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):  # (a send of nothing to a peer that has closed fails)
        sock.sendall(data[sent:])


def _recv(sock: socket.socket, max_fds: int = 0) -> tuple[Any, list[int]]:
    """One message (and the descriptors sent with it); None at end of stream."""
    if max_fds:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, max_fds)
    else:
        data, fds = sock.recv(1 << 16), []
    if not data:
        return None, fds
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        more = sock.recv(1 << 16)
        if not more:
            return None, fds
        data += more
    (n,) = _HEADER.unpack_from(data)
    return json.loads(data[_HEADER.size : _HEADER.size + n]), fds


# --------------------------------------------------------------------------- client
def _command() -> dict[str, Any] | None:
    """What the interpreter was asked to run, from `sys.orig_argv`; None if this is not
    `[-W x] [-u] (script | -c code | -m module) args` (then the process starts for real)."""
    argv = list(sys.orig_argv[1:])
    while argv:
        a = argv.pop(0)
        if a == "-u":
            continue
        if a == "-W" and argv:
            argv.pop(0)
            continue
        if a.startswith("-W") and len(a) > 2:
            continue
        if a in ("-c", "-m") and argv:
            target = argv.pop(0)
            if a == "-m" and target.startswith(LEAN):
                return None
            return {"kind": a, "target": target}
        if a.startswith("-") or not os.path.isfile(a):
            return None
        return {"kind": "script", "target": os.path.abspath(a)}
    return None


def _process_state() -> list[Any]:
    """What a process inherits besides its environment that the program may see: user,
    groups, capabilities (setpriv), resource limits (prlimit), CPU affinity (taskset)."""
    import resource

    with open("/proc/self/status", encoding="ascii") as f:
        status = [
            line.strip()
            for line in f
            if line.startswith(("Uid", "Gid", "Groups", "Cap", "NoNewPrivs", "Seccomp:"))
        ]
    limits = [
        (name, resource.getrlimit(getattr(resource, name)))
        for name in sorted(n for n in dir(resource) if n.startswith("RLIMIT_"))
    ]
    return [status, limits, sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0)]


def _inherited_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if os.get_inheritable(fd) or fd < 3:
                fds.append(fd)
        except OSError:
            continue  # listdir's own descriptor, closed by now
    return sorted(fds)


def _streams() -> dict[str, Any]:
    out = {}
    for name in ("stdin", "stdout", "stderr"):
        s = getattr(sys, name)
        if s is None:
            continue
        out[name] = {
            "encoding": s.encoding,
            "errors": s.errors,
            "line_buffering": s.line_buffering,
            "write_through": getattr(s, "write_through", False),
        }
    return out


def _count(path: str) -> int:
    """Add one to the count kept in the file at `path` (locked: processes race); the
    count before, 0 for a new file or one that cannot be read."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            n = int(os.read(fd, 32) or b"0")
            os.lseek(fd, 0, 0)
            os.ftruncate(fd, 0)
            os.write(fd, str(n + 1).encode())
            return n
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return 0


def _pick(prefix: str) -> list[str]:
    """The sockets of a pair of servers (`<prefix>a.sock`, `<prefix>b.sock`) in the
    order to try, alternating from one process to the next that the same process starts
    (a test's: the processes of other tests, on other workers, do not take its turns)."""
    turn = _count(f"{prefix}turn-{os.getppid()}")
    order = SERVERS[turn % 2 :] + SERVERS[: turn % 2]
    return [f"{prefix}{name}.sock" for name in order]


def client() -> None:
    """Called by `sitecustomize` at start-up: hand this process's start to a server and
    exit with its child's status; return (and start for real) when that can't be done."""
    where = os.environ.get(ENV, "")
    if where in ("", "0") or os.environ.get(FRESH, "") not in ("", "0"):
        return
    command = _command()
    if command is None:
        _log(f"not a script, -c or -m: {sys.orig_argv}")
        return
    refused = _try(_pick(os.path.join(where, "")), command)  # exits if one took it
    if refused and refused.get("variant"):  # servers for this process's environment
        _try(_pick(refused["variant"]), command)


def _try(addresses: list[str], command: dict[str, Any]) -> dict[str, Any] | None:
    """Hand the process to the first of these servers that listens (exits then), waiting
    for those still importing; the refusal if one refused, else None."""
    import time

    deadline = time.monotonic() + _WAIT_S
    while True:
        for address in addresses:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(address)
            except OSError:
                sock.close()
                continue
            refused = _hand_over(sock, command)  # exits if the server took it
            sock.close()
            return refused
        if not _starting(addresses) or time.monotonic() > deadline:
            _log(f"no server listens: {sys.orig_argv[1:3]}")
            return None
        time.sleep(0.02)


def _starting(addresses: list[str]) -> bool:
    """Whether one of these servers is still importing (its process is alive and its
    socket not there yet): the pytest-xdist workers start at once, before the servers
    listen, and wait for them rather than import the same modules beside them."""
    for address in addresses:
        try:
            with open(address.removesuffix(".sock") + ".pid", encoding="ascii") as f:
                pid = int(f.read())
            os.kill(pid, 0)
        except (OSError, ValueError):
            continue
        if not os.path.exists(address):
            return True
    return False


def _hand_over(sock: socket.socket, command: dict[str, Any]) -> dict[str, Any] | None:
    fds = _inherited_fds()
    request = {
        **command,
        "executable": sys.executable,
        "prefix": sys.prefix,
        "flags": _flags(),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path": sys.path,
        "warnoptions": sys.warnoptions,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "fds": fds,
        "streams": _streams(),
        "group_leader": os.getpgrp() == os.getpid(),
        "umask": _umask(),
        "state": _process_state(),
    }
    # signals that come before the child's pid is known are kept, then forwarded
    child: list[int] = []
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if not child:
            pending.append(signum)
            return
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    before = {name: signal.signal(getattr(signal, name), forward) for name in _SIGNALS}
    try:
        _send(sock, request, fds)
        answer, _ = _recv(sock)
    except OSError:
        answer = None
    _log(f"{answer} {sys.orig_argv[1:3]}")
    if not answer or "pid" not in answer:  # refused (answer["why"]): start for real
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)
        for signum in pending:
            os.kill(os.getpid(), signum)
        return answer if isinstance(answer, dict) else None
    child.append(answer["pid"])
    for signum in pending:
        forward(signum, None)
    try:
        status, _ = _recv(sock)
    except OSError:
        status = None
    if status is None:
        os.write(2, b"stoker test preload: the server went away before the process ended\n")
        os._exit(1)
    if "signal" in status:
        signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    os._exit(status["exit"])


def _log(line: str) -> None:
    """STOKER_TEST_PRELOAD_LOG=<file>: a line per process handed over or refused, and why."""
    where = os.environ.get("STOKER_TEST_PRELOAD_LOG")
    if where:
        with open(where, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --------------------------------------------------------------------------- server
class _Server:
    def __init__(self, address: str, variants: bool) -> None:
        import sysconfig

        self.where = os.path.dirname(address)
        self.variants = variants  # whether it starts servers for other environments

        # what a request must match: its hash seed is the server's own, never compared
        self.env = _import_time_env(_ENV_BEFORE_IMPORT)
        self.env.pop(FRESH, None)
        self.env.pop("PYTHONHASHSEED", None)
        self.parent = os.getppid()
        self.state = json.loads(json.dumps(_process_state()))  # as a request carries it
        stdlib = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
        # top-level modules imported from outside the standard library: a process on
        # whose sys.path one of them resolves elsewhere starts for real
        self.preloaded = {}
        for name, module in list(sys.modules.items()):
            origin = getattr(module, "__file__", None)
            if name.startswith("__") or "." in name or not origin:
                continue
            if any(origin.startswith(p + os.sep) for p in stdlib):
                continue
            self.preloaded[name] = origin
        # a child of a process that has initialized CUDA cannot use it
        torch = sys.modules["torch"]
        self.cuda = bool(torch.cuda.is_initialized())
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address + ".tmp")
        os.rename(address + ".tmp", address)  # clients see it only once it listens
        self.listener.listen(64)
        self.children: dict[int, socket.socket] = {}  # pid -> the client's connection
        self.groups: set[int] = set()

    def refuse(self, request: dict[str, Any]) -> str | None:
        if request["executable"] != sys.executable or request["prefix"] != sys.prefix:
            return "another interpreter"
        if request["flags"] != _flags():
            return "other interpreter flags"
        if request["state"] != self.state:
            return "other user, capabilities, limits, affinity or priority"
        env = _import_time_env(request["env"])
        for k, v in _SET_AT_IMPORT.items():  # the value the import would set
            if env.get(k) == v and k not in self.env:
                del env[k]
        env.pop(FRESH, None)
        if "PYTHONHASHSEED" in env:
            return "PYTHONHASHSEED set"
        if env != self.env:
            differ = sorted(k for k in {*env, *self.env} if env.get(k) != self.env.get(k))
            if set(differ) <= set(_VARIANT_ENV):
                request["overlay"] = {k: env.get(k) for k in differ}
            return f"environment read at torch's import differs: {', '.join(differ)}"
        if any(s not in request["streams"] for s in ("stdin", "stdout", "stderr")):
            return "a standard stream is closed"
        if self.cuda:
            return "CUDA was initialized while the server imported"
        written = _sets_import_time_env(_program_source(request), request["env"])
        if written:
            return f"the program sets {written} itself, which is read at import"
        import importlib.machinery

        for name, origin in self.preloaded.items():
            spec = importlib.machinery.PathFinder.find_spec(name, request["path"])
            if spec is None or spec.origin != origin:
                return f"{name} would be imported from elsewhere"
        return None

    def variant(self, overlay: dict[str, str | None]) -> str | None:
        """Where the servers for a process whose environment differs from this one's in
        what is read at import are (`<prefix>a.sock`, `<prefix>b.sock`): the DDP ranks'
        OMP_NUM_THREADS=1, the TRITON_INTERPRET=0 of Triton's real launch path.  The
        second process that asks starts them (a one-off starts for real, as before), with
        this server's environment changed in those variables, and two hash seeds of their
        own; this server is their parent, and they end with it.  None before that."""
        import hashlib

        key = hashlib.sha256(json.dumps(sorted(overlay.items())).encode()).hexdigest()[:16]
        prefix = os.path.join(self.where, f"v-{key}-")
        asked = _count(prefix + "asked")
        if asked == 0:
            return None
        if asked == 1:
            env = dict(_ENV_BEFORE_IMPORT)
            for k, v in overlay.items():
                if v is None:
                    env.pop(k, None)
                else:
                    env[k] = v
            start_servers(prefix, env, variants=False)
        return prefix

    def serve(self) -> None:
        import select

        while True:
            if os.getppid() != self.parent:
                return  # the test session is gone
            conns = list(self.children.values())
            ready, _, _ = select.select([self.listener, *conns], [], [], 0.02)
            for r in ready:
                if r is self.listener:
                    conn, _ = self.listener.accept()
                    self.accept(conn)
                else:  # a client ended before its child: kill the child (and its group)
                    pid = next(p for p, c in self.children.items() if c is r)
                    if r.recv(1) == b"":
                        self.kill(pid)
            self.reap()

    def kill(self, pid: int) -> None:
        try:
            if pid in self.groups:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            self.groups.discard(pid)
            if conn is None:
                continue
            if os.WIFSIGNALED(status):
                message = {"signal": os.WTERMSIG(status)}
            else:
                message = {"exit": os.waitstatus_to_exitcode(status)}
            try:
                _send(conn, message)
            except OSError:
                pass
            conn.close()

    def accept(self, conn: socket.socket) -> None:
        conn.settimeout(10)  # a client sends its request at once; none blocks the others
        try:
            request, fds = _recv(conn, max_fds=250)
            conn.settimeout(None)
        except OSError:
            conn.close()
            return
        why = "no request" if request is None else self.refuse(request)
        if why is not None or request is None:
            for fd in fds:
                os.close(fd)
            answer: dict[str, Any] = {"why": why}
            overlay = request.get("overlay") if request else None
            if overlay is not None and self.variants:
                variant = self.variant(overlay)
                if variant:
                    answer["variant"] = variant
            try:
                _send(conn, answer)
            except OSError:
                pass
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                code = _child(request, fds, conn, self)
            except Exception:  # before the program ran: say why, as the process's error
                import traceback

                traceback.print_exc()
                os._exit(1)
            # the interpreter ends the process as it ends any: threads joined, atexit
            # functions run, modules and open files finalized (`main` lets it through)
            raise SystemExit(code)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        if request["group_leader"]:
            self.groups.add(pid)
        try:
            _send(conn, {"pid": pid})
        except OSError:
            self.kill(pid)


# `os.environ[...] = "literal"`, `os.environ.setdefault("NAME", ...)`, `os.putenv("NAME", ...)`
_ENV_WRITE = re.compile(
    r"""environ\s*\[\s*["']([A-Za-z_][A-Za-z0-9_]*)["']\s*\]\s*=(?!=)\s*(?:(["'])(.*?)\2)?"""
    r"""|environ\.setdefault\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']"""
    r"""|putenv\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']"""
)


def _program_source(request: dict[str, Any]) -> str:
    """The text of what the process runs: its `-c` code, its script, or its `-m` module's
    file (found on its own `sys.path` without importing anything); "" if unreadable."""
    kind, target = request["kind"], request["target"]
    if kind == "-c":
        return str(target)
    where: str | None = target
    if kind == "-m":
        import importlib.machinery

        path: list[str] | None = [request["cwd"], *request["path"]]
        where = None
        for part in target.split("."):
            spec = importlib.machinery.PathFinder.find_spec(part, path)
            if spec is None:
                return ""
            path = list(spec.submodule_search_locations or []) or None
            where = spec.origin
        if path:  # a package runs its __main__
            spec = importlib.machinery.PathFinder.find_spec("__main__", path)
            where = spec.origin if spec else None
    try:
        with open(str(where), encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _sets_import_time_env(source: str, env: dict[str, str]) -> str | None:
    """The first variable read at import that the program's own text sets to something
    other than what it has (a program that sets TRITON_INTERPRET=0 before it imports
    Triton must not find Triton already imported in interpreter mode)."""
    for m in _ENV_WRITE.finditer(source):
        name = m.group(1) or m.group(4) or m.group(5)
        if not (name in _READ_AT_IMPORT or name.startswith(_IMPORT_TIME_ENV)):
            continue
        if m.group(1) and m.group(2) and m.group(3) == env.get(name):
            continue  # sets the value it already has
        if m.group(4) and name in env:
            continue  # setdefault of a variable already set
        return name
    return None


def _guard_triton_mode() -> None:
    """Triton decides interpreter or compiler for each `@triton.jit` function when it is
    defined, its own library's on import: in a child of a server that imported Triton, a
    program that switches TRITON_INTERPRET itself (from a module `refuse` did not read)
    would get a Triton of the other mode.  It fails at the switch, saying why."""
    if "triton" not in sys.modules:
        return
    mode = os.environ.get("TRITON_INTERPRET", "") == "1"
    real = os.putenv  # `os.environ[k] = v` calls the module's `putenv`

    def putenv(key: Any, value: Any) -> None:
        if os.fsdecode(key) == "TRITON_INTERPRET" and (os.fsdecode(value) == "1") != mode:
            raise RuntimeError(
                "stoker test preload: this process was forked from a server that imported "
                f"Triton with TRITON_INTERPRET={'1' if mode else 'unset'}, and now sets it to "
                f"{os.fsdecode(value)!r}: set it in the environment the process starts "
                "with, or STOKER_TEST_FRESH_PROCESS=1 there for a fresh interpreter"
            )
        real(key, value)

    os.putenv = putenv


def _child(request: dict[str, Any], fds: list[int], conn: socket.socket, server: _Server) -> int:
    """In the forked child: become the process the client would have been, then run it."""
    if request["group_leader"]:
        os.setpgid(0, 0)
    server.listener.close()
    for other in server.children.values():
        other.close()
    conn.close()
    # the client's descriptors at their own numbers; nothing else of the server's stays
    import fcntl

    base = 1 + max([*map(int, os.listdir("/proc/self/fd")), *request["fds"]])
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, base) for fd in fds]
    os.closerange(0, base)
    for target, fd in zip(request["fds"], moved, strict=True):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    for k, v in _SET_AT_IMPORT.items():
        os.environ.setdefault(k, v)
    _reseed()
    _guard_triton_mode()
    _streams_from(request["streams"])
    sys.argv[:] = request["argv"]
    sys.orig_argv[:] = request["orig_argv"]
    path = list(request["path"])
    kind, target = request["kind"], request["target"]
    if not sys.flags.safe_path:
        path.insert(
            0,
            os.path.dirname(os.path.realpath(target))
            if kind == "script"
            else (os.getcwd() if kind == "-m" else ""),
        )
    sys.path[:] = path
    sys.path_importer_cache.clear()
    import importlib

    importlib.invalidate_caches()
    _warnings_from(request["warnoptions"])
    for name in _SIGNALS:  # as a fresh interpreter has them
        signum = getattr(signal, name)
        signal.signal(signum, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
    return _run(kind, target)


def _reseed() -> None:
    """Python's `random` reseeds itself after a fork; NumPy's global generator does not."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _streams_from(streams: dict[str, Any]) -> None:
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        s = streams[name]
        f = open(
            fd,
            "r" if fd == 0 else "w",
            encoding=s["encoding"],
            errors=s["errors"],
            closefd=False,
        )
        if fd:
            f.reconfigure(line_buffering=s["line_buffering"], write_through=s["write_through"])
        setattr(sys, name, f)
        setattr(sys, f"__{name}__", f)


_SERVER_FILTERS: list[Any] = []  # warning filters torch's import added (set by `main`)
_DEFAULT_FILTERS: list[Any] = []


def _warnings_from(options: list[str]) -> None:
    """The filters a fresh interpreter with these -W options would have once torch was
    imported: the defaults, the options before them, torch's own in front."""
    import warnings

    sys.warnoptions[:] = options
    warnings.filters[:] = _DEFAULT_FILTERS
    warnings._processoptions(options)  # type: ignore[attr-defined]
    warnings.filters[:0] = _SERVER_FILTERS
    warnings._filters_mutated()  # type: ignore[attr-defined]


def _run(kind: str, target: str) -> int:
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    try:
        if kind == "-m":
            import runpy

            runpy._run_module_as_main(target)  # type: ignore[attr-defined]
            return 0
        if kind == "script":
            main.__file__ = target
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", target)
            with open(target, "rb") as f:
                code = compile(f.read(), target, "exec")
        else:
            main.__loader__ = importlib.machinery.BuiltinImporter  # type: ignore[assignment]
            code = compile(target, "<string>", "exec")
        main.__dict__["__spec__"] = None
        exec(code, main.__dict__)
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == _THIS:
            tb = tb.tb_next  # the traceback starts in the program, as the interpreter's does
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        if isinstance(e, KeyboardInterrupt):
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 1


def main(address: str, variants: bool = True) -> None:
    """A server: import torch, then fork a child per request until the session ends."""
    import gc
    import warnings

    _DEFAULT_FILTERS[:] = warnings.filters
    environ: Any = os._Environ  # type: ignore[attr-defined]
    lookup = environ.__getitem__

    def recorded(self: Any, key: str) -> str:
        _READ_AT_IMPORT.add(key)
        return lookup(self, key)  # type: ignore[no-any-return]

    present = set(os.environ)
    _ENV_BEFORE_IMPORT.update(os.environ)
    environ.__getitem__ = recorded  # `get` and `in` go through it too
    try:
        import importlib

        for name in PRELOAD:  # what every child starts with
            importlib.import_module(name)
        for name in PRELOAD_IF_PRESENT:
            try:
                importlib.import_module(name)
            except ImportError:  # this torch has no such module: its children import less
                pass
    finally:
        environ.__getitem__ = lookup
    # a copy of the environment reads every variable set; the lookups that matter are
    # of variables not set here (TORCH_LOGS, ...): one set later would change the import
    _READ_AT_IMPORT.difference_update(present)
    # read while Dynamo imports only to name the store of its precompile cache, whose
    # path it reads again at each use (torch/_dynamo/package.py, `DiskDynamoCache`): a
    # process with a cache folder of its own (each benchmark run) is forked all the same
    _READ_AT_IMPORT.difference_update(_READ_AGAIN_AT_USE)
    _SET_AT_IMPORT.update({k: v for k, v in os.environ.items() if _ENV_BEFORE_IMPORT.get(k) != v})

    added = len(warnings.filters) - len(_DEFAULT_FILTERS)
    _SERVER_FILTERS[:] = warnings.filters[:added]
    # Nothing is frozen (`gc.freeze`): a child starts with the collector's state a fresh
    # interpreter has (a program may look, `gc.get_freeze_count()`: stoker's demo freezes
    # its own heap only where nobody else did), and collects everything as it ends
    # (Triton's bindings print "leaked instances" for objects left frozen).
    server = _Server(address, variants)
    gc.collect()
    me = os.getpid()
    try:
        server.serve()
    finally:
        if os.getpid() == me:  # not in a child ending its program
            server.listener.close()
            try:
                os.unlink(address)
            except OSError:
                pass
    # The session is over (a child returns from `serve` through SystemExit, never here).
    # Nothing of the server's needs finalizing: it ends without tearing down its modules.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- session
def start_servers(
    where: str, env: dict[str, str] | None = None, variants: bool = True
) -> list[Any]:
    """Start a pair of servers in the background, with `env` (default: this process's)
    and a hash seed each; `where`: a folder, or a prefix of their files' paths.  A
    process started while they import waits for them (`_starting`).  Returns their
    `Popen`s."""
    import random
    import subprocess

    prefix = os.path.join(where, "") if os.path.isdir(where) else where
    procs = []
    for name in SERVERS:
        server_env = {
            **(os.environ if env is None else env),
            "PYTHONHASHSEED": str(random.randrange(1, 2**32)),
            FRESH: "1",
        }
        server_env.pop(ENV, None)
        proc = subprocess.Popen(
            [sys.executable, __file__, f"{prefix}{name}.sock", *([] if variants else ["-v"])],
            env=server_env,
            stdin=subprocess.DEVNULL,
            cwd=os.path.dirname(prefix),
        )
        with open(f"{prefix}{name}.pid", "w", encoding="ascii") as f:
            f.write(str(proc.pid))
        procs.append(proc)
    return procs


if __name__ == "__main__":
    os.environ.pop(FRESH, None)
    main(sys.argv[1], variants=sys.argv[2:] != ["-v"])
