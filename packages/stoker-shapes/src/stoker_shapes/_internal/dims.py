"""Named dynamic dimensions and the shape policies."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .errors import ShapeInputError


class Policy(StrEnum):
    """How input dimensions become symbolic.

    ``static``: every size is specialized.  ``dynamic``: dims named by a `Dim`
    (or, for the whole-call policy, every user-input dim) are symbolic.  ``auto``:
    static first; a dim that changes between calls becomes dynamic at the
    recompile (automatic dynamic shapes).
    """

    STATIC = "static"
    DYNAMIC = "dynamic"
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Dim:
    """A named dynamic dimension.  The same `Dim` on two inputs means equal sizes.

    ``min``/``max`` bound the sizes the compiled artifact accepts; sizes 0 and 1
    are always specialized, so the effective minimum is at least 2.
    """

    name: str
    min: int | None = None
    max: int | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ShapeInputError(f"Dim name {self.name!r} must be a Python identifier")
        if self.min is not None and self.min < 0:
            raise ShapeInputError(f"Dim {self.name!r}: min={self.min} is negative")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ShapeInputError(
                f"Dim {self.name!r}: min={self.min} > max={self.max}; swap them or widen the range"
            )

    @property
    def lower(self) -> int:
        return max(2, self.min or 0)

    def __repr__(self) -> str:
        rng = "".join(
            f", {k}={v}" for k, v in (("min", self.min), ("max", self.max)) if v is not None
        )
        return f"Dim({self.name!r}{rng})"
