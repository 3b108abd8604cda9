"""Buffers the stoker-triton wrappers of a suite model allocate (CPU, no GPU).

    python tools/wrapper_buffers.py gpt-m [--out DIR]

Captures the model's joint graph (static shapes), partitions it, compiles the
forward and backward graphs with stoker-triton and counts, per wrapper: the
buffers it allocates and their elements (what kernels store), and the peak of
elements live at once (kernel buffers and extern results, from allocation to
their `del`, a freed buffer that a later allocation takes counted once; the
returned ones stay live). Elements are shown as MiB at 4
bytes (the fp32 suite models; a bf16 entry such as cnn-m-bf16 is captured under
autocast, and its MiB overstate its 2-byte buffers). `--out` also writes the
wrappers and graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import tempfile

import torch

# a buffer allocated (through its dtype's prototype, or `empty_strided` where the
# device has no index); an extern result's layout check; a freed buffer taken; a free
_ALLOC = re.compile(r"\s+(buf\d+) = (?:P\d+\.new_)?empty_strided\(\(([^)]*)\), \(([^)]*)\)")
_EXTERN = re.compile(
    r"\s+if (buf\d+)\.stride\(\) != .*: \1 = ensure_layout\(\1, \(([^)]*)\), \(([^)]*)\)"
)
_REUSE = re.compile(r"\s+(buf\d+) = (buf\d+)  # reuse")
_DEL = re.compile(r"\s+del (buf\d+)")


def _extent(size: str, stride: str) -> int:
    sz = [int(x) for x in size.split(",") if x.strip()]
    st = [int(x) for x in stride.split(",") if x.strip()]
    return 1 + sum((a - 1) * b for a, b in zip(sz, st)) if all(sz) else 0


def count(wrapper: str) -> tuple[int, int, int]:
    """(buffers allocated, their elements, peak elements live)."""
    n = total = peak = 0
    live: dict[str, int] = {}
    for line in wrapper.splitlines():
        m, e, d = _ALLOC.match(line), _EXTERN.match(line), _DEL.match(line)
        r = _REUSE.match(line)
        if r:  # the new name holds the old one's memory
            live[r.group(1)] = live.pop(r.group(2), 0)
        if m:
            n += 1
            total += _extent(m.group(2), m.group(3))
        if m or e:
            g = m or e
            assert g is not None
            live[g.group(1)] = _extent(g.group(2), g.group(3))
        elif d:
            live.pop(d.group(1), None)
        peak = max(peak, sum(live.values()))
    return n, total, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--out", default="")
    a = p.parse_args()
    os.environ.setdefault("STOKER_CACHE_DIR", tempfile.mkdtemp())
    import stoker_capture
    import stoker_triton
    from stoker._internal.bench.suite import get_entry
    from stoker_capture._internal.stages.compile import example_inputs

    entry = get_entry(a.model)
    torch.manual_seed(0)
    size = entry.sized(False)
    model = entry.build(size)
    args, _ = entry.batch(size, torch.Generator().manual_seed(0))
    cfg = stoker_capture.AOTConfig(mode="joint", dynamic="static")
    with contextlib.ExitStack() as stack:
        if entry.autocast is not None:  # captured as the suite runs it (bf16 entries)
            stack.enter_context(torch.autocast("cpu", dtype=entry.autocast))
        state = stoker_capture.create_aot_state(model, args, None, cfg, stack)
        graph = stoker_capture.aot_stage1_graph_capture(state)
        part = stoker_capture.min_cut_partition(graph.gm, num_fw_outputs=graph.num_fw_outputs)
        with stoker_capture.autocast_off(), state.ctx.tracing():
            for tag, gm in (("forward", part.fw), ("backward", part.bw)):
                fn = stoker_triton.compile_graph(gm, example_inputs(gm))
                n, total, peak = count(fn.wrapper_source)
                mib = 4 / 2**20
                print(
                    f"{a.model} {tag}: {n} buffers, {total} elements ({total * mib:.1f} MiB), "
                    f"peak live {peak} ({peak * mib:.1f} MiB)"
                )
                if a.out:
                    os.makedirs(a.out, exist_ok=True)
                    with open(f"{a.out}/{a.model}_{tag}_wrapper.py", "w") as f:
                        f.write(fn.wrapper_source)
                    with open(f"{a.out}/{a.model}_{tag}_graph.txt", "w") as f:
                        f.write(str(gm.graph))


if __name__ == "__main__":
    main()
