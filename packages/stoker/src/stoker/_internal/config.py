"""Options of `stoker.compile` and the backend they select.

`CompileOptions` is validated once, up front, so a typo fails at
`stoker.compile(...)` and not at the first call.  Environment variables:
``STOKER_REPORT=out.html`` (write the compile report), ``STOKER_LOGS`` (see
`logs`), ``STOKER_BACKEND`` (default for ``backend="auto"`` resolution:
``aten``, ``c``, ``triton`` or ``interpret``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

BackendName = Literal["auto", "aten", "c", "triton", "interpret"]
BACKENDS: tuple[str, ...] = ("auto", "aten", "c", "triton", "interpret")
PARTITIONERS: tuple[str, ...] = ("min_cut", "default")
MODES: tuple[str, ...] = ("default", "max-autotune", "reduce-overhead")


class StokerConfigError(ValueError):
    """An option of `stoker.compile` / the ``stoker`` backend was invalid."""


@dataclass(frozen=True)
class CompileOptions:
    """Everything `stoker.compile` and ``torch.compile(backend="stoker")`` can be told."""

    # None: automatic dynamic (static first; a dimension seen to change recompiles once as
    # symbolic). True: every dimension symbolic from the start. False: always static.
    dynamic: bool | None = None
    # auto: Triton on CUDA inputs, C kernels on CPU ones (the aten executor where no C
    # compiler is found); aten: always the aten executor; c: fused C kernels (CPU);
    # triton: Triton kernels (CUDA); interpret: Triton kernels under TRITON_INTERPRET=1 (CPU).
    backend: str = "auto"
    # Compile the backwards of stoker-compiled forwards with stoker-autograd (see stoker.reset()).
    compiled_autograd: bool = True
    # Fraction [0, 1] of the forward activations the partitioner may save for backward
    # (0 recomputes all it may, 1 saves all); None: the partitioner's own choice.
    memory_budget: float | None = None
    # Write the compile report (one HTML file) here; None reads STOKER_REPORT.
    report: str | None = None
    # min_cut (saves the cheapest cut) or default (saves what the forward computed).
    partitioner: str = "min_cut"
    # Fail on a graph break instead of falling back to Python between graphs.
    fullgraph: bool = False
    # Recompiles per frame before Dynamo falls back to eager for it.
    recompile_limit: int = 8
    # default: one block/warp configuration per Triton kernel, chosen by heuristics (each
    # kernel compiled once); max-autotune: time several on the GPU, keep the fastest
    # (remembered on disk, in STOKER_CACHE_DIR); reduce-overhead: record each compiled
    # graph (forward, backward) into a CUDA graph per size key and replay it (`cudagraphs`).
    mode: str = "default"
    # reduce-overhead: size keys recorded per compiled graph; later keys run plain launches.
    cudagraph_limit: int = 8
    # Options passed through to stoker_capture's config unchanged.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_types(self)
        if self.backend not in BACKENDS:
            raise StokerConfigError(
                f"backend={self.backend!r} is not a stoker backend; choose one of {', '.join(BACKENDS)}"
            )
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise StokerConfigError(
                f"dynamic={self.dynamic!r}: use None (automatic), True or False"
            )
        if self.memory_budget is not None and not (0.0 <= self.memory_budget <= 1.0):
            raise StokerConfigError(
                f"memory_budget={self.memory_budget!r} must be a fraction in [0, 1] of the "
                "forward activations to keep, or None"
            )
        if self.partitioner not in PARTITIONERS:
            raise StokerConfigError(
                f"partitioner={self.partitioner!r}; choose one of {', '.join(PARTITIONERS)}"
            )
        if self.mode not in MODES:
            raise StokerConfigError(f"mode={self.mode!r}; choose one of {', '.join(MODES)}")
        if self.cudagraph_limit < 1:
            raise StokerConfigError(f"cudagraph_limit={self.cudagraph_limit} must be at least 1")
        if self.recompile_limit < 1:
            raise StokerConfigError(f"recompile_limit={self.recompile_limit} must be at least 1")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> CompileOptions:
        """Build from keyword options; unknown names are an error that lists the known ones."""
        known = set(cls.__dataclass_fields__) - {"extra"}
        extra = kwargs.pop("extra", None) or {}
        if not isinstance(extra, dict):
            raise StokerConfigError(f"extra={extra!r}: use a dict of stoker-capture options")
        extra = dict(extra)
        if isinstance(kwargs.get("report"), os.PathLike):
            kwargs["report"] = os.fspath(kwargs["report"])
        unknown = set(kwargs) - known
        if unknown:
            raise StokerConfigError(
                f"unknown stoker option(s) {', '.join(sorted(unknown))}; "
                f"known: {', '.join(sorted(known))} (capture options go in extra={{...}})"
            )
        opts = cls(**kwargs, extra=extra)
        if opts.report is None and os.environ.get("STOKER_REPORT"):
            opts = replace(opts, report=os.environ["STOKER_REPORT"])
        return opts


def _check_types(opts: CompileOptions) -> None:
    """A `StokerConfigError` for an option of the wrong type (``fullgraph="no"`` would
    otherwise be taken as true, ``recompile_limit="8"`` fail deep inside Dynamo)."""
    for name in ("compiled_autograd", "fullgraph"):
        value = getattr(opts, name)
        if not isinstance(value, bool):
            raise StokerConfigError(f"{name}={value!r}: use True or False")
    for name in ("recompile_limit", "cudagraph_limit"):
        value = getattr(opts, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise StokerConfigError(f"{name}={value!r}: use a whole number (at least 1)")
    budget = opts.memory_budget
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float)):
        raise StokerConfigError(
            f"memory_budget={budget!r}: use a number in [0, 1] (the fraction of forward "
            "activations to keep) or None"
        )
    if opts.report is not None and not isinstance(opts.report, str | os.PathLike):
        raise StokerConfigError(f"report={opts.report!r}: use a file path or None")
    if not isinstance(opts.extra, dict):
        raise StokerConfigError(f"extra={opts.extra!r}: use a dict of stoker-capture options")


def triton_available() -> bool:
    """Whether `triton` can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(requested: str, devices: Iterable[Any]) -> str:
    """The executor for a graph whose inputs live on ``devices``: aten, c, triton or
    interpret.

    ``auto`` picks Triton when any input is on CUDA and triton is installed; on the
    CPU, fused C kernels when stoker-triton and a C compiler are there, else the aten
    executor, saying once why (``STOKER_BACKEND`` overrides what ``auto`` picks).
    """
    if requested == "auto":
        env = os.environ.get("STOKER_BACKEND")
        if env:
            if env not in BACKENDS or env == "auto":
                raise StokerConfigError(f"STOKER_BACKEND={env!r}; use aten, c, triton or interpret")
            requested = env
        else:
            cuda = any(getattr(d, "type", str(d)) == "cuda" for d in devices)
            if cuda:
                return "triton" if triton_available() else "aten"
            return "c" if c_backend_missing() is None else "aten"
    if requested == "c":
        why = c_backend_missing()
        if why is not None:
            raise StokerConfigError(f"backend='c' {why}; or use backend='aten'")
        if any(getattr(d, "type", str(d)) == "cuda" for d in devices):
            raise StokerConfigError(
                "backend='c' compiles C kernels for CPU inputs, but the graph's inputs are "
                "on CUDA; use backend='triton' (or 'auto')"
            )
    if requested in ("triton", "interpret") and not triton_available():
        raise StokerConfigError(
            f"backend={requested!r} needs the `triton` package, which is not installed; "
            "install triton or use backend='aten'"
        )
    if requested == "triton":
        if not any(getattr(d, "type", str(d)) == "cuda" for d in devices):
            raise StokerConfigError(
                "backend='triton' needs CUDA inputs, but the graph's inputs are on the CPU; "
                "use backend='interpret' to run the Triton kernels under the interpreter, "
                "or backend='aten'"
            )
    if requested == "interpret":
        ensure_interpret_env()
    return requested


_C_MISSING: list[str | None] = []  # the answer of `c_backend_missing`, once per process


def c_backend_missing() -> str | None:
    """Why the C backend cannot run here (None: it can): stoker-triton (and triton, which
    it needs) installed, and a C compiler found (``STOKER_CC``, else cc, gcc, clang).
    The first time it cannot, one log line on ``stoker.backend`` says why and what to
    install; `backend="auto"` then runs the aten executor."""
    if _C_MISSING:
        return _C_MISSING[0]
    why: str | None = None
    if not triton_available() or importlib.util.find_spec("stoker_triton") is None:
        why = "needs stoker-triton and triton (pip install ./packages/stoker-triton)"
    else:
        from stoker_triton._internal.compile.ccompile import find_compiler

        if find_compiler() is None:
            env = os.environ.get("STOKER_CC")
            what = f"STOKER_CC={env!r} is not an executable" if env else "no cc, gcc or clang"
            why = (
                f"needs a C compiler with OpenMP, and found none ({what}): install gcc "
                "(Debian/Ubuntu: apt-get install gcc) or set STOKER_CC"
            )
    if why is not None:
        import logging

        logging.getLogger("stoker.backend").warning(
            "stoker: the CPU backend %s; running the aten executor instead", why
        )
    _C_MISSING.append(why)
    return why


def check_device(device: str | None) -> str:
    """The device a CLI command was given (``cpu``, ``cuda``, ``cuda:N``; None: cuda when
    torch sees a GPU, else cpu), or a `StokerConfigError` that says what to pass instead."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise StokerConfigError(f"--device {device}: not a device; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise StokerConfigError(f"--device {device}: stoker runs on cpu or cuda")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = (
                "this torch is built without CUDA"
                if torch.version.cuda is None
                else "torch sees no CUDA device"
            )
            raise StokerConfigError(
                f"--device {device}: {why}; run on the CPU with --device cpu (or leave --device out)"
            )
        if dev.index is not None and dev.index >= count:
            raise StokerConfigError(
                f"--device {device}: this machine has {count} CUDA device(s); "
                f"use --device cuda:0 to cuda:{count - 1}"
            )
    return device


def ensure_interpret_env() -> None:
    """Set ``TRITON_INTERPRET=1`` (it must be set before a Triton kernel is first jitted)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        # Kernels made after this point are interpreted; earlier ones were already jitted
        # for a GPU.  Setting it before importing triton avoids the question.
        warnings.warn(
            "backend='interpret' set TRITON_INTERPRET=1 after triton was imported; kernels "
            "jitted earlier in this process are not interpreted. Set TRITON_INTERPRET=1 in "
            "the environment before starting Python to be sure.",
            stacklevel=3,
        )
