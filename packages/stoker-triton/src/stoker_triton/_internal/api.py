"""The small front: `compile_graph` imports the pipeline (and triton) only when called."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    debug: bool | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """Compile a functional core-aten FX graph to fused Triton kernels.

    `example_inputs` are real tensors (static shapes) or fake tensors and
    SymInts from a shape env (symbolic shapes: every size assumption the
    generator makes is added to that shape env as a guard). Returns a
    callable `fn(*args)` returning what `gm(*args)` returns; `fn.report` is
    the `CompileReport`, `fn.wrapper_source` the generated wrapper. With
    `debug=True` or `STOKER_TRITON_DEBUG=1` the IR, schedule, kernels and
    wrapper are printed. `options`: `persistent_rnumel_max` (largest
    reduction kept whole in one block; above it kernels loop over the row),
    `max_autotune` (on a GPU, time several block/warp configurations per
    kernel and size and keep the fastest, remembered on disk; default: one
    configuration chosen by heuristics, each kernel compiled once).
    """
    from .pipeline import compile_graph_impl

    return compile_graph_impl(gm, example_inputs, debug=debug, options=options)
