"""The cyclic GC kept off the heap that exists before a compile, while the compile runs.

A compile allocates enough (fake tensors, FX nodes, sympy expressions, IR) to set off
several full collections, and each one walks the whole heap: torch's, sympy's and
Triton's modules, the model, the user's data. On the tiny GPT that was 0.9 CPU s of
a 2-block cold start and 1.5 s of an 8-block one, more than any single stage.
`frozen_heap` moves the objects alive at its start to the permanent generation
(`gc.freeze`) and gives them back at its end (`gc.unfreeze`): collections inside
walk only what the compile made. Nothing is freed later than the end of the
compile (cyclic garbage among the frozen objects waits for the next collection
after it), and nothing else changes: the collector runs as before, on less.

Nested uses are one (the outermost gives back); a process that froze its heap
itself (a forking server), or turned the collector off, is left as it is.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_held = [0]  # compiles inside a freeze this module made (any thread)


@contextlib.contextmanager
def frozen_heap(collect: bool = False) -> Iterator[None]:
    """Run the body with the objects alive now outside the cyclic GC's full walks.

    ``collect``: collect first, so no garbage is frozen (worth it before a long body,
    such as a training loop; a compile's few seconds do not need it)."""
    with _lock:
        mine = bool(_held[0]) or (gc.isenabled() and not gc.get_freeze_count())
        if mine:
            if not _held[0]:
                if collect:
                    gc.collect()
                gc.freeze()
            _held[0] += 1
    if not mine:
        yield
        return
    try:
        yield
    finally:
        with _lock:
            _held[0] -= 1
            if not _held[0]:
                gc.unfreeze()


__all__ = ["frozen_heap"]
