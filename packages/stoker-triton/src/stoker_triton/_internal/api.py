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
    configuration chosen by heuristics, each kernel compiled once), `target`
    (``"triton"``, the default, or ``"c"``: C kernels for CPU inputs, built by the
    system's C compiler).
    """
    from .pipeline import compile_graph_impl

    return compile_graph_impl(gm, example_inputs, debug=debug, options=options)


def graph_passes(target: str) -> tuple[Callable[[torch.fx.GraphModule], object], ...]:
    """The passes to run on a captured graph before it is partitioned, for kernels of
    ``target`` (``"c"`` or ``"triton"``): the layout choices made on the whole graph.
    On a CPU (``"c"``), convolutions run channels-last (`channels_last_convolutions`);
    none for Triton."""
    if target == "c":
        from .conv_layout import channels_last_convolutions

        return (channels_last_convolutions,)
    return ()


def start_compile_workers(device: torch.device) -> bool:
    """Start the parallel compile workers for `device` now, if kernels for it are
    compiled natively (a CUDA GPU, not the interpreter); returns whether they were.

    `compile_graph` starts them itself when it lowers a graph; a caller that
    first captures and partitions (seconds) calls this before, so the workers'
    start (each imports Triton's compiler) overlaps that work.

    Not where this cache already holds built kernels: that start is likely warm,
    finds every binary built, and needs no worker (`compile_graph` still starts
    them for a graph it has to lower)."""
    from .runtime import native_target

    try:
        if native_target(device) is None:
            return False
    except Exception:  # no GPU driver here: nothing compiles natively
        return False
    from .compile.xcompile import built_any, start_workers

    if built_any():
        return False

    start_workers()
    return True
