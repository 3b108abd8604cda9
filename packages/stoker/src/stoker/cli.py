"""The ``stoker`` command: ``demo``, ``bench``, ``explain`` and ``cache``.

stoker demo [--steps N]          train a small GPT eager and compiled, side by side
            [--ranks 2 --parallel ddp|fsdp2]   ... on local processes, under DDP or FSDP2
stoker bench [NAME ...] [--smoke] every registered benchmark, or those named (--list);
                                 bench-results/bench.json + .md, --baseline FILE compares
stoker bench --suite gpu [--smoke]  the H100 training suite, side by side with Inductor
stoker explain SCRIPT [ARGS...]  run a script with every log topic and the report on
stoker cache info|clear          what stoker keeps on disk (STOKER_CACHE_DIR); empty it

The console script and ``python -m stoker.cli`` start here; the commands live in
``stoker._internal.cli``.
"""

from __future__ import annotations

from ._internal.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
