"""The benchmarks `stoker bench` runs, one module per family (`..registry` lists them).

Each module is a program: ``python -m stoker._internal.bench.benchmarks.<module> --help``.
Its ``main(argv)`` parses its own options, prints its table and, given ``--json PATH``,
writes its figures there; the harness (`..harness`) runs it in a fresh process, so the
environment a module sets for itself (``TRITON_INTERPRET=0``, its caches) stays in it.
"""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str | None, doc: Any) -> None:
    """Write ``doc`` to ``path`` (nothing when ``path`` is empty)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
