"""Memory traffic of stoker's kernels per training step, on the CPU (nothing runs).

    python -m stoker._internal.bench.benchmarks.traffic [--models gpt-m,hf-llama] [--smoke] [--kernels] [--json PATH]
    python -m stoker._internal.bench.benchmarks.traffic --smoke --check .../benchmarks/traffic_expected.json

For each GPU-suite model: capture the joint graph (static shapes, fake tensors),
partition it with the min-cut partitioner (the stoker backend's default),
lower and schedule the forward and backward graphs as `compile_graph` does,
and count from the schedule the bytes each kernel reads and writes, its passes
over its inputs, and each extern call's bytes (`stoker_triton._internal.traffic`).
The step's *minimum* is every graph input read once and every output written
once; the *ratio* is the step's bytes over it. `--kernels` lists every kernel
(ratio to its own ideal, passes, uncoalesced bytes, launch configuration, the
aten ops it fused). `--check FILE` compares each model's ratio with the stored
one (a JSON map ``{model: ratio}``) and exits 1 when one grew by more than the
margin (`--margin`, relative).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Any

import torch

MODELS = ("gpt-m", "gpt-m-bf16", "hf-llama", "hf-gpt2", "mlp-l", "cnn-m-bf16")


def model_traffic(name: str, smoke: bool) -> dict[str, Any]:
    """The forward's and the backward's `GraphTraffic` of one suite entry, as a dict."""
    import stoker_capture
    from stoker._internal.bench.suite import get_entry
    from stoker_capture._internal.stages.compile import example_inputs
    from stoker_triton._internal.traffic import analyze_graph

    entry = get_entry(name)
    torch.manual_seed(0)
    size = entry.sized(smoke)
    model = entry.build(size)
    args, _ = entry.batch(size, torch.Generator().manual_seed(0))
    cfg = stoker_capture.AOTConfig(mode="joint", dynamic="static")
    graphs: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if entry.autocast is not None:  # captured as the suite runs it
            stack.enter_context(torch.autocast("cpu", dtype=entry.autocast))
        state = stoker_capture.create_aot_state(model, args, None, cfg, stack)
        graph = stoker_capture.aot_stage1_graph_capture(state)
        part = stoker_capture.min_cut_partition(graph.gm, num_fw_outputs=graph.num_fw_outputs)
        with stoker_capture.autocast_off(), state.ctx.tracing():
            for tag, gm in (("forward", part.fw), ("backward", part.bw)):
                graphs[tag] = analyze_graph(gm, example_inputs(gm))
    total = sum(g.total for g in graphs.values())
    minimum = sum(g.minimum for g in graphs.values())
    return {
        "model": name,
        "smoke": smoke,
        "total": total,
        "minimum": minimum,
        "ratio": total / minimum,
        "kernel_bytes": sum(g.kernel_bytes for g in graphs.values()),
        "extern_bytes": sum(g.extern_bytes for g in graphs.values()),
        "kernels": sum(len(g.kernels) for g in graphs.values()),
        "uncoalesced": sum(k.uncoalesced for g in graphs.values() for k in g.kernels),
        "max_passes": max((k.passes for g in graphs.values() for k in g.kernels), default=1.0),
        "graphs": {tag: g.as_dict() for tag, g in graphs.items()},
    }


UNIT = ["MiB", 2**20]  # KiB for the tiny configurations (`main` decides)


def _mib(n: float) -> str:
    return f"{n / float(UNIT[1]):.1f}"  # type: ignore[arg-type]


def print_summary(rows: list[dict[str, Any]]) -> None:
    u = UNIT[0]
    print(
        f"{'model':<11} {'kernels':>7} {'kernel ' + u:>10} {'extern ' + u:>10} {'min ' + u:>8} "  # type: ignore[operator]
        f"{'ratio':>6} {'uncoal ' + u:>10} {'max passes':>10}"  # type: ignore[operator]
    )
    for r in rows:
        print(
            f"{r['model']:<11} {r['kernels']:7d} {_mib(r['kernel_bytes']):>10} "
            f"{_mib(r['extern_bytes']):>10} {_mib(r['minimum']):>8} {r['ratio']:6.3f} "
            f"{_mib(r['uncoalesced']):>10} {r['max_passes']:10.2f}"
        )


def print_kernels(row: dict[str, Any]) -> None:
    for tag, g in row["graphs"].items():
        print(f"\n{row['model']} {tag}: {len(g['kernels'])} kernels, ratio {g['ratio']:.3f}")
        print(
            f"  {'kernel':<9} {'kind':<10} {'x':>8} {'r':>6} {UNIT[0]:>7} {'ratio':>6} "
            f"{'passes':>6} {'uncoal':>7} {'config':>15} {'i64':>3}  origins"
        )
        for k in g["kernels"]:
            cfg = "x".join(str(c) for c in k["config"])
            print(
                f"  {k['name']:<9} {k['kind']:<10} {k['xnumel']:8d} {k['rnumel']:6d} "
                f"{_mib(k['total']):>7} {k['ratio']:6.2f} {k['passes']:6.2f} "
                f"{_mib(k['uncoalesced']):>7} {cfg:>15} {'y' if k['int64'] else '':>3}  "
                f"{','.join(k['origins'])[:80]}"
            )


def check(rows: list[dict[str, Any]], expected_path: str, margin: float) -> list[str]:
    """Each model whose ratio moved from its stored value by more than `margin`: up is a
    regression; down is progress the stored value must record (so it stays a bound)."""
    with open(expected_path, encoding="utf-8") as f:
        expected = json.load(f)
    bad = []
    for r in rows:
        want = expected.get("smoke" if r["smoke"] else "full", {}).get(r["model"])
        got = r["ratio"]
        if want is None:
            bad.append(f"{r['model']}: no stored ratio in {expected_path}")
        elif got > want * (1 + margin):
            bad.append(f"{r['model']}: ratio {got:.4f} > stored {want:.4f} (+{margin:.1%})")
        elif got < want * (1 - margin):
            bad.append(
                f"{r['model']}: ratio {got:.4f} < stored {want:.4f} (-{margin:.1%}): "
                f"fewer bytes, good; store the new ratio in {expected_path}"
            )
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--smoke", action="store_true", help="the tiny configurations (tests)")
    ap.add_argument("--kernels", action="store_true", help="list every kernel")
    ap.add_argument("--json", default="", help="write every figure here")
    ap.add_argument("--check", default="", help="stored ratios to compare with (JSON)")
    ap.add_argument("--margin", type=float, default=0.005, help="relative (the count is exact)")
    a = ap.parse_args(argv)
    os.environ.setdefault("STOKER_CACHE_DIR", tempfile.mkdtemp(prefix="stoker-traffic-"))
    torch.set_num_threads(1)
    if a.smoke:
        UNIT[:] = ["KiB", 2**10]
    rows = [model_traffic(m, a.smoke) for m in a.models.split(",") if m]
    print_summary(rows)
    if a.kernels:
        for r in rows:
            print_kernels(r)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    if a.check:
        bad = check(rows, a.check, a.margin)
        for b in bad:
            print("traffic regression: " + b, file=sys.stderr)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
