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

from ..autocast import autocast_off
from ..errors import UnsupportedError
from .boxed import call_boxed, mark_boxed

_AOT_IDS = itertools.count()
_HOOK = torch._C._dynamo.compiled_autograd


LIVE = [0]
"""How many stoker Function nodes may still be backwarded: their ctx is alive and no
backward has run through them yet (without ``retain_graph``).  stoker-autograd reads it
before it looks for a stoker node in a backward's graph: 0 means none can be there."""


class _Live:
    """Counted in `LIVE` while the ctx that holds it lives, until `release`."""

    __slots__ = ("_on",)

    def __init__(self) -> None:
        self._on = True
        LIVE[0] += 1

    def release(self) -> None:
        """Its backward ran and freed what it saved: no later backward goes through it."""
        if self._on:
            self._on = False
            LIVE[0] -= 1

    def __del__(self) -> None:
        self.release()


COMPILED_AUTOGRAD_PROBE: list[Callable[[], bool | None]] = []
"""Set by stoker-autograd: whether the backward of a stoker Function run now will be run
by compiled autograd (None: it does not know; the engine hook decides)."""


def compiled_autograd_on() -> bool:
    """Whether this Function's backward will run under compiled autograd: what
    stoker-autograd says (it sets its hook per backward call, so the hook is unset while
    a forward runs), else whether a compiled-autograd compiler is registered with the
    engine now (read by swapping it out and back: the engine has no getter)."""
    if COMPILED_AUTOGRAD_PROBE:
        said = COMPILED_AUTOGRAD_PROBE[0]()
        if said is not None:
            return said
    prior = _HOOK.set_autograd_compiler(None, False)
    _HOOK.set_autograd_compiler(*prior)
    return prior[0] is not None


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


_TANGENT_DEPS: dict[int, tuple[frozenset[int], ...]] = {}  # by aot_id


def tangent_deps(info: AOTBackwardInfo) -> tuple[frozenset[int], ...]:
    """Per output of ``info.bw_module``: the tangents it reads, directly or not."""
    deps = _TANGENT_DEPS.get(info.aot_id)
    if deps is None:
        first = info.num_saved_symints + info.num_saved_tensors
        seen: dict[fx.Node, frozenset[int]] = {}
        placeholders = 0
        out: tuple[frozenset[int], ...] = ()
        for node in info.bw_module.graph.nodes:
            if node.op == "placeholder":
                k = placeholders - first
                seen[node] = frozenset((k,)) if k >= 0 else frozenset()
                placeholders += 1
            elif node.op == "output":
                outs = node.args[0] if isinstance(node.args[0], list | tuple) else node.args
                out = tuple(
                    seen.get(o, frozenset()) if isinstance(o, fx.Node) else frozenset()
                    for o in outs
                )
            else:
                seen[node] = frozenset().union(
                    *(seen.get(a, frozenset()) for a in node.all_input_nodes)
                )
        deps = _TANGENT_DEPS[info.aot_id] = out
    return deps


def undefined_grads(info: AOTBackwardInfo, undefined: set[int]) -> list[bool]:
    """Which grads of the backward to leave undefined when the tangents ``undefined`` are.

    A grad is a linear function of the tangents it reads: one that reads only undefined
    (zero) tangents is zero, and eager's engine never computes it, so the input's grad
    stays None (a parameter used only by outputs outside the loss keeps ``.grad is None``,
    which optimizers with weight decay or momentum treat differently from zeros).  A grad
    that reads no tangent at all is left alone.
    """
    return [bool(d) and d <= undefined for d in tangent_deps(info)]


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
        ctx._stoker_live = _Live()  # counted while this node lives (stoker-autograd's scope)
        outs = fw(*primals)
        ctx.save_for_backward(*outs[n_fw : n_fw + n_t])
        ctx._stoker_symints = [int(s) for s in outs[n_fw + n_t :]]
        sink.extend(outs[k] for k in side)
        result = tuple(outs[k] for k in returned)
        if not compiled_autograd_on():
            # the eager engine: grads of outputs outside the loss arrive as None, so the
            # backward can leave the grads that only they feed undefined, as eager does
            # (compiled autograd materializes them as zeros nodes, which it recognises)
            ctx.set_materialize_grads(False)
            ctx._stoker_like = [
                (r.shape, r.dtype, r.device) if isinstance(r, torch.Tensor) else None
                for r in result
            ]
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
        undefined: set[int] = set()
        for r, (g, k) in enumerate(zip(grads, plan.tangent_of)):
            if k is None:
                continue
            if g is None:  # an output outside the loss (materialize_grads is off)
                shape, dtype, device = ctx._stoker_like[r]
                g = torch.zeros(shape, dtype=dtype, device=device)
                undefined.add(k)
            tangents[k] = g.contiguous() if isinstance(g, torch.Tensor) else g
        args = [*ctx._stoker_symints, *ctx.saved_tensors, *tangents]
        del tangents
        # the list is the only holder of the saved tensors now (unless retain_graph): the
        # compiled backward frees each after its last reader, as eager's engine would
        ctx.maybe_clear_saved_tensors()
        with autocast_off():  # traced without autocast; eager's backward outside it runs so
            out = call_boxed(bw, args)
        if undefined:
            drop = undefined_grads(info, undefined)
            out = [None if d else g for g, d in zip(out, drop)]
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
