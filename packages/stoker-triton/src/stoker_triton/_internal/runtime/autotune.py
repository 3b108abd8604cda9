"""Autotune results on disk: the best configuration per size, one entry per kernel."""

from __future__ import annotations

import json
import threading
from typing import ClassVar

from stoker_shapes import DiskCache

from ..modcache.modules import cache_dir


class _Tuned:
    """Autotune results on disk, one entry per kernel: {"x,r": [XBLOCK, RBLOCK, warps]}."""

    lock = threading.Lock()
    data: ClassVar[dict[str, dict[str, list[int]]]] = {}

    @staticmethod
    def _store() -> DiskCache:
        import triton

        return DiskCache(cache_dir, "autotune", f"1-triton{triton.__version__}", ".json")

    @classmethod
    def _load(cls, sha: str) -> dict[str, list[int]]:
        if sha not in cls.data:
            body = cls._store().get(sha)
            try:
                loaded = json.loads(body) if body is not None else {}
            except ValueError:
                loaded = {}
            cls.data[sha] = loaded if isinstance(loaded, dict) else {}
        return cls.data[sha]

    @classmethod
    def get(cls, sha: str, key: str) -> list[int] | None:
        with cls.lock:
            return cls._load(sha).get(key)

    @classmethod
    def put(cls, sha: str, key: str, cfg: list[int]) -> None:
        with cls.lock:
            cls._load(sha)[key] = cfg
            cls._store().put(sha, json.dumps(cls.data[sha]).encode())
