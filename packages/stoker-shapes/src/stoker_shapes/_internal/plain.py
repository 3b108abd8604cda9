"""The Python values that stand for themselves: no tensor, no symbol, nothing to
trace through.  A graph takes them as arguments as they are, their ``repr`` names
them exactly (a cache key may spell them so), and an input of one of them is a
constant the compile specializes on.
"""

from __future__ import annotations

import torch

# a non-number input of one of these is a constant (guarded by equality)
CONSTANT_TYPES: tuple[type, ...] = (
    bool,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
# with the numbers, the graph arguments taken as they are
PLAIN_TYPES: tuple[type, ...] = (int, float, *CONSTANT_TYPES)
