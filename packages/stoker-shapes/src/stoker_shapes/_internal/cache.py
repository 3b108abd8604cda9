"""`GuardedCache`: compiled artifacts keyed by the guards their compilation produced."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .context import ShapeContext
from .dims import Policy
from .errors import RecompileLimitError
from .guards import GuardSet
from .source import Source

A = TypeVar("A")
CompileFn = Callable[[ShapeContext, Sequence[Any], Mapping[str, Any]], A]


@dataclass(slots=True)
class CacheEntry(Generic[A]):
    artifact: A
    guards: GuardSet


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    reasons: list[str] = field(default_factory=list)  # one per recompile (not the first compile)
    entries: int = 0
    fallbacks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "reasons": list(self.reasons),
            "entries": self.entries,
            "fallbacks": self.fallbacks,
        }


class GuardedCache(Generic[A]):
    """Call with inputs -> the artifact whose guards pass; compile on a miss.

    ``compile_fn(ctx, args, kwargs)`` runs every stage with the fresh
    `ShapeContext` it is given; the cache reads the guards out of that context
    afterwards, so nothing a later stage assumed goes unguarded.  Under policy
    ``auto``, a size that changed between calls is compiled dynamic at the
    recompile.  More than ``limit`` compilations raise `RecompileLimitError`
    listing every reason, or, with ``fallback``, warn once and call it.
    """

    def __init__(
        self,
        compile_fn: CompileFn[A],
        *,
        limit: int = 8,
        policy: Policy | str = Policy.AUTO,
        fallback: Callable[..., Any] | None = None,
        name: str = "function",
    ) -> None:
        self.compile_fn = compile_fn
        self.limit = limit
        self.policy = Policy(policy)
        self.fallback = fallback
        self.name = name
        self.entries: list[CacheEntry[A]] = []
        self._stats = CacheStats()
        self._auto_dynamic: set[tuple[Source, int]] = set()
        self._warned = False

    def lookup(
        self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, self_: Any = None
    ) -> A | None:
        """The artifact for these inputs, compiling on a miss (None: fell back).

        ``self_`` is the module whose parameters guards name as ``self.…`` (if any).
        """
        kwargs = kwargs if kwargs is not None else {}
        for entry in self.entries:
            if entry.guards.check(args, kwargs, self_):
                self._stats.hits += 1
                return entry.artifact
        return self._miss(args, kwargs, self_)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        artifact = self.lookup(args, kwargs)
        if artifact is None:
            assert self.fallback is not None
            return self.fallback(*args, **kwargs)
        return artifact(*args, **kwargs)  # type: ignore[operator]

    def _miss(self, args: Sequence[Any], kwargs: Mapping[str, Any], self_: Any) -> A | None:
        self._stats.misses += 1
        if self.entries:
            last = self.entries[0].guards  # the newest compilation
            reason = (
                last.explain(args, kwargs, self_) or "guards failed (no single guard explains it)"
            )
            self._stats.reasons.append(reason)
            if self.policy == Policy.AUTO:
                self._auto_dynamic.update(last.failing_sizes(args, kwargs))
        if len(self.entries) >= self.limit:
            msg = (
                f"{self.name}: recompiled {len(self.entries)} times, hitting the limit "
                f"of {self.limit}.  Recompile reasons:\n"
                + "\n".join(f"  {i + 1}. {r}" for i, r in enumerate(self._stats.reasons))
                + "\nMark the changing dims dynamic (Dim / policy='dynamic'), or raise `limit`."
            )
            if self.fallback is None:
                raise RecompileLimitError(msg, list(self._stats.reasons))
            if not self._warned:
                warnings.warn(msg + "\nFalling back to eager for calls that miss.", stacklevel=3)
                self._warned = True
            self._stats.fallbacks += 1
            return None
        ctx = ShapeContext(policy=self.policy, auto_dynamic=frozenset(self._auto_dynamic))
        artifact = self.compile_fn(ctx, args, kwargs)
        guards = ctx.produce_guards()
        self.entries.insert(0, CacheEntry(artifact, guards))  # newest first: likeliest to hit
        self._stats.entries = len(self.entries)
        return artifact

    def stats(self) -> dict[str, Any]:
        """Hits, misses, recompile reasons, entries and fallbacks so far."""
        return self._stats.as_dict()

    def clear(self) -> None:
        self.entries.clear()
        self._auto_dynamic.clear()
        self._stats = CacheStats()
