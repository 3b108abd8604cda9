"""Capture: stoker's compiler instance for torch's compiled-autograd engine hook.

On an engine-cache miss the C++ engine builds one `CaptureInstance` and calls its
methods by name while it walks the autograd graph with dummy tensors (see
TORCH_NOTES.md, "Compiled autograd engine hook").  Each call appends nodes to one
captured graph whose placeholders are ``inputs, sizes, scalars, hooks, packed_data``,
kept as a `graph.Walk` (a record per node, no ``fx.Node`` yet: a warm-start hit is
keyed on the records and never makes the FX graph):

* built-in nodes: a call of their functional backward (`ops.BoundBackward`);
* custom ``autograd.Function``: an opaque `ops.call_backward` with the real ctx,
  unless it is stoker-capture's own AOT backward, which is inlined (`aot_inline`);
* hooks: opaque `ops.call_hook` nodes tagged ``hook_type=``;
* accumulate-grad: opaque `ops.accumulate_grad`.

`end_capture` hands the walk to the ``finish`` callable the engine passed in
(`runtime.finish_capture`: a `runtime.CompiledBackward`, which looks it up in the
warm-start cache, or makes its FX graph, runs the reordering passes, retraces it to
core aten with real shapes and compiles it).  Capture
imports no later stage.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import sympy
import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    PythonKeyTracer,
    _ProxyTensor,
    disable_autocast_cache,
    disable_proxy_modes_tracing,
    fetch_object_proxy,
    set_proxy_slot,
    track_tensor_tree,
)
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, _suppress_guards
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._thunk import Thunk

from stoker_shapes import timing
from stoker_shapes._internal.plain import PLAIN_TYPES

from . import ops, recapture
from .aot_inline import inline_aot_backward, stoker_aot_info
from .forward_dims import ForwardDims
from .functions import function_key, function_name, is_torch_compiled
from .graph import PLACEHOLDERS, Walk, WalkNode, contiguous_strides, fake_tensor
from .origins import Origins
from .session import Session

Captured = tuple[torch.nn.Module, Walk, str]  # (root, the graph as captured, name)
Finish = Callable[
    [
        Session,
        Captured,
        dict[sympy.Symbol, tuple[str, int]],  # capture symbol -> (list, index)
        int,  # the capture's id
        Mapping[tuple[str, int], str] | None,  # what each input source is (`origins`)
        ForwardDims | None,
    ],
    tuple[Callable[..., Any], Any],
]
"""What `end_capture` hands the captured graph to: a later stage (the runtime's
`finish_capture`, passed in by the engine) that returns what the engine calls on every
backward, ``(runtime_wrapper, compiled_fn)``."""
_COUNTER = itertools.count()
# graph arguments taken as they are (what the tracer's ``create_arg`` does with them)
_PLAIN = frozenset(PLAIN_TYPES)


class CaptureInstance:
    """One capture of one backward graph (built by the engine through ``factory()``)."""

    def __init__(self, session: Session, finish: Finish) -> None:
        self._t0 = timing.start()  # the capture's mark (the engine makes one per capture)
        self.session = session
        self.finish = finish
        self.stack = contextlib.ExitStack()
        self.shape_env = ShapeEnv()
        self.fake_mode = FakeTensorMode(
            allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=self.shape_env
        )
        self.tracer = PythonKeyTracer()
        self.proxy_mode = ProxyTorchDispatchMode(self.tracer, "symbolic")
        self.sym_sources: dict[
            sympy.Symbol, tuple[str, int]
        ] = {}  # capture symbol -> (list, index)
        # (the graph's last node when the engine began the autograd node, its name as
        # messages show it, its name as eager's engine names it, call index): a node
        # object, not a position, since a lifted size's item is inserted at the top later
        self.origin_marks: list[tuple[WalkNode, str, str, int]] = []
        self.aot_counts: dict[int, int] = {}
        self.origins = Origins([], self.sym_sources)  # set per capture by begin_capture
        # the sizes an inlined AOT backward's forward held symbolic (set by begin_capture)
        self.forward_dims = ForwardDims([], self.sym_sources)
        # id(gradient an inlined AOT backward returned) -> (it, the forward's sizes of it)
        self._forward_grad_sizes: dict[int, tuple[torch.Tensor, list[Any]]] = {}
        self.id = -1
        # the autograd nodes walked, in order (`recapture`: why a capture happened again)
        self.signature: list[str] = []
        self._real: dict[int, torch.Tensor] = {}  # id(fake input) -> the engine's tensor

    def close(self) -> None:
        self.stack.close()

    # ---------------------------------------------------------------- begin
    def begin_capture(
        self,
        inputs: list[torch.Tensor],
        sizes: list[int],
        scalars: list[int | float],
        origins: list[list[tuple[int, str]]],
        *rest: Any,  # torch 2.13: accumulate_grad, check_nans
    ) -> tuple[str, list[torch.Tensor], list[Any], list[Any]]:
        self.id = next(_COUNTER)
        self.session.stats.captures += 1
        self.tracer.root = torch.nn.Module()
        # the tracer (and the proxy mode through it) makes its nodes in the walk
        self.graph = Walk()
        self.tracer.graph = self.graph  # type: ignore[assignment]
        self.tracer.tensor_attrs = {}
        phs: list[Any] = [
            self.tracer.create_proxy("placeholder", name, (), {}) for name in PLACEHOLDERS
        ]
        args_p, sizes_p, scalars_p, hooks_p, packed_p = phs
        self.hooks_node, self.packed_node = hooks_p.node, packed_p.node
        self.stack.enter_context(enable_python_dispatcher())

        fakes = [self._fake_input(x) for x in inputs]
        self._real = {id(f): x for f, x in zip(fakes, inputs)}
        self.signature = []
        self.origins = Origins(fakes, self.sym_sources)  # for recompile reasons
        self.forward_dims = ForwardDims(fakes, self.sym_sources)
        self._forward_grad_sizes = {}
        self._sym_anchor = packed_p.node
        for i, f in enumerate(fakes):
            self._track(f, node := self._getitem(args_p.node, i))
            self._sym_anchor = node

        # The engine's own size arithmetic is traced too (by the proxy mode, through
        # each symbol's proxy slot).  A symbol's ``sizes[i]`` node is made at its first
        # use: many lifted sizes are never read by the graph.
        sym_sizes = [self._lifted(v, "sizes", i, sizes_p.node) for i, v in enumerate(sizes)]
        sym_scalars = [self._lifted(v, "scalars", i, scalars_p.node) for i, v in enumerate(scalars)]

        self.stack.enter_context(self.fake_mode)
        self.stack.enter_context(self.proxy_mode)
        self.stack.enter_context(disable_autocast_cache())
        self.stack.enter_context(_suppress_guards(self.shape_env))  # capture must not specialize
        return str(self.id), fakes, sym_sizes, sym_scalars

    def _fake_input(self, x: torch.Tensor) -> torch.Tensor:
        """A fake with ``x``'s sizes, strides, dtype and device, built directly.

        Capture reads no more than that (its metadata is dropped at the end; the
        retrace fakeifies the real inputs), so the fake converter's full description
        of ``x`` (view bases, storage, ``.grad``: ~3 ms per input) is not needed.
        """
        if type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter:
            with warnings.catch_warnings():  # the converter reads .grad of non-leaf inputs
                warnings.simplefilter("ignore", UserWarning)
                return self.fake_mode.from_tensor(x)  # a subclass: keep its description
        with disable_proxy_modes_tracing():
            fake = fake_tensor(self.fake_mode, x.shape, x.stride(), 0, x.dtype, x.device)
        if x.requires_grad:
            fake.requires_grad_(True)
        return fake

    def _symbol(self, v: Any, where: str, i: int) -> Any:
        from torch._dynamo.source import GetItemSource, LocalSource

        src = GetItemSource(LocalSource(where), i)
        if isinstance(v, bool):
            raise TypeError(f"stoker-autograd: unexpected bool in {where}[{i}]")
        s: Any
        if isinstance(v, int):
            s = self.shape_env.create_unspecified_symint_and_symbol(v, src, DimDynamic.DYNAMIC)
        elif isinstance(v, float):
            sym = self.shape_env.create_unspecified_symbol(
                v, source=src, dynamic_dim=DimDynamic.DYNAMIC
            )
            s = self.shape_env.create_symfloatnode(sym, hint=v, source=src)
        else:
            raise TypeError(f"stoker-autograd: unexpected {type(v).__name__} in {where}[{i}]")
        if isinstance(s, torch.SymInt | torch.SymFloat) and isinstance(s.node.expr, sympy.Symbol):
            self.sym_sources[s.node.expr] = (where, i)
        return s

    def _lifted(self, v: Any, where: str, i: int, placeholder: WalkNode) -> Any:
        """The symbol of the engine's ``where[i]``, bound to a ``where[i]`` node made at
        its first use."""
        s = self._symbol(v, where, i)
        if isinstance(s, torch.SymInt | torch.SymFloat):
            set_proxy_slot(
                s, self.tracer, Thunk(functools.partial(self._sym_item, s, placeholder, i))
            )
        return s

    def _sym_item(self, s: Any, placeholder: WalkNode, i: int) -> fx.Proxy:
        # among the graph's inputs, where an eager one would be: the reordering passes
        # place nodes relative to their inputs
        with self.graph.inserting_after(self._sym_anchor):
            node = self._getitem(placeholder, i)
        self._sym_anchor = node
        node.meta["val"] = s  # as the tracer's own binding does; dropped at the end
        self.origins.size(s, f"a size read by {self.origins.node}")
        return self._proxy(node)

    # --------------------------------------------------------------- helpers
    def to_proxy(self, t: Any) -> Any:
        if t is None:
            return None
        if isinstance(t, list):
            return [self.to_proxy(x) for x in t]
        if isinstance(t, tuple):
            return tuple(self.to_proxy(x) for x in t)
        if isinstance(t, torch.SymInt | torch.SymFloat):
            if t.node.expr.is_number:
                return int(t) if isinstance(t, torch.SymInt) else float(t)
            return fetch_object_proxy(self.tracer, t).force()  # type: ignore[union-attr]
        if not isinstance(t, torch.Tensor):
            return t
        return fetch_object_proxy(self.tracer, t).proxy  # type: ignore[union-attr]

    # Graph building.  Capture makes its nodes directly in the graph: the tracer's
    # ``create_proxy``/``create_arg`` (generic checks per argument, stack and module
    # metadata) and ``track_tensor_tree`` (a snapshot fake as ``val`` per value, which
    # `end_capture` drops) cost more than the rest of a capture together.
    def _arg(self, a: Any) -> Any:
        """``a`` as an argument of a node: tensors and symbols by their nodes."""
        t = type(a)
        if t in _PLAIN:
            return a
        if t is list:
            return [self._arg(x) for x in a]
        if t is tuple:
            return tuple(self._arg(x) for x in a)
        if t is WalkNode:
            return a
        if isinstance(a, fx.Proxy):
            return a.node
        if isinstance(a, torch.Tensor | torch.SymInt | torch.SymFloat):
            p = self.to_proxy(a)
            return p.node if isinstance(p, fx.Proxy) else p
        return self.tracer.create_arg(a)  # anything else as the tracer takes it

    def _node(
        self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> WalkNode:
        return self.graph.create_node("call_function", fn, self._arg(args), kwargs or {})

    def _getitem(self, node: WalkNode, i: int) -> WalkNode:
        return self.graph.create_node("call_function", operator.getitem, (node, i), {})

    def _proxy(self, node: WalkNode) -> fx.Proxy:
        """A proxy of ``node`` (a proxy holds a walk's node as it would an fx.Node)."""
        return fx.Proxy(cast(fx.Node, node), self.tracer)

    def _track(self, t: Any, node: WalkNode) -> None:
        """Bind the value ``t`` to ``node``: later uses of ``t`` read it."""
        if t is None:
            return
        if (
            type(t) is FakeTensor
            and all(type(n) is int for n in t.shape)
            and all(type(n) is int for n in t.stride())
        ):  # no symbolic size to bind as well
            set_proxy_slot(t, self.tracer, _ProxyTensor(self._proxy(node), None))
        else:
            track_tensor_tree([t], [self._proxy(node)], constant=None, tracer=self.tracer)

    def _track_items(self, values: Sequence[Any], node: WalkNode) -> None:
        """Bind ``values[i]`` to ``node[i]`` (no node for a None)."""
        for i, v in enumerate(values):
            if v is not None:
                self._track(v, self._getitem(node, i))

    def _fake(
        self, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: Any
    ) -> torch.Tensor:
        with _disable_current_modes():  # neither traced nor faked again
            return fake_tensor(self.fake_mode, size, stride, 0, dtype, device)

    def _dummy(self) -> torch.Tensor:
        # odd size: easy to spot if it leaks
        return self._fake((0, 123456789), (123456789, 1), torch.get_default_dtype(), "cpu")

    def _dummy_like(self, x: torch.Tensor) -> torch.Tensor:
        """``torch.empty_like(x)``: built directly for a dense ``x`` of concrete sizes."""
        if (
            type(x) is FakeTensor
            and all(type(n) is int for n in x.shape)
            and all(type(n) is int for n in x.stride())
            and x.numel() > 0
            and ops.is_dense(x)  # empty_like keeps the strides of a dense tensor
        ):
            return self._fake(x.shape, x.stride(), x.dtype, x.fake_device)
        with disable_proxy_modes_tracing():
            return torch.empty_like(x)

    def _call(
        self, fn: Callable[..., Any], args: Any, n_out: int, kwargs: dict[str, Any] | None = None
    ) -> list[torch.Tensor]:
        node = self._node(fn, args, kwargs)
        result = [self._dummy() for _ in range(n_out)]
        self._track_items(result, node)
        return result

    # ----------------------------------------------------- engine: functional
    def set_node_origin(self, node_name: str, nodecall_index: int, pyobj: Any) -> None:
        raw = node_name
        cls = getattr(pyobj, "_forward_cls", None)
        if cls is not None and is_torch_compiled(cls):  # which of torch's compiled functions
            node_name = f"{node_name}[torch.compile aot_id {cls._aot_id}]"
        last = self.graph.last  # the placeholders come first: never the root itself
        self.origin_marks.append((last, node_name, raw, nodecall_index))
        self.origins.node = node_name
        self.signature.append(node_name.removeprefix("torch::autograd::"))

    def bind_function(
        self, fn_name: str, fn: Callable[..., Any], is_custom_function: bool, is_traceable: bool
    ) -> str:
        return ops.REGISTRY.bind(fn_name, fn, is_custom_function, is_traceable)

    def apply_functional(
        self, fn_name: str, grads: Sequence[Any], args: Any, output_metadata: Sequence[Any]
    ) -> list[torch.Tensor]:
        op = ops.REGISTRY.get(fn_name)
        self._note_grads(grads, self.origins.node)
        self.origins.saved(
            args,
            f"a shape saved by {self.origins.node}",
            f"saved tensor {{k}} of {self.origins.node}",
            f"a size saved by {self.origins.node}",
        )
        return self._call(op, (grads, *args), len(output_metadata))

    def _note_grads(self, grads: Sequence[Any], node: str) -> None:
        one = sum(g is not None for g in grads) == 1
        for k, g in enumerate(grads):
            self.origins.tensor(g, f"the gradient {'' if one else f'{k} '}flowing into {node}")

    def validate_outputs(
        self, fn_name: str, outputs: Sequence[Any], args: Any, output_metadata: Sequence[Any]
    ) -> Sequence[Any]:
        op = ops.REGISTRY.get(fn_name)
        metas = args[0] if len(args) == 1 else None
        node = self.origins.node
        for k, meta in enumerate(metas if isinstance(metas, list | tuple) else args):
            self.origins.saved(
                meta,
                f"gradient {k} returned by {node}",
                f"tensor {{k}} checked by {node}",
                f"a size of gradient {k} returned by {node}",
            )
        if isinstance(metas, list | tuple) and len(metas) == len(outputs):
            for out, meta in zip(outputs, metas, strict=True):
                self._note_checked_sizes(out, meta)
        if isinstance(metas, list | tuple) and len(metas) == len(outputs) > 1:
            # One check per gradient (it checks each on its own): then a gradient's
            # accumulate-grad and hooks can move up to it (passes), also out of an
            # inlined AOT backward, where one node yields every gradient.
            for k, out in enumerate(outputs):
                check = self._node(op, ([out], [metas[k]]))
                check.meta["stoker_out_index"] = k  # which output (anomaly mode's message)
                self._track_items([out], check)
            return outputs
        self._track_items(outputs, self._node(op, (outputs, *args)))
        return outputs

    def _note_checked_sizes(self, out: Any, meta: Any) -> None:
        """The check of a gradient an inlined AOT backward returned lifts its sizes again:
        they are the sizes the forward knew (`ForwardDims`), as those of the gradient."""
        forward = self._forward_grad_sizes.get(id(out)) if isinstance(out, torch.Tensor) else None
        if forward is None or forward[0] is not out or not isinstance(meta, list | tuple):
            return
        shape = meta[1] if len(meta) > 1 else None
        if isinstance(shape, list | tuple) and len(shape) == len(forward[1]):
            self.forward_dims.sizes(list(shape), forward[1])

    def accumulate(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        result = self._dummy()
        self._track(result, self._node(torch.add, (old, new)))
        return result

    def accumulate_grad(self, variable: torch.Tensor, *rest: Any) -> torch.Tensor | None:
        # The protocol differs by release; branch on what the engine passed, not on versions:
        #   torch 2.13: (variable, variable_grad, grad, has_post_hooks) -> Tensor
        #   torch 2.11: (variable, grad, has_post_hooks) -> None (reads variable.grad at run time)
        if len(rest) == 3:
            variable_grad, grad, has_post_hooks = rest
            returns = True
        else:
            grad, has_post_hooks = rest
            variable_grad, returns = None, False
        shape = tuple(variable.shape)
        real = self._real.get(id(variable))
        name = recapture.parameter_name(real)
        what = f"the parameter {name}" if name else "the parameter"
        self.origins.tensor(variable, f"{what} of shape {shape} (AccumulateGrad)")
        self.origins.tensor(variable_grad, f"the .grad of {what} of shape {shape}")
        if self.signature:
            param = name if name else f"a parameter of shape {shape}"
            # Whether .grad is set is in the engine's key either way (torch 2.11 collects
            # it without passing it here): read it off the engine's own tensor there.
            if returns:
                held = f" [.grad {'None' if variable_grad is None else 'set'}]"
            elif real is not None:
                held = f" [.grad {'None' if real.grad is None else 'set'}]"
            else:
                held = ""
            self.signature[-1] += f" of {param}{held}"
        self.forward_dims.parameter(variable)
        self.forward_dims.parameter(variable_grad)
        self._note_grads([grad], f"AccumulateGrad (a parameter of shape {shape})")
        node = self._node(
            ops.accumulate_grad, (variable, variable_grad, grad, bool(has_post_hooks))
        )
        result = self._dummy_like(variable)
        self._track(result, node)
        if not returns:
            return None
        variable.grad = result
        return result

    # ------------------------------------------------- engine: custom Function
    def proxy_call_backward(
        self,
        inputs: Sequence[Any],
        output_metadatas: Sequence[Any],
        saved_tensors: Sequence[torch.Tensor],
        backward_idx: int,
        ctx: Any,
        maybe_backward_state_idx: int | None = None,
        opaque_object_indices: Sequence[int] = (),
        *rest: Any,
    ) -> tuple[torch.Tensor | None, ...]:
        cls = ctx._forward_cls
        fn_name = function_name(cls)
        if maybe_backward_state_idx is not None:
            raise NotImplementedError(
                f"stoker-autograd: {fn_name} carries a Dynamo BackwardState, which Dynamo "
                "makes only while torch's own compiled autograd is enabled at compile time "
                "(hooks registered inside the compiled region are then deferred to it). "
                "Compile that forward without torch's compiled autograd enabled (Dynamo then "
                "runs such hooks eagerly), or run its backward under torch's compiled "
                "autograd instead of stoker_autograd.enable()"
            )
        name = f"{fn_name}.backward"
        self._note_grads(inputs, name)
        self.origins.saved(
            saved_tensors,
            f"a shape saved by {name}",
            f"saved tensor {{k}} of {name}",
            f"a size saved by {name}",
        )
        pctx = self._proxy(self._getitem(self.hooks_node, backward_idx))
        pinputs = self.to_proxy(list(inputs))
        psaved = self.to_proxy(list(saved_tensors))
        info = stoker_aot_info(ctx)
        nodes: list[Any] | None = None
        forward_sizes: list[Any] = []
        if info is not None:  # stoker's own AOT backward: inlined where it can be
            proxies = inline_aot_backward(self, info, ctx, pinputs, psaved, output_metadatas)
            if proxies is not None:
                nodes = [None if p is None else p.node for p in proxies]
                forward_sizes = self._note_forward_dims(
                    info, ctx, saved_tensors, output_metadatas, pinputs
                )
        if nodes is None:
            # Any other Function, torch.compile's CompiledFunction (Inductor, aot_eager)
            # included: an opaque call of its real backward with its real ctx.
            call = self._node(ops.call_backward, (pctx, psaved, *pinputs))
            call.meta["stoker_fn"] = fn_name
            call.meta["stoker_fn_key"] = function_key(cls)  # in the key (None: uncacheable)
            call.meta["stoker_out_meta"] = [
                None if m is None else (m[0], m[1], m[2], self._size_exprs(m[3]))
                for m in output_metadatas
            ]
            nodes = [
                None if m is None else self._getitem(call, i)
                for i, m in enumerate(output_metadatas)
            ]
        grads: list[torch.Tensor | None] = []
        for m, node in zip(output_metadatas, nodes, strict=True):
            if m is None or node is None:
                grads.append(None)
                continue
            layout, device, dtype, size = m
            # concrete sizes: a symbolic fake costs ~15 ms here (contiguity through
            # sympy); what follows reads only the node (the retrace has real sizes)
            if layout == torch.strided:
                g = self._fake(_hints(size), contiguous_strides(_hints(size)), dtype, device)
            else:
                with disable_proxy_modes_tracing():
                    g = torch.empty(size=_hints(size), dtype=dtype, layout=layout, device=device)
            self._track(g, node)
            grads.append(g)
        for grad, fs in zip(grads, forward_sizes, strict=False):
            if grad is not None and fs is not None:
                self._forward_grad_sizes[id(grad)] = (grad, fs)
        return tuple(grads)

    def _note_forward_dims(
        self,
        info: Any,
        ctx: Any,
        saved_tensors: Sequence[Any],
        output_metadatas: Sequence[Any],
        grads: Sequence[Any] = (),
    ) -> list[Any]:
        """Which lifted sizes the inlined AOT backward's forward held symbolic: its saved
        symints and tensors (``bw_module``'s placeholders), the gradients it returns, and
        the sizes the engine lifted for a gradient it hands this backward (`_grad_sizes`):
        those are the tangent's sizes in the forward (the engine's ``validate_outputs``
        saw to it).  Returns, per output metadata, the forward's sizes of that gradient
        (or None)."""
        bw: fx.GraphModule = info.bw_module
        phs = [n.meta.get("val") for n in bw.graph.nodes if n.op == "placeholder"]
        ns, nt = int(info.num_saved_symints), int(info.num_saved_tensors)
        symints = list(ctx._get_compiled_autograd_symints()) if ns else []
        self.forward_dims.sizes(symints, phs[:ns])
        for t, v in zip(saved_tensors, phs[ns : ns + nt]):
            if isinstance(v, torch.Tensor):
                self.forward_dims.tensor(t, list(v.shape))
        tangent_of = getattr(ctx._forward_cls, "_stoker_tangent_of", None) or ()
        for g, k in zip(grads, tangent_of, strict=False):
            v = phs[ns + nt + k] if k is not None and ns + nt + k < len(phs) else None
            size = _grad_sizes(getattr(g, "node", None))
            if isinstance(v, torch.Tensor) and size is not None and len(size) == v.dim():
                lifted = [d.meta.get("val") if isinstance(d, WalkNode) else d for d in size]
                self.forward_dims.sizes(lifted, list(v.shape))
        outs = bw.graph.output_node().args[0]
        outs = outs if isinstance(outs, list | tuple) else (outs,)
        vals = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in outs]
        extra = len(output_metadatas) - len(vals)
        out: list[Any] = [None] * extra
        for m, v in zip(output_metadatas[extra:], vals):
            if m is not None and isinstance(v, torch.Tensor):
                self.forward_dims.sizes(list(m[3]), list(v.shape))
                out.append(list(v.shape))
            else:
                out.append(None)
        return out

    def _size_exprs(self, size: Sequence[Any]) -> list[Any]:
        return [s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in size]

    def bind_backward_state(self, index: int) -> Any:
        raise NotImplementedError("stoker-autograd: Dynamo BackwardState is not supported")

    # ----------------------------------------------------------- CopySlices
    def log_compile_reasons(self, compile_reasons: list[str]) -> None:
        """Why the engine missed its cache (kept on the session, newest last)."""
        self.session.capture_reasons.append(list(compile_reasons))
        del self.session.capture_reasons[:-16]

    def call_copy_slices_prologue(self, inputs: Sequence[Any], *meta: Any) -> list[torch.Tensor]:
        if len(meta) == 2:  # an older protocol passes (base, view) geometries
            base, view = meta
            meta = (
                base.sizes(),
                base.strides(),
                base.storage_offset(),
                view.sizes(),
                view.strides(),
                view.storage_offset(),
            )
        return self._call(ops.copy_slices_prologue, (inputs, *meta), 3)

    def call_copy_slices_epilogue(
        self, needs_input_grad: Sequence[bool], result: Any, res: Any, grad_slice: Any
    ) -> list[torch.Tensor]:
        return self._call(
            ops.copy_slices_epilogue,
            (list(needs_input_grad), result, res, grad_slice),
            len(needs_input_grad),
        )

    # ----------------------------------------------------------------- hooks
    def _hook(self, hook_id: int, *args: Any, hook_type: str) -> WalkNode:
        hook = self._getitem(self.hooks_node, hook_id)
        return self._node(ops.call_hook, (hook, *args), {"hook_type": hook_type})

    def tensor_pre_hook(
        self, inputs: list[torch.Tensor], hook_id: int, i: int
    ) -> list[torch.Tensor]:
        node = self._hook(hook_id, inputs[i], hook_type="tensor_pre_hook")
        inputs[i] = self._dummy_like(inputs[i])
        self._track(inputs[i], node)
        return inputs

    def cpp_tensor_pre_hook(
        self, inputs: list[torch.Tensor], hook_id: int, i: int
    ) -> list[torch.Tensor]:
        node = self._node(ops.call_cpp_tensor_pre_hooks, (hook_id, inputs[i]))
        inputs[i] = self._dummy_like(inputs[i])
        self._track(inputs[i], node)
        return inputs

    def pre_hook(self, inputs: Sequence[Any], hook_id: int) -> list[Any]:
        node = self._hook(hook_id, list(inputs), hook_type="pre_hook")
        out = [None if x is None else self._dummy_like(x) for x in inputs]
        self._track_items(out, node)
        return out

    def post_hook(self, outputs: Sequence[Any], inputs: Sequence[Any], hook_id: int) -> list[Any]:
        node = self._hook(hook_id, list(outputs), list(inputs), hook_type="post_hook")
        out = [None if x is None else self._dummy_like(x) for x in outputs]
        self._track_items(out, node)
        return out

    def post_acc_grad_hook(self, input: torch.Tensor, hook_id: int) -> list[torch.Tensor]:
        node = self._hook(hook_id, input, hook_type="post_acc_grad_hook")
        res = [self._dummy_like(input)]
        self._track(res[0], node)
        return res

    def unpack_hook(self, hook_id: int, data_id: int) -> torch.Tensor:
        hook = self._getitem(self.hooks_node, hook_id)
        data = self._getitem(self.packed_node, data_id)
        node = self._node(ops.call_hook, (hook, data), {"hook_type": "unpack_hook"})
        out = self._dummy()
        self._track(out, node)
        return out

    # ------------------------------------------------------------------- end
    def end_capture(self, outputs: Any) -> tuple[Callable[..., Any], Any]:
        self._node(ops.exec_final_callbacks_stub, ())
        self.stack.close()
        self._real = {}
        recapture.note(self.session.signatures, self.signature, f"backward graph {self.id}")
        self.tracer.create_node(
            "output", "output", (self.tracer.create_arg(self.to_proxy(outputs)),), {}
        )
        graph = self.graph
        self._annotate_origins(graph)
        # Capture ran on dummy tensors: their metadata is not the real shapes; drop it.
        for node in graph.nodes:
            for key in ("tensor_meta", "example_value", "val"):
                node.meta.pop(key, None)
        # the FX graph, the reordering passes and the graph module: at the first use of
        # `gm`, which a warm-start cache hit never makes (its key is the walk's text)
        wrapper, compiled = self.finish(
            self.session,
            (self.tracer.root, graph, f"StokerBackward{self.id}"),
            self.sym_sources,
            self.id,
            self.origins.table,
            self.forward_dims,
        )
        self.session.graphs.append(compiled)
        timing.done("autograd capture", self._t0, "", f"backward graph {self.id}")
        return wrapper, compiled

    def _annotate_origins(self, graph: Walk) -> None:
        """Each node's autograd node: ``meta["autograd_node"]`` as messages name it
        (``MulBackward0 (NodeCall 3)``), ``meta["autograd_fn"]`` as eager's engine
        names it (``MulBackward0``; anomaly mode's messages)."""
        after: dict[WalkNode, tuple[str, str]] = {}
        for last, name, raw, call in self.origin_marks:
            after[last] = (f"{name} (NodeCall {call})", raw)  # the last one begun there
        current: tuple[str, str] | None = None
        for node in graph.nodes:
            if current is not None and node.op == "call_function":
                node.meta.setdefault("autograd_node", current[0])
                node.meta.setdefault("autograd_fn", current[1])
            mark = after.get(node)
            if mark is not None:
                current = mark


def _hints(size: Sequence[Any]) -> list[int]:
    """``size`` with each symbolic size replaced by its value at capture."""
    out = []
    for s in size:
        hint = s.node.hint if isinstance(s, torch.SymInt) else s
        out.append(int(hint) if hint is not None else 1)
    return out


def getitem_index(node: fx.Node) -> int | None:
    """``i`` when node is ``x[i]``."""
    if node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1]
        return idx if isinstance(idx, int) else None
    return None


def _grad_sizes(node: Any) -> list[Any] | tuple[Any, ...] | None:
    """The sizes the engine lifted for a gradient it hands an inlined AOT backward (the
    arguments of their nodes), where ``node`` made it: the zeros the engine makes for
    an output that no gradient reached (a transformer's key/value cache the loss does
    not read), or the ``validate_outputs`` check of the node before, which gives a
    gradient exactly the sizes of the input it flows to (through any tensor pre-hook:
    FSDP2's at a block's boundary).  None where another node made it."""
    for _ in range(8):  # a few pre-hooks at most
        if not isinstance(node, WalkNode):
            return None
        if node.target is ops.call_hook and node.kwargs.get("hook_type") == "tensor_pre_hook":
            node = node.args[1] if len(node.args) > 1 else None
            continue
        break
    if not isinstance(node, WalkNode):
        return None
    if node.target is torch.ops.aten.zeros.default:
        size = node.args[0] if node.args else None
        return size if isinstance(size, list | tuple) else None
    if node.target is operator.getitem and isinstance(node.args[1], int):
        check = node.args[0]
        if isinstance(check, WalkNode) and getattr(check.target, "__name__", "") == (
            "validate_outputs"
        ):
            metas = check.args[1] if len(check.args) > 1 else None
            j = node.args[1]
            if isinstance(metas, list | tuple) and j < len(metas):
                meta = metas[j]
                size = meta[1] if isinstance(meta, list | tuple) and len(meta) > 1 else None
                return size if isinstance(size, list | tuple) else None
    return None
