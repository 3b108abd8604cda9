"""Sweep torch's OpInfo database through stoker-triton (forward, or --backward
joint graphs built with autograd.grad) under the interpreter; print the pass
rate and every failure with its stage and reason.

    TRITON_INTERPRET=1 python packages/stoker-triton/scripts/opinfo_sweep.py [--backward] [--limit N]

A sample "fails at trace" when make_fx cannot trace it (not counted against
the compiler); random ops (rand*, bernoulli, dropout, rrelu, multinomial) and
empty* differ from eager by design.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import warnings
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--limit", type=int, default=None, help="only the first N OpInfos")
    ap.add_argument("--samples", type=int, default=2)
    args = ap.parse_args()

    import torch
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from stoker_triton import compile_graph

    warnings.filterwarnings("ignore")

    class Timeout(Exception):
        pass

    def on_alarm(*_: Any) -> None:
        raise Timeout

    signal.signal(signal.SIGALRM, on_alarm)
    counts: collections.Counter[str] = collections.Counter()
    failures: dict[str, tuple[str, str]] = {}
    for op in op_db[: args.limit]:
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        if args.backward and not op.supports_autograd:
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=args.backward))
        except Exception:
            continue
        for s in samples[: args.samples]:
            flat, spec = tree_flatten((s.input, s.args, s.kwargs))
            tidx = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]

            def fwd(
                *ts: Any, flat: Any = flat, spec: Any = spec, tidx: Any = tidx, op: Any = op
            ) -> Any:
                fl = list(flat)
                for i, t in zip(tidx, ts):
                    fl[i] = t
                inp, a, kw = tree_unflatten(fl, spec)
                return op(inp, *a, **kw)

            def joint(*ts: Any, fwd: Any = fwd) -> Any:
                outs = [
                    o
                    for o in tree_flatten(fwd(*ts))[0]
                    if isinstance(o, torch.Tensor) and o.requires_grad
                ]
                ins = [t for t in ts if t.requires_grad]
                return torch.autograd.grad([o.sum() for o in outs], ins, allow_unused=True)

            f = joint if args.backward else fwd
            ts = [flat[i] if args.backward else flat[i].detach() for i in tidx]
            name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
            stage = "trace"
            signal.alarm(30)
            try:
                gm = make_fx(f, decomposition_table=core_aten_decompositions())(*ts)
                stage = "compile"
                fn = compile_graph(gm, ts)
                stage = "run"
                out, ref = fn(*ts), gm(*ts)
                stage = "compare"
                lo, lr = tree_flatten(out)[0], tree_flatten(ref)[0]
                assert len(lo) == len(lr), "output count"
                for a, b in zip(lo, lr):
                    if isinstance(b, torch.Tensor):
                        torch.testing.assert_close(
                            a, b, atol=1e-4, rtol=1e-3, equal_nan=True, check_stride=False
                        )
                counts["pass"] += 1
            except Exception as e:
                counts["trace_fail" if stage == "trace" else f"fail_{stage}"] += 1
                if stage != "trace":
                    failures[name] = (
                        stage,
                        f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                    )
            finally:
                signal.alarm(0)
    traced = sum(v for k, v in counts.items() if k != "trace_fail")
    print(
        f"{'backward' if args.backward else 'forward'}: {counts['pass']}/{traced} traced samples pass ({100 * counts['pass'] / max(traced, 1):.1f}%); {dict(counts)}"
    )
    for name, (stage, why) in failures.items():
        print(f"  {name}: {stage}: {why}")


if __name__ == "__main__":
    main()
