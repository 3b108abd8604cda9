"""Code generation: a `Schedule` of fused kernels printed as Python source.

- `kernel.py`: one Triton kernel's source per scheduled kernel;
- `kernelmemo.py`: each distinct kernel generated once (a model's repeated blocks);
- `ops.py`: the Triton half of the pointwise table, the shared prelude and printers;
- `wrapper.py`: the Python wrapper that binds sizes, allocates (`reuse.py`: which
  freed buffer an allocation takes) and launches in schedule order.

May import the IR and the scheduler (`ir.py`, `scheduler.py`); never `lowering/`,
`runtime/`, `compile/` or the pipeline. Keep this file free of imports (`compile/`
reads `ops.py`'s prelude without the rest of code generation).
"""
