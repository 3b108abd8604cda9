"""A pool of compile worker processes that never imports the user's script.

`multiprocessing`'s spawn and forkserver start methods re-import `__main__`
in every child, so a training script without an `if __name__ == "__main__":`
guard would run again in each worker (and try to start workers of its own).
Fork is unsafe once CUDA or threads are up. So, like Inductor's compile
workers, the workers are forked by a zygote (`zygote.py`): one plain
subprocess, a fresh interpreter that imports the compiler once. Where it
cannot fork (no `os.fork`, the zygote failed), each worker is a plain
subprocess running this module (the reason is logged on `stoker.kernels`).
Jobs go down a pipe and results come back, pickled, length-prefixed.

A job names a function in `stoker_triton._internal.compile.xcompile` and its
arguments (plain data). A worker that dies fails the job it held with its
stderr tail and is replaced for the next job.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .zygote import Zygote

_LEN = struct.Struct("<Q")
MODE_ENV = "STOKER_TRITON_WORKERS"  # "fork" (default: from the zygote) or "subprocess"
log = logging.getLogger("stoker.kernels")


def send_msg(f: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def recv_msg(f: IO[bytes]) -> Any:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


class _Worker:
    """One worker process: its job channel, its stderr file and how to end it."""

    def __init__(
        self,
        inp: IO[bytes],
        out: IO[bytes],
        err: IO[bytes],
        proc: subprocess.Popen[bytes] | None = None,
        sock: socket.socket | None = None,
        kill: Callable[[], None] | None = None,
    ) -> None:
        self.inp, self.out, self.err = inp, out, err
        self.proc, self.sock, self._kill = proc, sock, kill

    def dead(self) -> bool:
        """Whether it exited while idle (it sends nothing unasked: readable is EOF)."""
        if self.proc is not None:
            return self.proc.poll() is not None
        assert self.sock is not None
        return bool(select.select([self.sock], [], [], 0)[0])

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def end(self) -> None:
        for f in (self.inp, self.out):
            try:
                f.close()
            except OSError:
                pass
        if self.sock is not None:
            self.sock.close()  # the worker reads EOF and exits
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._kill is not None:
            self._kill()
        self.err.close()


class Pool:
    """`n` worker processes; `submit(name, *args)` runs `xcompile.<name>(*args)`."""

    def __init__(self, n: int, env: dict[str, str] | None = None, start: bool = False) -> None:
        """`start`: start every worker process now (forked from the zygote, or each
        importing Triton) while the caller still lowers its graph, not at its first job."""
        self.jobs: queue.Queue[tuple[str, tuple[Any, ...], Future[Any]] | None] = queue.Queue()
        self.env = {**os.environ, **(env or {})}
        pkg_root = str(Path(__file__).resolve().parents[3])  # the dir holding stoker_triton
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (pkg_root, self.env.get("PYTHONPATH", "")) if p
        )
        self.mode = self.env.get(MODE_ENV, "fork") or "fork"
        if self.mode not in ("fork", "subprocess"):
            raise ValueError(f"{MODE_ENV}={self.mode!r}: use 'fork' (default) or 'subprocess'")
        self.zygote: Zygote | None = None
        self.fallback: str | None = None  # why workers are plain subprocesses, if they are
        if self.mode == "fork":
            from .zygote import Zygote

            self.zygote = Zygote(self.env)
        self.threads = [
            threading.Thread(target=self._serve, daemon=True, name=f"stoker-compile-{i}")
            for i in range(n)
        ]
        self.closed = False
        self.start_now = start
        self.started = 0  # worker processes started (tests read it)
        self.ready = threading.Condition()
        self.n_ready = 0  # workers that said hello (imported the compiler)
        self.pids: list[int] = []  # their process ids, in that order
        for t in self.threads:
            t.start()

    def submit(self, name: str, *args: Any) -> Future[Any]:
        if self.closed:
            raise RuntimeError("stoker-triton: the compile worker pool is shut down")
        fut: Future[Any] = Future()
        self.jobs.put((name, args, fut))
        return fut

    def wait_ready(self, n: int | None = None, timeout: float | None = None) -> bool:
        """Wait until `n` (default: every) worker has started and imported the compiler."""
        want = len(self.threads) if n is None else n
        with self.ready:
            return self.ready.wait_for(lambda: self.n_ready >= want, timeout)

    def shutdown(self, wait: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        for _ in self.threads:
            self.jobs.put(None)
        if wait:
            for t in self.threads:
                t.join()
            if self.zygote is not None:
                self.zygote.close()

    def _start(self) -> _Worker:
        # stderr to a file: a pipe nobody drains would fill and stall the worker
        self.started += 1  # one thread per worker: no two threads race on a count's step
        err = tempfile.TemporaryFile()
        worker = self._fork(err) if self.fallback is None and self.zygote is not None else None
        if worker is None:
            proc = subprocess.Popen(
                [sys.executable, "-m", "stoker_triton._internal.compile.workers"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=self.env,
            )
            assert proc.stdin is not None and proc.stdout is not None
            worker = _Worker(proc.stdout, proc.stdin, err, proc=proc)
        try:
            _ok, pid = recv_msg(worker.inp)  # its hello: the compiler is imported
        except (EOFError, OSError) as e:
            tail = worker.stderr()
            worker.end()
            raise EOFError(tail) from e
        with self.ready:
            self.pids.append(pid)
            self.n_ready += 1
            self.ready.notify_all()
        return worker

    def _fork(self, err: IO[bytes]) -> _Worker | None:
        from .zygote import ZygoteError

        zygote = self.zygote
        assert zygote is not None
        try:
            sock, pid = zygote.fork(err)
        except ZygoteError as e:
            if self.fallback is None:
                self.fallback = str(e)
                log.info("compile workers start as subprocesses, not forked: %s", e)
            return None
        return _Worker(
            sock.makefile("rb"),
            sock.makefile("wb"),
            err,
            sock=sock,
            kill=lambda: zygote.kill(pid),
        )

    def _serve(self) -> None:
        worker: _Worker | None = None
        try:
            if self.start_now:
                worker = self._try_start()
            while True:
                item = self.jobs.get()
                if item is None:
                    return
                name, args, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    if worker is None or worker.dead():
                        if worker is not None:
                            worker.end()
                        worker = None
                        worker = self._start()
                    send_msg(worker.out, (name, args))
                    ok, value = recv_msg(worker.inp)
                except (EOFError, OSError) as e:
                    err = worker.stderr() if worker is not None else str(e)
                    if worker is not None:
                        worker.end()
                    worker = None
                    fut.set_exception(
                        RuntimeError(f"stoker-triton: a compile worker died: {err[-2000:]}")
                    )
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(RuntimeError(value))
        finally:
            if worker is not None:
                worker.end()

    def _try_start(self) -> _Worker | None:
        try:
            return self._start()
        except (EOFError, OSError):  # its first job starts another and reports the error
            return None


def serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """A worker's loop: hello once the compiler is imported, then job -> result."""
    os.environ["TRITON_INTERPRET"] = "0"
    from stoker_triton._internal.compile import xcompile

    xcompile.keep_torch_out()
    xcompile.import_compiler()  # before the hello: a started pool is ready sooner
    send_msg(out, (True, os.getpid()))
    while True:
        try:
            name, args = recv_msg(inp)
        except EOFError:
            return
        try:
            send_msg(out, (True, getattr(xcompile, name)(*args)))
        except Exception as e:  # the job's error, back to the pool
            send_msg(out, (False, f"{type(e).__name__}: {e}"))


def _main() -> None:
    # Results go out on a private copy of stdout; anything the compiler prints
    # to fd 1 lands on stderr instead of corrupting the protocol.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    _main()
