"""A stand-in CUDA driver for tests and CPU benchmarks (not used by the compiler).

`install()` makes Triton's real (non-interpreter) launch path run on a machine
without a GPU: kernels are compiled for sm_90 (TTIR to cubin, with ptxas),
"loaded" and "launched" by stubs. Binding, specialization, the cache key, the
disk-cache lookup and the launcher call are Triton's own. Run it in a process
with ``TRITON_INTERPRET=0`` set before triton is imported; CPU tensors stand in
for GPU ones (their addresses are only looked at, never read).
"""

from __future__ import annotations

import types
from typing import Any


class FakeGPU:
    """Enough of a CUDA driver for Triton to build kernels for sm_90 and "launch"
    them. With ``record``, each launch's arguments (everything the launcher
    receives: grid, stream, function, metadata, hooks, kernel arguments) are
    appended to `launches`."""

    def __init__(self, record: bool = False) -> None:
        self.record = record
        self.launches: list[tuple[Any, ...]] = []
        self.utils = types.SimpleNamespace(
            load_binary=lambda name, kernel, shared, device: (None, name, 0, 0, 1024),
            get_device_properties=lambda device: {"max_shared_mem": 232448},
            unload_module=lambda module: None,
        )

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def launcher_cls(self, src: Any, metadata: Any) -> Any:
        if not self.record:
            return lambda *args: None
        launches = self.launches
        return lambda *args: launches.append(args)


def install(record: bool = False) -> FakeGPU:
    """Make a `FakeGPU` Triton's active driver; returns it."""
    from triton.runtime import driver

    fake = FakeGPU(record)
    driver.set_active(fake)
    from .runtime import fastlaunch

    fastlaunch.reset()  # the adapter resolves the new driver's entry points
    return fake
