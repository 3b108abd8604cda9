"""`dynamo_backend`: stoker's pipeline as a ``torch.compile`` backend (seed 002).

The backend adopts Dynamo's fake mode and shape env and runs every stage at
lowering time, so any guard that capture, partitioning or the compiler adds
lands in Dynamo's shape env and is installed by Dynamo with its own guards:
violating one recompiles, never silently reuses a wrong graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from stoker_shapes import ShapeContext, timing

from . import capcache
from .api import compile_pipeline
from .config import AOTConfig, Compiler


def dynamo_backend(
    compiler: Compiler | None = None,
    *,
    bw_compiler: Compiler | None = None,
    partition: Callable[..., Any] | None = None,
    memory_budget: float | None = None,
    debug_checks: bool | None = None,
    cache: bool | None = None,
    lazy_backward: bool = False,
) -> Callable[..., Any]:
    """A torch.compile backend: ``torch.compile(model, backend=dynamo_backend())``.

    ``compiler(gm, example_inputs)`` compiles the forward and backward graphs
    (None: the aten executor); its example inputs are fake tensors over
    Dynamo's symbols, so a specialization it makes becomes a Dynamo guard.
    ``cache``: load and store captured graphs in ``$STOKER_CACHE_DIR/capture``
    (capcache.py; None: on unless ``STOKER_CAPTURE_CACHE=0``).  The compiled
    function's ``cache_outcome`` says what the cache did ("hit", "miss (why)").
    ``lazy_backward``: compile the backward at its first call (`AOTConfig`), for a
    caller whose backward usually never calls it (compiled autograd inlines it).
    """

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        cfg = AOTConfig(
            partition=partition,
            memory_budget=memory_budget,
            fw_compiler=compiler,
            bw_compiler=bw_compiler,
            dynamic="static",
            guard_params=False,
            lazy_backward=lazy_backward,
        )
        if debug_checks is not None:
            cfg.debug_checks = debug_checks
        tc = torch._guards.TracingContext.try_get()
        if tc is None or tc.fake_mode is None:
            # called outside Dynamo (e.g. directly): our own shape context, static shapes
            return compile_pipeline(gm, list(example_inputs), {}, cfg)
        ctx = ShapeContext.adopt(tc.fake_mode)
        fakes = _dynamo_fakes(gm, example_inputs, tc)
        use_cache = capcache.enabled() if cache is None else cache
        store = None
        if use_cache:
            with timing.timed("cache load", "captured-graph cache key"):
                store = capcache.CaptureCache(gm, example_inputs, fakes, ctx, cfg)
        compiled = compile_pipeline(
            gm, list(example_inputs), {}, cfg, ctx=ctx, fake_args=(fakes, {}), cache=store
        )
        compiled.check_guards = False  # Dynamo installs and checks the guards
        compiled.cache_outcome = store.outcome if store is not None else ""
        return compiled

    return backend


def _dynamo_fakes(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], tc: Any) -> list[Any]:
    """Dynamo's own fake inputs (same symbols), re-fakified from the real example inputs."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: list[Any] = []
    for node, x in zip(phs, example_inputs):
        example = node.meta.get("example_value")
        if isinstance(x, torch.Tensor):
            grapharg = node.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            context = tc.tensor_to_context.get(x) if hasattr(tc, "tensor_to_context") else None
            out.append(
                tc.fake_mode.from_tensor(x, symbolic_context=context, source=source, trace=False)
            )
        elif isinstance(example, torch.SymInt | torch.SymFloat):
            out.append(example)  # a symbolic number: Dynamo's own SymInt
        else:
            out.append(x)
    return out
