"""`cat` reads each input only inside its own range (out-of-bounds reads crashed the interpreter)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import stoker_triton


@pytest.mark.parametrize("sizes", [(1, 4, 0), (1, 4, 3), (0, 2, 3), (2,)])
def test_cat_pieces_read_only_their_range(sizes: tuple[int, ...]) -> None:
    xs = [torch.randn(n, 5, 5) for n in sizes]

    def f(*ts: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.cat(ts, 0) * 2,)

    gm = make_fx(f)(*xs)
    fn = stoker_triton.compile_graph(gm, xs)
    fresh = [torch.randn(n, 5, 5) for n in sizes]
    torch.testing.assert_close(fn(*fresh)[0], f(*fresh)[0])
