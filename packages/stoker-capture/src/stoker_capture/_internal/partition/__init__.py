"""The partitioner: a joint forward+backward graph split into a forward and a backward.

- `core.py`: the joint graph's contract, `Partition`, and `default_partition` (save what
  the backward reads);
- `mincut.py`: `min_cut_partition`, which recomputes cheap values instead of saving them;
- `ops.py`: the table of which aten ops may be recomputed.

May import `tracing/` and `errors`; never a stage, `runtime/` or `capcache/`.
"""
