"""``mode="reduce-overhead"``: each compiled graph recorded once per size key, then replayed.

`graphed(fn, gm, example_inputs, ...)` wraps a compiled callable (a forward or
backward graph, a compiled-autograd segment; Triton or aten executor) in a
`GraphedCallable`. Per size key (the values of number inputs and the sizes of
inputs compiled with symbolic sizes; one key for a static graph):

1. the first call runs plain (Triton compiles its kernels, the allocator warms
   up); outputs of that call still held at the second call are noted;
2. the second call records the graph (on a side stream, into one private
   memory pool per device shared by every graph: forward and backward), then
   replays it;
3. later calls copy the inputs that are not at a static address into the
   graph's input buffers, replay, copy back inputs the graph writes, and return
   the outputs. All of it from lists fixed at the record (`_Entry`): a replay
   costs a few calls plus one ``detach`` per output.

Static addresses: parameters, module buffers (`mark_static`: the backend marks
the inputs Dynamo found in ``_buffers``), and outputs of a graph recorded in the same pool
(the forward's saved tensors that the backward reads) are read where they are,
not copied; a call that passes one at another address (``param.data = ...``, a
forward that ran plain) makes the graph record again. So are copied inputs
that kept one address over the first replays (`_Entry.probed`; copied for good
once one moves). One tensor passed twice is one buffer. An output that is an
input, or a view of one, comes back as the caller's tensor or the same view of it.

Outputs live in the pool, and the next replay of this graph, or of a graph
recorded before it in the same pool (whose freed temporaries this graph's
outputs may occupy), overwrites them. So before a replay every such output
storage is checked for holders other than this module: an output still held
at the second call (a loss kept in a list) is returned as a copy from the
start; a held one found at a replay makes the graph record again (new static
outputs, recorded after every graph whose outputs are held; the held ones stay
with their holders, watched in the old graph's place: `_Held`) and this graph's
held outputs are copies from then on. A caller never sees a value that a later
replay wrote. The bytes each graph keeps (input buffers, outputs in the pool)
are in its `CudaGraphStats`. The backward's gradients
are static too, so stoker-autograd copies them into ``.grad`` rather than
stealing them (`GraphedCallable.static_outputs`).

Plain launches instead of a graph, with the reason in the log (``STOKER_LOGS=
cudagraphs``) and the report: no CUDA device; CPU syncs, data-dependent sizes,
random ops, CPU tensors (`plan`); more size keys than the limit
(``cudagraph_limit``: recorded keys keep replaying, new keys run plain); more
records again than ``cudagraph_limit``; a capture that failed.

The recorder is what makes and replays graphs: `CudaRecorder` (torch.cuda.graph),
or a stand-in (`HostRecorder`, which runs the function again and writes its
results into the recorded outputs) so that all of the above runs in CPU tests.
"""

from __future__ import annotations

import functools
import operator
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..report import logs
from .plan import REASONS, GraphPlan, plan_graph
from .recorders import CudaRecorder as CudaRecorder
from .recorders import HostRecorder as HostRecorder
from .recorders import Recorder as Recorder
from .recorders import _cdata, _flatten, _is_static, current_recorder
from .recorders import mark_static as mark_static
from .recorders import use_recorder as use_recorder

log = logs.logger("cudagraphs")
_use_count: Callable[[int], int] = torch._C._storage_Use_Count


@dataclass
class CudaGraphStats:
    """One compiled graph in reduce-overhead mode; the report's "CUDA graphs" rows."""

    label: str
    reason: str | None = None  # why it always runs as plain launches; None: graphed
    warmups: int = 0  # first calls of a size key (plain)
    records: int = 0  # graphs recorded (one per size key)
    replays: int = 0
    plain: dict[str, int] = field(default_factory=dict)  # plain runs of a graphed callable
    copied_out: int = 0  # outputs returned as copies (held by the caller across a replay)
    copied_in: int = 0  # inputs copied into the graph's buffers per replay (last record)
    # bytes the recorded graphs (every size key) keep between calls: the buffers inputs
    # are copied into, and the outputs in the pool (storages counted once); the pool's
    # freed temporaries are not counted (reserved, reused by graphs recorded later)
    bytes_in: int = 0
    bytes_out: int = 0

    def ran_plain(self, why: str) -> None:
        first = why not in self.plain
        self.plain[why] = self.plain.get(why, 0) + 1
        (log.info if first else log.debug)("%s: plain launches: %s", self.label, why)


# ---------------------------------------------------------------------- the pool


class _Pool:
    """The graphs recorded into one memory pool, in record order, and in the place of a
    graph recorded again, its outputs that are still held (`_Held`). ``generation``
    changes whenever one is added or goes: an entry's list of storages to watch, its
    own and those of everything recorded after it, is rebuilt only then."""

    def __init__(self) -> None:
        self.entries: list[weakref.ref[_Entry | _Held]] = []
        self.held: list[_Held] = []  # kept here until their holders let go
        self.generation = 0

    def add(self, entry: _Entry) -> None:
        self.entries.append(weakref.ref(entry, self._died))
        self.generation += 1

    def bury(self, entry: _Entry) -> None:
        """``entry`` is recorded again: its outputs still held stay in its place."""
        held = _Held(entry)
        if not held.refs:
            return
        for k, r in enumerate(self.entries):
            if r() is entry:
                self.entries[k] = weakref.ref(held, self._died)
                self.held.append(held)
                self.generation += 1
                return

    def _died(self, ref: weakref.ref[Any]) -> None:
        self.generation += 1

    def live(self) -> list[_Entry | _Held]:
        if any(h.released() for h in self.held):
            self.held = [h for h in self.held if not h.released()]  # (their refs die: _died)
        alive = [e for r in self.entries if (e := r()) is not None]
        if len(alive) != len(self.entries):
            self.entries = [weakref.ref(e, self._died) for e in alive]
        return alive

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is an output of a graph recorded here (a static address)."""
        cd = _cdata(t)
        return any(cd == c for e in self.live() if isinstance(e, _Entry) for c, _, _ in e.owned)

    def after(self, entry: _Entry) -> list[_Entry | _Held]:
        live = self.live()
        return live[live.index(entry) + 1 :] if entry in live else []


class _Held:
    """Outputs of a graph recorded again that their holders still keep. They stay where
    the graph put them, possibly in the freed temporaries of a graph recorded before
    it, whose replays must not overwrite them: watched in the graph's place in the pool
    until released. Weak references keep the storages' handles valid, not their memory
    (held: a use count above 0)."""

    def __init__(self, entry: _Entry) -> None:
        self.refs = [
            StorageWeakRef(entry.flat[outs[0]].untyped_storage())  # type: ignore[no-untyped-call]
            for cd, base, outs in entry.owned
            if _use_count(cd) > base
        ]
        self.owned: list[tuple[int, int, list[int]]] = [(r.cdata, 0, []) for r in self.refs]

    def released(self) -> bool:
        return all(_use_count(cd) == 0 for cd, _, _ in self.owned)


_POOLS: dict[Any, _Pool] = {}


# ---------------------------------------------------------------------- one size key

ALIAS, COPY, KEEP, INPUT, SAME = 0, 1, 2, 3, 4  # how a recorded output is returned
HELD = "outputs of an earlier replay are still held"
MOVED = "an input read in place (a parameter, a saved tensor) is at another address"
SPLIT = "inputs that were one tensor when recorded (one buffer) are two now"
STABLE = "copied inputs stayed at one address: read in place"
PROBE_CALLS = 4  # replays over which copied inputs must keep their addresses
_data_ptr = torch.Tensor.data_ptr
_detach = torch.Tensor.detach


class _Entry:
    """One recorded graph: its static inputs and outputs and how to return them.

    Everything a replay needs is fixed here, once per record, so that a replay is a
    few calls over prebuilt lists (`run`): one comparison of the read-in-place
    inputs' data pointers against a list, one of the watched storages' use counts
    against a list, one ``_foreach_copy_`` of the copied inputs, one ``detach`` per
    output handed out."""

    def __init__(
        self,
        owner: GraphedCallable,
        args: Sequence[Any],
        still_held: set[int],
    ) -> None:
        rec, pool = owner.recorder, owner.pool
        self.owner = owner
        static_idx: list[int] = []  # inputs read in place, with their data pointers
        self.static_ptrs: list[int] = []
        self.copies: list[tuple[int, torch.Tensor]] = []  # (input, buffer) copied in
        # inputs passed twice (compiled autograd hands a saved tensor to each node that
        # saved it: log_softmax's result to two): one buffer, one copy per replay
        self.same_as: list[tuple[int, int]] = []  # (input, the earlier input it was)
        first: dict[tuple[Any, ...], int] = {}
        statics: list[Any] = list(args)
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            if _is_static(a) or pool.owns(a) or i in owner.stable:
                static_idx.append(i)
                self.static_ptrs.append(a.data_ptr())
                continue
            same = (_cdata(a), a.storage_offset(), a.dtype, tuple(a.size()), a.stride())
            if same in first:
                self.same_as.append((i, first[same]))
                statics[i] = statics[first[same]]
                continue
            first[same] = i
            buf = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
            buf.copy_(a)
            statics[i] = buf
            self.copies.append((i, buf))
        self.static_idx = tuple(static_idx)
        # the copied inputs a probe watches over the first replays (`probed`)
        self.probe = (
            () if owner.probed else tuple(i for i, _ in self.copies if i not in owner.moving)
        )
        self._probe_ptrs: list[int] | None = None
        self._probe_left = PROBE_CALLS
        self.copy_back = [(i, b) for i, b in self.copies if i in owner.plan.mutated]
        self.graph, out = rec.record(owner.fn, statics, owner.pool_id)
        flat, self.rebuild = _flatten(out)
        del out
        self.modes: list[int] = []
        # output -> (input, size, stride, offset from the input's own): rebuilt on the
        # caller's tensor (the recorded one is not kept: it would pin the caller's memory)
        self.view_of: dict[int, tuple[int, Any, Any, int]] = {}
        by_storage = self._classify_outputs(flat, statics, still_held)
        # A graph reads its inputs at their recorded addresses; holding the caller's
        # tensors would only keep storages alive (and look like outputs still in use).
        del statics
        self.flat: list[Any] = [None if m in (INPUT, SAME) else t for m, t in zip(self.modes, flat)]
        del flat
        # the storages a replay overwrites, with our own references to each (measured
        # here, where no local variable holds an output)
        self.owned = [(cd, _use_count(cd), outs) for cd, outs in by_storage.items()]
        self.static_bytes_out = sum(
            self.flat[outs[0]].untyped_storage().nbytes() for outs in by_storage.values()
        )
        self.static_bytes_in = sum(b.untyped_storage().nbytes() for _, b in self.copies)
        self._prepare_replay()
        if not rec.record_executes:
            rec.replay(self.graph, None)
        for i, buf in self.copy_back:
            args[i].copy_(buf)
        pool.add(self)

    def _classify_outputs(
        self, flat: list[Any], statics: list[Any], still_held: set[int]
    ) -> dict[int, list[int]]:
        """How each output is returned; the outputs in pool memory, by storage.

        An output that is an input, or views one (a parameter's transpose saved for
        backward), is returned as the caller's tensor or the same view of it, as a plain
        call returns it (compiled autograd's cache key sees the difference)."""
        inputs = {
            _cdata(statics[i]): (i, int(statics[i].storage_offset()))
            for i in range(len(statics))
            if isinstance(statics[i], torch.Tensor)
        }
        by_storage: dict[int, list[int]] = {}
        for j, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                self.modes.append(KEEP)
                continue
            cd = _cdata(t)
            if cd in inputs:
                i, base = inputs[cd]
                self.modes.append(SAME if t is statics[i] else INPUT)
                off = int(t.storage_offset()) - base
                self.view_of[j] = (i, tuple(t.size()), tuple(t.stride()), off)
            else:
                self.modes.append(COPY if j in still_held else ALIAS)
                by_storage.setdefault(cd, []).append(j)
        return by_storage

    def _prepare_replay(self) -> None:
        """The per-replay work as prebuilt lists (see the class docstring)."""
        rec = self.owner.recorder
        self._host = rec.record_executes  # a host stand-in replays by running fn on args
        self._replay = functools.partial(rec.replay, self.graph, None)
        self._static_get = _getter(self.static_idx)
        self._dup = _getter(tuple(j for j, _ in self.same_as))
        self._dup_of = _getter(tuple(i for _, i in self.same_as))
        self._bufs = [b for _, b in self.copies]
        self._srcs = _getter(tuple(i for i, _ in self.copies))
        self._back = [b for _, b in self.copy_back]
        self._back_dst = _getter(tuple(i for i, _ in self.copy_back))
        self._all_alias = all(m == ALIAS for m in self.modes)
        self._tuple_out = self.rebuild is tuple
        self._watch_gen = -1  # the watched storages are gathered at the first check
        self._watch: list[int] = []
        self._bases: list[int] = []

    def _watched(self) -> tuple[list[int], list[int]]:
        """The storages a replay may overwrite and our references to each: this graph's
        outputs, and those of graphs recorded after it in the pool (they may sit in our
        freed temporaries: the forward's saved tensors, when the backward recorded first)."""
        pool = self.owner.pool
        if self._watch_gen != pool.generation:
            owned = [*self.owned, *(o for e in pool.after(self) for o in e.owned)]
            self._watch = [cd for cd, _, _ in owned]
            self._bases = [base for _, base, _ in owned]
            self._watch_gen = pool.generation
        return self._watch, self._bases

    def blocked(self, args: Sequence[Any]) -> str | None:
        """Why this call may not replay (None: it may). ``held``: this graph's outputs the
        caller still holds (they are returned as copies once the graph records again)."""
        ptrs = list(map(_data_ptr, self._static_get(args)))
        if ptrs != self.static_ptrs:
            owner = self.owner
            for i, p, q in zip(self.static_idx, ptrs, self.static_ptrs, strict=True):
                if p != q and i in owner.stable:  # read in place on trust: copied from now on
                    owner.stable.discard(i)
                    owner.moving.add(i)
            return MOVED
        # one buffer serves inputs that were one tensor (sizes and strides are the key's)
        if self.same_as and list(map(_data_ptr, self._dup(args))) != list(
            map(_data_ptr, self._dup_of(args))
        ):
            return SPLIT
        watch, bases = self._watched()
        if list(map(_use_count, watch)) == bases:
            return None
        self.held: set[int] = set()
        for cd, base, outs in self.owned:
            if _use_count(cd) > base:
                self.held.update(outs)
        return HELD

    def probed(self, args: Sequence[Any]) -> bool:
        """One replay of the probe over the copied inputs' addresses; True when it ends
        with inputs that stayed at one address throughout (then read in place: no
        buffer, no copy; the graph records again). Compiled autograd's saved tensors
        from eager code (log_softmax's result, 128 MiB on gpt-m) come back to the same
        cached block step after step; a batch cycled through a list does not."""
        owner = self.owner
        ptrs = [args[i].data_ptr() for i in self.probe]
        if self._probe_ptrs is not None:  # (the record call's own addresses are not
            # compared: recording allocates the buffers, moving what comes after)
            moved = (i for i, p, q in zip(self.probe, ptrs, self._probe_ptrs) if p != q)
            owner.moving.update(moved)
        self._probe_ptrs = ptrs
        self._probe_left -= 1
        if self._probe_left:
            return False
        owner.probed = True
        stable = {i for i in self.probe if i not in owner.moving}
        stable |= {j for j, i in self.same_as if i in stable}
        self.probe = ()
        owner.stable |= stable
        return bool(stable)

    def run(self, args: Sequence[Any]) -> Any:
        if self._bufs:
            torch._foreach_copy_(self._bufs, self._srcs(args))
        if self._host:
            self.owner.recorder.replay(self.graph, self._host_args(args))
        else:
            self._replay()
        if self._back:
            torch._foreach_copy_(self._back_dst(args), self._back)
        return self.outputs(args)

    def _host_args(self, args: Sequence[Any]) -> list[Any]:
        """A host stand-in runs the function again: on the buffers and static inputs."""
        out = list(args)
        for i, buf in self.copies:
            out[i] = buf
        for j, i in self.same_as:
            out[j] = out[i]
        return out

    def outputs(self, args: Sequence[Any]) -> Any:
        if self._all_alias:
            if self._tuple_out:
                return tuple(map(_detach, self.flat))
            return self.rebuild(list(map(_detach, self.flat)))
        res: list[Any] = []
        for j, (mode, t) in enumerate(zip(self.modes, self.flat)):
            if mode == ALIAS:
                res.append(t.detach())
            elif mode == COPY:
                res.append(t.clone())
            elif mode == SAME:
                res.append(args[self.view_of[j][0]])
            elif mode == INPUT:
                i, size, stride, off = self.view_of[j]
                a = args[i]
                res.append(a.as_strided(size, stride, a.storage_offset() + off))
            else:
                res.append(t)
        return self.rebuild(res)


# ---------------------------------------------------------------------- the callable


class GraphedCallable:
    """A compiled callable that replays a recorded graph per size key; see the module."""

    # Outputs are static buffers the next replay overwrites: never make one `.grad`.
    static_outputs = True

    def __init__(
        self,
        fn: Callable[..., Any],
        plan: GraphPlan,
        recorder: Recorder,
        stats: CudaGraphStats,
        limit: int,
        pool_id: Any,
    ) -> None:
        self.fn, self.plan, self.recorder, self.stats = fn, plan, recorder, stats
        self.limit = limit
        self.pool_id = pool_id
        self.pool = _POOLS.setdefault(pool_id, _Pool())
        self.entries: dict[tuple[Any, ...], _Entry] = {}
        self.warm: dict[tuple[Any, ...], list[tuple[int, StorageWeakRef]]] = {}
        self.rerecords = 0  # records made because a replay would overwrite held outputs
        self._scalars = plan.scalars
        self._symbolic = plan.symbolic
        self._keyed = bool(plan.scalars or plan.symbolic)  # else one key: ()
        # inputs neither static nor pool outputs: read in place once they kept one
        # address over the first replays (`_Entry.probed`, once per callable), copied
        # for good once one moved
        self.stable: set[int] = set()
        self.moving: set[int] = set()
        self.probed = False

    def __getattr__(self, name: str) -> Any:  # report, wrapper_source of the inner callable
        fn = self.__dict__.get("fn")
        if fn is None:
            raise AttributeError(name)
        return getattr(fn, name)

    def key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        if not self._scalars and not self._symbolic:
            return ()
        return tuple(args[i] for i in self._scalars) + tuple(
            (tuple(args[i].shape), args[i].stride()) for i in self._symbolic
        )

    def __call__(self, *args: Any) -> Any:
        if self.stats.reason is not None:
            return self.fn(*args)
        key = self.key(args) if self._keyed else ()
        entry = self.entries.get(key)
        if entry is None:
            return self._first_calls(key, args)
        why = entry.blocked(args)
        if why is None:
            if not (entry.probe and entry.probed(args) and self.rerecords < self.limit):
                self.stats.replays += 1
                return entry.run(args)
            why = STABLE
        if self.rerecords < self.limit:
            # HELD: new static outputs (the held ones stay with their holder), recorded
            # after every graph whose outputs are held, so its temporaries avoid them.
            # MOVED: the graph reads the inputs where they are now (inputs read in place
            # on trust are copied from now on). SPLIT: one buffer each. STABLE: inputs
            # that kept their address are read in place.
            self.rerecords += 1
            held = entry.held if why is HELD else set()
            self.pool.bury(entry)
            del self.entries[key], entry
            return self._record(key, args, held, why)
        self.stats.ran_plain(f"{why}; recorded again {self.limit} times (cudagraph_limit)")
        return self.fn(*args)

    def _first_calls(self, key: tuple[Any, ...], args: Sequence[Any]) -> Any:
        if key not in self.warm:
            if len(self.entries) >= self.limit:
                self.stats.ran_plain(
                    f"a new size key after {self.limit} recorded (cudagraph_limit): dynamic "
                    "sizes would re-record without bound"
                )
                return self.fn(*args)
            if len(self.warm) >= self.limit:
                self.stats.reason = (
                    f"more than {self.limit} size keys seen once each: dynamic sizes would "
                    "re-record without bound"
                )
                log.info("%s: plain launches from now on: %s", self.stats.label, self.stats.reason)
                self.warm.clear()
                return self.fn(*args)
            self.stats.warmups += 1
            out = self.fn(*args)
            self.warm[key] = _fresh_outputs(out, args)
            return out
        held = {j for j, ref in self.warm.pop(key) if not ref.expired()}  # type: ignore[no-untyped-call]
        return self._record(key, args, held, "second call")

    def _record(self, key: tuple[Any, ...], args: Sequence[Any], held: set[int], why: str) -> Any:
        t0 = time.perf_counter()
        try:
            entry = _Entry(self, args, held)
        except Exception as e:  # a capture that failed: the graph runs as plain launches
            self.stats.reason = f"recording failed: {type(e).__name__}: {e}"
            log.warning("%s: plain launches from now on: %s", self.stats.label, self.stats.reason)
            return self.fn(*args)
        self.entries[key] = entry
        self.stats.records += 1
        self.stats.copied_in = len(entry.copies)
        self.stats.copied_out += len(held)
        self.stats.bytes_in = sum(e.static_bytes_in for e in self.entries.values())
        self.stats.bytes_out = sum(e.static_bytes_out for e in self.entries.values())
        log.info(
            "%s: recorded size key %s (%s; %d keys, %d records, %.1f ms; %d inputs copied "
            "per replay (%s), %d read in place; %d outputs returned as copies; %s of "
            "outputs kept in the pool)",
            self.stats.label,
            key or "(static)",
            why,
            len(self.entries),
            self.stats.records,
            (time.perf_counter() - t0) * 1e3,
            len(entry.copies),
            _mib(entry.static_bytes_in),
            len(entry.static_ptrs),
            sum(1 for m in entry.modes if m == COPY),
            _mib(entry.static_bytes_out),
        )
        return entry.outputs(args)


def graphed(
    fn: Callable[..., Any],
    gm: torch.fx.GraphModule | None,
    example_inputs: Sequence[Any],
    stats: CudaGraphStats,
    limit: int,
) -> Callable[..., Any]:
    """``fn`` as a `GraphedCallable`, or ``fn`` itself with ``stats.reason`` saying why not."""
    recorder = current_recorder()
    plan = plan_graph(gm, example_inputs)
    stats.reason = recorder.unsupported(example_inputs) or plan.reason
    if stats.reason is None and "new_seed()" in str(getattr(fn, "wrapper_source", "")):
        stats.reason = REASONS["random"].format(op="(a kernel of the generated wrapper)")
    if stats.reason is not None:
        log.info("%s: plain launches: %s", stats.label, stats.reason)
        return fn
    return GraphedCallable(fn, plan, recorder, stats, limit, recorder.pool_id(example_inputs))


# ---------------------------------------------------------------------- helpers


def _getter(idx: tuple[int, ...]) -> Callable[[Sequence[Any]], tuple[Any, ...] | list[Any]]:
    """``args -> (args[i] for i in idx)`` as a sequence (one C call for two or more)."""
    if len(idx) > 1:
        return operator.itemgetter(*idx)
    if idx:
        (i,) = idx
        return lambda args: [args[i]]
    return lambda args: []


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _fresh_outputs(out: Any, args: Sequence[Any]) -> list[tuple[int, StorageWeakRef]]:
    """Weak references to the outputs of a plain call that are not views of an input."""
    inputs = {_cdata(a) for a in args if isinstance(a, torch.Tensor)}
    refs: list[tuple[int, StorageWeakRef]] = []
    for j, t in enumerate(_flatten(out)[0]):
        if isinstance(t, torch.Tensor) and _cdata(t) not in inputs:
            refs.append((j, StorageWeakRef(t.untyped_storage())))  # type: ignore[no-untyped-call]
    return refs
