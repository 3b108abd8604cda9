"""Errors of the umbrella package."""

from __future__ import annotations


class StokerMissingPieceError(ImportError):
    """A sibling package (or one of its functions) that this feature needs is not installed."""


def missing_piece(package: str, name: str, feature: str) -> StokerMissingPieceError:
    """``stoker_capture.dynamo_backend`` is needed for ``stoker.compile`` but ... ."""
    dist = package.replace("_", "-")
    return StokerMissingPieceError(
        f"{package}.{name} is needed for {feature}, but it is not available in the installed "
        f"{dist}; install a {dist} that provides it (`pip install -U {dist}`), "
        "or turn that feature off"
    )
