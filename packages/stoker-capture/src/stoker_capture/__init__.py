"""stoker-capture: the staged AOT pipeline.

Stages are plain functions from one dataclass to the next, so a caller can
stop after any stage, inspect or edit its result, and resume::

    create_aot_state(fn, args, kwargs, config, stack) -> AOTState
    aot_stage1_graph_capture(state)                  -> CapturedGraph
    aot_stage2_export(state, graph)                  -> ExportedGraph
    aot_stage2_compile(state, graph, compiler)       -> CompiledFn
"""

from typing import TYPE_CHECKING, Any

from .__about__ import __version__
from ._internal.api import AOTCompiled, aot_function, aot_module, export
from ._internal.autocast import autocast_off, autocast_state
from ._internal.config import AOTConfig, aten_executor
from ._internal.dynamo import dynamo_backend
from ._internal.errors import (
    ExportFormatError,
    GraphLintError,
    GuardViolationError,
    StokerCaptureError,
    UnsupportedError,
)
from ._internal.graphs.lint import lint_graph
from ._internal.runtime.function import AOTBackwardInfo
from ._internal.stages.capture import CapturedGraph, aot_stage1_graph_capture, eager_autograd_engine
from ._internal.stages.compile import CompiledFn, aot_stage2_compile
from ._internal.stages.state import (
    AOTState,
    ForwardMeta,
    InputInfo,
    InputKind,
    OutputInfo,
    OutputKind,
    create_aot_state,
)

if TYPE_CHECKING:
    from ._internal.partition.core import Partition, PartitionError, default_partition
    from ._internal.partition.mincut import min_cut_partition
    from ._internal.stages.export import ExportedGraph, ExportSignature, aot_stage2_export, load

# Imported at first use: a process that loads its compiled graphs from the caches
# (a warm start) never exports or partitions, and does not pay for their import.
_LAZY = {
    "ExportedGraph": "stages.export",
    "ExportSignature": "stages.export",
    "aot_stage2_export": "stages.export",
    "load": "stages.export",
    "Partition": "partition.core",
    "PartitionError": "partition.core",
    "default_partition": "partition.core",
    "min_cut_partition": "partition.mincut",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stoker_capture' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"._internal.{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AOTBackwardInfo",
    "AOTCompiled",
    "AOTConfig",
    "AOTState",
    "CapturedGraph",
    "CompiledFn",
    "ExportFormatError",
    "ExportSignature",
    "ExportedGraph",
    "ForwardMeta",
    "GraphLintError",
    "GuardViolationError",
    "InputInfo",
    "InputKind",
    "OutputInfo",
    "OutputKind",
    "Partition",
    "PartitionError",
    "StokerCaptureError",
    "UnsupportedError",
    "__version__",
    "aot_function",
    "aot_module",
    "aot_stage1_graph_capture",
    "aot_stage2_compile",
    "aot_stage2_export",
    "aten_executor",
    "autocast_off",
    "autocast_state",
    "create_aot_state",
    "default_partition",
    "dynamo_backend",
    "eager_autograd_engine",
    "export",
    "lint_graph",
    "load",
    "min_cut_partition",
]
