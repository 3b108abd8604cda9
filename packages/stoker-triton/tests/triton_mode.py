"""How the stoker-triton tests choose between native kernels and Triton's interpreter.

On a machine with CUDA the tests run natively by default; without one they run
under the interpreter (and cross-compile every kernel for sm_90). An explicit
TRITON_INTERPRET=1 opts back into the interpreter, TRITON_INTERPRET=0 into
native kernels. Pure (environment in, environment out) so it is tested on CPU.
"""

from __future__ import annotations

from collections.abc import MutableMapping


def select_triton_mode(environ: MutableMapping[str, str], cuda_available: bool) -> str:
    """Fill in TRITON_INTERPRET (and, under the interpreter, the default
    cross-compile target) in `environ`; returns "native" or "interpret"."""
    value = environ.get("TRITON_INTERPRET", "").strip()
    if value not in ("0", "1"):
        if value:
            raise ValueError(f"TRITON_INTERPRET={value!r}: use 1 (interpreter) or 0 (native)")
        value = "0" if cuda_available else "1"
    environ["TRITON_INTERPRET"] = value
    if value == "1":
        # Under the interpreter, also compile every kernel the tests generate for an
        # H100 (sm_90) with Triton's real compiler: no GPU needed, and it catches what
        # the interpreter forgives. STOKER_TRITON_CHECK_TARGETS="" skips it.
        environ.setdefault("STOKER_TRITON_CHECK_TARGETS", "cuda:90")
        return "interpret"
    return "native"
