"""OpInfo sweep: every op in torch's `op_db` through `stoker_capture.aot_function`.

For each op (float32 by default, CPU) and each of its first few sample inputs, the op is
compiled with `aot_function` (capture, partition, the aten executor or
another compiler) and its outputs, and its input gradients if the op supports
autograd, are compared with eager PyTorch.  Prints the pass rate among ops
that support autograd and every failure; expected failures (with a reason
each) live in `tools/opinfo_expected.py`.

    python tools/opinfo_sweep.py                       # the whole sweep
    python tools/opinfo_sweep.py --ops add,mul,softmax # some ops
    python tools/opinfo_sweep.py --limit 50            # the first 50 ops
    python tools/opinfo_sweep.py --triton              # compile with stoker_triton.compile_graph
    python tools/opinfo_sweep.py --c                   # the same, to C kernels (the CPU backend)
    python tools/opinfo_sweep.py --triton --dtype bfloat16  # samples in bfloat16 (or float16)
    python tools/opinfo_sweep.py --partition min_cut   # partition with min_cut_partition
    python tools/opinfo_sweep.py --bytes               # saved bytes: min_cut vs torch's min-cut
    python tools/opinfo_sweep.py --backend torch       # torch's own aot_function (harness check)

Exit status 1 when an op fails that is not an expected failure.  The
functions here are also used by the quick CI subset
(packages/stoker-capture/tests/test_opinfo_quick.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from types import FrameType, ModuleType
from typing import Any

import torch
import torch.utils._pytree as pytree

HERE = pathlib.Path(__file__).resolve().parent
DTYPE = torch.float32
DEVICE = "cpu"
RTOL = 1e-4
ATOL = 1e-4
# (rtol, atol) per --dtype. Half precision: one rounding of the result
# (2**-10, 2**-7 relative) plus inputs a decomposition reads rounded; gradients
# go through decomposed formulas that round elsewhere than eager: GRAD_SCALE x.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
GRAD_SCALE = {torch.float32: 1.0, torch.float16: 4.0, torch.bfloat16: 4.0}

Compile = Callable[[Callable[..., Any]], Callable[..., Any]]


def load_expected() -> ModuleType:
    """tools/opinfo_expected.py, loaded by path (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "stoker_opinfo_expected", HERE / "opinfo_expected.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EXPECTED = load_expected()


# --------------------------------------------------------------------------- ops


def op_key(op: Any) -> str:
    """`name` or `name.variant`, as in torch's test names."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def load_ops(names: Sequence[str] | None = None, limit: int | None = None) -> list[Any]:
    """OpInfos supporting DTYPE on DEVICE, optionally only `names` (op or op.variant)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if DTYPE in op.supported_dtypes(DEVICE)]
    if names:
        wanted = set(names)
        ops = [op for op in ops if op_key(op) in wanted or op.name in wanted]
        missing = wanted - {op_key(op) for op in ops} - {op.name for op in ops}
        if missing:
            raise SystemExit(f"opinfo_sweep: no {DTYPE} {DEVICE} OpInfo named {sorted(missing)}")
    if limit is not None:
        ops = ops[:limit]
    return ops


# --------------------------------------------------------------------------- compilers


def stoker_compile(
    compiler: Any = None, partition: str = "default", check: bool = False
) -> Compile:
    """`stoker_capture.aot_function(fn, compiler=compiler, partition=..., debug_checks=check)`."""
    import stoker_capture

    aot_function = getattr(stoker_capture, "aot_function", None)
    if aot_function is None:
        raise SystemExit("opinfo_sweep: stoker_capture has no aot_function yet")
    kw: dict[str, Any] = {"debug_checks": check}
    if partition == "min_cut":
        from stoker_capture._internal.partition.mincut import min_cut_partition

        kw["partition"] = min_cut_partition
    return lambda fn: aot_function(fn, compiler=compiler, **kw)


def triton_compile(partition: str = "default", check: bool = False) -> Compile:
    if DEVICE == "cpu":
        # CPU tensors run Triton kernels only under the interpreter; set before triton loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import stoker_triton
    except ImportError as e:
        raise SystemExit(f"opinfo_sweep --triton: stoker_triton is not importable ({e})") from e
    return stoker_compile(stoker_triton.compile_graph, partition, check)


def c_compile(partition: str = "default", check: bool = False) -> Compile:
    """stoker-triton's CPU backend: the same pipeline, C kernels (`options={"target": "c"}`)."""
    from stoker_triton import compile_graph

    def compiler(gm: Any, example_inputs: Any) -> Any:
        return compile_graph(gm, example_inputs, options={"target": "c"})

    return stoker_compile(compiler, partition, check)


def torch_compile() -> Compile:
    """torch's own aot_function with the nop compiler: checks the harness, not stoker."""
    from functorch.compile import aot_function, nop

    return lambda fn: aot_function(fn, fw_compiler=nop)


# --------------------------------------------------------------------------- one sample


@dataclasses.dataclass(slots=True)
class OpResult:
    key: str
    status: str  # pass | fail | xfail | xpass | skip
    autograd: bool  # the op supports autograd (counts towards the pass rate)
    samples: int = 0  # samples checked
    error: str = ""  # first failure: "sample i: Type: message"
    reason: str = ""  # expected failure / skip reason from opinfo_expected
    seconds: float = 0.0


class _Timeout(Exception):
    pass


class EagerFailed(Exception):
    """Eager PyTorch itself fails on this sample (e.g. a CUDA-only op): nothing to compare."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise _Timeout("op took longer than its time limit")


def _split_sample(sample: Any) -> tuple[list[torch.Tensor], Callable[[list[Any]], Any]]:
    """Tensors of (input, args, kwargs) as a flat list, and how to rebuild the call."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def rebuild(tensors: list[Any]) -> Any:
        new = list(leaves)
        for pos, t in zip(positions, tensors):
            new[pos] = t
        return pytree.tree_unflatten(new, spec)

    return [leaves[i] for i in positions], rebuild


def _fresh(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _tensor_leaves(out: Any) -> list[Any]:
    return pytree.tree_leaves(out)


def _compare(got: Any, ref: Any, what: str, *, values: bool, scale: float = 1.0) -> None:
    g_leaves, r_leaves = _tensor_leaves(got), _tensor_leaves(ref)
    if len(g_leaves) != len(r_leaves):
        raise AssertionError(f"{what}: {len(g_leaves)} values, eager has {len(r_leaves)}")
    for i, (g, r) in enumerate(zip(g_leaves, r_leaves)):
        if isinstance(r, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                raise AssertionError(f"{what}[{i}]: got {type(g).__name__}, eager has a tensor")
            if g.shape != r.shape or g.dtype != r.dtype:
                raise AssertionError(
                    f"{what}[{i}]: got {g.dtype}{list(g.shape)}, eager has {r.dtype}{list(r.shape)}"
                )
            if values:
                torch.testing.assert_close(
                    g.detach(),
                    r.detach(),
                    rtol=RTOL * scale,
                    atol=ATOL * scale,
                    equal_nan=True,
                    msg=lambda m, i=i: f"{what}[{i}]: {m}",
                )
        elif values and g != r and not (g != g and r != r):  # nan == nan for floats
            raise AssertionError(f"{what}[{i}]: got {g!r}, eager has {r!r}")


def check_sample(
    compile_fn: Compile, op: Any, sample: Any, *, grads: bool, values: bool = True
) -> None:
    """Compile `op` over one sample; compare outputs and (if `grads`) input gradients with eager."""
    tensors, rebuild = _split_sample(sample)

    def fn(*ts: torch.Tensor) -> Any:
        inp, args, kwargs = rebuild(list(ts))
        return op(inp, *args, **kwargs)

    eager_in, comp_in = _fresh(tensors), _fresh(tensors)
    with torch.enable_grad():
        try:
            ref = fn(*eager_in)
        except Exception as e:
            raise EagerFailed(_short(e)) from e
        compiled = compile_fn(fn)
        got = compiled(*comp_in)
    _compare(got, ref, "output", values=values)
    if not grads:
        return
    wrt = [i for i, t in enumerate(eager_in) if t.requires_grad]
    r_outs = [o for o in _tensor_leaves(ref) if isinstance(o, torch.Tensor) and o.requires_grad]
    g_outs = [o for o in _tensor_leaves(got) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not wrt or not r_outs:
        return
    if len(g_outs) != len(r_outs):
        raise AssertionError(
            f"{len(g_outs)} compiled outputs require grad, eager has {len(r_outs)}"
        )
    cot = [torch.randn_like(o) for o in r_outs]
    try:
        r_grads = torch.autograd.grad(r_outs, [eager_in[i] for i in wrt], cot, allow_unused=True)
    except Exception:  # eager's backward rejects this cotangent: forward only
        return
    g_grads = torch.autograd.grad(g_outs, [comp_in[i] for i in wrt], cot, allow_unused=True)
    zeros = lambda gs, ins: [  # noqa: E731 - an unused input's grad is zero
        torch.zeros_like(ins[i]) if g is None else g for g, i in zip(gs, wrt)
    ]
    _compare(
        zeros(g_grads, comp_in),
        zeros(r_grads, eager_in),
        "grad",
        values=values,
        scale=GRAD_SCALE.get(DTYPE, 1.0),
    )


def _samples(op: Any, requires_grad: bool) -> Iterator[Any]:
    return iter(op.sample_inputs(DEVICE, DTYPE, requires_grad=requires_grad))


def run_op(
    op: Any, compile_fn: Compile, *, max_samples: int = 3, time_limit: int = 120
) -> OpResult:
    """Check one op over its first `max_samples` samples; classify against the expected table."""
    key = op_key(op)
    autograd = bool(op.supports_autograd)
    res = OpResult(key, "pass", autograd)
    skip = EXPECTED.SKIP.get(key)
    if skip is not None:
        res.status, res.reason = "skip", skip
        return res
    values = key not in EXPECTED.RANDOM
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(time_limit)
    eager_error = ""
    try:
        for i, sample in enumerate(_samples(op, autograd)):
            if i >= max_samples:
                break
            random_sample = EXPECTED.sample_is_random(key, sample.kwargs)
            try:
                check_sample(
                    compile_fn, op, sample, grads=autograd, values=values and not random_sample
                )
                res.samples += 1
            except _Timeout:
                raise
            except EagerFailed as e:
                eager_error = eager_error or f"sample {i}: {e}"
                continue
            except Exception as e:  # every failure is reported, not raised
                res.status = "fail"
                res.error = f"sample {i}: {_short(e)}"
                break
    except _Timeout as e:
        res.status, res.error = "fail", f"timeout: {e}"
    except Exception as e:  # sample generation itself failed
        res.status, res.error = "fail", f"sample generation: {_short(e)}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    res.seconds = time.perf_counter() - t0
    if res.status == "pass" and res.samples == 0:
        res.status = "skip"
        res.reason = f"eager fails on {DEVICE}: {eager_error}" if eager_error else "no samples"
        return res
    reason = EXPECTED.XFAIL.get(key) or EXPECTED.XFAIL_BY_DTYPE.get(_dtype_name(), {}).get(key)
    if reason is not None:
        res.reason = reason
        res.status = "xfail" if res.status == "fail" else "xpass"
    if not values and res.status == "pass":
        res.reason = EXPECTED.RANDOM[key]
    return res


def _dtype_name() -> str:
    return str(DTYPE).removeprefix("torch.")


def _short(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if len(first) > 300:
        first = first[:300] + "..."
    if len(lines) > 1:  # a compiler error says what is wrong on its last line
        first += " ... " + lines[-1].strip()[:200]
    return f"{type(e).__name__}: {first}"


# --------------------------------------------------------------------------- saved bytes


def bytes_of_op(op: Any) -> dict[str, Any] | None:
    """Saved activation bytes of default, min-cut and torch's min-cut on the op's joint graph.

    Uses the op's first sample; None when the op has no autograd, no joint graph,
    or capture fails (the main sweep reports those).
    """
    import contextlib
    import copy

    from torch._functorch.partitioners import min_cut_rematerialization_partition

    import stoker_capture
    from stoker_capture._internal.partition.core import node_bytes

    if not op.supports_autograd:
        return None
    sample = next(_samples(op, True), None)
    if sample is None:
        return None
    tensors, rebuild = _split_sample(sample)

    def fn(*ts: torch.Tensor) -> Any:
        inp, args, kwargs = rebuild(list(ts))
        return op(inp, *args, **kwargs)

    try:
        cfg = stoker_capture.AOTConfig(mode="joint", dynamic="static")
        with contextlib.ExitStack() as stack, torch.enable_grad():
            state = stoker_capture.create_aot_state(fn, _fresh(tensors), None, cfg, stack)
            graph = stoker_capture.aot_stage1_graph_capture(state)
    except Exception:  # capture failures are the main sweep's business
        return None
    if not graph.joint:
        return None
    gm, n = graph.gm, graph.num_fw_outputs
    row: dict[str, Any] = {"op": op_key(op)}
    row["default"] = stoker_capture.default_partition(gm, num_fw_outputs=n).saved_bytes
    row["min_cut"] = stoker_capture.min_cut_partition(gm, num_fw_outputs=n).saved_bytes
    try:
        tgm = copy.deepcopy(gm)
        inputs = [p.meta["val"] for p in tgm.graph.nodes if p.op == "placeholder"]
        fw, _ = min_cut_rematerialization_partition(tgm, inputs, num_fwd_outputs=n)
        out = next(p for p in fw.graph.nodes if p.op == "output")
        saved = {
            v for v in out.args[0][n:] if isinstance(v, torch.fx.Node) and v.op != "placeholder"
        }
        row["torch"] = sum(node_bytes(v) for v in saved)
    except Exception as e:
        row["torch_error"] = _short(e)
    return row


def bytes_sweep(ops: Sequence[Any], verbose: bool) -> int:
    """Compare saved bytes over every op's joint graph; 1 if min-cut ever saves more than torch's."""
    rows = []
    for op in ops:
        row = bytes_of_op(op)
        if row is None:
            continue
        rows.append(row)
        worse = "torch" in row and row["min_cut"] > row["torch"]
        if verbose or worse:
            print(
                f"{'WORSE' if worse else 'ok':<5} {row['op']:<40} default {row['default']:>8} "
                f"min_cut {row['min_cut']:>8} torch {row.get('torch', 'n/a'):>8}",
                flush=True,
            )
    cmp = [r for r in rows if "torch" in r]
    worse = [r for r in cmp if r["min_cut"] > r["torch"]]
    better = [r for r in cmp if r["min_cut"] < r["torch"]]
    total = {k: sum(r[k] for r in cmp) for k in ("default", "min_cut", "torch")}
    print(
        f"\nsaved bytes over {len(cmp)} joint graphs: min_cut {total['min_cut']}, torch's min-cut "
        f"{total['torch']}, default {total['default']}; min_cut saves less on {len(better)}, "
        f"the same on {len(cmp) - len(better) - len(worse)}, more on {len(worse)}"
    )
    return 1 if worse else 0


# --------------------------------------------------------------------------- report


def summarize(results: Sequence[OpResult]) -> dict[str, Any]:
    ag = [r for r in results if r.autograd and r.status != "skip"]
    passed = [r for r in ag if r.status in ("pass", "xpass")]
    return {
        "ops": len(results),
        "autograd_ops": len(ag),
        "autograd_passed": len(passed),
        "pass_rate": len(passed) / len(ag) if ag else 1.0,
        "passed": sum(r.status in ("pass", "xpass") for r in results),
        "failed": [r.key for r in results if r.status == "fail"],
        "xfail": [r.key for r in results if r.status == "xfail"],
        "xpass": [r.key for r in results if r.status == "xpass"],
        "skipped": [r.key for r in results if r.status == "skip"],
    }


def print_report(results: Sequence[OpResult], seconds: float) -> dict[str, Any]:
    s = summarize(results)
    print(
        f"\nOpInfo sweep: {s['passed']}/{s['ops']} ops pass; among ops that support autograd "
        f"{s['autograd_passed']}/{s['autograd_ops']} = {100 * s['pass_rate']:.1f}% "
        f"({len(s['skipped'])} skipped, {len(s['xfail'])} expected failures, "
        f"{len(s['failed'])} unexpected failures) in {seconds:.0f} s"
    )
    by_key = {r.key: r for r in results}
    if s["xfail"]:
        print("\nexpected failures:")
        for k in s["xfail"]:
            print(f"  {k:<40} {by_key[k].reason}")
    if s["skipped"]:
        print("\nskipped:")
        for k in s["skipped"]:
            print(f"  {k:<40} {by_key[k].reason}")
    if s["xpass"]:
        print("\nexpected to fail but passed (remove from tools/opinfo_expected.py):")
        for k in s["xpass"]:
            print(f"  {k}")
    if s["failed"]:
        print("\nUNEXPECTED FAILURES:")
        for k in s["failed"]:
            print(f"  {k:<40} {by_key[k].error}")
    return s


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", help="comma-separated op names (op or op.variant)")
    ap.add_argument("--limit", type=int, help="only the first N ops")
    ap.add_argument("--samples", type=int, default=3, help="sample inputs per op (default 3)")
    ap.add_argument(
        "--triton", action="store_true", help="compile with stoker_triton.compile_graph"
    )
    ap.add_argument(
        "--c", action="store_true", help="compile to C kernels (stoker-triton's CPU backend)"
    )
    ap.add_argument("--backend", choices=["stoker", "torch"], default="stoker")
    ap.add_argument(
        "--partition",
        choices=["default", "min_cut"],
        default="default",
        help="stoker's partitioner",
    )
    ap.add_argument("--check", action="store_true", help="lint graphs between stages")
    ap.add_argument(
        "--bytes",
        action="store_true",
        help="instead: saved bytes of min_cut vs default vs torch's min-cut per joint graph",
    )
    ap.add_argument("--device", default="cpu", help="device of the samples (default cpu)")
    ap.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="dtype of the samples (default float32); ops eager lacks in it are left out",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per op")
    args = ap.parse_args(argv)
    global DEVICE, DTYPE, RTOL, ATOL
    DEVICE = args.device
    DTYPE = getattr(torch, args.dtype)
    RTOL, ATOL = TOLERANCES[DTYPE]

    if args.bytes:
        return bytes_sweep(
            load_ops(args.ops.split(",") if args.ops else None, args.limit), args.verbose
        )
    if args.triton:
        compile_fn = triton_compile(args.partition, args.check)
    elif args.c:
        compile_fn = c_compile(args.partition, args.check)
    elif args.backend == "torch":
        compile_fn = torch_compile()
    else:
        compile_fn = stoker_compile(partition=args.partition, check=args.check)
    ops = load_ops(args.ops.split(",") if args.ops else None, args.limit)
    t0 = time.perf_counter()
    results = []
    for op in ops:
        r = run_op(op, compile_fn, max_samples=args.samples)
        results.append(r)
        if args.verbose or r.status == "fail":
            print(f"{r.status:<5} {r.key:<40} {r.seconds:6.2f}s {r.error}", flush=True)
    s = print_report(results, time.perf_counter() - t0)
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                {"summary": s, "results": [dataclasses.asdict(r) for r in results]}, indent=1
            )
        )
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
