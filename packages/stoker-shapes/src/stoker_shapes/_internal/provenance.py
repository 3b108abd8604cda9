"""Where a guard came from: the aten op being traced and the user's line.

The shape env keeps a `SLoc` per guard, but it points at the innermost frame
outside torch, which inside stoker is stoker's own code.  We record our own
origin at the moment a guard is added: the op is read from the innermost
``__torch_dispatch__`` frame on the stack, the user's line from the innermost
frame outside torch, stoker and the standard library (or, when an FX graph is
being retraced, from the node's recorded stack trace).
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_STOKER_MARKERS = tuple(
    os.sep + name + os.sep
    for name in ("stoker_shapes", "stoker_capture", "stoker_autograd", "stoker_triton", "stoker")
)
_FRAME_RE = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s*(?P<code>.*)'
)


def is_internal_file(filename: str) -> bool:
    """True for torch's, stoker's and the standard library's files."""
    if filename.startswith(_TORCH_DIR) or filename.startswith(_STDLIB_DIR):
        return True
    if filename.startswith("<") and filename != "<stdin>":
        return True  # generated code (FX graphs, our guard functions)
    if any(marker in filename for marker in _STOKER_MARKERS) and "/tests" not in filename:
        return True
    return "site-packages" + os.sep + "sympy" in filename


@dataclass(frozen=True, slots=True)
class Origin:
    """The op and the user frame that made a guard (any field may be unknown)."""

    op: str | None = None  # e.g. "aten.view.default"
    filename: str | None = None
    lineno: int | None = None
    code: str | None = None  # the user's source line, stripped
    note: str | None = None  # a non-op reason, e.g. "Dim 'batch' shared by ..."

    @property
    def location(self) -> str | None:
        if self.filename is None:
            return None
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    def describe(self) -> str:
        """``made by aten.view at model.py:12 (x.view(8, -1))``."""
        parts: list[str] = []
        if self.note:
            parts.append(self.note)
        if self.op:
            parts.append(f"made by {self.op}")
        if self.location:
            where = f"at {self.location}"
            if self.code:
                where += f" ({self.code})"
            parts.append(where)
        return " ".join(parts) if parts else "origin unknown"

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("op", "filename", "lineno", "code", "note")}

    @staticmethod
    def from_json(data: dict[str, Any] | None) -> Origin | None:
        return None if data is None else Origin(**data)


def _op_name(func: object) -> str | None:
    if isinstance(func, torch._ops.OpOverload):
        return f"{func.namespace}.{func._opname}.{func._overloadname}"
    return None


def _origin_from_stack_trace(stack_trace: str) -> tuple[str, int, str] | None:
    frames = [m for m in _FRAME_RE.finditer(stack_trace) if not is_internal_file(m["file"])]
    if not frames:
        return None
    last = frames[-1]
    return last["file"], int(last["line"]), last["code"].strip()


def _origin(op: str | None, user: tuple[str, int, str] | None, note: str | None = None) -> Origin:
    """``op`` at the ``user`` frame (file, line, source line); without one, at the user
    frame of the node FX is tracing (its recorded stack trace), if any."""
    if user is None:
        meta = torch.fx.traceback.get_current_meta()
        trace = meta.get("stack_trace") if meta else None
        if isinstance(trace, str):
            user = _origin_from_stack_trace(trace)
    if user is None:
        return Origin(op=op, note=note)
    return Origin(op=op, filename=user[0], lineno=user[1], code=user[2] or None, note=note)


def current_origin(note: str | None = None, skip: int = 1) -> Origin:
    """The origin of whatever is being traced right now."""
    frame: types.FrameType | None = sys._getframe(skip)
    op: str | None = None
    user: tuple[str, int, str] | None = None
    while frame is not None:
        code = frame.f_code
        if op is None and code.co_name in ("__torch_dispatch__", "dispatch"):
            op = _op_name(frame.f_locals.get("func"))
        if user is None and not is_internal_file(code.co_filename):
            line = linecache.getline(code.co_filename, frame.f_lineno).strip()
            user = (code.co_filename, frame.f_lineno, line)
        if op is not None and user is not None:
            break
        frame = frame.f_back
    return _origin(op, user, note)


def origin_from_traceback(tb: types.TracebackType | None) -> Origin:
    """The innermost user frame and op of an exception's traceback."""
    op: str | None = None
    user: tuple[str, int, str] | None = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in ("__torch_dispatch__", "dispatch"):
            op = _op_name(tb.tb_frame.f_locals.get("func")) or op
        if not is_internal_file(code.co_filename):
            line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            user = (code.co_filename, tb.tb_lineno, line)
        tb = tb.tb_next
    return _origin(op, user)
