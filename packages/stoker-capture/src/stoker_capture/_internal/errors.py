"""Errors raised by stoker-capture; each says what was wrong, where, and what to do."""

from __future__ import annotations

from stoker_shapes import StokerShapesError


class StokerCaptureError(StokerShapesError):
    """Base class of every error stoker-capture raises."""


class UnsupportedError(StokerCaptureError, NotImplementedError):
    """A feature the pipeline does not support (tensor subclasses, double backward, ...)."""


class GuardViolationError(StokerCaptureError, ValueError):
    """An `ExportedGraph` was called with inputs its guards reject."""


class ExportFormatError(StokerCaptureError, ValueError):
    """A saved export is truncated, corrupt, or from another format version."""


class GraphLintError(StokerCaptureError, AssertionError):
    """A graph between stages broke an invariant (debug checks, ``STOKER_CHECK=1``)."""
