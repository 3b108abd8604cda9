"""`AOTConfig`: every knob of the staged pipeline, in one place."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

# compiler(gm, example_inputs) -> callable run as fn(*args), returning the graph's output tuple
Compiler = Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]
# partition(joint, num_fw_outputs=..., memory_budget=...) -> Partition
PartitionFn = Callable[..., Any]
# graph_pass(gm) -> anything: edits the captured graph in place (see `AOTConfig.graph_passes`)
GraphPass = Callable[[torch.fx.GraphModule], object]
Mode = Literal["auto", "joint", "inference"]


def aten_executor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The default compiler: run the graph module as it is (its forward: no Module call)."""
    # stages hand over lazy graph modules: generate the code now, not inside the first call
    _LazyGraphModule.force_recompile(gm)
    return gm.forward


@dataclass(slots=True)
class AOTConfig:
    """How one compilation runs, from capture to compiled function.

    >>> AOTConfig(mode="joint", dynamic="dynamic", debug_checks=True)
    """

    # "joint" (forward + backward), "inference" (forward only), or "auto": joint when
    # grad mode is on and some input requires grad
    mode: Mode = "auto"
    # partitioner of the joint graph; None means `default_partition`
    partition: PartitionFn | None = None
    # passed to the partitioner: 0 recomputes all it may, 1 saves all (None: its default)
    memory_budget: float | None = None
    # compiles the forward (and inference) graph; None means the aten executor
    fw_compiler: Compiler | None = None
    # compiles the backward graph; None means the same compiler as the forward
    bw_compiler: Compiler | None = None
    # shape policy for user inputs: "static", "dynamic" or "auto" (see stoker_shapes.Policy)
    dynamic: str = "auto"
    # compile the backward at its first use, with the shape env frozen (default: at lowering)
    lazy_backward: bool = False
    # with lazy_backward: a backward whose late compile needs a new guard (which can no
    # longer be checked) runs its graph as it is (the aten executor), instead of raising
    lazy_backward_fallback: bool = False
    # lint every graph between stages (also on with the environment variable STOKER_CHECK=1)
    debug_checks: bool = field(default_factory=lambda: os.environ.get("STOKER_CHECK", "") == "1")
    # decomposition table for capture; None means torch's core-aten decompositions
    decompositions: Mapping[Any, Callable[..., Any]] | None = None
    # guard parameters and buffers (as self.<path>); exports own theirs and do not
    guard_params: bool = True
    # run in order on the captured graph at the end of capture, before it is partitioned
    # or compiled: a backend's layout choices (stoker-triton's channels-last convolutions
    # on a CPU). A pass edits the graph in place and keeps its contract: the same inputs
    # and outputs, each output in the layout it had, a fake value on every node
    graph_passes: tuple[GraphPass, ...] = ()

    def as_text(self) -> str:
        """One line per knob that differs from the default."""
        default = AOTConfig(debug_checks=False)
        diffs = [
            f"{k}={getattr(self, k)!r}"
            for k in self.__slots__  # type: ignore[attr-defined]
            if getattr(self, k) != getattr(default, k)
        ]
        return f"AOTConfig({', '.join(diffs)})"

    def __str__(self) -> str:
        return self.as_text()

    def fw(self) -> Compiler:
        """The forward compiler (the aten executor when unset)."""
        return self.fw_compiler or aten_executor

    def bw(self) -> Compiler:
        """The backward compiler (the forward's when unset)."""
        return self.bw_compiler or self.fw()
