"""The zygote: one fresh process imports the compiler once and forks the compile workers.

Each compile worker started as its own interpreter imports Triton by itself
(on the H100's Python, which has no bytecode cache for site-packages, every
one compiles Triton's sources again: seconds each, sixteen at once). As
Inductor does, one subprocess (`python -m` this module: a fresh interpreter
that never imports the user's script, torch or CUDA, and starts no thread)
imports Triton, its CUDA backend and `xcompile` once; each worker is then a
`fork` of it, ready at once. It forks only while it is single-threaded with
no CUDA driver loaded (`fork_refused` says why not), and the pool falls back
to one subprocess per worker, with the reason logged, where it cannot.

Control: the pool sends one request at a time on a Unix socket, with the
worker's job channel (one end of a socket pair) and its stderr file passed
as file descriptors (`socket.send_fds`); the zygote replies with the pid.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any

from .workers import recv_msg, send_msg, serve

_FORK, _KILL = b"F", b"K"


class ZygoteError(RuntimeError):
    """The zygote cannot fork a worker (the reason is the message)."""


def fork_refused() -> str | None:
    """Why this process must not fork now (threads, CUDA), or None."""
    if not hasattr(os, "fork") or not hasattr(socket, "send_fds"):
        return "this platform has no os.fork"
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads are running"
    try:  # native threads too (a library's own)
        n = len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: the Python count above is what we know
        n = 1
    if n != 1:
        return f"{n} threads are running"
    if "torch" in sys.modules:
        return "torch is imported (CUDA may be initialised)"
    try:
        with open("/proc/self/maps") as f:
            if "libcuda" in f.read():
                return "the CUDA driver library is loaded"
    except OSError:  # no /proc
        pass
    return None


class Zygote:
    """The pool's side: starts the zygote at the first `fork` and asks it for workers."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.lock = threading.Lock()  # one request at a time on the control socket
        self.proc: subprocess.Popen[bytes] | None = None
        self.ctl: socket.socket | None = None
        self.replies: IO[bytes] | None = None
        self.err: IO[bytes] | None = None
        self.failed: str | None = None  # why it cannot fork (sticky)
        self.forks = 0  # workers forked (tests read it)

    def fork(self, err: IO[bytes]) -> tuple[socket.socket, int]:
        """A new worker writing its stderr to `err`: (its job channel, its pid)."""
        with self.lock:
            if self.failed is not None:
                raise ZygoteError(self.failed)
            try:
                if self.ctl is None:
                    if not hasattr(os, "fork") or not hasattr(socket, "send_fds"):
                        raise ZygoteError("this platform has no os.fork")
                    self._start()
                mine, theirs = socket.socketpair()
                try:
                    pid = self._ask(_FORK, [theirs.fileno(), err.fileno()])
                finally:
                    theirs.close()
            except (OSError, EOFError, ZygoteError) as e:
                self.failed = self._why(e)
                self._close()
                raise ZygoteError(self.failed) from e
            self.forks += 1
            return mine, int(pid)

    def kill(self, pid: int) -> None:
        """Kill and reap a worker the zygote forked (a dead one: reap it)."""
        with self.lock:
            if self.ctl is None:
                return
            try:
                self._ask(_KILL + str(pid).encode(), [])
            except (OSError, EOFError, ZygoteError):  # the zygote is gone: so is its child
                pass

    def close(self) -> None:
        with self.lock:
            self._close()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self.err = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stoker_triton._internal.compile.zygote",
                    str(theirs.fileno()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=self.err,
                stderr=self.err,
                env={**self.env, "TRITON_INTERPRET": "0"},  # before the package's imports
                pass_fds=[theirs.fileno()],
            )
        finally:
            theirs.close()
        self.ctl = ours
        self.replies = ours.makefile("rb")
        ok, why = recv_msg(self.replies)  # it imported the compiler, or says why not
        if not ok:
            raise ZygoteError(why)

    def _ask(self, msg: bytes, fds: list[int]) -> Any:
        assert self.ctl is not None and self.replies is not None
        socket.send_fds(self.ctl, [msg], fds)
        ok, value = recv_msg(self.replies)
        if not ok:
            raise ZygoteError(value)
        return value

    def _why(self, e: BaseException) -> str:
        if isinstance(e, ZygoteError):
            return str(e)
        tail = ""
        if self.err is not None:
            self.err.seek(0)
            tail = self.err.read().decode(errors="replace")[-2000:]
        return f"the zygote process died ({type(e).__name__}): {tail}"

    def _close(self) -> None:
        if self.replies is not None:
            self.replies.close()
        if self.ctl is not None:
            self.ctl.close()  # the zygote reads EOF and exits
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.ctl = self.replies = self.proc = None


def _child(fds: list[int]) -> None:
    """In a forked worker: stderr to the pool's file, then serve jobs; never returns."""
    code = 0
    try:
        chan, err = fds
        os.dup2(err, 2)
        os.dup2(err, 1)  # what the compiler prints must not reach the zygote's output
        os.close(err)
        sock = socket.socket(fileno=chan)
        serve(sock.makefile("rb"), sock.makefile("wb"))
    except BaseException:  # the pool reads it from the stderr tail
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main(fd: int) -> None:
    import signal

    # Ctrl-C in a terminal reaches the whole process group: the pool ends the zygote
    # and its workers (EOF on their channels), a KeyboardInterrupt the caller survives must not
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctl = socket.socket(fileno=fd)
    out = ctl.makefile("wb")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        import gc

        from stoker_triton._internal.compile import xcompile

        xcompile.keep_torch_out()
        xcompile.import_compiler()
        gc.freeze()  # what the imports built stays shared with the workers, never copied
        why = fork_refused()
    except Exception as e:  # reported to the pool, which falls back
        why = f"the zygote could not import the compiler: {type(e).__name__}: {e}"
    send_msg(out, (why is None, why))
    if why is not None:
        return
    children: set[int] = set()
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(ctl, 64, 2)
        if not msg:  # the pool closed: each worker exits when its channel closes
            return
        _reap(children)
        if msg[:1] == _KILL:
            pid = int(msg[1:])
            if pid in children:
                _kill(pid)
                children.discard(pid)
            send_msg(out, (True, pid))
            continue
        why = fork_refused()
        if why is not None or len(fds) != 2:
            for f in fds:
                os.close(f)
            send_msg(out, (False, why or f"a fork request with {len(fds)} descriptors"))
            continue
        pid = os.fork()
        if pid == 0:
            ctl.close()
            _child(fds)
        for f in fds:
            os.close(f)
        children.add(pid)
        send_msg(out, (True, pid))


def _reap(children: set[int]) -> None:
    for pid in list(children):
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


def _kill(pid: int) -> None:
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


if __name__ == "__main__":
    _main(int(sys.argv[1]))
