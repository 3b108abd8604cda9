"""Which collectives each training step issues, and which backward node issued them.

`install()` wraps the Python entry points of c10d's ``ProcessGroup`` (the
methods ``torch.distributed``'s functions end in, listed in `_METHODS`), so
every collective that Python code issues in this process is recorded before it
runs: FSDP2's all-gathers and reduce-scatters (eager or compiled), stoker's DDP
reducer's all-reduces.  DDP's C++ reducer and compiled functional collectives
issue theirs from C++ and are not seen.  The wrappers only record; the
collective itself is unchanged.

Each `Issued` says its kind, size, dtype and phase (``forward``: outside any
backward; ``backward``: inside one).  Issued from a backward that
stoker-autograd compiled, it also names the graph node that issued it (a hook,
a custom Function's backward, the final callbacks), its position in that graph
and the backward compute after it: what the collective can overlap.  A step is
one forward and its backward: a collective outside a backward, or in another
backward (autograd graph task), after one inside a backward opens the next
step (so a backward that a hook runs inside another, as reentrant
checkpointing does, counts as a step of its own).  A step is ``compiled`` when
its backward ran through stoker-autograd.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

# The kind of each ProcessGroup method Python's c10d API calls (names differ between
# torch releases: 2.13 all_gather_single, 2.11 _allgather_base, ...); absent ones are skipped.
_METHODS: dict[str, str] = {
    "allgather": "all_gather",
    "_allgather_base": "all_gather",
    "all_gather_single": "all_gather",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_single_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


@dataclass
class Site:
    """The node of a compiled backward graph that issued a collective."""

    kind: str  # hook type, "backward of <Function>", or "final callbacks"
    at: int | None  # index among the graph's call nodes (None: not found)
    of: int | None  # call nodes in the graph
    compute_after: int | None  # backward compute nodes after it


@dataclass
class Issued:
    kind: str  # all_gather | reduce_scatter | all_reduce | broadcast
    numel: int  # elements per rank: a gather's input, a reduce-scatter's output
    dtype: str
    phase: str  # forward | backward
    site: Site | None  # set inside a backward stoker-autograd compiled


@dataclass
class Step:
    issued: list[Issued] = field(default_factory=list)
    compiled: bool = False  # its backward ran through stoker-autograd
    task: int = -1  # the autograd graph task of its backward (-1: none yet)

    def counts(self) -> dict[str, dict[str, int]]:
        """``{kind: {phase: n}}`` for the kinds issued."""
        out: dict[str, dict[str, int]] = {}
        for c in self.issued:
            per = out.setdefault(c.kind, {})
            per[c.phase] = per.get(c.phase, 0) + 1
        return out


MAX_STEPS = 64  # steps kept (the newest)
_STEPS: list[Step] = []
_LOCK = threading.Lock()
_INSTALLED: list[bool] = [False]


def install() -> None:
    """Record every collective issued through Python from now on (idempotent)."""
    if _INSTALLED[0] or not torch.distributed.is_available():
        return
    pg: Any = torch._C._distributed_c10d.ProcessGroup
    for name, kind in _METHODS.items():
        real = getattr(pg, name, None)
        if real is not None:
            setattr(pg, name, _recording(real, kind))
    _INSTALLED[0] = True


def _recording(real: Any, kind: str) -> Any:
    # never traced by Dynamo (it would break the graph on the frame inspection)
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            _record(kind, args)
        except Exception:  # pragma: no cover - recording must never break a collective
            pass
        return real(self, *args, **kwargs)

    method.__name__ = getattr(real, "__name__", kind)
    method.__doc__ = getattr(real, "__doc__", None)
    method._stoker_real = real  # type: ignore[attr-defined]
    return method


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, list | tuple):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


def _record(kind: str, args: tuple[Any, ...]) -> None:
    # the gathers' first argument is the output: count the input (the second)
    t = _first_tensor(args[1] if kind == "all_gather" and len(args) > 1 else args)
    task = int(torch._C._current_graph_task_id())
    phase = "forward" if task == -1 else "backward"
    site = _site(sys._getframe(2)) if phase == "backward" else None
    issued = Issued(
        kind,
        int(t.numel()) if t is not None else 0,
        str(t.dtype).removeprefix("torch.") if t is not None else "?",
        phase,
        site,
    )
    with _LOCK:
        last = _STEPS[-1] if _STEPS else None
        if last is None or (last.task != -1 and task != last.task):
            _STEPS.append(Step())
            del _STEPS[:-MAX_STEPS]
        step = _STEPS[-1]
        step.issued.append(issued)
        step.task = task if task != -1 else step.task
        step.compiled = step.compiled or site is not None


def _in_backward_yet(step: Step) -> bool:
    return step.task != -1


# ---------------------------------------------------------------------- the issuing node
def _opaque_codes() -> dict[Any, Any]:
    import stoker_autograd

    return {t.__code__: t for t in stoker_autograd.OPAQUE_TARGETS if hasattr(t, "__code__")}


def _site(frame: Any) -> Site | None:
    """The stoker-autograd opaque call on the stack, and the graph node running it.

    The op's frame names the kind (its ``hook_type``, the Function of its ``ctx``);
    the runner above it (the segment runner, the FX interpreter) holds the node as
    ``n``.  None outside a compiled backward (eager autograd).
    """
    import stoker_autograd

    codes = _opaque_codes()
    f = frame
    while f is not None and f.f_code not in codes:
        f = f.f_back
    if f is None:
        return None
    op = codes[f.f_code]
    if op is stoker_autograd.call_hook:
        kind = str(f.f_locals.get("hook_type"))
    elif op is stoker_autograd.call_backward:
        fwd = getattr(f.f_locals.get("ctx"), "_forward_cls", None)
        kind = f"backward of {getattr(fwd, '__name__', 'autograd.Function')}"
    else:
        kind = "final callbacks" if "final" in op.__name__ else op.__name__
    g = f.f_back
    while g is not None:
        n = g.f_locals.get("n")
        if isinstance(n, torch.fx.Node) and n.target is op:
            return Site(kind, *_position(n))
        g = g.f_back
    return Site(kind, None, None, None)


# ---------------------------------------------------------------------- where they sit
def comm_sites(graph: Any, with_nodes: bool = False) -> list[Any]:
    """The nodes of a captured backward graph that can issue collectives, in order.

    DDP's buckets start in post-accumulate-grad hooks; FSDP2 all-gathers in its
    pre-backward hooks and reduce-scatters in ``RegisterPostBackwardFunction``'s
    backward and in its root callback (the final callbacks, at the graph's end).
    Each site says how much backward compute (functional backwards and aten ops)
    runs after it: what a collective started there can overlap with.  With
    ``with_nodes``: ``(node, site)`` pairs.
    """
    import stoker_autograd

    calls = [n for n in graph.nodes if n.op == "call_function"]
    opaque = stoker_autograd.OPAQUE_TARGETS
    compute = [
        n.target not in opaque and getattr(n.target, "__name__", "") != "getitem" for n in calls
    ]
    sites: list[Any] = []
    for i, n in enumerate(calls):
        if n.target is stoker_autograd.call_hook:
            kind = str(n.kwargs.get("hook_type"))
        elif n.target is stoker_autograd.call_backward:
            kind = f"backward of {n.meta.get('stoker_fn', 'autograd.Function')}"
        elif n.target in opaque and "final_callbacks" in getattr(n.target, "__name__", ""):
            kind = "final callbacks"
        else:
            continue
        if kind == "unpack_hook":
            continue
        site = {"at": i, "of": len(calls), "kind": kind, "compute_after": sum(compute[i:])}
        sites.append((n, site) if with_nodes else site)
    return sites


_POSITIONS: dict[int, tuple[Any, dict[Any, tuple[int, int, int]]]] = {}  # id(graph) -> ...


def _position(node: torch.fx.Node) -> tuple[int | None, int | None, int | None]:
    """(index among call nodes, call nodes, compute nodes after it) in ``node``'s graph
    (Nones for a node `comm_sites` does not list)."""
    graph = node.graph
    cached = _POSITIONS.get(id(graph))
    if cached is None or cached[0] is not graph:
        table = {
            n: (s["at"], s["of"], s["compute_after"]) for n, s in comm_sites(graph, with_nodes=True)
        }
        cached = (graph, table)
        if len(_POSITIONS) > 64:
            _POSITIONS.clear()
        _POSITIONS[id(graph)] = cached
    return cached[1].get(node, (None, None, None))


# ---------------------------------------------------------------------- reading the log
def steps() -> list[Step]:
    """The newest steps recorded, oldest first."""
    with _LOCK:
        return list(_STEPS)


def clear() -> None:
    with _LOCK:
        _STEPS.clear()


def last(compiled: bool) -> Step | None:
    """The newest step whose backward was (or was not) compiled by stoker-autograd."""
    for s in reversed(steps()):
        if s.compiled == compiled and _in_backward_yet(s):
            return s
    return None
