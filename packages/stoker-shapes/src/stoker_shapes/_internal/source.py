"""Structured paths from a call's roots to the values that guards read.

A `Source` is what every guard and every error message names: ``args[0]``,
``kwargs['mask']``, ``self.layers[0].weight``, ``args[0].size()[1]``.  Its
`name` is also valid Python over the roots ``args``, ``kwargs`` and ``self``,
which is how the guard code generator reads values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch._guards import Source as TorchSource

SourceKind = Literal["root", "item", "attr", "size", "stride", "storage_offset"]


@dataclass(frozen=True, slots=True)
class Source:
    """One step of a path: the root, an item, an attribute, or a tensor property."""

    kind: SourceKind
    key: str | int  # root name, item key, attribute name, or dim index
    base: Source | None = None  # None only for roots

    # -- constructors -------------------------------------------------------
    @staticmethod
    def root(name: str) -> Source:
        return Source("root", name)

    @staticmethod
    def arg(index: int) -> Source:
        return Source("item", index, Source.root("args"))

    @staticmethod
    def kwarg(name: str) -> Source:
        return Source("item", name, Source.root("kwargs"))

    @staticmethod
    def module_path(qualname: str, root: str = "self") -> Source:
        """``layers.0.weight`` -> ``self.layers[0].weight``."""
        src = Source.root(root)
        for part in qualname.split("."):
            src = src.item(int(part)) if part.isdigit() else src.attr(part)
        return src

    def item(self, key: int | str) -> Source:
        return Source("item", key, self)

    def attr(self, name: str) -> Source:
        return Source("attr", name, self)

    def size(self, dim: int) -> Source:
        return Source("size", dim, self)

    def stride(self, dim: int) -> Source:
        return Source("stride", dim, self)

    def storage_offset(self) -> Source:
        return Source("storage_offset", 0, self)

    # -- reading ------------------------------------------------------------
    @property
    def name(self) -> str:
        """Python text of this path over the roots ``args``/``kwargs``/``self``."""
        if self.kind == "root":
            return str(self.key)
        assert self.base is not None
        base = self.base.name
        if self.kind == "item":
            return f"{base}[{self.key!r}]"
        if self.kind == "attr":
            return f"{base}.{self.key}"
        if self.kind == "size":
            return f"{base}.size()[{self.key}]"
        if self.kind == "stride":
            return f"{base}.stride()[{self.key}]"
        return f"{base}.storage_offset()"

    @property
    def root_name(self) -> str:
        src: Source = self
        while src.base is not None:
            src = src.base
        return str(src.key)

    @property
    def tensor(self) -> Source:
        """The tensor a size/stride/offset source reads from (itself otherwise)."""
        if self.kind in ("size", "stride", "storage_offset"):
            assert self.base is not None
            return self.base
        return self

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Source({self.name})"

    # -- serialization --------------------------------------------------------
    def to_json(self) -> list[object]:
        steps: list[object] = []
        src: Source | None = self
        while src is not None:
            steps.append([src.kind, src.key])
            src = src.base
        return steps[::-1]

    @staticmethod
    def from_json(steps: list[object]) -> Source:
        src: Source | None = None
        for step in steps:
            assert isinstance(step, list) and len(step) == 2
            kind, key = step
            src = Source(kind, key, src)
        assert src is not None
        return src

    def to_torch(self) -> TorchSource:
        """The equivalent ``torch._guards.Source`` (for fake tensor symbol creation)."""
        from torch._dynamo.source import AttrSource, GetItemSource, LocalSource

        if self.kind == "root":
            return LocalSource(str(self.key))
        assert self.base is not None
        base = self.base.to_torch()
        if self.kind == "item":
            return GetItemSource(base, self.key)
        if self.kind == "attr":
            return AttrSource(base, str(self.key))
        raise ValueError(f"{self.name}: tensor properties have no torch source")
