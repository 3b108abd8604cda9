"""Every benchmark `stoker bench` runs, by name (`REGISTRY`).

A benchmark is one of two kinds:

* a **program**: a module of `benchmarks` (``python -m stoker._internal.bench.benchmarks.<m>``)
  that prints its own table and, given ``--json PATH``, writes its figures there. The
  harness runs it in a fresh process with ``args`` (``smoke_args`` under ``--smoke``,
  ``extra`` appended), so what the module sets for itself (``TRITON_INTERPRET=0`` and
  the stand-in sm_90 driver, its own cache folders, its worker processes) stays there;
* an **in-process** run (``run``): the model benchmarks, which already start a fresh
  process per (model, backend) and take the ``--models`` / ``--backends`` options.

Either way the figures become rows (``rows``: the JSON document -> `Row`), which the
harness compares with a baseline.  To add one: write its module under `benchmarks`
(``main(argv)``, a ``--json`` option, a ``--smoke`` size or small arguments that run in
seconds) and add one `register` call below; the smoke test
(tests-integration/test_tools_smoke.py) runs every entry of the table.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A row: {"benchmark": name, "case": what was measured, "metrics": {name: number}}.
Row = dict[str, Any]

PACKAGE = "stoker._internal.bench.benchmarks"
HERE = os.path.dirname(os.path.abspath(__file__))
TRAFFIC_EXPECTED = os.path.join(HERE, "benchmarks", "traffic_expected.json")

# Metric names (substrings) where a larger figure is the better one; every other metric
# (seconds, bytes, counts) regresses when it grows.
HIGHER_IS_BETTER = ("gbs", "gb_s", "bandwidth", "speed", "hits", "pct", "throughput")


@dataclass(frozen=True)
class Options:
    """What the command line asked for, as the in-process benchmarks read it."""

    smoke: bool = False
    models: Sequence[str] | None = None
    backends: Sequence[str] | None = None
    steps: int | None = None  # None: 20, or 1 under --smoke
    warm: bool = True
    device: str | None = None
    # seconds per benchmark process; None: the benchmark's own `limit` (900 by default)
    timeout: float | None = None
    extra: Sequence[str] = ()
    on_rows: Callable[[list[dict[str, Any]]], None] | None = None


@dataclass(frozen=True)
class Benchmark:
    name: str
    group: str  # the package it measures
    help: str
    module: str = ""  # a module of `benchmarks`, run as a program
    args: tuple[str, ...] = ()
    smoke_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    smoke_env: Mapping[str, str] = field(default_factory=dict)  # added under --smoke
    flags: tuple[str, ...] = ()  # python's own flags (before -m)
    run: Callable[[Options], Any] | None = None  # in-process instead of a program
    rows: Callable[[Any], list[Row]] | None = None  # default: `flatten_rows`
    gpu: bool = False  # measures only on a GPU (without one it says so and exits 0)
    # seconds the whole program may run unless --timeout says otherwise: a benchmark
    # that runs each model in a process with a time limit of its own gets room for all
    limit: float = 900.0

    def command(self, smoke: bool, extra: Sequence[str], json_path: str) -> list[str]:
        """The program's arguments after ``python`` (a ``--json`` in ``extra`` is kept:
        the harness reads the figures from there)."""
        args = self.smoke_args if smoke else self.args
        out = [] if "--json" in extra else ["--json", json_path]
        return [*self.flags, "-m", f"{PACKAGE}.{self.module}", *args, *extra, *out]


def json_given(extra: Sequence[str]) -> str | None:
    """The path of a ``--json PATH`` among a benchmark's own arguments."""
    if "--json" in extra:
        i = list(extra).index("--json")
        return extra[i + 1] if i + 1 < len(extra) else None
    return None


REGISTRY: dict[str, Benchmark] = {}


def register(b: Benchmark) -> Benchmark:
    if b.name in REGISTRY:
        raise ValueError(f"benchmark {b.name!r} registered twice")
    if (b.run is None) == (not b.module):
        raise ValueError(f"benchmark {b.name!r}: give a module or a run function")
    REGISTRY[b.name] = b
    return b


# ----------------------------------------------------------------------------- rows


def _numbers(value: Any, prefix: str, out: dict[str, float]) -> None:
    """Every number under ``value`` (dicts walked, lists skipped), dotted names."""
    if isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, (int, float)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _numbers(v, f"{prefix}.{k}" if prefix else str(k), out)


CASE_KEYS = ("case", "model", "backend", "name", "label")


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float))


def flatten_rows(doc: Any, prefix: str = "") -> list[Row]:
    """Rows from a benchmark's JSON, without knowing its shape.

    A list of dicts gives a row each, its case named by its ``case`` / ``model`` /
    ``backend`` / ``name`` / ``label`` strings (else its index). A dict that holds
    numbers is a row (case ``prefix``): its numbers, and those of the dicts inside it
    under dotted names; a dict without numbers of its own is a table, each of its dicts
    and lists a case (``prefix key``). Lists of numbers are left out (a loss curve)."""
    rows: list[Row] = []
    if isinstance(doc, list):
        for i, item in enumerate(doc):
            if isinstance(item, dict):
                named = _join(*(item[k] for k in CASE_KEYS if isinstance(item.get(k), str)))
                rows += flatten_rows(
                    {k: v for k, v in item.items() if k not in CASE_KEYS},
                    _join(prefix, named or str(i)),
                )
        return rows
    if not isinstance(doc, dict):
        return rows
    if any(_is_number(v) for v in doc.values()):
        metrics: dict[str, float] = {}
        _numbers({k: v for k, v in doc.items() if not isinstance(v, list)}, "", metrics)
        rows.append({"case": prefix, "metrics": metrics})
        for k, v in doc.items():
            if isinstance(v, list):
                rows += flatten_rows(v, _join(prefix, str(k)))
        return rows
    for k, v in doc.items():
        if isinstance(v, (dict, list)):
            rows += flatten_rows(v, _join(prefix, str(k)))
    return rows


# ----------------------------------------------------------------------------- the models


def _run_models(o: Options) -> Any:
    from .bench import BACKENDS, format_table, run_models

    rows = run_models(
        models=o.models or (("mlp",) if o.smoke else None),
        backends=o.backends or (("stoker",) if o.smoke else BACKENDS),
        steps=o.steps or (1 if o.smoke else 20),
        warm=o.warm and not o.smoke,
        device=o.device,
        timeout=o.timeout or 900.0,
    )
    print(format_table(rows), flush=True)
    return rows


def _run_gpu_suite(o: Options) -> Any:
    from .bench import format_suite_table, run_suite
    from .suite import SUITE_BACKENDS

    rows = run_suite(
        entries=o.models,
        backends=o.backends or (("eager", "stoker") if o.smoke else SUITE_BACKENDS),
        steps=o.steps or (1 if o.smoke else 20),
        warm=o.warm and not o.smoke,
        device=o.device,
        timeout=o.timeout or 900.0,
        smoke=o.smoke,
        on_row=o.on_rows,
    )
    print(format_suite_table(rows), flush=True)
    return rows


def _model_rows(doc: Any) -> list[Row]:
    keep = ("losses", "stoker", "warm_stoker", "device", "smoke", "peak_kind", "error")
    rows = [{k: v for k, v in r.items() if k not in keep} for r in doc if isinstance(r, dict)]
    return flatten_rows(rows)


def _depth_rows(doc: Any) -> list[Row]:
    """``depth``'s raw JSON is every process's stages ({checkout: [repeat][depth]});
    a row per checkout and depth: the median over the repeats of its summary."""
    import statistics

    from .benchmarks.depth import summarize

    shaped = isinstance(doc, dict) and all(
        isinstance(v, list) and all(isinstance(r, list) for r in v) for v in doc.values()
    )
    if not shaped:
        return flatten_rows(doc)
    rows: list[Row] = []
    for tree, repeats in doc.items():
        for j in range(len(repeats[0]) if repeats else 0):
            runs = [summarize(rep[j]) for rep in repeats]
            metrics = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append({"case": f"{tree} {repeats[0][j]['layers']} blocks", "metrics": metrics})
    return rows


def model_check(o: Options, suite: bool) -> None:
    """Refuse unknown ``--models`` / ``--backends`` before anything runs."""
    from ..config import check_device
    from .bench import BACKENDS, check_names

    check_device(o.device)
    if suite:
        from .suite import SUITE, SUITE_BACKENDS

        if o.backends:
            check_names("--backends", o.backends, SUITE_BACKENDS, " with --suite gpu")
        known = [e.name for e in SUITE]
        check_names("--models", list(o.models or known), known, " (entries of --suite gpu)")
        return
    from .models import model_zoo

    if o.backends:
        check_names("--backends", o.backends, BACKENDS)
    if o.models:
        zoo = list(model_zoo())
        hint = ""
        if any(n.startswith("hf-") and n not in zoo for n in o.models):
            hint = " (the hf-* models need `transformers`)"
        check_names("--models", o.models, zoo, hint)


# ----------------------------------------------------------------------------- the table

NO_TARGETS = {"STOKER_TRITON_CHECK_TARGETS": ""}  # no sm_90 cross-compile of each kernel

register(
    Benchmark(
        "conv_layout",
        "stoker-triton",
        "a convolution forward and backward, NCHW against channels-last, beside the layout "
        "the C backend picks for it",
        module="conv_layout",
        smoke_args=("--smoke",),
    )
)

register(
    Benchmark(
        "cpu_step",
        "stoker-triton",
        "the CPU backend (C kernels) beside eager and Inductor-CPU: steady step, cold and "
        "warm compile, at 1 and 2 threads",
        module="cpu_step",
        limit=2 * 3600.0,  # 6 models x 2 thread counts, each process limited to 1800 s
        smoke_args=(
            "--models",
            "tiny-gpt",
            "--threads",
            "1",
            "--steps",
            "1",
            "--rounds",
            "1",
            "--smoke",
            "--backends",
            "eager,stoker",
        ),
    )
)
register(
    Benchmark(
        "hf_zoo",
        "stoker",
        "thirty Hugging Face architectures at tiny sizes, eager / stoker (C kernels) / "
        "Inductor-CPU: steady step and parity with eager (--parity-only: losses and every "
        "gradient over 3 steps, and whether C is bit-identical to the aten executor)",
        module="hf_zoo",
        limit=6 * 3600.0,  # 30 models x thread counts, each process limited to 900 s
        smoke_args=(
            "--models",
            "falcon",  # the zoo's quickest to compile (each model is its own process)
            "--parity-only",
            "--backends",
            "eager,c",
            "--steps",
            "2",
            "--threads",
            "1",
            "--check",
        ),
    )
)
register(
    Benchmark(
        "varlen",
        "stoker",
        "a new sequence length every step: the step at the 1st, 2nd, 3rd and 10th new "
        "length and the graphs compiled, eager / stoker / Inductor",
        module="varlen",
        limit=3600.0,  # a process per backend, each limited to 1800 s
        # the aten executor: the C backend's two cold builds double the smoke's time, and
        # packages/stoker/tests/test_stoker_varlen.py holds it to the same target
        smoke_args=("--smoke", "--backends", "eager,stoker", "--backend", "aten", "--check"),
        rows=lambda doc: flatten_rows(doc["rows"] if isinstance(doc, dict) else doc),
    )
)
register(
    Benchmark(
        "shapes",
        "stoker-shapes",
        "guard-check cost: µs per call of a GuardSet over 10 tensors, beside a plain call",
        module="shapes",
        smoke_args=("--number", "2000", "--repeat", "1"),
    )
)
register(
    Benchmark(
        "capture",
        "stoker-capture",
        "capture + partition vs torch.compile(aot_eager): compile time, steady call, "
        "saved-activation bytes of each partitioner",
        module="capture",
        smoke_args=("--iters", "2", "--models", "mlp"),
    )
)
register(
    Benchmark(
        "capture_pipeline",
        "stoker",
        "stoker's own compile stages (capture, partition, lower, schedule, codegen, load) "
        "on a GPU-suite model, fastest of --repeat processes",
        module="capture",
        args=("--pipeline", "gpt-m"),
        smoke_args=("--pipeline", "tiny-gpt", "--smoke", "--repeat", "1"),
    )
)
register(
    Benchmark(
        "autograd",
        "stoker-autograd",
        "backward time, the eager autograd engine vs stoker-autograd (cache hit)",
        module="autograd",
        smoke_args=("--steps", "2", "--warmup", "1"),
    )
)
register(
    Benchmark(
        "autograd_first",
        "stoker-autograd",
        "the first compiled-autograd backward: capture, retrace, whole call, per repeat",
        module="autograd_first",
        args=("--model", "gpt-m", "--repeat", "3"),
        smoke_args=("--model", "tiny-gpt", "--repeat", "2"),
    )
)
register(
    Benchmark(
        "autograd_scope",
        "stoker-autograd",
        "what deciding the scope of compiled autograd costs per backward (µs)",
        module="autograd_scope",
        smoke_args=("--repeats", "1", "--calls", "20"),
    )
)
register(
    Benchmark(
        "segments",
        "stoker-autograd",
        "how a model's compiled backward is cut into segments, and their compile time",
        module="segments",
        smoke_args=("--model", "tiny-gpt", "--device", "cpu"),
        env=NO_TARGETS,
    )
)
register(
    Benchmark(
        "ddp",
        "stoker",
        "segments per compiled backward and step time under DDP (2 gloo ranks), eager and stoker",
        module="ddp",
        smoke_args=("--bucket-mb", "0.01", "--steps", "5"),
        flags=("-W", "ignore"),
        env={"OMP_NUM_THREADS": "1"},
    )
)
register(
    Benchmark(
        "triton",
        "stoker-triton",
        "kernels on a GPU: GB/s against a device copy, cold compile times "
        "(--smoke: tiny sizes on the interpreter, numbers meaningless)",
        module="kernels",
        smoke_args=("--smoke",),
        smoke_env=NO_TARGETS,
        gpu=True,
    )
)
register(
    Benchmark(
        "launch",
        "stoker-triton",
        "CPU µs per kernel launch, per compiled-graph call, per stoker.compile call",
        module="launch",
        smoke_args=("--smoke",),
    )
)
register(
    Benchmark(
        "launch_replay",
        "stoker",
        "CPU µs per call of mode='reduce-overhead''s wrapper around a (stubbed) replay",
        module="launch",
        args=("--replay",),
        smoke_args=("--replay", "--smoke"),
    )
)
register(
    Benchmark(
        "workers",
        "stoker-triton",
        "compile workers: pool start and a cold batch compile, fork vs subprocess",
        module="workers",
        smoke_args=("--n", "2", "--mode", "fork", "--cache", "pyc"),
    )
)
register(
    Benchmark(
        "workers_cold",
        "stoker-triton",
        "compile workers: a cold start up to its launches",
        module="workers",
        args=("--cold-start",),
        smoke_args=("--cold-start", "--n", "2", "--mode", "fork", "--cache", "pyc"),
    )
)
register(
    Benchmark(
        "traffic",
        "stoker-triton",
        "bytes stoker's kernels move per training step over the step's minimum, every "
        "GPU-suite model (held to the stored ratios)",
        module="traffic",
        smoke_args=("--smoke", "--check", TRAFFIC_EXPECTED),
    )
)
register(
    Benchmark(
        "depth",
        "stoker",
        "does a cold compile grow with depth? a tiny GPT of 2 and 8 blocks, by stage",
        module="depth",
        limit=3600.0,  # a process per depth and repeat, each limited to 1800 s
        smoke_args=("--smoke", "--layers", "1,2", "--repeat", "1", "--steps", "3"),
        rows=_depth_rows,
    )
)
register(
    Benchmark(
        "warm",
        "stoker",
        "a warm start on the CPU by stage, beside Inductor's warm CPU start",
        module="warm",
        args=("--inductor",),
        smoke_args=("--smoke", "--repeat", "1", "--imports", "0"),
    )
)
register(
    Benchmark(
        "warm_cold",
        "stoker",
        "a cold first step by stage, the precompile queued on compile workers",
        module="warm",
        args=("--cold",),
        smoke_args=("--cold", "--smoke", "--repeat", "1", "--workers", "2"),
    )
)
register(
    Benchmark(
        "step_cpu",
        "stoker",
        "CPU time of one steady training step, by part (Dynamo, runtime, launches, "
        "compiled autograd, ...)",
        module="step_cpu",
        smoke_args=("--model", "tiny-gpt", "--steps", "2", "--rounds", "1"),
    )
)
register(
    Benchmark(
        "demo_start",
        "stoker",
        "`stoker demo`'s first step, cold and warm, by stage (the CPU warm-start target)",
        module="demo_start",
        smoke_args=("--backend", "aten", "--warm", "1", "--batch", "2"),
    )
)
register(
    Benchmark(
        "demo_step",
        "stoker",
        "`stoker demo`'s steady training step, eager vs stoker, alternating",
        module="demo_step",
        smoke_args=("--steps", "2", "--rounds", "1", "--batch", "2"),
    )
)
register(
    Benchmark(
        "models",
        "stoker",
        "the model zoo trained eager, aot_eager, inductor and stoker, each in a cold and "
        "a warm process (--models, --backends, --steps)",
        run=_run_models,
        rows=_model_rows,
    )
)
register(
    Benchmark(
        "gpu",
        "stoker",
        "the GPU training suite: six configurations + the small table, eager / inductor "
        "/ stoker (and reduce-overhead), parity against eager (--models, --backends)",
        run=_run_gpu_suite,
        rows=_model_rows,
    )
)
