"""Which backward stoker compiles, and torch's engine hook around it.

The engine has one compiled-autograd hook for the process
(``set_autograd_compiler``): while it is set, *every* backward is handed to it.  So
stoker never leaves it set.  ``Variable._execution_engine`` (through which
``backward()`` and ``torch.autograd.grad`` run, via ``_engine_run_backward``) is
replaced by a `_Router` that decides per backward call:

* the innermost open block (`enable()` / `on()`: ``scope="all"`` or
  ``"compiled"``; `disabled()`), else the process-wide default (`set_default`,
  what ``stoker.compile`` turns on), else nothing: the plain engine, hook untouched;
* ``scope="compiled"``: only a backward whose graph holds a node of a
  stoker-compiled forward (a Function carrying ``_stoker_aot``), found by a walk of
  ``grad_fn.next_functions`` from the roots that stops at the first one, after an
  O(1) check that any such node is alive at all (``stoker_capture``'s ``LIVE``);
* never compiled: a backward run inside `eager_autograd_engine` (a hook's backward
  inside a compiled one: "no nested compiled autograd", it runs eagerly; the joint
  trace), inside a backward stoker left to another compiled-autograd compiler (a hook's
  backward there), inside a functorch transform (``torch.func.grad``, ``vmap``: wrapped
  tensors), or under a dispatch mode (a tracer's, as in AOTAutograd's joint trace and
  Inductor's compile; FlopCounterMode: the engine's compiled path refuses them; logged
  once per kind on ``stoker.autograd``).

A compiled backward sets the hook (one persistent factory, which reads the routed
call's session) for the duration of that one call, with Dynamo's frame evaluation
off (Dynamo must not trace stoker's engine callbacks: a backward called inside a
``torch.compile``d function runs in a graph break, where Dynamo traces every Python
frame that starts), then puts back what was there.

The engine's cache of captured graphs is process-global and keyed by the autograd
graph only.  It is kept across blocks: it is cleared (before a compiled backward,
never during one) only when what its graphs were compiled for changes (another
compiler, ``dynamic``, ``recompile_limit``), when another compiled-autograd
implementation used the engine, or on `clear_cache()`; the recaptures that follow
say why in `recapture_reasons()`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.variable import Variable

from stoker_capture._internal.runtime import function as _runtime_fn
from stoker_capture._internal.stages import capture as _capture

from . import recapture
from .capture import CaptureInstance
from .session import (
    RECOMPILE_REASONS,
    RELEASE_NODES,
    RUNTIME_CALLS,
    Compiler,
    Session,
    Stats,
    aten_executor,
)

STATS = Stats()
"""Process-wide counters (`stats()`); every session adds to them."""

_hook = torch._C._dynamo.compiled_autograd
_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame
_EAGER_DEPTH = _capture.EAGER_DEPTH
_LIVE = _runtime_fn.LIVE
_RUNS = RUNTIME_CALLS

SCOPES = ("all", "compiled")
_log = logging.getLogger("stoker.autograd")


@dataclass(eq=False)
class _Entry:
    """One open block (`on`/`enable`/`disabled`) or the default (`set_default`)."""

    kind: str  # "all" | "compiled" | "off"
    session: Session | None
    api: str  # how it was opened, for messages
    where: str  # file:line that opened it


class _State:
    def __init__(self) -> None:
        self.stack: list[_Entry] = []  # open blocks, innermost last
        self.default: _Entry | None = None  # the process-wide scope (`set_default`)
        self.idle = True  # no block and no default: every backward is eager, untouched
        self.owner: tuple[Any, bool, int] | None = None  # config the cache's graphs are for
        self.clear_pending: str | None = None  # why to clear the cache before the next one
        self.routed: Session | None = None  # the session of the compiled backward running
        # one compiled backward at a time (one hook per process); reentrant: a backward
        # on the same thread inside one is eager anyway, never a deadlock
        self.lock = threading.RLock()


_STATE = _State()


def _update_idle() -> None:
    _STATE.idle = not _STATE.stack and _STATE.default is None


_OWN_MODULES = frozenset({"stoker_autograd", "stoker", "contextlib"})


def _caller() -> str:
    """file:line of the user code that opened a block (past stoker's own frames: the
    umbrella's ``autograd_enabled`` opens blocks too)."""
    f = sys._getframe(1)
    while f is not None and str(f.f_globals.get("__name__", "")).split(".")[0] in _OWN_MODULES:
        f = f.f_back  # type: ignore[assignment]
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


# ------------------------------------------------------------------ the factory
def _factory() -> CaptureInstance:
    """The engine's factory, registered only while a routed backward runs: captures into
    the session of that backward (the newest config's session otherwise: a foreign
    caller that registered this factory itself).  The runtime (retrace, segments, the
    disk cache) is imported here, at the first capture, not with the package."""
    from .runtime import finish_capture

    session = _STATE.routed
    if session is None:
        entry = _STATE.stack[-1] if _STATE.stack else _STATE.default
        session = entry.session if entry is not None and entry.session is not None else None
    if session is None:
        session = Session(compiler=aten_executor, stats=STATS)
    return CaptureInstance(session, finish_capture)


# ------------------------------------------------------------------ sessions and blocks
def _session(
    compiler: Compiler | None, dynamic: bool, recompile_limit: int, reuse: Session | None = None
) -> Session:
    if reuse is not None:
        if compiler is not None or dynamic is not True or recompile_limit != 8:
            raise TypeError(
                "stoker_autograd: pass either session= or compiler/dynamic/recompile_limit "
                "(a session brings its own)"
            )
        return reuse
    return Session(
        compiler=compiler or aten_executor,
        dynamic=bool(dynamic),
        stats=STATS,
        recompile_limit=int(recompile_limit),
    )


def _check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise ValueError(
            f"stoker_autograd: scope={scope!r}; use 'all' (every backward in the block) or "
            "'compiled' (only backwards through a stoker-compiled forward)"
        )


def _push(entry: _Entry) -> None:
    _install()
    _STATE.stack.append(entry)
    _update_idle()


def _pop(entry: _Entry) -> None:
    """Close ``entry``; blocks must close innermost first (else: an error, and ``entry``
    is closed anyway, so the state matches the blocks still open)."""
    stack = _STATE.stack
    if stack and stack[-1] is entry:
        stack.pop()
        _update_idle()
        return
    if entry not in stack:
        raise RuntimeError(
            f"stoker_autograd: {entry.api} opened at {entry.where} was already closed"
        )
    inner = stack[stack.index(entry) + 1 :]
    stack.remove(entry)
    _update_idle()
    raise RuntimeError(
        f"stoker_autograd: {entry.api} opened at {entry.where} was closed before "
        + ", ".join(f"{e.api} opened at {e.where}" for e in inner)
        + " inside it. Close blocks innermost first (with-blocks nest by themselves; each "
        "on() needs its off() before the enclosing block ends). The outer one is closed "
        "now; the inner ones stay open until they are closed."
    )


def on(
    compiler: Compiler | None = None,
    dynamic: bool = True,
    recompile_limit: int = 8,
    *,
    scope: str = "all",
    session: Session | None = None,
) -> Session:
    """Compile backwards until the matching `off()` (`enable` without a ``with``)."""
    _check_scope(scope)
    session = _session(compiler, dynamic, recompile_limit, session)
    entry = _Entry(scope, session, "on()", _caller())
    _push(entry)
    assert entry.session is not None
    return entry.session


def off() -> None:
    """Close the innermost `on()`."""
    stack = _STATE.stack
    if not stack:
        raise RuntimeError("stoker_autograd.off() without a matching on()")
    top = stack[-1]
    if top.api != "on()":
        raise RuntimeError(
            f"stoker_autograd.off() would close {top.api} opened at {top.where}, which is "
            "still open; leave that block first (off() closes the innermost on())"
        )
    _pop(top)


@contextlib.contextmanager
def enable(
    compiler: Compiler | None = None,
    dynamic: bool = True,
    recompile_limit: int = 8,
    *,
    scope: str = "all",
    session: Session | None = None,
) -> Iterator[Session]:
    """Capture and compile backwards inside this block.

    ``scope="all"``: every ``backward()`` / ``torch.autograd.grad``; ``"compiled"``: only
    those whose graph holds a node of a stoker-compiled forward.  ``compiler(gm,
    example_inputs) -> callable`` compiles the retraced core-aten graph (default: run it
    as is).  With ``dynamic`` sizes are graph inputs, so a new batch size reuses the
    captured graph.  What the engine captured is kept when the block ends: entering
    again with the same compiler (the same object), ``dynamic`` and
    ``recompile_limit`` replays it.  ``session=`` reuses a `Session` (its compiler,
    ``dynamic``, ``recompile_limit``, and its ``graphs`` list, which this block's
    captures join), e.g. `default_session()`.
    """
    _check_scope(scope)
    session = _session(compiler, dynamic, recompile_limit, session)
    entry = _Entry(scope, session, "enable()", _caller())
    _push(entry)
    try:
        assert entry.session is not None
        yield entry.session
    finally:
        _pop(entry)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """The eager engine for every backward inside this block (the cache is kept)."""
    entry = _Entry("off", None, "disabled()", _caller())
    _push(entry)
    try:
        yield
    finally:
        _pop(entry)


def set_default(
    compiler: Compiler | None = None,
    dynamic: bool = True,
    recompile_limit: int = 8,
    *,
    scope: str = "compiled",
) -> Session:
    """The process-wide scope, where no block is open (``stoker.compile`` sets it):
    ``scope="compiled"`` compiles the backwards that run through a stoker-compiled
    forward, ``"all"`` every backward.  Replaces an earlier default; returns its
    `Session`.  `clear_default()` removes it."""
    _check_scope(scope)
    _install()
    session = _session(compiler, dynamic, recompile_limit)
    _STATE.default = _Entry(scope, session, "set_default()", _caller())
    _update_idle()
    return session


def clear_default() -> None:
    """Remove the process-wide scope (the open blocks stay)."""
    _STATE.default = None
    _update_idle()


def default_session() -> Session | None:
    """The `Session` of the process-wide scope (None: none set)."""
    return None if _STATE.default is None else _STATE.default.session


def clear_cache() -> None:
    """Forget every captured backward (the engine's cache).  Inside a backward that stoker
    is compiling this happens before the next one instead."""
    why = "clear_cache() was called"
    if _STATE.routed is not None:
        _STATE.clear_pending = _STATE.clear_pending or why
        return
    _hook.clear_cache()
    recapture.cache_cleared(why)
    _STATE.owner = None
    _STATE.clear_pending = None


def is_enabled() -> bool:
    """Whether a backward run now may be compiled (an `enable()`/`on()` block, or the
    default scope, and no `disabled()` inside it)."""
    entry = _STATE.stack[-1] if _STATE.stack else _STATE.default
    return entry is not None and entry.kind != "off"


def _compiles_stoker_backwards() -> bool | None:
    """For stoker-capture's forward: will this Function's backward be compiled?"""
    entry = _STATE.stack[-1] if _STATE.stack else _STATE.default
    if entry is None:
        return None  # stoker is not in charge: the engine hook decides (torch's, if any)
    return entry.kind != "off"


# ------------------------------------------------------------------ the router
class _Router:
    """``Variable._execution_engine``: the real engine, with stoker's hook set around the
    backwards stoker compiles."""

    __slots__ = ("_real",)

    def __init__(self, real: Any) -> None:
        self._real = real

    def run_backward(self, t_outputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        if _STATE.idle:
            return self._real.run_backward(t_outputs, *args, **kwargs)
        return _route(self._real, t_outputs, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _install() -> None:
    """Put the router in place (once; it stays: with no scope it only forwards)."""
    engine = Variable._execution_engine
    if isinstance(engine, _Router):
        return
    Variable._execution_engine = _Router(engine)  # type: ignore[assignment]


def _route(real: Any, t_outputs: Sequence[Any], args: Any, kwargs: Any) -> Any:
    st = _STATE
    entry = st.stack[-1] if st.stack else st.default
    if entry is None or _EAGER_DEPTH[0]:  # (a hook's backward in a compiled one: eager)
        return real.run_backward(t_outputs, *args, **kwargs)
    if entry.kind == "off":
        return _run_eager(real, t_outputs, args, kwargs)
    if _in_functorch_transform():
        return real.run_backward(t_outputs, *args, **kwargs)
    if entry.kind == "compiled" and not holds_stoker_node(t_outputs):
        return real.run_backward(t_outputs, *args, **kwargs)
    if torch._C._len_torch_dispatch_stack():
        _eager_under_dispatch_mode()
        return real.run_backward(t_outputs, *args, **kwargs)
    assert entry.session is not None
    try:
        return _run_compiled(real, entry, t_outputs, args, kwargs)
    except _Unkeyable as e:
        _note_unkeyable(e)
        return _run_eager(real, t_outputs, args, kwargs)


def _in_functorch_transform() -> bool:
    """Inside a functorch transform (``torch.func.grad``, ``vjp``, ``jacrev``, ``vmap``):
    its backward runs on wrapped tensors at a transform level, which compiled autograd
    cannot capture; the eager engine runs it, as it does for torch's own compiled
    autograd. (The other places torch asks the engine for its plain path, AOTAutograd's
    joint trace and Inductor's compile, trace under a dispatch mode: see `_route`.)"""
    return torch._C._functorch.maybe_current_level() is not None


_NOTED_MODES: set[str] = set()


def _eager_under_dispatch_mode() -> None:
    """A backward under a dispatch mode (a tracer's fake or proxy mode, FlopCounterMode, a
    logging mode) runs on the eager engine: the engine's compiled path refuses every
    dispatch mode.  Said once per kind of mode, on ``stoker.autograd``."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    names = ", ".join(sorted({type(m).__name__ for m in _get_current_dispatch_mode_stack()}))
    if names not in _NOTED_MODES:
        _NOTED_MODES.add(names)
        _log.info(
            "a backward under %s runs on the eager engine (compiled autograd does not "
            "support dispatch modes)",
            names,
        )


_KINDS: dict[type, bool] = {}  # autograd node type -> is a stoker-compiled forward's node


def holds_stoker_node(roots: Sequence[Any]) -> bool:
    """Whether the autograd graph behind ``roots`` (tensors or ``GradientEdge``s) holds a
    node of a stoker-compiled forward: breadth first from the roots, stopping at the
    first (a loss is a few nodes from the model's output); the whole graph when there is
    none, unless no such node is alive at all (O(1))."""
    if not _LIVE[0]:
        return False
    todo: deque[Any] = deque()
    for r in roots if isinstance(roots, list | tuple) else (roots,):
        fn = r.grad_fn if isinstance(r, torch.Tensor) else r[0]  # a GradientEdge: (node, nr)
        if fn is not None:
            todo.append(fn)
    seen = set(todo)
    kinds = _KINDS
    while todo:
        fn = todo.popleft()
        t = type(fn)
        k = kinds.get(t)
        if k is None:
            k = kinds[t] = (
                getattr(getattr(fn, "_forward_cls", None), "_stoker_aot", None) is not None
            )
        if k:
            return True
        for nxt, _ in fn.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def _run_eager(real: Any, t_outputs: Sequence[Any], args: Any, kwargs: Any) -> Any:
    """`disabled()`: the eager engine, also where another implementation set the hook.

    The hook is read and swapped under the lock (a compiled backward on another thread
    holds it while stoker's hook is set), but the backward runs outside it: a backward
    that this one's hooks start on another thread (reentrant checkpointing on a device
    thread) must not wait for it."""
    st = _STATE
    with st.lock:
        prior = _hook.set_autograd_compiler(None, False)
    if prior[0] is None:  # nothing was set (stoker's hook never is, outside its calls)
        return real.run_backward(t_outputs, *args, **kwargs)
    try:
        return real.run_backward(t_outputs, *args, **kwargs)
    finally:
        with st.lock:
            _hook.set_autograd_compiler(*prior)


def _prepare_cache(session: Session) -> None:
    """Before a compiled backward: clear the engine's cache if its graphs were compiled
    for something else (and say why, for the recaptures that follow)."""
    st = _STATE
    why = st.clear_pending
    config = session.config()
    if why is None and st.owner is not None and st.owner != config:
        why = _config_change(st.owner, config)
    elif why is None and st.owner is None and not _hook.is_cache_empty():
        why = "it held graphs stoker did not capture"
    if why is not None:
        _hook.clear_cache()
        recapture.cache_cleared(why)
        st.clear_pending = None
    st.owner = config


def _config_change(old: tuple[Any, bool, int], new: tuple[Any, bool, int]) -> str:
    changes = []
    if old[0] is not new[0]:
        changes.append(f"compiler {_name(old[0])} -> {_name(new[0])}")
    if old[1] != new[1]:
        changes.append(f"dynamic {old[1]} -> {new[1]}")
    if old[2] != new[2]:
        changes.append(f"recompile_limit {old[2]} -> {new[2]}")
    return "compiled for another " + ", ".join(changes)


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _run_compiled(
    real: Any, entry: _Entry, t_outputs: Sequence[Any], args: Any, kwargs: Any
) -> Any:
    st = _STATE
    session = entry.session
    assert session is not None
    with st.lock:
        prior_frame = _set_eval_frame(None)  # Dynamo must not trace stoker's callbacks
        try:
            prior: tuple[Any, bool] = _hook.set_autograd_compiler(_factory, session.dynamic)  # type: ignore[arg-type]
            try:
                if prior[0] is _factory:  # never left set; if it was, leave it unset
                    prior = (None, False)
                elif prior[0] is not None:  # another implementation's hook is set now
                    if entry is st.default:  # and stoker was not asked explicitly: theirs
                        _hook.set_autograd_compiler(*prior)
                        # a backward called inside theirs (a hook's) runs eagerly, as
                        # torch's own compiled autograd runs its graph (`_route`)
                        _EAGER_DEPTH[0] += 1
                        try:
                            return real.run_backward(t_outputs, *args, **kwargs)
                        finally:
                            _EAGER_DEPTH[0] -= 1
                    st.clear_pending = "another compiled-autograd compiler was registered"
                _prepare_cache(session)
                return _run_registered(real, session, t_outputs, args, kwargs)
            finally:
                _hook.set_autograd_compiler(*prior)
        finally:
            _set_eval_frame(prior_frame)


def _run_registered(
    real: Any, session: Session, t_outputs: Sequence[Any], args: Any, kwargs: Any
) -> Any:
    st = _STATE
    runs, captures, compiles = _RUNS[0], STATS.captures, STATS.compiles
    multithreading = torch._C._is_multithreading_enabled()
    torch._C._set_multithreading_enabled(False)  # compiled autograd runs on this thread
    st.routed = session
    # _engine_run_backward passes (grad_tensors, keep_graph, create_graph, inputs, ...)
    keep = args[1] if len(args) > 1 else kwargs.get("keep_graph", True)
    RELEASE_NODES[0] = not keep
    try:
        out = real.run_backward(t_outputs, *args, **kwargs)
    except Exception as e:
        if _RUNS[0] == runs and STATS.captures == captures and _raised_by_a_key(e):
            raise _Unkeyable(e) from e  # nothing ran yet: the eager engine runs it
        raise
    finally:
        RELEASE_NODES[0] = False
        st.routed = None
        torch._C._set_multithreading_enabled(multithreading)
    if _RUNS[0] == runs:  # the engine replayed a graph of another compiled-autograd compiler
        st.clear_pending = "it held a graph of another compiled-autograd compiler"
    if STATS.captures != captures or STATS.compiles != compiles:
        _mirror(STATS.captures - captures, STATS.compiles - compiles)
    return out


class _Unkeyable(Exception):
    """The engine could not key a node of the graph (its ``_compiled_autograd_key``
    raised) before anything ran; ``__cause__`` is what it raised."""


_NOTED_UNKEYABLE: set[str] = set()


def _raised_by_a_key(e: BaseException) -> bool:
    """True when ``e`` came out of a Function's ``_compiled_autograd_key``: the engine
    reads those while it looks the graph up in its cache, before any node runs.  torch's
    double-backward stub (``CompiledFunctionBackward``, left in the graph by a
    ``create_graph`` backward through a torch.compile'd forward) reuses its forward's
    key, which reads a ``ctx.symints`` the stub's ctx does not have."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name == "_compiled_autograd_key"


def _note_unkeyable(e: _Unkeyable) -> None:
    cause = f"{type(e.__cause__).__name__}: {e.__cause__}"
    if cause not in _NOTED_UNKEYABLE:
        _NOTED_UNKEYABLE.add(cause)
        warnings.warn(
            "stoker-autograd: a backward runs on the eager engine: the compiled-autograd "
            f"engine could not key one of its autograd nodes ({cause})",
            stacklevel=2,
        )


def _mirror(captures: int, compiles: int) -> None:
    """Count captures and compiles in ``torch._dynamo.utils.counters["compiled_autograd"]``
    as torch's compiled autograd does (when torch._dynamo is loaded already)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return
    counters["compiled_autograd"]["captures"] += captures
    counters["compiled_autograd"]["compiles"] += compiles


def _not_traced(*fns: Callable[..., Any]) -> None:
    """Dynamo runs these as they are (no trace): a backward called inside a
    ``torch.compile``d function runs in a graph break, where every frame that starts
    is traced unless told."""
    ef = torch._C._dynamo.eval_frame
    action = getattr(ef, "_FrameAction", None)
    strategy = getattr(ef, "_FrameExecStrategy", None)
    setter = getattr(ef, "set_code_exec_strategy", None)
    if action is None or strategy is None or setter is None:
        return
    for fn in fns:
        setter(fn.__code__, strategy(action.SKIP, action.DEFAULT))


_not_traced(
    _Router.run_backward,
    _Router.__getattr__,
    _route,
    _in_functorch_transform,
    _eager_under_dispatch_mode,
    holds_stoker_node,
    _run_eager,
    _run_compiled,
    _run_registered,
)
_runtime_fn.COMPILED_AUTOGRAD_PROBE[:] = [_compiles_stoker_backwards]


# ------------------------------------------------------------------ counters
def stats() -> dict[str, int]:
    """Counters: captures, cache_hits, compiles, recompiles, eager_runs, fallbacks, segments."""
    return STATS.as_dict()


def cache_outcomes() -> dict[str, int]:
    """The warm-start cache's outcomes in this process: ``hit``, ``miss (why)``,
    ``uncacheable (why)``, ``write`` (docs/autograd.md, "Warm start")."""
    from . import graphstore

    return dict(graphstore.outcomes)


def recompile_reasons() -> list[str]:
    """Why each backward was compiled again since `reset_stats()` (one line per recompile,
    naming the graph, what changed in user terms (``dim 0 of saved tensor 0 of
    PowBackward0 changed 3 -> 5``) and the guard that failed with the value seen)."""
    return list(RECOMPILE_REASONS)


def recapture_reasons() -> list[str]:
    """Why each backward was captured again since `reset_stats()` (one line per
    recapture, naming the graph and how its autograd nodes differ from the closest
    earlier capture: ``AccumulateGrad of fc1.weight: .grad None -> .grad set``,
    ``no longer: AccumulateGrad of head.bias [.grad set]``; or why stoker cleared the
    engine's cache: ``the engine's cache was cleared (compiled for another compiler
    ...)``)."""
    return list(recapture.RECAPTURE_REASONS)


def reset_stats() -> None:
    """Zero the counters and forget the reasons (and the captures they compare with)."""
    for k in STATS.as_dict():
        setattr(STATS, k, 0)
    RECOMPILE_REASONS.clear()
    recapture.reset()
