"""Errors raised by stoker-shapes; every message names the source it is about."""

from __future__ import annotations


class StokerShapesError(Exception):
    """Base class of every error stoker-shapes raises."""


class ShapeInputError(StokerShapesError, TypeError):
    """An input (or a `Dim`/dynamic-shapes spec) that stoker cannot handle."""


class SpecializationError(StokerShapesError):
    """A dim declared dynamic was specialized to a constant by the traced code."""


class DataDependentError(StokerShapesError):
    """Control flow on a value only known at run time (a data-dependent branch)."""


class RecompileLimitError(StokerShapesError):
    """More distinct compilations than the cache's limit allows."""

    def __init__(self, message: str, reasons: list[str]) -> None:
        super().__init__(message)
        self.reasons = reasons
