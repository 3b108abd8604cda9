"""stoker-shapes: fake tensors, symbolic shapes, sources, guards and a guard-keyed cache.

One `ShapeContext` (a fake mode and its shape env) per compilation; every
stage adds its guards to it; `ShapeContext.produce_guards` reads them out at
the end as a `GuardSet` that checks, explains and serializes; `GuardedCache`
keys compiled artifacts by those guards.
"""

from .__about__ import __version__
from ._internal.cache import GuardedCache
from ._internal.context import ShapeContext, data_dependent_error, tree_sources
from ._internal.dims import Dim, Policy
from ._internal.diskcache import DiskCache, atomic_write
from ._internal.errors import (
    DataDependentError,
    RecompileLimitError,
    ShapeInputError,
    SpecializationError,
    StokerShapesError,
)
from ._internal.guards import Guard, GuardSet, TensorSpec
from ._internal.provenance import Origin, current_origin
from ._internal.source import Source

__all__ = [
    "DataDependentError",
    "Dim",
    "DiskCache",
    "Guard",
    "GuardSet",
    "GuardedCache",
    "Origin",
    "Policy",
    "RecompileLimitError",
    "ShapeContext",
    "ShapeInputError",
    "Source",
    "SpecializationError",
    "StokerShapesError",
    "TensorSpec",
    "__version__",
    "atomic_write",
    "current_origin",
    "data_dependent_error",
    "tree_sources",
]
