"""A pool of compile worker processes that never imports the user's script.

`multiprocessing`'s spawn and forkserver start methods re-import `__main__`
in every child, so a training script without an `if __name__ == "__main__":`
guard would run again in each worker (and try to start workers of its own).
Fork is unsafe once CUDA or threads are up. So, like Inductor's compile
workers, these are plain subprocesses running this module: jobs go down
stdin and results come back on a private pipe, pickled, length-prefixed.

A job names a function in `stoker_triton._internal.xcompile` and its
arguments (plain data). A worker that dies fails the job it held with its
stderr tail and is replaced for the next job.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

_LEN = struct.Struct("<Q")


def _send(f: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _recv(f: IO[bytes]) -> Any:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


class Pool:
    """`n` worker processes; `submit(name, *args)` runs `xcompile.<name>(*args)`."""

    def __init__(self, n: int, env: dict[str, str] | None = None, start: bool = False) -> None:
        """`start`: start every worker process now (each imports Triton while the
        caller still lowers its graph), not at its first job."""
        self.jobs: queue.Queue[tuple[str, tuple[Any, ...], Future[Any]] | None] = queue.Queue()
        self.env = {**os.environ, **(env or {})}
        pkg_root = str(Path(__file__).resolve().parents[2])  # the dir holding stoker_triton
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (pkg_root, self.env.get("PYTHONPATH", "")) if p
        )
        self.threads = [
            threading.Thread(target=self._serve, daemon=True, name=f"stoker-compile-{i}")
            for i in range(n)
        ]
        self.closed = False
        self.start_now = start
        self.started = 0  # worker processes started (tests read it)
        for t in self.threads:
            t.start()

    def submit(self, name: str, *args: Any) -> Future[Any]:
        if self.closed:
            raise RuntimeError("stoker-triton: the compile worker pool is shut down")
        fut: Future[Any] = Future()
        self.jobs.put((name, args, fut))
        return fut

    def shutdown(self, wait: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        for _ in self.threads:
            self.jobs.put(None)
        if wait:
            for t in self.threads:
                t.join()

    def _start(self) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
        # stderr to a file: a pipe nobody drains would fill and stall the worker
        self.started += 1  # one thread per worker: no two threads race on a count's step
        err = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [sys.executable, "-m", "stoker_triton._internal.workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=self.env,
        )
        return proc, err

    def _serve(self) -> None:
        proc: subprocess.Popen[bytes] | None = None
        errf: IO[bytes] | None = None
        if self.start_now:
            proc, errf = self._start()
        try:
            while True:
                item = self.jobs.get()
                if item is None:
                    return
                name, args, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                if proc is None or proc.poll() is not None:
                    proc, errf = self._start()
                assert proc.stdin is not None and proc.stdout is not None
                try:
                    _send(proc.stdin, (name, args))
                    ok, value = _recv(proc.stdout)
                except (EOFError, BrokenPipeError, OSError):
                    proc.kill()
                    proc.wait()
                    err = ""
                    if errf is not None:
                        errf.seek(0)
                        err = errf.read().decode(errors="replace")
                    proc = None
                    fut.set_exception(
                        RuntimeError(f"stoker-triton: a compile worker died: {err[-2000:]}")
                    )
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(RuntimeError(value))
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _main() -> None:
    # Results go out on a private copy of stdout; anything the compiler prints
    # to fd 1 lands on stderr instead of corrupting the protocol.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    os.environ["TRITON_INTERPRET"] = "0"
    from stoker_triton._internal import xcompile

    xcompile.import_compiler()  # before the first job: a started pool is ready sooner

    while True:
        try:
            name, args = _recv(inp)
        except EOFError:
            return
        try:
            _send(out, (True, getattr(xcompile, name)(*args)))
        except Exception as e:  # the job's error, back to the pool
            _send(out, (False, f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    _main()
