"""`dynamo_backend`: stoker's pipeline as a ``torch.compile`` backend (seed 002).

The backend adopts Dynamo's fake mode and shape env and runs every stage at
lowering time, so any guard that capture, partitioning or the compiler adds
lands in Dynamo's shape env and is installed by Dynamo with its own guards:
violating one recompiles, never silently reuses a wrong graph.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stoker_shapes import ShapeContext, timing

from . import capcache
from .api import compile_pipeline
from .config import AOTConfig, Compiler, GraphPass


def dynamo_backend(
    compiler: Compiler | None = None,
    *,
    bw_compiler: Compiler | None = None,
    partition: Callable[..., Any] | None = None,
    memory_budget: float | None = None,
    debug_checks: bool | None = None,
    cache: bool | None = None,
    lazy_backward: bool = False,
    lazy_backward_fallback: bool = False,
    graph_passes: Sequence[GraphPass] = (),
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
    ``lazy_backward_fallback``: a lazy backward whose compile needs a new guard (a size
    the compiler specializes on, too late to be checked) runs its graph uncompiled
    instead of raising; what makes deferring safe with symbolic sizes.
    ``graph_passes``: run on each captured graph before it is partitioned (`AOTConfig`).
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
            lazy_backward_fallback=lazy_backward_fallback,
            graph_passes=tuple(graph_passes),
        )
        if debug_checks is not None:
            cfg.debug_checks = debug_checks
        tc = torch._guards.TracingContext.try_get()
        if tc is None or tc.fake_mode is None:
            # called outside Dynamo (e.g. directly): our own shape context, static shapes
            return _checked(compile_pipeline(gm, list(example_inputs), {}, cfg), gm, example_inputs)
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
        return _checked(compiled, gm, example_inputs)

    return backend


# Dynamo guards requires_grad of parameters from torch 2.12 on: there a call never
# reaches a graph compiled for another requires_grad, and no per-call check is needed.
DYNAMO_GUARDS_REQUIRES_GRAD = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 12)


def _checked(
    compiled: Callable[..., Any], gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
) -> Callable[..., Any]:
    """``compiled``, behind `RequiresGradCheck` where a tensor input did not require grad
    (on torches whose Dynamo does not guard that)."""
    if DYNAMO_GUARDS_REQUIRES_GRAD:
        return compiled
    frozen = [
        i
        for i, x in enumerate(example_inputs)
        if isinstance(x, torch.Tensor) and not x.requires_grad and x.dtype.is_floating_point
    ]
    return RequiresGradCheck(compiled, gm, frozen) if frozen else compiled


class RequiresGradCheck:
    """A compiled graph that runs uncompiled, with a warning, when an input it was
    compiled for without a gradient requires one now.

    Dynamo before torch 2.12 (torch 2.11 is the GPU machine's) does not guard whether
    a parameter requires grad: unfreezing one (``p.requires_grad_(True)`` between steps)
    reused the graph compiled while it was frozen, whose backward gives it no gradient,
    silently (Inductor and aot_eager too). Later torches recompile before the call
    reaches here. The check reads only the inputs that did not require grad (buffers,
    data, frozen parameters). Attribute reads go to the compiled function."""

    def __init__(
        self, compiled: Callable[..., Any], gm: torch.fx.GraphModule, frozen: list[int]
    ) -> None:
        self.compiled = compiled
        self.gm = gm
        self.frozen = frozen
        self.warned = False

    def __call__(self, *args: Any) -> Any:
        if torch.is_grad_enabled():
            for i in self.frozen:
                if args[i].requires_grad:
                    return self._uncompiled(i, args)
        return self.compiled(*args)

    def _uncompiled(self, i: int, args: tuple[Any, ...]) -> Any:
        if not self.warned:
            self.warned = True
            ph = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
            name = ph[i].name if i < len(ph) else f"input {i}"
            warnings.warn(
                f"stoker: {name} requires grad now but the graph was compiled while it did "
                f"not, and this torch ({torch.__version__}) did not recompile for it (Dynamo "
                "before torch 2.12 does not guard requires_grad of parameters): the graph "
                "runs uncompiled while it does, for correct gradients. Call "
                "torch._dynamo.reset() after changing requires_grad, or use torch >= 2.12.",
                stacklevel=2,
            )
        return self.gm(*args)

    def __getattr__(self, name: str) -> Any:
        if name == "compiled":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.compiled, name)


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
