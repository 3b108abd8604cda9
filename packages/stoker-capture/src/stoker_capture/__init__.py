"""stoker-capture: the staged AOT pipeline.

Stages are plain functions from one dataclass to the next, so a caller can
stop after any stage, inspect or edit its result, and resume::

    create_aot_state(fn, args, kwargs, config, stack) -> AOTState
    aot_stage1_graph_capture(state)                  -> CapturedGraph
    aot_stage2_export(state, graph)                  -> ExportedGraph
    aot_stage2_compile(state, graph, compiler)       -> CompiledFn
"""

from .__about__ import __version__
from ._internal.capture import CapturedGraph, aot_stage1_graph_capture
from ._internal.config import AOTConfig, aten_executor
from ._internal.errors import (
    ExportFormatError,
    GraphLintError,
    GuardViolationError,
    StokerCaptureError,
    UnsupportedError,
)
from ._internal.lint import lint_graph
from ._internal.state import (
    AOTState,
    ForwardMeta,
    InputInfo,
    InputKind,
    OutputInfo,
    OutputKind,
    create_aot_state,
)

__all__ = [
    "AOTConfig",
    "AOTState",
    "CapturedGraph",
    "ExportFormatError",
    "ForwardMeta",
    "GraphLintError",
    "GuardViolationError",
    "InputInfo",
    "InputKind",
    "OutputInfo",
    "OutputKind",
    "StokerCaptureError",
    "UnsupportedError",
    "__version__",
    "aot_stage1_graph_capture",
    "aten_executor",
    "create_aot_state",
    "lint_graph",
]
