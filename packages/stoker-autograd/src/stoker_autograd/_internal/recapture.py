"""Why the engine captured a backward again, in user terms.

The engine's cache is keyed in C++ by every autograd node of the backward and what
each one holds; a miss calls ``begin_capture`` with no word of what changed.  Each
capture writes a *signature*: the autograd nodes it walked, in order, each
accumulate-grad with its parameter (by name where `name_parameters` was told it) and
whether that ``.grad`` already existed.  A capture that closely resembles an earlier
one (most of its nodes the same) is a recapture; the difference from the closest
earlier signature says why, e.g. ``AccumulateGrad of fc1.weight: .grad None ->
.grad set`` or ``no longer: AccumulateGrad of head.bias [.grad set]`` (a frozen
layer).  Recorded in `recapture_reasons()` and logged on
``stoker.recompiles``.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

_NAMES = WeakIdKeyDictionary()  # parameter -> its qualified name
_log = logging.getLogger("stoker.recompiles")

RECAPTURE_REASONS: list[str] = []
"""Why each backward was captured again since `reset_stats()` (``recapture_reasons()``)."""

SIMILAR = 0.5  # a capture is a recapture of an earlier one at least this alike (difflib)
KEPT = 16  # signatures kept per session (the newest)
SHOWN = 3  # differences named per reason


def name_parameters(
    named: nn.Module | Iterable[tuple[str, torch.Tensor]], prefix: str = ""
) -> None:
    """Name parameters for stoker-autograd's messages (a module's ``named_parameters()``,
    or ``(name, tensor)`` pairs): recapture reasons and the descriptions of a backward's
    inputs then say ``fc1.weight`` where they said ``the parameter of shape (8, 6)``.
    Held weakly: naming keeps nothing alive."""
    pairs = named.named_parameters() if isinstance(named, nn.Module) else named
    for name, p in pairs:
        if isinstance(p, torch.Tensor):
            _NAMES[p] = prefix + name


def parameter_name(t: object) -> str | None:
    """The name `name_parameters` gave ``t`` (None: not named)."""
    if not isinstance(t, torch.Tensor):
        return None
    name = _NAMES.get(t)  # type: ignore[no-untyped-call]
    return name if isinstance(name, str) else None


def _kind(entry: str) -> str:
    """What an entry is, without what it holds: ``AccumulateGrad of fc1.weight``
    without its ``[.grad None]``, a compiled forward's backward without its number
    (stoker's ``CompiledFunction_3Backward``, torch.compile's
    ``CompiledFunctionBackward[torch.compile aot_id 3]``)."""
    return _NUMBERED.sub(r"\1", entry.split(" [", 1)[0])


_NUMBERED = re.compile(r"(CompiledFunction)_\d+|(?<=aot_id )\d+")


def _changed(a: str, b: str) -> str:
    """``AccumulateGrad of fc1.weight: .grad None -> .grad set`` for one node holding other
    values; ``a -> b`` otherwise."""
    ka, _, ha = a.partition(" [")
    kb, _, hb = b.partition(" [")
    if ka == kb and ha and hb:
        return f"{ka}: {ha.rstrip(']')} -> {hb.rstrip(']')}"
    return f"{a} -> {b}"


def why(before: list[list[str]], now: list[str]) -> str | None:
    """What differs between ``now`` and the most alike of ``before`` (None: no earlier
    signature is alike enough, so this is a new backward, not a recapture).  Entries
    are aligned by kind (`_kind`); an aligned pair that holds other values is a change
    ``a -> b``."""
    kinds = [_kind(e) for e in now]
    best, best_kinds, best_ratio = None, None, SIMILAR
    for old in before:
        old_kinds = [_kind(e) for e in old]
        ratio = difflib.SequenceMatcher(None, old_kinds, kinds, autojunk=False).ratio()
        if ratio >= best_ratio:
            best, best_kinds, best_ratio = old, old_kinds, ratio
    if best is None or best_kinds is None:
        return None
    changes: list[str] = []
    matcher = difflib.SequenceMatcher(None, best_kinds, kinds, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            changes += [_changed(a, b) for a, b in zip(best[i1:i2], now[j1:j2]) if a != b]
        elif tag == "replace":
            changes += [f"{a} -> {b}" for a, b in zip(best[i1:i2], now[j1:j2])]
            changes += [f"no longer: {a}" for a in best[i1 + (j2 - j1) : i2]]
            changes += [f"new: {b}" for b in now[j1 + (i2 - i1) : j2]]
        elif tag == "delete":
            changes += [f"no longer: {a}" for a in best[i1:i2]]
        else:  # insert
            changes += [f"new: {b}" for b in now[j1:j2]]
    if not changes:
        return (
            "the same autograd nodes as an earlier capture: one of them holds other "
            "values (a saved tensor's dtype, device or layout, or a node attribute)"
        )
    more = f" (and {len(changes) - SHOWN} more)" if len(changes) > SHOWN else ""
    return "; ".join(changes[:SHOWN]) + more


def note(signatures: list[list[str]], now: list[str], graph: str) -> None:
    """Record why ``now`` was captured (if it is a recapture), then keep it."""
    reason = why(signatures, now)
    if reason is not None:
        if len(RECAPTURE_REASONS) < 1000:  # a bound for a process that recaptures forever
            RECAPTURE_REASONS.append(f"{graph}: {reason}")
        _log.info("captured the backward again (%s): %s", graph, reason)
    signatures.append(now)
    del signatures[:-KEPT]
