"""How close stoker's float16/bfloat16 kernels are to eager, bit for bit.

For a few fused chains, the share of elements where stoker's result equals
eager's exactly (and the largest difference in ulps), next to what keeping the
chain in float32 and rounding once at the end (Inductor's default) would give.
The numbers are in docs/triton.md ("Half precision and dtype semantics").

    TRITON_INTERPRET=1 python tools/half_vs_eager.py    # CPU: the interpreter vs CPU eager
    python tools/half_vs_eager.py --device cuda         # GPU: native kernels vs CUDA eager
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

CHAINS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "(x + 0.01) - x": lambda x: (x + 0.01) - x,
    "exp(x) - exp2(x) + expm1(x)": lambda x: torch.exp(x) - torch.exp2(x) + torch.expm1(x),
    "tanh(x) * sigmoid(x) + erf(x)": lambda x: torch.tanh(x) * torch.sigmoid(x) + torch.erf(x),
    "gelu(x) + silu(x)": lambda x: F.gelu(x) + F.silu(x),
    "rsqrt(abs(x) + 1) * sqrt(abs(x))": lambda x: torch.rsqrt(x.abs() + 1) * torch.sqrt(x.abs()),
    "cos(x) * 2": lambda x: torch.cos(x) * 2,
    "softmax(x)": lambda x: torch.softmax(x, -1),
    "layer_norm(x)": lambda x: F.layer_norm(x, (x.shape[-1],)),
}


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of the spacing of b's dtype at b."""
    fi = torch.finfo(b.dtype)
    spacing = b.double().abs().clamp(min=fi.tiny) * fi.eps
    return float(((a.double() - b.double()).abs() / spacing).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="64,256")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton import compile_graph

    shape = tuple(int(s) for s in args.shape.split(","))
    torch.manual_seed(0)
    print(
        "| chain | dtype | stoker = eager | stoker max ulp | float32 chain, one rounding = eager |"
    )
    print("|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float16):
        for name, f in CHAINS.items():
            x = torch.randn(shape, dtype=dtype, device=args.device) * 2
            gm = make_fx(f, decomposition_table=core_aten_decompositions())(x)
            out = compile_graph(gm, [x])(x)
            out = out[0] if isinstance(out, list | tuple) else out
            ref = f(x)
            once = f(x.float()).to(dtype)
            same = 100 * float((out == ref).float().mean())
            same_once = 100 * float((once == ref).float().mean())
            dt = str(dtype).removeprefix("torch.")
            print(
                f"| `{name}` | {dt} | {same:.2f}% | {max_ulps(out, ref):.1f} | {same_once:.2f}% |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
