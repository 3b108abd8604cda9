"""The ``stoker`` command's parser and commands (`stoker.cli` is its entry point, and
its docstring lists the commands)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from ..report.report import Report


class UsageError(Exception):
    """A command's arguments or settings are wrong: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that says where to look (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stoker", description="stoker: a PyTorch training compiler")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="train a small GPT eager and compiled side by side")
    d.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    d.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    d.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "aten", "c", "triton", "interpret"],
        help="stoker executor (auto: Triton on a GPU, C kernels on a CPU)",
    )
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    d.add_argument(
        "--report",
        default="stoker-demo-report.html",
        help="where to write the compile report (default ./stoker-demo-report.html)",
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.add_argument(
        "--ranks", type=int, default=1, help="local processes (default 1: no parallelism)"
    )
    d.add_argument(
        "--parallel",
        default="ddp",
        choices=["ddp", "fsdp2"],
        help="with --ranks > 1: DistributedDataParallel or FSDP2 fully_shard (default ddp)",
    )

    b = sub.add_parser(
        "bench",
        help="run the benchmarks (all, or those named; --list names them)",
        description="Run every registered benchmark, or those named, each as its own "
        "process; write one JSON and one markdown table; compare with a baseline. "
        "Arguments after `--` go to the one benchmark named.",
    )
    b.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    b.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    b.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes: every code path in seconds, numbers not to quote (the model "
        "benchmarks: 1 steady step, no warm process)",
    )
    b.add_argument(
        "--suite",
        choices=("models", "gpu"),
        default=None,
        help="gpu: the GPU suite alone (= `stoker bench gpu`); models: everything (default)",
    )
    b.add_argument(
        "--models",
        default=None,
        help="comma-separated zoo names, or suite entries with --suite gpu; naming models "
        "without a benchmark name runs only the model benchmark",
    )
    b.add_argument(
        "--backends",
        default=None,
        help="comma-separated (default: eager,aot_eager,inductor,stoker; with --suite gpu: "
        "eager,inductor,inductor-ro,stoker,stoker-ro; --smoke: stoker, or eager,stoker "
        "with --suite gpu)",
    )
    b.add_argument(
        "--steps", type=int, default=None, help="steady-state steps per model (default 20)"
    )
    b.add_argument("--json", default="bench-results/bench.json", help="where to write the JSON")
    b.add_argument(
        "--markdown", default=None, help="where to write the table (default: the JSON's, .md)"
    )
    b.add_argument("--baseline", default=None, help="a JSON of an earlier run to compare with")
    b.add_argument(
        "--threshold",
        type=float,
        default=0.10,
        help="a metric worse than the baseline's by more than this is flagged (default 0.10)",
    )
    b.add_argument(
        "--fail-on-regression", action="store_true", help="exit 1 when a metric is flagged"
    )
    b.add_argument(
        "--reuse-caches",
        action="store_true",
        help="keep STOKER_CACHE_DIR etc. from the environment (default: empty ones each)",
    )
    b.add_argument(
        "--no-warm", action="store_true", help="skip the warm-cache (second process) run"
    )
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    b.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per benchmark process (default 900; hf_zoo, cpu_step, varlen and "
        "depth, whose model processes have limits of their own, get hours)",
    )

    e = sub.add_parser("explain", help="run a script with stoker's logs and report on")
    e.add_argument("--logs", default="all", help="STOKER_LOGS topics (default all)")
    e.add_argument(
        "--report", default="stoker-report.html", help="report path (default ./stoker-report.html)"
    )
    e.add_argument("script", help="the Python script to run")
    e.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")

    c = sub.add_parser("cache", help="stoker's on-disk cache: info or clear")
    c.add_argument("action", choices=["info", "clear"])
    c.add_argument(
        "--triton",
        action="store_true",
        help="clear also empties Triton's own cache (TRITON_CACHE_DIR; shared with Inductor)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if argv[:1] == ["bench"] and "--" in argv:  # the named benchmark's own arguments
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    try:
        return _run(args, extra)
    except UsageError as e:
        print(f"stoker {args.command}: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
    from ..config import StokerConfigError

    if args.command == "demo":
        from ..bench.demo import check_demo_args

        try:
            device = check_demo_args(
                steps=args.steps,
                batch=args.batch,
                backend=args.backend,
                device=args.device,
                ranks=args.ranks,
            )
        except StokerConfigError as e:
            raise UsageError(str(e)) from None
        demo = dict(
            steps=args.steps,
            batch=args.batch,
            backend=args.backend,
            device=device,
            report=args.report,
            seed=args.seed,
            progress=not args.no_progress,
        )
        if args.ranks > 1:
            from ..bench.demo_distributed import run_distributed_demo

            return run_distributed_demo(ranks=args.ranks, parallel=args.parallel, **demo)
        from ..bench.demo import run_demo

        return run_demo(**demo)
    if args.command == "bench":
        try:
            return bench(args, extra)
        except StokerConfigError as e:
            raise UsageError(str(e)) from None
    if args.command == "explain":
        return explain(args.script, args.args, logs=args.logs, report=args.report)
    if args.command == "cache":
        from . import cache

        try:
            return cache.info() if args.action == "info" else cache.clear(args.triton)
        except cache.CacheDirError as e:
            raise UsageError(str(e)) from None
    raise AssertionError(args.command)  # argparse rejects unknown commands


def _names(spec: str | None) -> list[str] | None:
    """``"mlp, gpt"`` -> ``["mlp", "gpt"]``; None (or nothing named) -> None."""
    names = [n.strip() for n in (spec or "").split(",") if n.strip()]
    return names or None


def bench(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """``stoker bench``: the benchmarks named (all without names; the model benchmark
    alone when only ``--models`` is given; the GPU suite with ``--suite gpu``)."""
    from ..bench.registry import REGISTRY, Options, model_check

    if args.list:
        from ..bench.harness import list_text

        print(list_text())
        return 0
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps {args.steps}: time at least 1 steady step (default 20)")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout}: give a positive number of seconds")
    names = list(args.names)
    if not names:
        if args.suite == "gpu":
            names = ["gpu"]
        elif args.models:
            names = ["models"]
        else:
            names = list(REGISTRY)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise UsageError(
            f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(REGISTRY)} "
            "(stoker bench --list)"
        )
    if extra and len(names) != 1:
        raise UsageError("arguments after `--` go to one benchmark: name exactly one")
    options = Options(
        smoke=args.smoke,
        models=_names(args.models),
        backends=_names(args.backends),
        steps=args.steps,
        warm=not args.no_warm,
        device=args.device,
        timeout=args.timeout,
        extra=tuple(extra),
    )
    for suite in ("models", "gpu"):
        if suite in names:
            model_check(options, suite == "gpu")
    from ..bench import harness

    markdown = args.markdown or os.path.splitext(args.json)[0] + ".md"
    doc = harness.run(
        names,
        options,
        json_path=args.json,
        markdown_path=markdown,
        baseline=args.baseline,
        threshold=args.threshold,
        reuse_caches=args.reuse_caches,
    )
    print(
        f"stoker bench: JSON written to {os.path.abspath(args.json)}, "
        f"table to {os.path.abspath(markdown)}",
        file=sys.stderr,
    )
    worse = harness.regressions(doc)
    if worse:
        print(
            f"stoker bench: {len(worse)} metrics worse than the baseline by more than "
            f"{args.threshold:.0%}: " + "; ".join(worse[:20]),
            file=sys.stderr,
        )
    failed = [n for n, e in doc["benchmarks"].items() if e["status"] != "ok"]
    if failed:
        print(f"stoker bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or (worse and args.fail_on_regression) else 0


def explain(script: str, script_args: Sequence[str], *, logs: str, report: str) -> int:
    """Run ``script`` as ``__main__`` with STOKER_LOGS and STOKER_REPORT set."""
    import runpy

    if not os.path.exists(script):
        raise UsageError(f"no such script: {script}")
    from ... import set_logs

    try:
        set_logs(logs)
    except ValueError as e:
        raise UsageError(f"--logs {logs}: {e}") from None
    os.environ["STOKER_LOGS"] = logs
    os.environ["STOKER_REPORT"] = os.path.abspath(report)
    from ..api import compile_api

    kept: list[Report] = []
    compile_api._KEEP_AT_RESET.append(kept)  # reports a stoker.reset() in the script drops
    old_argv = sys.argv
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old_argv
        compile_api._KEEP_AT_RESET.remove(kept)
        _write_explain_reports(kept, os.environ["STOKER_REPORT"])
    return code


def _write_explain_reports(kept: list[Report], path: str) -> None:
    """Write every report the script made (kept at a reset, or current), say where."""
    from ..api.backend import _autograd_stats
    from ..api.compile_api import current_reports

    reports = list(kept)
    for r in current_reports():
        if all(r is not k for k in reports):
            r.autograd = _autograd_stats()
            reports.append(r)
    if not reports:
        print(
            f"stoker explain: the script compiled nothing with stoker; no report at {path}",
            file=sys.stderr,
        )
        return
    stem, ext = os.path.splitext(path)
    free = iter([path, *(f"{stem}-{i}{ext}" for i in range(2, len(reports) + 1))])
    for rep in reports:
        # A report the script gave its own path keeps it; the others get --report's path,
        # numbered from the second on. The path stays on the report: its rewrite at exit
        # goes to the same file.
        if not rep.path or os.path.abspath(rep.path) == os.path.abspath(path):
            rep.path = next(free)
        written = rep.write(rep.path)
        graphs = len(rep.compiles)
        step = rep.step_record()
        took = f"first compiled step {step.wall_ms / 1e3:.2f} s; " if step is not None else ""
        print(
            f"stoker explain: report written to {written} ({graphs} graph"
            f"{'s' if graphs != 1 else ''}; {took}on-disk caches {rep.cache_line()})",
            file=sys.stderr,
        )


if __name__ == "__main__":
    raise SystemExit(main())
