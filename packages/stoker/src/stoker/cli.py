"""The ``stoker`` command: ``demo``, ``bench``, ``explain`` and ``cache``.

stoker demo [--steps N]          train a small GPT eager and compiled, side by side
            [--ranks 2 --parallel ddp|fsdp2]   ... on local processes, under DDP or FSDP2
stoker bench [--models ...]      the benchmark suite (table + bench-results/bench.json)
stoker bench --suite gpu [--smoke]  the H100 training suite, side by side with Inductor
stoker explain SCRIPT [ARGS...]  run a script with every log topic and the report on
stoker cache info|clear          what stoker keeps on disk (STOKER_CACHE_DIR); empty it
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stoker", description="stoker: a PyTorch training compiler")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="train a small GPT eager and compiled side by side")
    d.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    d.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    d.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "aten", "triton", "interpret"],
        help="stoker executor (auto: Triton on a GPU, else the aten executor)",
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

    b = sub.add_parser("bench", help="benchmark eager, aot_eager, inductor and stoker")
    b.add_argument(
        "--suite",
        choices=("models", "gpu"),
        default="models",
        help="models: the zoo (default); gpu: the H100 suite of GPU_FINDINGS (6 training "
        "configurations + the small forward/backward table)",
    )
    b.add_argument(
        "--smoke", action="store_true", help="with --suite gpu: the same entries at tiny sizes"
    )
    b.add_argument(
        "--models",
        default=None,
        help="comma-separated zoo names, or suite entries with --suite gpu (default: all)",
    )
    b.add_argument(
        "--backends",
        default=None,
        help="comma-separated (default: eager,aot_eager,inductor,stoker; with --suite gpu: "
        "eager,inductor,inductor-ro,stoker,stoker-ro)",
    )
    b.add_argument(
        "--steps", type=int, default=20, help="steady-state steps per model (default 20)"
    )
    b.add_argument("--json", default="bench-results/bench.json", help="where to write the JSON")
    b.add_argument(
        "--no-warm", action="store_true", help="skip the warm-cache (second process) run"
    )
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    b.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement process")

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
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        demo = dict(
            steps=args.steps,
            batch=args.batch,
            backend=args.backend,
            device=args.device,
            report=args.report,
            seed=args.seed,
            progress=not args.no_progress,
        )
        if args.ranks > 1:
            from ._internal.demo_distributed import run_distributed_demo

            return run_distributed_demo(ranks=args.ranks, parallel=args.parallel, **demo)
        from ._internal.demo import run_demo

        return run_demo(**demo)
    if args.command == "bench":
        from ._internal.bench import run_bench

        return run_bench(
            models=args.models.split(",") if args.models else None,
            backends=(args.backends or default_backends(args.suite)).split(","),
            steps=args.steps,
            json_path=args.json,
            warm=not args.no_warm,
            device=args.device,
            timeout=args.timeout,
            suite=args.suite,
            smoke=args.smoke,
        )
    if args.command == "explain":
        return explain(args.script, args.args, logs=args.logs, report=args.report)
    if args.command == "cache":
        from ._internal import cache_cli

        return cache_cli.info() if args.action == "info" else cache_cli.clear(args.triton)
    raise AssertionError(args.command)  # argparse rejects unknown commands


def default_backends(suite: str) -> str:
    if suite == "gpu":
        return "eager,inductor,inductor-ro,stoker,stoker-ro"
    return "eager,aot_eager,inductor,stoker"


def explain(script: str, script_args: Sequence[str], *, logs: str, report: str) -> int:
    """Run ``script`` as ``__main__`` with STOKER_LOGS and STOKER_REPORT set."""
    import runpy

    if not os.path.exists(script):
        print(f"stoker explain: no such script: {script}", file=sys.stderr)
        return 2
    os.environ["STOKER_LOGS"] = logs
    os.environ["STOKER_REPORT"] = os.path.abspath(report)
    from . import set_logs

    set_logs(logs)
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
        _write_explain_report(os.environ["STOKER_REPORT"])
    return code


def _write_explain_report(path: str) -> None:
    """Make sure the report exists after the script ran, and say where it is."""
    from ._internal.compile_api import last_report

    rep = last_report()
    if rep is None:
        import stoker

        rep = stoker.backend.report  # torch.compile(backend="stoker") used the default backend
        if not rep.compiles:
            print(
                f"stoker explain: the script compiled nothing with stoker; no report at {path}",
                file=sys.stderr,
            )
            return
        rep.path = path
    from ._internal.backend import _autograd_stats

    rep.autograd = _autograd_stats()
    written = rep.write(rep.path or path)
    step = rep.step_record()
    took = f"first compiled step {step.wall_ms / 1e3:.2f} s, " if step is not None else ""
    print(
        f"stoker explain: {took}on-disk caches {rep.cache_line()}; report written to {written}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    raise SystemExit(main())
