"""The benchmark suite (``nox -s bench``, same as ``stoker bench``).

    python tools/bench.py [--models mlp,gpt] [--backends eager,stoker] [--steps 20] [--no-warm]

Without ``--models``: runs, each if present, tools/bench_shapes.py (guard-check
cost), bench_capture.py, bench_autograd.py, bench_triton.py, bench_traffic.py
(bytes moved per step), bench_depth.py (a cold compile of 2 and 8 blocks) and
bench_warm.py --inductor (a warm start beside Inductor's), then the model
benchmark (eager, torch.compile aot_eager / inductor, stoker side by side); with
``--models`` only those models. Prints a table on stdout (steady step times as
min / median / max over the steps) and writes bench-results/bench.json (the
scripts that take ``--json`` also write bench-results/bench_<name>.json).
"""

from __future__ import annotations

import sys

from stoker.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
