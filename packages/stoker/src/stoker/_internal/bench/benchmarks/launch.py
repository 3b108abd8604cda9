"""CPU cost of launching stoker-triton kernels (`kernels.py --launch-overhead`).

- per launch: one generated-style kernel through `Launcher` (the lean path:
  the compiled binary's launcher called directly) against the same launch
  through `JITFunction.run` (Triton's binder, as before);
- per compiled graph call: `compile_graph` of a one-kernel graph, whole call
  minus its launch (the wrapper: arguments, layout checks, allocation, return);
- per `stoker.compile` call: the same function through Dynamo's guards and
  stoker's runtime, minus the launch; beside it Dynamo's own floor (a backend
  that runs the captured graph as is, minus eager).

Without CUDA, the launches run Triton's real (non-interpreter) path on a stand-in
sm_90 driver whose launcher does nothing (`stoker_triton._internal.fakegpu`):
what is measured is the host work before the driver call. With CUDA, real
launches (CPU time to enqueue; the GPU work is tiny).

``python -m stoker._internal.bench.benchmarks.launch --replay``: the CPU cost per call of
``mode="reduce-overhead"``'s wrapper around a CUDA graph replay (`replay_overhead`),
on any machine (the replay is stubbed out).

``--smoke``: a hundredth of the calls per round (numbers too noisy to quote), so a
test can run both modes and see that every row is printed and every path taken.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from . import write_json

_SMOKE_DIV = [1]  # --smoke: a hundredth of the calls


def _per_call_us(fn: Callable[[], Any], n: int) -> float:
    """CPU time of this thread per call, in microseconds: the best of 7 rounds
    (thread time leaves out the time other processes hold the core; the best
    round the least cache disturbance from them)."""
    fn()
    n = max(1, n // _SMOKE_DIV[0])
    rounds = []
    for _ in range(7):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        rounds.append((time.thread_time() - t0) / n * 1e6)
    return min(rounds)


def launch_overhead(json_path: str | None = None) -> int:
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        from stoker_triton._internal.fakegpu import install

        install()
    import triton
    import triton.language as tl
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from stoker_triton import compile_graph
    from stoker_triton._internal.runtime import Launcher

    @triton.jit  # type: ignore[misc, untyped-decorator]
    def kernel(in_ptr, out_ptr, xnumel, rnumel, s0, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
        m = x < xnumel
        tl.store(out_ptr + x, tl.load(in_ptr + x, m) * s0, m)

    dev = "cuda" if gpu else "cpu"
    a, o = torch.randn(4096, device=dev), torch.empty(4096, device=dev)
    lau = Launcher(kernel, "bench", False, False, False)
    lau.n_ptrs = 2
    if lau.fast is None:
        print("launch-overhead: the lean path is off here (see the log); nothing to compare")
        return 1
    n = 20000
    direct = _per_call_us(lambda: lau(a, o, 4096, 1, 3), n)  # the target read per launch
    target = lau.fast.target()  # as a generated wrapper reads it: once per graph call
    lean = _per_call_us(lambda: lau.go(target, a, o, 4096, 1, 3), n)
    xb, rb, w = lau.configs[(4096, 1)]
    # the floor under the lean path: Triton's launcher alone, every argument precomputed
    entry = next(iter(lau.fast.entries.values()))
    run, function, meta, grid = entry[:4]
    stream = torch.cuda.current_stream().cuda_stream if gpu else 0
    ap, op = a.data_ptr(), o.data_ptr()
    bare = _per_call_us(
        lambda: run(
            grid, 1, 1, stream, function, meta, None, None, None, ap, op, 4096, 1, 3, xb, rb
        ),
        n,
    )
    eager_op = _per_call_us(lambda: torch.mul(a, 3, out=o), n)
    plain = _per_call_us(
        lambda: kernel[(4096 // xb,)](a, o, 4096, 1, 3, XBLOCK=xb, RBLOCK=rb, num_warps=w), n
    )

    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (x * 2 + b).relu()

    x, b = torch.randn(64, 64, device=dev), torch.randn(64, device=dev)
    g = compile_graph(make_fx(f, decomposition_table=core_aten_decompositions())(x, b), [x, b])  # type: ignore[arg-type]
    assert len(g.report.kernels) == 1, g.report  # type: ignore[attr-defined]
    graph = _per_call_us(lambda: g(x, b), n // 4)

    import stoker

    if not gpu:  # the stub driver stands in for CUDA: let CPU inputs take the Triton executor
        from stoker._internal.api import backend

        backend.resolve_backend = lambda requested, devices: "triton"  # type: ignore[attr-defined]
    sf = stoker.compile(f, backend="triton", dynamic=False)
    # Dynamo's own floor: the same function, a backend that runs the captured graph as is
    df = torch.compile(f, backend=lambda gm, example_inputs: gm.forward, dynamic=False)
    with torch.no_grad():
        sf(x, b)
        full = _per_call_us(lambda: sf(x, b), n // 4)
        dynamo = _per_call_us(lambda: df(x, b), n // 4)
        eager = _per_call_us(lambda: f(x, b), n // 4)
    if gpu:
        torch.cuda.synchronize()
    where = "CUDA" if gpu else "stub sm_90 driver, no GPU"
    print(
        f"launch overhead, CPU µs of the thread, best of 7 rounds ({where}; triton {triton.__version__})"
    )
    print(f"  per launch, lean path (Launcher.go)       {lean:8.2f}   target <= 5")
    print(f"    called directly (target read per launch){direct:8.2f}")
    print(f"    Triton's launcher alone (args ready)    {bare:8.2f}")
    print(f"  per launch, JITFunction.run               {plain:8.2f}")
    print(f"  eager torch.mul(a, 3, out=o), for scale   {eager_op:8.2f}")
    print(f"  per compile_graph call, 1 kernel          {graph:8.2f}")
    print(f"    of which fixed (call minus launch)      {graph - lean:8.2f}")
    print(f"  per stoker.compile call, 1 kernel         {full:8.2f}")
    print(f"    of which fixed (guards+runtime+wrapper) {full - lean:8.2f}   target <= 30")
    print(f"  torch.compile, graph run as is (floor)    {dynamo:8.2f}")
    print(f"    of which Dynamo (minus eager f)         {dynamo - eager:8.2f}")
    figures = {"lean_launch_us": lean, "direct_launch_us": direct, "triton_launcher_us": bare}
    figures.update({"jitfunction_run_us": plain, "eager_op_us": eager_op, "graph_call_us": graph})
    figures.update({"stoker_call_us": full, "dynamo_floor_us": dynamo, "eager_f_us": eager})
    write_json(json_path, figures)
    return 0


# ---------------------------------------------------------------------- CUDA graph replays


def replay_overhead(json_path: str | None = None) -> int:
    """CPU µs per call of `mode="reduce-overhead"`'s wrapper (`GraphedCallable`) around a
    replay that does nothing (a stand-in recorder), beside the bare callable: what
    the wrapper itself costs per graph call, whatever the graph does on the device.

    - forward: an input copied in, P parameters read in place, K fresh outputs
      (the forward's result and the tensors it saves for backward);
    - backward segment: K inputs that are outputs of the forward graph (saved
      tensors, read in place), one gradient copied in, P parameters, P gradients out.
    """
    import torch
    from torch import nn

    from stoker._internal.cudagraphs import cudagraphs as cg

    class NullRecorder(cg.HostRecorder):
        """Records by running the function once; a replay does nothing (the graph's
        device work is not what is measured), as `CudaRecorder.replay` is called."""

        record_executes = False

        def replay(self, graph: Any, args: list[Any] | None) -> None:
            pass

    def case(p: int, k: int) -> tuple[float, float, float, float]:
        params = [nn.Parameter(torch.randn(4, 4)) for _ in range(p)]
        x, gy = torch.randn(2, 4), torch.randn(2, 4)
        saved = [torch.randn(2, 4) for _ in range(k)]
        grads = tuple(torch.randn(4, 4) for _ in range(p))

        fresh = [True]  # while recording, fresh outputs (as a graph's); timed: prebuilt

        def fwd(*args: Any) -> tuple[torch.Tensor, ...]:
            return tuple(t.clone() for t in saved) if fresh[0] else tuple(saved)

        def bwd(*args: Any) -> tuple[torch.Tensor, ...]:
            return tuple(t.clone() for t in grads) if fresh[0] else grads

        sf, sb = cg.CudaGraphStats("fwd"), cg.CudaGraphStats("bwd")
        with cg.use_recorder(NullRecorder()):
            f = cg.graphed(fwd, None, [x, *params], sf, 8)
            # warm-up, record (nothing held across), then the first replays with the
            # copied input at two addresses in turn, as batches are: copied for good
            for xi in (x, x, x.clone(), x, x.clone()):
                f(xi, *params)
            outs = list(f(x, *params))  # pool outputs: the backward reads them in place
            b = cg.graphed(bwd, None, [*outs, gy, *params], sb, 8)
            for gi in (gy, gy, gy.clone(), gy, gy.clone(), gy):
                b(*outs, gi, *params)
            fresh[0] = False
            n = 2000
            bw = _per_call_us(lambda: b(*outs, gy, *params), n)
            outs.clear()  # released, as autograd releases saved tensors after the backward
            fw = _per_call_us(lambda: f(x, *params), n)
        # every timed call replayed (none recorded again or ran plain)
        assert (sf.records, sb.records, sf.plain, sb.plain) == (1, 1, {}, {}), (sf, sb)
        assert (sf.copied_out, sb.copied_out, sb.copied_in) == (0, 0, 1), (sf, sb)
        fb = _per_call_us(lambda: fwd(x, *params), n)
        return fw, fb, bw, _per_call_us(lambda: bwd(*saved, gy, *params), n)

    print("reduce-overhead wrapper, CPU µs of the thread per call, best of 7 rounds")
    print("(replay stubbed out; 'bare' is the compiled callable alone)")
    print(
        f"  {'P params':>8} {'K outputs':>9} {'forward':>8} {'bare':>6} {'backward':>9} {'bare':>6}"
    )
    rows = {pk: case(*pk) for pk in ((1, 1), (8, 8), (32, 32), (64, 64))}
    for (p, k), (fw, fb, bw, bb) in rows.items():
        print(f"  {p:8d} {k:9d} {fw:8.2f} {fb:6.2f} {bw:9.2f} {bb:6.2f}")
    slope = (rows[64, 64][0] - rows[1, 1][0]) / 63
    print(
        f"  forward: {rows[1, 1][0] - rows[1, 1][1]:.2f} fixed + {slope:.2f} per (parameter, output)"
    )
    print("  target: wrapper minus bare <= 30 (the plain path's fixed cost is 23)")
    write_json(
        json_path,
        [
            {"case": f"P={p} K={k}", "forward_us": fw, "forward_bare_us": fb}
            | {"backward_us": bw, "backward_bare_us": bb}
            for (p, k), (fw, fb, bw, bb) in rows.items()
        ],
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replay", action="store_true", help="the reduce-overhead wrapper instead")
    ap.add_argument("--smoke", action="store_true", help="few calls per round: a test run")
    ap.add_argument("--json", help="write the figures (µs per call) here")
    opts = ap.parse_args(argv)
    if opts.smoke:
        _SMOKE_DIV[0] = 100
    return replay_overhead(opts.json) if opts.replay else launch_overhead(opts.json)


if __name__ == "__main__":
    raise SystemExit(main())
