"""stoker's own ``torch.autograd.Function`` around a compiled forward and backward.

Contract with stoker-autograd (which inlines our backward into compiled
autograd): every generated Function class carries ``_stoker_aot``, an
`AOTBackwardInfo`; at run time the forward saves tensors with
``ctx.save_for_backward`` and symints in ``ctx._stoker_symints``.  The class
must NOT define ``_aot_id`` (torch's compiled autograd keys on that).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .autocast import autocast_off
from .boxed import call_boxed, mark_boxed
from .errors import UnsupportedError

_AOT_IDS = itertools.count()


def next_aot_id() -> int:
    """A process-unique id for one compiled function."""
    return next(_AOT_IDS)


@dataclass(frozen=True, slots=True)
class AOTBackwardInfo:
    """What compiled autograd needs to inline this function's backward."""

    bw_module: fx.GraphModule  # partitioned core-aten backward, uncompiled
    num_saved_symints: int  # bw inputs: (*saved_symints, *saved_tensors, *tangents)
    num_saved_tensors: int
    num_tangents: int
    aot_id: int  # unique per compiled function


@dataclass(frozen=True, slots=True)
class FunctionPlan:
    """How the Function maps the compiled forward's outputs to its own."""

    num_fw_outputs: int  # leading forward outputs (the rest are saved values)
    returned: tuple[int, ...]  # forward outputs the Function returns, in order
    side: tuple[int, ...]  # forward outputs passed back outside autograd (numbers, aliases)
    non_differentiable: tuple[int, ...]  # positions in `returned` that never require grad
    tangent_of: tuple[int | None, ...]  # per returned output: its tangent index, or None
    name: str  # for messages


def _compiled_autograd_key(ctx: Any) -> tuple[int, ...]:
    return (ctx._autograd_function_id, *ctx._stoker_symints)


def make_function_class(
    info: AOTBackwardInfo, plan: FunctionPlan, fw: Callable[..., Any], bw: Callable[..., Any]
) -> type[torch.autograd.Function]:
    """A new Function class running ``fw`` / ``bw``; call ``Cls.apply(sink, *primals)``.

    ``sink`` is a list that receives the forward outputs listed in ``plan.side``.
    """
    n_fw, n_t = plan.num_fw_outputs, info.num_saved_tensors
    if isinstance(bw, fx.GraphModule):  # run as is (the aten executor): boxed
        bw = mark_boxed(bw)
    returned, side = plan.returned, plan.side
    n_tangents = info.num_tangents

    def forward(ctx: Any, sink: list[Any], *primals: Any) -> tuple[Any, ...]:
        outs = fw(*primals)
        ctx.save_for_backward(*outs[n_fw : n_fw + n_t])
        ctx._stoker_symints = [int(s) for s in outs[n_fw + n_t :]]
        sink.extend(outs[k] for k in side)
        result = tuple(outs[k] for k in returned)
        nd = [result[k] for k in plan.non_differentiable if isinstance(result[k], torch.Tensor)]
        if nd:
            ctx.mark_non_differentiable(*nd)
        return result

    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            raise UnsupportedError(
                f"{plan.name}: double backward (create_graph=True) through a stoker-compiled "
                "function is not supported.  Call backward without create_graph, or run this "
                "function eagerly where you need higher-order gradients."
            )
        tangents: list[Any] = [None] * n_tangents
        for g, k in zip(grads, plan.tangent_of):
            if k is not None:
                tangents[k] = g.contiguous() if isinstance(g, torch.Tensor) else g
        args = [*ctx._stoker_symints, *ctx.saved_tensors, *tangents]
        del tangents
        # the list is the only holder of the saved tensors now (unless retain_graph): the
        # compiled backward frees each after its last reader, as eager's engine would
        ctx.maybe_clear_saved_tensors()
        with autocast_off():  # traced without autocast; eager's backward outside it runs so
            out = call_boxed(bw, args)
        return (None, *out)

    return type(
        f"CompiledFunction_{info.aot_id}",
        (torch.autograd.Function,),
        {
            "_stoker_aot": info,
            # stoker-autograd (compiled autograd) inlines ``info.bw_module``: it needs the
            # grad -> tangent map, and the engine's cache key must include what the
            # inlined graph depends on (the class, via its id, and the saved symints,
            # which the engine then lifts as graph inputs).
            "_stoker_tangent_of": plan.tangent_of,
            "_compiled_autograd_key": staticmethod(_compiled_autograd_key),
            "forward": staticmethod(forward),
            "backward": staticmethod(backward),
            "__doc__": f"stoker-compiled {plan.name} (aot id {info.aot_id}).",
        },
    )
