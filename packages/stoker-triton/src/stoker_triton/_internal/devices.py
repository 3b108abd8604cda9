"""What the lowering and the scheduler decide differently per device.

One IR and one scheduler serve every device; a device brings an emitter (Triton
source, or C), a compiler step and a loader, and this small description of the
choices that differ:

- `persistent_rnumel_max`: the longest reduction row a kernel holds whole (a
  GPU's registers; above it the kernel loops, and a symbolic row is guarded). None:
  rows are always walked by loops (a CPU), so no row length is ever guarded;
- `split`: how many partial reductions a long reduction with few outputs is split
  into (`tiling.split_factor` on a GPU: enough programs to fill it);
- `vector_bytes`: the vector width the compiler is told to use (the C emitter's
  outer-reduction tile follows from it);
- `parallel_min_work`: the elements a kernel must touch before its outer loop runs
  on several threads (below it, a thread's start costs more than it saves);
- `wide_loop_min`: the shortest simd loop that asks for the CPU's widest vectors
  (16 float lanes with AVX-512; a shorter loop keeps `vector_bytes`);
- `outer_tile` (from `vector_bytes`): how many neighbouring outputs an outer reduction
  (`x.sum(0)`) accumulates side by side, so that its loads run along contiguous memory;
- `short_row_max` (from `vector_bytes`): rows up to this length are reduced the same
  way, outputs side by side, since one row fills no vector.

Imports only the IR's size helpers: lowering and the scheduler both read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .ir import Expr


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str  # "gpu" (Triton) | "cpu" (C)
    persistent_rnumel_max: int | None
    split: Callable[[Expr, Expr, bool], int]  # (xnumel, rnumel, outer) -> partials
    vector_bytes: int = 0
    parallel_min_work: int = 0
    wide_loop_min: int = 0

    @property
    def outer_tile(self) -> int:
        """Outputs an outer reduction accumulates side by side: two vectors of float32."""
        return max(1, 2 * self.vector_bytes // 4)

    @property
    def short_row_max(self) -> int:
        """The longest static reduction row walked like an outer reduction (outputs side
        by side): one vector of float32; a shorter row fills no vector on its own."""
        return self.vector_bytes // 4


def gpu_spec(persistent_rnumel_max: int) -> DeviceSpec:
    """The Triton path's choices (a GPU, or Triton's interpreter standing in for one)."""
    from .tiling import split_factor

    return DeviceSpec("gpu", persistent_rnumel_max, split_factor)


# A CPU splits only a reduction to one or a few outputs over a long row (`x.sum()`, a
# gradient norm): into a fixed number of partials, so the result does not depend on
# how many threads run it (bit for bit the same at 1 and at N threads).
CPU_SPLIT_PARTS = 16
CPU_SPLIT_MIN_RNUMEL = 1 << 16
CPU_SPLIT_MAX_OUTPUTS = 4


def cpu_split(xnumel: Expr, rnumel: Expr, outer: bool) -> int:
    """Partials of a long reduction with few outputs (static sizes only): the largest
    divisor of `rnumel` up to `CPU_SPLIT_PARTS`, so every partial is whole."""
    if not (xnumel.is_number and rnumel.is_number):
        return 1
    x, r = int(xnumel), int(rnumel)
    if x > CPU_SPLIT_MAX_OUTPUTS or r < CPU_SPLIT_MIN_RNUMEL:
        return 1
    return max(d for d in range(1, CPU_SPLIT_PARTS + 1) if r % d == 0)


CPU = DeviceSpec(
    "cpu",
    persistent_rnumel_max=None,
    split=cpu_split,
    vector_bytes=32,  # AVX2's width (ccompile.DEFAULT_FLAGS: 256-bit vectors on AVX-512 too)
    parallel_min_work=32768,
    wide_loop_min=64,
)
