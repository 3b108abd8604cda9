"""`CompileReport`: what compile_graph did, for people and for the umbrella package."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator


@dataclasses.dataclass
class KernelInfo:
    name: str  # kernel step name in the wrapper (kernel0, ...)
    kind: str  # pointwise | persistent-reduction | looped-reduction | scatter
    nodes: list[str]  # IR nodes fused into it
    xnumel: str
    rnumel: str
    path: str  # kernel source file in the cache dir
    source: str
    fn_name: str = ""  # the Triton function's name: what a profiler shows (`kernel_fn_name`)
    origins: list[str] = dataclasses.field(default_factory=list)  # the aten ops it fused


# Every kernel of every graph compiled or loaded in this process, by its function name
# (a profile of a training step names kernels so: `tools/lap_profile.py` reads this).
KERNELS: dict[str, KernelInfo] = {}


def register_kernels(report: CompileReport) -> None:
    for k in report.kernels:
        if k.fn_name:
            KERNELS.setdefault(k.fn_name, k)


@dataclasses.dataclass
class CompileReport:
    """Kernels, fusion groups, extern/fallback ops, guards and per-stage timings."""

    kernels: list[KernelInfo] = dataclasses.field(default_factory=list)
    target: str = ""  # the emitter: "triton" (a GPU, or Triton's interpreter) or "c" (the CPU)
    extern_calls: list[str] = dataclasses.field(
        default_factory=list
    )  # every aten call the wrapper makes
    fallback_ops: dict[str, int] = dataclasses.field(
        default_factory=dict
    )  # op -> count (no lowering)
    fallback_reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    guards_added: list[str] = dataclasses.field(
        default_factory=list
    )  # added to the shape env by codegen
    timings_ms: dict[str, float] = dataclasses.field(default_factory=dict)  # stage -> milliseconds
    # stage -> CPU milliseconds of this process (the benchmark's measure on a busy machine)
    cpu_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    # repeated regions lowered once (lowering/regions.py): each found, and graph nodes renamed
    regions: list[str] = dataclasses.field(default_factory=list)
    reused_nodes: int = 0
    lowered_nodes: int = 0  # graph nodes lowered by their rule (not renamed), constants aside
    wrapper_path: str = ""
    # the compiled-graph cache: "hit", "miss (<why>)", "uncacheable: <why>", "" (off)
    cache: str = ""
    cache_local: bool = False  # a hit on an entry this process wrote (the same graph again)
    # the IR and the schedule as text, printed when first asked for (printing every
    # sympy index of a large graph costs seconds that a compile does not need)
    text_of: dict[str, str | Callable[[], str]] = dataclasses.field(
        default_factory=dict, repr=False
    )

    @property
    def ir_text(self) -> str:
        return self._text("ir")

    @property
    def schedule_text(self) -> str:
        return self._text("schedule")

    def _text(self, what: str) -> str:
        t = self.text_of.get(what, "")
        if callable(t):
            t = self.text_of[what] = t()
        return t

    @property
    def n_kernels(self) -> int:
        return len(self.kernels)

    @property
    def fusion_groups(self) -> list[list[str]]:
        return [k.nodes for k in self.kernels]

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        # (imported here: `import stoker_triton` must not import stoker_shapes, which
        # imports torch; the compile workers and their zygote import this package and
        # must stay torch-free, or the zygote refuses to fork them)
        from stoker_shapes import timing

        t0, c0, mark = time.perf_counter(), time.process_time(), timing.start()
        try:
            yield
        finally:
            self.timings_ms[name] = (
                self.timings_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
            )
            self.cpu_ms[name] = self.cpu_ms.get(name, 0.0) + (time.process_time() - c0) * 1e3
            if name == "cache":
                timing.done("cache load", mark, "compiled-graph cache load")
            else:
                timing.done("codegen", mark, f"triton {name}")

    def __str__(self) -> str:
        lines = [
            f"stoker-triton: {self.n_kernels} kernel(s), {len(self.extern_calls)} extern call(s)"
        ]
        for k in self.kernels:
            lines.append(f"  {k.name} [{k.kind}] {k.xnumel} x {k.rnumel}: {', '.join(k.nodes)}")
        if self.extern_calls:
            lines.append(f"  extern: {', '.join(self.extern_calls)}")
        if self.fallback_ops:
            lines.append(
                "  fallback (no lowering): "
                + ", ".join(f"{k} x{v}" for k, v in self.fallback_ops.items())
            )
        if self.guards_added:
            lines.append(f"  guards added: {'; '.join(self.guards_added)}")
        lines.append(
            "  timings: " + ", ".join(f"{k} {v:.1f} ms" for k, v in self.timings_ms.items())
        )
        if self.wrapper_path:
            lines.append(f"  wrapper: {self.wrapper_path}")
        if self.cache:
            lines.append(f"  compiled-graph cache: {self.cache}")
        return "\n".join(lines)
