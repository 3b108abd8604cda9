"""Errors of the umbrella package."""

from __future__ import annotations

from typing import Any


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


def sibling(package: str, name: str, feature: str) -> Any:
    """``package.name``, a sibling package's function that ``feature`` needs; or, when
    the package or the name is not there, the `missing_piece` error saying so."""
    import importlib

    try:
        module = importlib.import_module(package)
    except ImportError as e:
        raise missing_piece(package, name, feature) from e
    found = getattr(module, name, None)
    if found is None:
        raise missing_piece(package, name, feature)
    return found
