"""Compiling generated kernels with Triton's own compiler, in worker processes.

- `xcompile.py`: the jobs (a kernel built for a GPU target, the precompile for
  the GPU at hand) and the markers of what was built;
- `workers.py`: the pool of worker processes, fed jobs over pipes;
- `zygote.py`: one fresh process (``python -m stoker_triton._internal.compile.zygote``)
  that imports the compiler once and forks each worker.

The workers and the zygote never import torch: the zygote forks only from a torch-free,
single-threaded process. Keep this file free of imports, and import nothing at module
level in these files that imports torch. May import `modcache/` and `codegen/ops.py`
(lazily); never `runtime/`, `lowering/` or the pipeline.
"""
