"""What deciding the scope of compiled autograd costs per backward (CPU).

    python -m stoker._internal.bench.benchmarks.autograd_scope [--repeats 7] [--calls 300]

stoker-autograd sets the engine hook only for the backwards it compiles: every
``backward()`` / ``autograd.grad`` goes through a router (``Variable._execution_engine``)
that decides.  This measures, in microseconds per backward call (median over
``--repeats`` rounds of ``--calls`` calls, and the fastest round, the better estimate of
a fixed cost on a shared machine; variants interleaved, their order rotated):

1. the decision alone (`engine.holds_stoker_node`): no stoker node pending (none alive,
   or all backwarded already: O(1)); the walk of a stoker model's graph (stops at its
   first node); the walk of eager graphs of several sizes (all of it: a stoker forward
   not yet backwarded is alive beside them);
2. an eager backward of ``nn.Linear(3, 3)`` (``retain_graph``, no forward): the real
   engine called directly, the router with no scope, with the default scope and no
   stoker node pending, and with a stoker forward pending (the walk);
3. around a stoker model's compiled backward: the router's own work per call (the
   engine replaced by a stub), and a whole step (forward, replayed backward) with the
   hook set once for the loop (as before the router) against the router.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.variable import Variable

import stoker_autograd
import stoker_capture
from stoker_autograd._internal import engine
from stoker_autograd._internal.session import RUNTIME_CALLS

from . import write_json


def _us(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _median(rows: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in rows.items()}


def _median_min(rows: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    return {k: (statistics.median(v), min(v)) for k, v in rows.items()}


def _mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _nodes(root: torch.Tensor) -> int:
    seen, todo = set(), [root.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo += [n for n, _ in fn.next_functions]
    return len(seen)


def decision(repeats: int, calls: int) -> list[tuple[str, int, float]]:
    torch.manual_seed(0)
    stoker_model = stoker_capture.aot_module(_mlp(16, 2))
    x16 = torch.randn(4, 16)
    graphs: dict[str, torch.Tensor] = {}
    graphs["stoker model's loss"] = stoker_model(x16).pow(2).sum()
    for depth in (1, 8, 32):
        graphs[f"eager MLP, {depth} layers"] = _mlp(16, depth)(x16).pow(2).sum()
    rows: dict[str, list[float]] = {k: [] for k in graphs}
    rows["none pending (O(1))"] = []
    for _ in range(repeats):
        for name, loss in graphs.items():
            rows[name].append(_us(lambda loss=loss: engine.holds_stoker_node([loss]), calls))  # type: ignore[misc]
        live = engine._LIVE[0]
        engine._LIVE[0] = 0  # what the check reads when no stoker node is pending
        try:
            mlp8 = graphs["eager MLP, 8 layers"]
            rows["none pending (O(1))"].append(
                _us(lambda g=mlp8: engine.holds_stoker_node([g]), calls)  # type: ignore[misc]
            )
        finally:
            engine._LIVE[0] = live
    med = _median(rows)
    sizes = {k: _nodes(v) for k, v in graphs.items()} | {"none pending (O(1))": 0}
    return [(k, sizes[k], med[k]) for k in rows]


def _interleaved(
    variants: dict[str, Callable[[], float]], repeats: int
) -> dict[str, tuple[float, float]]:
    """Median of each variant's figure over ``repeats`` rounds, the order rotated each
    round (load spikes of the shared machine hit every variant alike)."""
    names = list(variants)
    rows: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            rows[name].append(variants[name]())
    return _median_min(rows)


def eager_backward(repeats: int, calls: int) -> dict[str, tuple[float, float]]:
    """``loss.backward(retain_graph=True)`` of one small eager graph (no forward in the
    timing): what the router adds to the engine's own work."""
    torch.manual_seed(0)
    plain = nn.Linear(3, 3)
    loss = plain(torch.randn(4, 3)).sum()
    stoker_model = stoker_capture.aot_module(_mlp(16, 2))
    engine._install()
    router = Variable._execution_engine
    assert isinstance(router, engine._Router)
    real = router._real

    def step() -> None:
        loss.backward(retain_graph=True)

    def real_engine() -> float:
        Variable._execution_engine = real  # type: ignore[assignment]
        try:
            return _us(step, calls)
        finally:
            Variable._execution_engine = router  # type: ignore[assignment]

    def default_scope(alive: bool) -> float:
        stoker_autograd.set_default()
        graph = stoker_model(torch.randn(4, 16)).sum() if alive else None
        try:
            return _us(step, calls)
        finally:
            del graph
            stoker_autograd.clear_default()

    return _interleaved(
        {
            "real engine (no router)": real_engine,
            "router, no scope": lambda: _us(step, calls),
            "router, default scope, no stoker node pending": lambda: default_scope(False),
            "router, default scope, a stoker forward pending": lambda: default_scope(True),
        },
        repeats,
    )


class _StubEngine:
    """Runs no backward: what is left of a routed call is the router's own work."""

    def run_backward(self, *args: Any, **kwargs: Any) -> None:
        RUNTIME_CALLS[0] += 1  # as stoker's runtime wrapper counts a compiled backward


def routing_overhead(repeats: int, calls: int) -> dict[str, tuple[float, float]]:
    """The router's own work around one compiled backward of a stoker model (the
    decision, Dynamo's frame evaluation off and on, the hook set and put back, the lock,
    the engine's multithreading flag, the counters), the engine replaced by a stub; and a
    whole step of that model (forward, replayed backward) with the hook set once for the
    loop, as before the router, against the router."""
    torch.manual_seed(0)
    base = _mlp(16, 2)
    model = stoker_capture.aot_module(base)
    x = torch.randn(4, 16)
    engine._install()
    router = Variable._execution_engine
    assert isinstance(router, engine._Router)
    real = router._real
    stub = _StubEngine()

    def step() -> None:
        base.zero_grad(set_to_none=True)
        model(x).sum().backward()

    with stoker_autograd.enable(scope="compiled") as session:
        for _ in range(3):
            step()  # capture, compile
        loss = model(x).sum()  # a pending stoker graph: the walk finds its node
        args = ((torch.ones(()),), True, False, ())

        def routed_stub() -> float:
            return _us(lambda: router.run_backward((loss,), *args, allow_unreachable=True), calls)

        def direct_stub() -> float:
            return _us(lambda: stub.run_backward((loss,), *args, allow_unreachable=True), calls)

        router._real = stub
        try:
            rows = _interleaved(
                {"stub engine, called directly": direct_stub, "stub engine, routed": routed_stub},
                repeats,
            )
        finally:
            router._real = real

        def hook_for_the_loop() -> float:
            prior = torch._C._dynamo.compiled_autograd.set_autograd_compiler(
                engine._factory,  # type: ignore[arg-type]
                True,
            )
            Variable._execution_engine = real  # type: ignore[assignment]
            engine._STATE.routed = session
            try:
                return _us(step, calls // 10)
            finally:
                engine._STATE.routed = None
                Variable._execution_engine = router  # type: ignore[assignment]
                torch._C._dynamo.compiled_autograd.set_autograd_compiler(*prior)

        rows |= _interleaved(
            {
                "step, hook set for the loop (before)": hook_for_the_loop,
                "step, router per call": lambda: _us(step, calls // 10),
            },
            repeats,
        )
    st = stoker_autograd.stats()
    assert st["captures"] == 1, st  # one capture, every other call replayed
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--json", help="write the figures (µs per call) here")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, CPU; µs per call, median of {args.repeats} rounds")
    print("\n1. the decision (holds_stoker_node)")
    print(f"{'graph':<30}{'nodes':>7}{'µs':>9}{'µs/node':>9}")
    doc: dict[str, Any] = {"decision": {}, "eager backward": {}, "compiled backward": {}}
    for name, n, us in decision(args.repeats, args.calls):
        doc["decision"][name] = {"nodes": n, "us": us}
        print(f"{name:<30}{n:>7}{us:>9.2f}{(us / n if n else 0):>9.3f}")
    print("\n2. an eager backward of nn.Linear(3, 3) (retain_graph, no forward)")
    print(f"{'':<46}{'median':>9}{'min':>9}")
    for name, (med, low) in eager_backward(args.repeats, args.calls).items():
        doc["eager backward"][name] = {"median_us": med, "min_us": low}
        print(f"{name:<46}{med:>9.2f}{low:>9.2f}")
    print("\n3. around a stoker model's compiled backward (2-layer MLP, aten executor)")
    print(f"{'':<46}{'median':>9}{'min':>9}")
    for name, (med, low) in routing_overhead(args.repeats, args.calls).items():
        doc["compiled backward"][name] = {"median_us": med, "min_us": low}
        print(f"{name:<46}{med:>9.2f}{low:>9.2f}")
    write_json(args.json, doc)


if __name__ == "__main__":
    main()
