from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stoker_shapes import ShapeContext, Source

Tracer = Callable[..., Any]


def _trace(ctx: ShapeContext, fn: Callable[..., Any], *args: Any, dynamic: Any = None) -> Any:
    """Fakeify ``args`` as args[i] and trace ``fn`` on them inside the context's fake mode."""
    specs = dynamic if dynamic is not None else [None] * len(args)
    fakes = [ctx.fakeify(a, Source.arg(i), s) for i, (a, s) in enumerate(zip(args, specs))]
    with ctx.tracing():
        return make_fx(fn)(*fakes)


@pytest.fixture
def trace() -> Tracer:
    return _trace


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
