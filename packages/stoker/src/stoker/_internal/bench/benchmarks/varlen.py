"""Training on a new sequence length every step: what each new length costs, beside Inductor.

    python -m stoker._internal.bench.benchmarks.varlen [--lengths 32,37,45,...]
        [--batch 4] [--layers 2] [--d 64] [--heads 2] [--vocab 128] [--block 128]
        [--threads 1] [--backend auto|c|aten] [--backends eager,stoker,inductor]
        [--check] [--smoke] [--json PATH]

Padding-free batches give a new sequence length at every step. A small GPT
(`..models.GPT`) trains with AdamW, the batch fixed, one step per length of
``--lengths`` (each new), then one step per length again from the third on (each
seen before).
Each backend runs in its own fresh process with empty cache folders (stoker's and
Inductor's), from the same weights on the same batches:

- ``eager``: the model as it is;
- ``stoker``: ``stoker.compile(model)`` (``--backend``: ``auto`` is the C backend where
  a C compiler is found, else the aten executor), forward and compiled-autograd
  backward;
- ``inductor``: ``torch.compile(model)`` (``dynamic=None``: automatic dynamic, as
  stoker's default).

Reported per backend: the wall time of the step at the first, second, third and
tenth new length; the median step at the new lengths from the third on (what a new
length costs once sizes are symbolic), at the same lengths seen before
(``steady_ms``), and the median ratio of the two per length (``new_over_seen``); the
graphs compiled (forward: the graphs Dynamo handed the backend; backward: stoker's
compiled-autograd backward graphs, or Inductor's AOT backward graphs) and how many
of them were compiled after the second new length (the target: none); the largest
difference of a step's loss from eager's. ``--check`` exits 1 when stoker compiled
anything after the second new length or its losses left eager's.

A length equal to the model's ``--block`` (its longest sequence) compiles once more,
under stoker and Inductor alike: slicing the causal mask to its full size is
another graph. The default lengths stay below it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import write_json

BACKENDS = ("eager", "stoker", "inductor")
LENGTHS = "32,37,45,50,57,61,66,70,77,83,90,96"
SMOKE = {"lengths": "5,7,9,11,13", "batch": 2, "layers": 1, "d": 16, "heads": 2, "vocab": 32}
LOSS_RTOL = 1e-3  # a step's loss against eager's (fp32, a few AdamW steps apart)


def _counts(backend: str, compiled: Any) -> tuple[int, int]:
    """(forward graphs, backward graphs) compiled so far in this process."""
    if backend == "stoker":
        import stoker_autograd

        return len(compiled.stoker_report.compiles), int(stoker_autograd.stats()["compiles"])
    if backend == "inductor":
        from torch._dynamo.utils import counters

        fw = int(counters["stats"]["unique_graphs"])
        ind = counters["inductor"]
        # every graph Inductor compiled (each goes through its FX-graph cache), forward
        # and AOT backward alike; the forwards are the graphs Dynamo handed it
        graphs = sum(int(ind[k]) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit"))
        graphs += int(ind["fxgraph_cache_bypass"])
        return fw, max(0, graphs - fw)
    return 0, 0


def worker(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """One backend: a step per new length, then steady steps at lengths seen before."""
    import torch

    from ..models import GPT, GPTConfig, lm_loss

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lengths = [int(t) for t in args.lengths.split(",") if t]
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=max(args.block, *lengths),
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.d,
    )
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    executor = ""
    if backend == "stoker":
        import stoker

        fn: Any = stoker.compile(model, backend=args.backend)
    elif backend == "inductor":
        fn = torch.compile(model)
    else:
        fn = model

    def step(t: int, i: int) -> float:
        gen = torch.Generator().manual_seed(1000 + i)  # the same batches in every process
        seq = torch.randint(0, cfg.vocab_size, (args.batch, t + 1), generator=gen)
        loss: Any = lm_loss(fn(seq[:, :-1]), seq[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    order = lengths + lengths[2:]  # the new lengths, then again (seen) from the third
    step_s: list[float] = []
    losses: list[float] = []
    fw_after: list[int] = []
    bw_after: list[int] = []
    for i, t in enumerate(order):
        t0 = time.perf_counter()
        losses.append(step(t, i))
        step_s.append(time.perf_counter() - t0)
        fw, bw = _counts(backend, fn)
        fw_after.append(fw)
        bw_after.append(bw)
    if backend == "stoker":
        recs = fn.stoker_report.compiles
        executor = recs[0].executor if recs else ""
    return {
        "backend": backend,
        "executor": executor,
        "lengths": order,
        "new": len(lengths),
        "step_s": step_s,
        "losses": losses,
        "fw_after": fw_after,
        "bw_after": bw_after,
    }


def summarize(raw: dict[str, Any], eager: dict[str, Any] | None) -> dict[str, Any]:
    """The row of one backend's worker output."""
    s, n = raw["step_s"], raw["new"]
    row: dict[str, Any] = {"backend": raw["backend"]}
    if raw.get("executor"):
        row["executor"] = raw["executor"]
    for k, name in ((0, "first"), (1, "second"), (2, "third"), (9, "tenth")):
        if k < n:
            row[f"{name}_new_s"] = s[k]
    if n > 2:
        new, seen = s[2:n], s[n:]
        row["new_after_second_ms"] = statistics.median(new) * 1e3
        row["steady_ms"] = statistics.median(seen) * 1e3
        row["new_over_seen"] = statistics.median(a / b for a, b in zip(new, seen, strict=True))
    fw, bw = raw["fw_after"], raw["bw_after"]
    row["fw_graphs"] = fw[-1]
    row["bw_graphs"] = bw[-1]
    k = min(1, len(fw) - 1)  # after the second new length
    row["compiles_after_second"] = (fw[-1] - fw[k]) + (bw[-1] - bw[k])
    if eager is not None and raw["backend"] != "eager":
        row["loss_max_rel_diff"] = max(
            abs(a - b) / max(abs(b), 1e-12)
            for a, b in zip(raw["losses"], eager["losses"], strict=True)
        )
    return row


def _run_worker(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stoker-varlen-") as caches:
        env = dict(os.environ)
        env["STOKER_CACHE_DIR"] = os.path.join(caches, "stoker")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
        env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
        env["OMP_NUM_THREADS"] = str(args.threads)
        env.pop("TRITON_INTERPRET", None)
        cmd = [sys.executable, "-m", "stoker._internal.bench.benchmarks.varlen", "--worker"]
        cmd += [backend, *_model_argv(args)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        return {"backend": backend, "error": done.stderr[-2000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _model_argv(args: argparse.Namespace) -> list[str]:
    out = []
    for k in ("lengths", "batch", "layers", "d", "heads", "vocab", "block", "threads"):
        out += [f"--{k}", str(getattr(args, k))]
    return [*out, "--backend", args.backend]


def _cell(row: dict[str, Any], key: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return fmt.format(row[key] * scale) if key in row else "-"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| backend | 1st new length s | 2nd s | 3rd s | 10th s | new length after the 2nd "
        "ms | the same seen ms | new / seen | fw graphs | bw graphs | compiles after the 2nd | loss vs eager |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            last = r["error"].strip().splitlines()[-1:] or [""]
            lines.append(f"| {r['backend']} | error: {last[0]} |")
            continue
        name = r["backend"] + (f" ({r['executor']})" if r.get("executor") else "")
        lines.append(
            f"| {name} | {_cell(r, 'first_new_s')} | {_cell(r, 'second_new_s')} | "
            f"{_cell(r, 'third_new_s')} | {_cell(r, 'tenth_new_s')} | "
            f"{_cell(r, 'new_after_second_ms', fmt='{:.1f}')} | "
            f"{_cell(r, 'steady_ms', fmt='{:.1f}')} | {_cell(r, 'new_over_seen', fmt='{:.2f}')} | "
            f"{r['fw_graphs']} | {r['bw_graphs']} | "
            f"{r['compiles_after_second']} | {_cell(r, 'loss_max_rel_diff', fmt='{:.1e}')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", default=LENGTHS, help="one step per length, each new")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d", type=int, default=64, help="the model's width (n_embd)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--block", type=int, default=128, help="the longest sequence (block_size)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto", help="stoker's: auto, c or aten")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--check", action="store_true", help="exit 1 when stoker misses the target")
    p.add_argument("--smoke", action="store_true", help="a tiny model on 4 lengths")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default="")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return 0
    backends = [b for b in args.backends.split(",") if b]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        p.error(f"--backends: unknown {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    raws = {b: _run_worker(b, args) for b in ["eager", *[b for b in backends if b != "eager"]]}
    eager = raws["eager"] if "error" not in raws["eager"] else None
    rows = [
        raws[b] if "error" in raws[b] else summarize(raws[b], eager)
        for b in raws
        if b in backends or b == "eager"
    ]
    print(
        f"a {args.layers}-block GPT (d={args.d}), batch {args.batch}, {args.threads} thread(s); "
        f"new lengths {args.lengths}, then those from the third again (seen before)"
    )
    print(table(rows), flush=True)
    doc = {"config": {k: getattr(args, k) for k in vars(args) if k != "worker"}, "rows": rows}
    doc["runs"] = [raws[b] for b in raws]
    write_json(args.json, doc)
    failed = [r["backend"] for r in rows if "error" in r]
    if args.check and "stoker" in backends and "error" not in raws["stoker"]:
        st = next(r for r in rows if r["backend"] == "stoker")
        if st["compiles_after_second"] or st.get("loss_max_rel_diff", 0.0) > LOSS_RTOL:
            print(
                f"stoker missed the target: {st['compiles_after_second']} graphs compiled "
                f"after the second new length, losses {st.get('loss_max_rel_diff')} from eager's"
            )
            failed.append("check")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
