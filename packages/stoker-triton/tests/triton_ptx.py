"""The PTX a GPU would run for a compiled graph's kernels, built on the CPU.

Triton's interpreter computes with NumPy, so what the GPU compiler does with a
kernel (saturating conversions, LLVM folds, miscompiles) never shows in a CPU
run. `kernel_ptx` compiles a kernel's *native* module (the GPU prelude, not the
interpreter's) for sm_90 with the installed Triton in a subprocess
(TRITON_INTERPRET=0 there), so tests can check the instructions on the CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any

from stoker_triton._internal.codegen.ops import PRELUDE, PRELUDE_BF16

_CHILD = r"""
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stoker_triton._internal.compile import xcompile
path, specs, xblock = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
spec = importlib.util.spec_from_file_location("stoker_ptx_kernel", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fn = mod.kernel
args = [xcompile._stand_in(tuple(s)) if isinstance(s, list) else s for s in specs]
sig, consts, attrs = xcompile.signature(fn.arg_names, args, {"XBLOCK": xblock, "RBLOCK": 1})
src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
print(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def native_module_source(kernel_source: str) -> str:
    """A kernel module as the GPU runs it (the native bfloat16 prelude)."""
    body = re.sub(r"def \w+\(", "def kernel(", kernel_source, count=1)
    return (
        "import triton\nimport triton.language as tl\n"
        + PRELUDE
        + PRELUDE_BF16["native"]
        + "\n\n"
        + body
    )


def kernel_ptx(fn: Any, args: list[Any], index: int = 0, xblock: int = 512) -> str:
    """PTX for sm_90 of kernel `index` of the compiled graph `fn`, specialized
    for `args` (its launch arguments: tensors by dtype, 16-byte aligned, then ints)."""
    k = fn.report.kernels[index]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(native_module_source(k.source))
    specs = [
        ["tensor", str(a.dtype).removeprefix("torch."), True] if hasattr(a, "dtype") else a
        for a in args
    ]
    import json

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    try:
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, f.name, json.dumps(specs), str(xblock)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        os.unlink(f.name)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def instructions(ptx: str) -> list[str]:
    """PTX instructions with registers and immediates blanked (`cvt.rzi.s32.f32 R, R;`)."""
    out = []
    for line in ptx.splitlines():
        line = re.sub(r"^@!?%\w+\s+", "", line.strip())  # drop a predicate guard
        if not line or line.startswith(("//", ".", "$", "{", "}", "(", ")")):
            continue
        out.append(re.sub(r"%\w+", "R", line))
    return out
