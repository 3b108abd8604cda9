"""Local multi-process runs: one process per rank on 127.0.0.1 (gloo on the CPU, NCCL
with one GPU per rank), for ``stoker demo --ranks N`` and the distributed tests."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_rank(rank: int, world: int, port: int, backend: str, timeout_s: float = 120.0) -> None:
    """Join the process group of a local run (gloo or nccl)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def _entry(
    rank: int, fn: Callable[..., Any], world: int, port: int, backend: str, args: Any
) -> None:
    import torch.distributed as dist

    init_rank(rank, world, port, backend)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes (a picklable ``fn``)."""
    import torch.multiprocessing

    mp: Any = torch.multiprocessing
    mp.spawn(_entry, args=(fn, world, free_port(), backend, args), nprocs=world, join=True)
