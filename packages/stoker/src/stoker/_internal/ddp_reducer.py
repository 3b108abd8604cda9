"""stoker's bucketed reducer for a DDP module (the ``stoker_reducer`` mode).

DDP's buckets (same caps, same first-bucket cap; rebuilt after the first
synchronised backward in the order the gradients became ready, as DDP does), a
post-accumulate-grad hook per parameter, an async all-reduce per bucket started
by the hook of its last gradient, and a wait in the backward's final callback.
Numerics as DDP's reducer: each gradient times ``1/world_size``, then a summing
all-reduce.  ``no_sync()``: gradients accumulate locally.  `check_supported`
refuses what it does not do, saying what to change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.variable import Variable
from torch.nn.parallel import DistributedDataParallel as DDP

from . import logs
from .config import StokerConfigError

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
    ready: int  # gradients ready (of all the DDP's) when it was started


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
    """Reduces a DDP module's gradients bucket by bucket as they become ready."""

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
        self.pending: list[set[int]] = []
        self.works: list[tuple[int, Any, torch.Tensor]] = []  # (bucket, work, flat)
        self.ready = 0
        self.active = False
        self.handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_ready, i))
            for i, p in enumerate(self.params)
        ]

    def _set_buckets(self, buckets: list[list[int]]) -> None:
        self.buckets = buckets
        self.record.buckets = [[self.names[i] for i in b] for b in buckets]
        self.bucket_of = {i: b for b, idx in enumerate(buckets) for i in idx}

    def _rebuild(self, order: list[int]) -> None:
        """Buckets in the order the first backward made the gradients ready (DDP does
        the same after its first iteration), so each leaves as early as it can."""
        if sorted(order) != list(range(len(self.params))):
            return  # some gradient missing: _finalize raises
        indices, _limits = _C10D._compute_bucket_assignment_by_size(
            [self.params[i] for i in order], self.caps, [False] * len(order), order
        )
        self._set_buckets([list(b) for b in indices])
        _LOG.info("DDP buckets rebuilt in gradient-ready order: %s", self.record.buckets)

    def _on_ready(self, i: int, param: torch.Tensor) -> None:
        if not self.ddp.require_backward_grad_sync:  # no_sync(): accumulate locally
            return
        if not self.active:
            self.active = True
            self.pending = [set(b) for b in self.buckets]
            self.works, self.ready = [], 0
            self.record.steps.append([])
            del self.record.steps[: -self.record.max_steps]
            Variable._execution_engine.queue_callback(self._finalize)
        self.ready += 1
        if self.order is not None:
            self.order.append(i)
        b = self.bucket_of[i]
        self.pending[b].discard(i)
        if not self.pending[b]:
            self._launch(b)

    def _launch(self, b: int) -> None:
        grads = [self.params[i].grad for i in self.buckets[b]]
        if any(g is None for g in grads):  # pragma: no cover - a hook fired without a grad
            raise RuntimeError("stoker: a DDP gradient vanished before its bucket was reduced")
        world = dist.get_world_size(self.ddp.process_group)
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
            flat.mul_(1.0 / world)  # as DDP's reducer: scale, then a summing all-reduce
            work = dist.all_reduce(flat, group=self.ddp.process_group, async_op=True)
        self.works.append((b, work, flat))
        names = [self.names[i] for i in self.buckets[b]]
        self.record.steps[-1].append(
            Collective(b, names, flat.numel() * flat.element_size(), self.ready)
        )

    def _finalize(self) -> None:
        self.active = False
        missing = [self.names[i] for s in self.pending for i in sorted(s)]
        if missing:
            for _b, work, _flat in self.works:
                work.wait()
            raise DistributedConfigError(
                f"stoker: DDP parameters got no gradient in this backward: {', '.join(missing)}. "
                "stoker's reducer needs every parameter in the loss (find_unused_parameters is "
                "not supported with compiled autograd); set requires_grad=False on unused ones "
                "or pass compiled_autograd=False to stoker.compile."
            )
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

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
