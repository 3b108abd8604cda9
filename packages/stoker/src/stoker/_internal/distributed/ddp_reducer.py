"""stoker's bucketed reducer for a DDP module (the ``stoker_reducer`` mode).

DDP's buckets (same caps, same first-bucket cap; rebuilt after the first
synchronised backward in the order the gradients became ready, as DDP does), an
async all-reduce per bucket started by the post-accumulate-grad hook of its last
gradient (a hook per parameter until the rebuild, then one per bucket: each hook
cuts the compiled backward), and a wait in the backward's final callback.
Numerics as DDP's reducer: each gradient times ``1/world_size``, then a summing
all-reduce.  ``no_sync()``: gradients accumulate locally.  `check_supported`
refuses what it does not do, saying what to change.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.variable import Variable
from torch.nn.parallel import DistributedDataParallel as DDP

import stoker_autograd

from ..config import StokerConfigError
from ..report import logs

_LOG = logs.logger("distributed")
_C10D: Any = dist  # its private bucket helpers are not in the stubs


class DistributedConfigError(StokerConfigError):
    """A DDP setting stoker cannot honour in the chosen mode (the message says what to change)."""


@dataclass
class Collective:
    """One bucket's all-reduce in one backward."""

    bucket: int  # index in launch order of DDP's buckets (0: the last parameters)
    params: list[str]  # parameter names, in bucket order
    nbytes: int
    # gradients known ready (of all the DDP's) when it was started: counted one by one
    # while every parameter is hooked; after the rebuild, those of the buckets started
    # so far, this one included (all of them from the final callback)
    ready: int


@dataclass
class DDPRecord:
    """What the report shows for one DDP module."""

    mode: str
    why: str
    buckets: list[list[str]] = field(default_factory=list)  # parameter names per bucket
    steps: list[list[Collective]] = field(default_factory=list)  # collectives per backward
    max_steps: int = 64  # steps kept (the newest)


# Settings `BucketReducer` refuses: (what is set, how to tell, what to do).
_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "find_unused_parameters=True",
        lambda d: bool(d.find_unused_parameters),
        "every parameter must take part in the loss: pass find_unused_parameters=False",
    ),
    (
        "mixed_precision",
        lambda d: getattr(d, "mixed_precision", None) is not None,
        "cast the model yourself (or use torch.autocast) and drop DDP's mixed_precision",
    ),
    (
        "a communication hook (register_comm_hook)",
        lambda d: bool(getattr(d, "_comm_hooks", ())),
        "register no comm hook",
    ),
    (
        "delay_all_reduce_named_params",
        lambda d: bool(getattr(d, "_delay_all_reduce_params", ())),
        "drop delay_all_reduce_named_params / param_to_hook_all_reduce",
    ),
    (
        "bucket_cap_mb_list",
        lambda d: bool(getattr(getattr(d, "_bucket_config", None), "per_bucket_bytes_caps", ())),
        "pass one bucket_cap_mb instead of bucket_cap_mb_list",
    ),
)


_JOIN = (
    "DDP's join() context (uneven inputs)",
    lambda d: bool(getattr(getattr(d, "_join_config", None), "enable", False)),
    "give every rank the same number of batches (e.g. DistributedSampler(drop_last=True)), "
    "as join()'s shadow all-reduces follow DDP's C++ reducer, which stoker's replaces",
)


def check_supported(ddp: DDP, join_only: bool = False) -> None:
    """Raise `DistributedConfigError` naming each DDP setting stoker's reducer refuses."""
    rules = (_JOIN,) if join_only else (*_UNSUPPORTED, _JOIN)
    bad = [(what, fix) for what, test, fix in rules if test(ddp)]
    if _JOIN[0] in (what for what, _fix in bad):  # Join leaves it on when its block raises
        ddp._join_config = type(ddp._join_config).construct_disabled_join_config()
    if bad:
        raise DistributedConfigError(_message(bad))


def _message(bad: list[tuple[str, str]]) -> str:
    lines = "\n".join(f"  - {what}: {fix}" for what, fix in bad)
    return (
        "stoker: DistributedDataParallel with compiled autograd (stoker.compile's default) "
        f"runs stoker's bucketed reducer, which does not support:\n{lines}\n"
        "or keep these settings and pass compiled_autograd=False to stoker.compile "
        "(DDP's own reducer then runs, with Dynamo's graph split at bucket boundaries)."
    )


def refuse_join(ddp: Any) -> None:
    """Make ``ddp.join()`` (and a forward inside one entered earlier) raise what to change."""

    def join_hook(**kwargs: Any) -> Any:  # Join() calls it first: nothing is set up yet
        what, _test, fix = _JOIN
        raise DistributedConfigError(_message([(what, fix)]))

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def pre(module: Any, args: Any) -> None:
        check_supported(ddp, join_only=True)

    ddp.join_hook = join_hook
    ddp.register_forward_pre_hook(pre)


def first_bucket_bytes(ddp: DDP) -> int:
    """The byte cap of DDP's first bucket (never larger than the others)."""
    cap = int(ddp.bucket_bytes_cap)
    cfg = getattr(ddp, "_bucket_config", None)
    first = getattr(cfg, "first_bucket_bytes_cap", _C10D._DEFAULT_FIRST_BUCKET_BYTES)
    return min(int(first), cap)


class BucketReducer:
    """Reduces a DDP module's gradients bucket by bucket as they become ready.

    Two ways to know that a bucket is ready, one at a time:

    * counting (the first synchronised backward, and for good after an out-of-order
      one): a hook on every parameter; the bucket leaves when its last one fires.
      Every hook is a Python call, so the compiled backward is cut once per parameter.
    * one hook per bucket (after the rebuild): only the bucket's last parameter in
      gradient-ready order is hooked, so the compiled backward is cut once per bucket.
      Its hook checks, against a picture of ``.grad`` taken when the compiled backward
      started (`stoker_autograd.on_backward_start`: no cut), that every gradient of the
      bucket was accumulated in this backward, and only then starts the all-reduce.  A
      bucket that is not complete (another graph order, a parameter without gradient,
      a backward not compiled) waits for the final callback, which starts it when all
      its gradients are in (or names the missing ones); after such a compiled
      backward the reducer goes back to counting.  A backward stoker-autograd does
      not run (``stoker.autograd_enabled(False)``) has no picture: every bucket leaves
      from the final callback, and a gradient counts as there when ``.grad`` exists.
    """

    def __init__(self, ddp: DDP, record: DDPRecord) -> None:
        self.ddp = ddp
        self.record = record
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        named = [
            (n, p) for n, p in ddp.module.named_parameters() if n not in ignored and p.requires_grad
        ]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.caps = [first_bucket_bytes(ddp), int(ddp.bucket_bytes_cap)]
        indices, _limits = _C10D._compute_bucket_assignment_by_size(
            self.params, self.caps, [False] * len(self.params)
        )
        # As DDP: first guess, the reverse of registration order; rebuilt after the
        # first synchronised backward in the order the gradients became ready.
        self._set_buckets([list(b) for b in reversed(indices)])
        self.order: list[int] | None = []  # ready order in the first backward; None: rebuilt
        self.counting = True  # a hook per parameter (else: one per bucket)
        self.pending: list[set[int]] = []  # counting: the gradients each bucket waits for
        self.launched: list[bool] = []
        self.works: list[tuple[int, Any, torch.Tensor]] = []  # (bucket, work, flat)
        self.ready = 0
        self.active = False
        self.out_of_order = False  # a bucket's hook found a gradient missing
        self.before: _Picture | None = None  # .grad when this compiled backward started
        self.handles: list[Any] = []
        self._hook(range(len(self.params)))
        self.start = stoker_autograd.on_backward_start(
            functools.partial(_on_start, weakref.ref(self))
        )
        weakref.finalize(self, self.start.remove)

    def _set_buckets(self, buckets: list[list[int]]) -> None:
        self.buckets = buckets
        self.record.buckets = [[self.names[i] for i in b] for b in buckets]
        self.bucket_of = {i: b for b, idx in enumerate(buckets) for i in idx}

    def _hook(self, indices: Iterable[int]) -> None:
        """Post-accumulate-grad hooks on these parameters only (each one cuts the
        compiled backward; the engine captures again when they change)."""
        for h in self.handles:
            h.remove()
        self.handles = [
            self.params[i].register_post_accumulate_grad_hook(functools.partial(self._on_ready, i))
            for i in indices
        ]

    def _rebuild(self, order: list[int]) -> None:
        """Buckets in the order the first backward made the gradients ready (DDP does
        the same after its first iteration), so each leaves as early as it can; from
        now on only each bucket's last gradient is hooked."""
        if sorted(order) != list(range(len(self.params))):
            return  # some gradient missing: _finalize raises
        indices, _limits = _C10D._compute_bucket_assignment_by_size(
            [self.params[i] for i in order], self.caps, [False] * len(order), order
        )
        self._set_buckets([list(b) for b in indices])
        pos = {i: k for k, i in enumerate(order)}
        self._hook(max(b, key=pos.__getitem__) for b in self.buckets)
        stoker_autograd.skip_compile()  # this graph (a cut per parameter) is not run again
        self.counting = False
        _LOG.info("DDP buckets rebuilt in gradient-ready order: %s", self.record.buckets)

    def _start_backward(self) -> None:
        """At a compiled backward's start: the picture of ``.grad`` a bucket's hook
        compares with (one hook per bucket, synchronised backwards only)."""
        self.before = None
        if self.counting or not self.ddp.require_backward_grad_sync:
            return
        grads = [p.grad for p in self.params]
        self.before = _Picture(
            int(torch._C._current_graph_task_id()),
            [id(g) if g is not None else 0 for g in grads],
            [g._version if g is not None else -1 for g in grads],
        )

    def _accumulated(self, i: int, pic: _Picture | None) -> bool:
        """Parameter ``i``'s gradient was accumulated in this backward: its ``.grad`` is
        another tensor, or the same one written since ``pic`` (the engine adds in
        place).  Without a picture of this backward (None), only that ``.grad`` exists."""
        g = self.params[i].grad
        if g is None or pic is None:
            return g is not None
        return id(g) != pic.ids[i] or g._version != pic.versions[i]

    def _picture(self) -> _Picture | None:
        """The picture taken when this backward started (None: none, it is eager)."""
        pic = self.before
        if pic is None or pic.task != int(torch._C._current_graph_task_id()):
            return None
        return pic

    def _on_ready(self, i: int, param: torch.Tensor) -> None:
        if not self.ddp.require_backward_grad_sync:  # no_sync(): accumulate locally
            return
        if not self.active:
            self.active = True
            self.pending = [set(b) for b in self.buckets]
            self.launched = [False] * len(self.buckets)
            self.works, self.ready, self.out_of_order = [], 0, False
            self.record.steps.append([])
            del self.record.steps[: -self.record.max_steps]
            Variable._execution_engine.queue_callback(self._finalize)
        b = self.bucket_of[i]
        if self.counting:
            self.ready += 1
            if self.order is not None:
                self.order.append(i)
            self.pending[b].discard(i)
            if not self.pending[b]:
                self._launch(b)
            return
        pic = self._picture()
        if pic is not None and all(self._accumulated(j, pic) for j in self.buckets[b]):
            self.ready += len(self.buckets[b])
            self._launch(b)
        else:  # the final callback starts it, once every gradient is in
            self.out_of_order = pic is not None

    def _launch(self, b: int) -> None:
        grads = [self.params[i].grad for i in self.buckets[b]]
        if any(g is None for g in grads):  # pragma: no cover - a hook fired without a grad
            raise RuntimeError("stoker: a DDP gradient vanished before its bucket was reduced")
        world = dist.get_world_size(self.ddp.process_group)
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
            flat.mul_(1.0 / world)  # as DDP's reducer: scale, then a summing all-reduce
            work = dist.all_reduce(flat, group=self.ddp.process_group, async_op=True)
        self.launched[b] = True
        self.works.append((b, work, flat))
        names = [self.names[i] for i in self.buckets[b]]
        self.record.steps[-1].append(
            Collective(b, names, flat.numel() * flat.element_size(), self.ready)
        )

    def _missing(self) -> list[str]:
        """The parameters that got no gradient in this backward (registration order)."""
        if self.counting:
            return [self.names[i] for i in sorted(i for s in self.pending for i in s)]
        pic = self._picture()
        waiting = [i for b, done in enumerate(self.launched) if not done for i in self.buckets[b]]
        return [self.names[i] for i in sorted(waiting) if not self._accumulated(i, pic)]

    def _finalize(self) -> None:
        self.active = False
        missing = self._missing()
        if missing:
            for _b, work, _flat in self.works:
                work.wait()
            self.before = None
            raise DistributedConfigError(
                f"stoker: DDP parameters got no gradient in this backward: {', '.join(missing)}. "
                "stoker's reducer needs every parameter in the loss (find_unused_parameters is "
                "not supported with compiled autograd); set requires_grad=False on unused ones "
                "or pass compiled_autograd=False to stoker.compile."
            )
        self.before = None
        self.ready = len(self.params)
        for b, done in enumerate(self.launched):  # out of order, or no compiled backward
            if not done:
                self._launch(b)
        with torch.no_grad():
            for b, work, flat in self.works:
                work.wait()
                offset = 0
                for i in self.buckets[b]:
                    g = self.params[i].grad
                    assert g is not None
                    n = g.numel()
                    g.copy_(flat[offset : offset + n].view_as(g))
                    offset += n
        self.works = []
        if self.order is not None:
            order, self.order = self.order, None
            self._rebuild(order)
        elif self.out_of_order and not self.counting:
            _LOG.warning(
                "DDP: a bucket's last gradient came before others of the bucket in this "
                "compiled backward (another graph order than the first backward's); the "
                "bucket left from the final callback; hooking every parameter from now on"
            )
            self.counting = True
            self._hook(range(len(self.params)))
            stoker_autograd.skip_compile()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.start.remove()


@dataclass
class _Picture:
    """Each parameter's ``.grad`` (``id``, version counter) when a compiled backward started."""

    task: int  # the backward's autograd graph task
    ids: list[int]  # 0: no .grad
    versions: list[int]


def _on_start(ref: weakref.ref[BucketReducer]) -> None:
    reducer = ref()
    if reducer is not None:
        reducer._start_backward()
