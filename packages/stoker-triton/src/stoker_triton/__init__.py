"""stoker-triton: a Triton code generator with fusion for functional core-aten FX graphs.

`compile_graph(gm, example_inputs) -> callable` (usable as an `aot_function`
compiler). Importing this package does not import triton; the pipeline and
triton load on the first compile.
"""

from .__about__ import __version__
from ._internal.api import compile_graph, graph_passes, start_compile_workers
from ._internal.report import CompileReport, KernelInfo

__all__ = [
    "CompileReport",
    "KernelInfo",
    "__version__",
    "compile_graph",
    "graph_passes",
    "start_compile_workers",
]
