"""How a custom ``autograd.Function`` is named in messages and in the warm-start key.

Every Python ``autograd.Function`` node of a backward is an opaque ``call_backward``
(stoker-capture's own AOT backward is inlined instead, `aot_inline`).  That includes
the backward of a forward that ``torch.compile`` compiled with another backend
(Inductor, ``aot_eager``): torch's ``CompiledFunction``, recognised by ``_aot_id`` on
its class.  The call runs its real backward with its real ctx, as eager's engine
does; nothing of it is traced.

Its class name is the same for every function torch compiles
(``_AOTDispatchAutogradFunctionFactory.build.<locals>.CompiledFunction``) and its
``_aot_id`` is a per-process counter, so neither identifies it across processes.
The warm-start key adds a digest of its backward graph (``bw_module``'s nodes and
constants), which does: two torch-compiled functions never share a key.
(A function loaded from torch's own AOTAutograd cache keeps its backward graph
serialized: it is deserialized once for the digest.)  When torch kept no backward
graph there is no stable identity, and the graph is not stored.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import torch
import torch.fx as fx

_DIGESTS: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()


def is_torch_compiled(cls: Any) -> bool:
    """A Function class made by torch's AOTAutograd (``torch.compile`` with Inductor,
    ``aot_eager``, ...): its backward is torch's compiled backward."""
    return hasattr(cls, "_aot_id")


def function_name(cls: Any) -> str:
    """The Function's name in messages (``MyFn``; ``CompiledFunction[torch.compile aot_id 3]``)."""
    if is_torch_compiled(cls):
        return f"CompiledFunction[torch.compile aot_id {cls._aot_id}]"
    return str(cls.__qualname__)


def function_key(cls: Any) -> str | None:
    """The Function's identity in the warm-start key (None: it has no stable one).

    A user Function: its qualified name (its backward runs live, so another Function
    of the same name at the same place in the same graph computes its own result).
    torch's ``CompiledFunction``: the name plus a digest of its backward graph."""
    base = f"{cls.__module__}.{cls.__qualname__}"
    if not is_torch_compiled(cls):
        return base
    if cls not in _DIGESTS:
        _DIGESTS[cls] = _backward_digest(cls)
    digest = _DIGESTS[cls]
    return None if digest is None else f"{base}#bw={digest}"


def _backward_digest(cls: Any) -> str | None:
    info: Any = getattr(cls, "_lazy_backward_info", None)
    bw = getattr(info, "bw_module", None)
    load = getattr(info, "bw_module_fn", None)
    if bw is None and callable(load):
        try:  # loaded from torch's AOTAutograd cache: the backward graph, deserialized
            bw = load()
        except Exception:
            return None
    if not isinstance(bw, fx.GraphModule):
        return None
    # the graph by structure (nodes by position, not name): the same whether torch
    # kept the module or deserialized it from its cache
    h = hashlib.sha256()
    index: dict[fx.Node, int] = {}
    for i, n in enumerate(bw.graph.nodes):
        index[n] = i
        args = fx.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")  # type: ignore[arg-type, return-value]
        h.update(f"{n.op} {_target(n.target)} {args}\n".encode())
        if n.op == "get_attr":
            v = getattr(bw, str(n.target), None)
            if isinstance(v, torch.Tensor):
                h.update(f"{tuple(v.shape)}:{v.dtype}:{v.device}".encode())
                if v.numel() * v.element_size() <= 1 << 16:  # small constants: by value
                    h.update(
                        v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                    )
    h.update(f"symints={getattr(cls, 'num_symints_saved_for_bw', None)}".encode())
    return h.hexdigest()[:24]


def _target(t: Any) -> str:
    if isinstance(t, str):
        return t
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', None) or t}"
