"""The captured-graph cache: a warm process loads a Dynamo graph's partitioned forward
and backward instead of running the function, capturing and partitioning it again.

An entry (``$STOKER_CACHE_DIR/capture/graphs/<key>``, a checked `DiskCache` file)
holds the forward metadata (mutations, aliases, outputs: `ForwardMeta`), the
forward and backward graphs (inference: the one graph) with every node's
``meta["val"]`` as sizes and strides over the shape env's symbols, the
partition's decisions, and the guards capture and partition added to the shape
env, each with its origin.  The compile step then runs on the loaded graphs as
on fresh ones (stoker-triton's compiled-graph cache hits there in turn).

| what decides the key | how |
|---|---|
| the Dynamo graph | every node (`stoker_shapes` cache-key text): op, name, target, args, kwargs, example value; the graph module's parameters and buffers |
| the inputs | each one's dtype, device, sizes, strides, offset, requires_grad (symbolic sizes as expressions), view or not, which inputs share a storage |
| the shape env | each input symbol's replacement and range, and the guards already held |
| the config | mode, shape policy, guard_params, partitioner (by name), memory budget; grad mode, autocast state, oneDNN on or off, default dtype and device, deterministic algorithms |
| the code | torch, stoker-capture and stoker-shapes versions, a hash of both packages' sources, the entry format |

| on a lookup | result |
|---|---|
| something no key can describe | miss "uncacheable: why" (below); nothing stored |
| no entry | miss "new key: <parts> changed": the key parts that differ from the last entry stored for the graph's code site (``capture/sites``) |
| broken entry (bytes, version, unpickling) | `DiskCache` warns once naming the file; miss "corrupt entry"; the cold run rewrites it |
| a recorded guard is false at the current sizes | that variant is skipped; none left: miss "guard replay failed", nothing added to the shape env |
| otherwise | hit: the guards are added to the shape env (with their origins), the graphs loaded |

Uncacheable (captured every time): a call of a Python function that is not
torch's (its code is not in the key) or of torch's helpers that call back into
the user's (Dynamo's, hooks', Functions', checkpointing's), a higher-order op or
subgraph (custom ``autograd.Function``, checkpointing), a module called as a
module, a tensor constant, an argument of a type the key cannot spell, a tensor
subclass input or an input that is neither a tensor nor a number, a
partitioner or decomposition table of the user's, and results the entry cannot
hold: sizes that depend on data (unbacked symbols), graphs with constants or
non-aten calls, outputs that are Python objects a pickle does not reproduce.

key.py builds the key (and says what is uncacheable), graphs.py turns graphs
and their node values into data and back, this file reads and writes entries.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from stoker_shapes import DiskCache, ShapeContext
from stoker_shapes._internal.cachekey import add_variant, guards_hold, read_variants, replay
from stoker_shapes._internal.diskcache import cache_root, warn_once

from ..config import AOTConfig
from ..stages.capture import CapturedGraph
from ..tracing.forward_meta import ForwardMeta, OutputKind
from .graphs import GraphData, _Decoder, _pack_graph, _unpack_graph
from .key import ENTRY_FORMAT, Uncacheable, capture_key, code_site

__all__ = [
    "CaptureCache",
    "Entry",
    "Loaded",
    "Uncacheable",
    "capture_key",
    "enabled",
    "stats",
    "store",
]

log = logging.getLogger("stoker.cache")

_ENV_OFF = "STOKER_CAPTURE_CACHE"  # "0": neither read nor write entries
MAX_VARIANTS = 8  # entries per key: one per distinct set of guards capture added

# process-wide counters: "hits", "misses: <why>", "captures" (cold runs), "writes"
stats: dict[str, int] = {}


def count(what: str) -> None:
    stats[what] = stats.get(what, 0) + 1


def enabled() -> bool:
    return os.environ.get(_ENV_OFF, "1") != "0"


def store() -> DiskCache:
    return DiskCache(lambda: cache_root() / "capture", "graphs", ENTRY_FORMAT)


def sites() -> DiskCache:
    """Per code site, the key parts' hashes of the last entry stored (for miss reasons)."""
    return DiskCache(lambda: cache_root() / "capture", "sites", ENTRY_FORMAT, quiet=True)


# --------------------------------------------------------------------------
# the entry


@dataclasses.dataclass
class Entry:
    meta: ForwardMeta  # without fw_specs (sizes capture alone uses) and out_spec
    out_spec: str  # pytree.treespec_dumps of meta.out_spec
    joint: bool
    num_fw_outputs: int
    num_tangents: int
    tangent_mask: list[bool]
    graphs: list[GraphData]  # [forward, backward] when joint, else [the inference graph]
    partition: dict[str, Any]  # the `Partition`'s fields but its graphs
    guards: list[Any]  # the ShapeGuards capture and partition added
    guard_origins: list[Any]  # per guard: its stoker-shapes Origin (or None)
    replacement_origins: dict[Any, Any]  # origins of what they changed in the shape env
    range_origins: dict[Any, Any]


@dataclasses.dataclass
class Loaded:
    """A hit: what `compile_pipeline` resumes from."""

    meta: ForwardMeta
    graph: CapturedGraph
    partition: Any  # a `Partition` (None for inference)


class CaptureCache:
    """The cache for one Dynamo graph: `load` it, or watch the cold run and `save` it.

    >>> cache = CaptureCache(gm, example_inputs, fakes, ctx, cfg)
    >>> hit = cache.load()            # None: capture (cache.outcome says why)
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        fakes: Sequence[Any],
        ctx: ShapeContext,
        cfg: AOTConfig,
    ) -> None:
        self.ctx = ctx
        self.outcome = ""  # "hit", "miss (new key)", "uncacheable: ...", for reports
        self.key: str | None = None
        env = ctx.shape_env
        self._start = (len(env.guards), dict(ctx.replacement_origins), dict(ctx.range_origins))
        self._end: tuple[int, dict[Any, Any], dict[Any, Any]] | None = None
        self._graphs: list[GraphData] | None = None  # the cold run's, packed at `snapshot`
        self._fields: dict[str, Any] = {}
        self._why = ""  # why `snapshot` could not pack them
        self._site = code_site(gm)
        self._parts: dict[str, str] = {}
        try:
            self.key, self._parts = capture_key(gm, example_inputs, fakes, ctx, cfg)
        except Uncacheable as e:
            self._miss(f"uncacheable: {e}")

    def _miss(self, why: str) -> None:
        count(f"misses: {why}")
        if why == "new key":
            why += self._changed()
        self.outcome = why if why.startswith("uncacheable") else f"miss ({why})"
        log.info("captured-graph cache %s", self.outcome)

    def _changed(self) -> str:
        """``: config, inputs changed``: the key parts that differ from the last entry
        stored for this code site ("" when there is none)."""
        try:
            last = json.loads(sites().get(self._site) or b"{}")
        except ValueError:
            return ""
        changed = [k for k, h in self._parts.items() if k in last and last[k] != h]
        return f": {', '.join(changed)} changed" if changed else ""

    # ------------------------------------------------------------------ a warm run
    def load(self) -> Loaded | None:
        if self.key is None:
            return None
        variants, why = self._read()
        for entry in variants:
            if not guards_hold(entry.guards, self.ctx.shape_env):
                why = "guard replay failed"
                continue
            try:
                loaded = self._rebuild(entry)
            except Exception as e:  # an op that is gone, a symbol the shape env lacks
                path = store().path(self.key)
                warn_once(str(path), "stoker cache: ignoring an entry of %s (%s)", path, e)
                why = "corrupt entry"
                break
            count("hits")
            self.outcome = "hit"
            log.info("captured-graph cache hit: %s", self.key)
            return loaded
        self._miss(why)
        return None

    def _read(self) -> tuple[list[Entry], str]:
        assert self.key is not None
        return read_variants(store(), self.key, Entry, "capturing again")

    def _rebuild(self, entry: Entry) -> Loaded:
        """The entry's graphs over this shape env; then its guards replayed (last, so a
        graph that fails to load adds nothing)."""
        from ..partition.core import Partition

        ctx, env = self.ctx, self.ctx.shape_env
        dec = _Decoder(ctx)
        with env.suppress_guards():
            gms = [_unpack_graph(g, dec) for g in entry.graphs]
        for i, origin in zip(replay(entry.guards, env), entry.guard_origins, strict=True):
            if i is not None and origin is not None:
                ctx.guard_origins[i] = origin
        ctx.replacement_origins.update(entry.replacement_origins)
        ctx.range_origins.update(entry.range_origins)
        graph = CapturedGraph(
            _joint_note() if entry.joint else gms[0],
            entry.joint,
            entry.num_fw_outputs,
            entry.num_tangents,
            list(entry.tangent_mask),
        )
        part = Partition(gms[0], gms[1], **entry.partition) if entry.joint else None
        meta = dataclasses.replace(entry.meta, out_spec=pytree.treespec_loads(entry.out_spec))
        return Loaded(meta, graph, part)

    # ------------------------------------------------------------------ a cold run
    def watch(self, partition: Callable[..., Any], graph: CapturedGraph) -> Callable[..., Any]:
        """``partition`` taking a `snapshot` right after it ran."""

        def watched(*args: Any, **kwargs: Any) -> Any:
            part = partition(*args, **kwargs)
            self.snapshot(graph, part)
            return part

        return watched

    def snapshot(self, graph: CapturedGraph, partition: Any = None) -> None:
        """Note the result and the shape env now, before any compiler runs: the guards
        capture and partition added end here, and node values are read before a
        compiler's specializations (``int(s0)`` replaces s0 by its value) reach them."""
        ctx = self.ctx
        self._end = (
            len(ctx.shape_env.guards),
            dict(ctx.replacement_origins),
            dict(ctx.range_origins),
        )
        try:
            if graph.joint:
                self._graphs = [_pack_graph(partition.fw), _pack_graph(partition.bw)]
                self._fields = {
                    f.name: getattr(partition, f.name)
                    for f in dataclasses.fields(partition)
                    if f.name not in ("fw", "bw")
                }
            else:
                self._graphs, self._fields = [_pack_graph(graph.gm)], {}
        except Uncacheable as e:
            self._graphs, self._why = None, str(e)

    def save(self, meta: ForwardMeta, graph: CapturedGraph) -> None:
        """Store the cold run's result; a result the entry cannot hold is logged, not stored."""
        count("captures")
        if self.key is None or self._end is None:
            return
        try:
            if self._graphs is None:
                raise Uncacheable(self._why)
            self._put(self._entry(meta, graph, self._graphs))
        except Uncacheable as e:
            self.outcome = f"uncacheable: {e}"
            log.info("captured graph not cached: %s", e)

    def _entry(self, meta: ForwardMeta, graph: CapturedGraph, graphs: list[GraphData]) -> Entry:
        for o in meta.outputs:
            if o.kind == OutputKind.CONSTANT and not _round_trips(o.value):
                raise Uncacheable(f"an output constant of type {type(o.value).__name__}")
        try:  # the output structure as text: a pickled TreeSpec depends on pytree internals
            out_spec = pytree.treespec_dumps(meta.out_spec)
        except Exception as e:
            raise Uncacheable(f"an output structure that cannot be stored ({e})") from e
        stored_meta = dataclasses.replace(meta, fw_specs=[], out_spec=cast(Any, None))
        n0, rep0, rng0 = self._start
        assert self._end is not None
        n1, rep1, rng1 = self._end
        env = self.ctx.shape_env
        return Entry(
            stored_meta,
            out_spec,
            graph.joint,
            graph.num_fw_outputs,
            graph.num_tangents,
            list(graph.tangent_mask),
            graphs,
            self._fields,
            list(env.guards[n0:n1]),
            [self.ctx.guard_origins.get(i) for i in range(n0, n1)],
            {k: v for k, v in rep1.items() if rep0.get(k) is not v},
            {k: v for k, v in rng1.items() if rng0.get(k) is not v},
        )

    def _put(self, entry: Entry) -> None:
        assert self.key is not None
        add_variant(store(), self.key, entry, "capturing again", MAX_VARIANTS, Uncacheable)
        sites().put(self._site, json.dumps(self._parts).encode())
        count("writes")


def _round_trips(v: Any) -> bool:
    try:
        same = pickle.loads(pickle.dumps(v))
        return bool(same is v or (type(same) is type(v) and same == v))
    except Exception:
        return False


def _joint_note() -> fx.GraphModule:
    """A loaded joint capture keeps no joint graph (its forward and backward are the
    partition's): a graph that only says so, for as_text."""
    g = fx.Graph()
    g.output(())
    gm = fx.GraphModule(torch.nn.Module(), g, class_name="LoadedFromCaptureCache")
    return gm
