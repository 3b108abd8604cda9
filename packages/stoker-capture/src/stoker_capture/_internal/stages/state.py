"""Stage 0: `create_aot_state` fakeifies the inputs and learns what the function does.

It runs the function once, functionalized, on fake inputs and records the
forward metadata every later stage needs: which inputs it mutates (data or
metadata), which outputs alias inputs or each other, which outputs require
grad.  Nothing is traced into a graph yet.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from stoker_shapes import Dim, ShapeContext, Source

from ..config import AOTConfig
from ..errors import UnsupportedError
from ..tracing.forward_meta import (
    _SYM,
    ForwardMeta,
    InputInfo,
    InputKind,
    Layout,
    OutputInfo,
    OutputKind,
    captured_tensor_error,
    forward_meta,
)
from ..tracing.torch_fixes import torch_decompositions_fixed

__all__ = [
    "AOTState",
    "ForwardMeta",
    "InputInfo",
    "InputKind",
    "Layout",
    "OutputInfo",
    "OutputKind",
    "captured_tensor_error",
    "create_aot_state",
]


@dataclass(slots=True)
class AOTState:
    """Everything the stages share: the fake inputs, the shape context, the metadata.

    ``flat_fn(*primals)`` is the function over flat inputs (parameters and
    buffers first, then user inputs); it returns the flat user outputs.
    """

    flat_fn: Callable[..., list[Any]]  # primals -> flat user outputs
    fake_primals: list[Any]  # fake tensors / SymInts, one per primal
    meta: ForwardMeta  # mutations, aliasing, requires_grad
    ctx: ShapeContext  # fake mode + shape env: every stage adds its guards here
    config: AOTConfig  # the knobs
    stack: contextlib.ExitStack  # context managers that live as long as the pipeline
    joint: bool  # capture forward + backward (else inference)
    in_spec: pytree.TreeSpec  # structure of (args, kwargs)
    leaf_template: list[Any]  # flat (args, kwargs) leaves: constants, None where a primal goes
    user_positions: list[int]  # leaf index of each user primal
    num_params: int  # parameters + buffers at the front of the primals
    module: torch.nn.Module | None = None  # the module whose parameters were lifted (if any)
    name: str = "fn"  # for messages
    # per positional then keyword argument: the `Dim` of each dynamic dim (export's dynamic_shapes)
    dynamic_dims: list[dict[int, Dim] | None] = field(default_factory=list)

    def as_text(self) -> str:
        kind = "joint" if self.joint else "inference"
        return (
            f"AOTState({self.name}, {kind}, policy={self.ctx.policy.value})\n{self.meta.as_text()}"
        )

    def __str__(self) -> str:
        return self.as_text()

    def flat_user_inputs(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        """The user primals of a call, in primal order (the guards checked the structure)."""
        if not kwargs and self.in_spec.num_leaves == len(args) == len(self.leaf_template):
            return [args[p] for p in self.user_positions]  # flat positional call: no pytree
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        return [leaves[p] for p in self.user_positions]

    def param_getter(self) -> Callable[[], list[Any]]:
        """Reads the parameters and buffers by path at call time (a replaced one is seen)."""
        if self.module is None or self.num_params == 0:
            return list
        paths = [qualname(inp.source) for inp in self.meta.inputs[: self.num_params]]
        get = operator.attrgetter(*paths)
        module = self.module
        if len(paths) == 1:
            return lambda: [get(module)]
        return lambda: list(get(module))


def qualname(src: Source) -> str:
    """``self.layers[0].weight`` -> ``layers.0.weight``."""
    keys: list[str] = []
    node: Source | None = src
    while node is not None and node.base is not None:
        keys.append(str(node.key))
        node = node.base
    return ".".join(reversed(keys))


DynamicShapes = Sequence[Any] | Mapping[str, Any] | None


def create_aot_state(
    fn: Callable[..., Any] | torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    config: AOTConfig,
    stack: contextlib.ExitStack,
    *,
    ctx: ShapeContext | None = None,
    dynamic_shapes: DynamicShapes = None,
    fake_args: tuple[Sequence[Any], Mapping[str, Any]] | None = None,
    meta: ForwardMeta | None = None,
) -> AOTState:
    """Fakeify the inputs and run ``fn`` once, functionalized, to learn its forward metadata.

    ``fn`` may be an ``nn.Module``: its parameters and buffers become the first
    primals (lifted with ``torch.func.functional_call``).  ``ctx`` is the
    frontend's `ShapeContext` (e.g. adopted from Dynamo); otherwise one is made
    with ``config.dynamic``.  ``dynamic_shapes`` gives a spec per argument
    (a dict or list of `Dim` per tensor), as ``torch.export`` does.
    ``fake_args`` are already-fake inputs (the frontend's); then ``args`` are
    only used for their structure.  ``meta``: the forward metadata of an earlier
    run of the same function on inputs like these (the captured-graph cache's):
    the function is not run.
    """
    kwargs = dict(kwargs or {})
    ctx = ctx if ctx is not None else ShapeContext(policy=config.dynamic)
    module = fn if isinstance(fn, torch.nn.Module) else None
    name = _name_of(fn, module)

    # parameters and buffers: lifted as the first primals, guarded as self.<path>
    params = dict(module.named_parameters()) if module is not None else {}
    buffers = dict(module.named_buffers()) if module is not None else {}
    inputs: list[InputInfo] = []
    fake_primals: list[Any] = []
    for kind, group in ((InputKind.PARAMETER, params), (InputKind.BUFFER, buffers)):
        for pname, p in group.items():
            _check_plain(p, Source.module_path(pname))
            if config.guard_params:
                fake = ctx.fakeify(p, Source.module_path(pname), is_param=True)
            else:
                fake = ctx.fake_mode.from_tensor(p, static_shapes=True)
            fake_primals.append(fake)
            inputs.append(InputInfo("", kind, Source.module_path(pname), True, p.requires_grad))
    pb_names = [*params, *buffers]

    # user inputs: fakeified per argument (each with its dynamic spec)
    specs = _bind_dynamic_shapes(fn, args, kwargs, dynamic_shapes)
    if fake_args is None:
        fargs = [
            ctx.fakeify(a, Source.arg(i), _no_sym_float(a, specs[0][i])) for i, a in enumerate(args)
        ]
        fkwargs = {
            k: ctx.fakeify(v, Source.kwarg(k), _no_sym_float(v, specs[1].get(k)))
            for k, v in kwargs.items()
        }
    else:
        fargs, fkwargs = list(fake_args[0]), dict(fake_args[1])
    leaves, in_spec = pytree.tree_flatten((tuple(fargs), fkwargs))
    sources = _leaf_sources(args, kwargs)
    user_positions = [i for i, v in enumerate(leaves) if isinstance(v, (torch.Tensor, *_SYM))]
    template = [None if i in user_positions else v for i, v in enumerate(leaves)]
    for pos in user_positions:
        v = leaves[pos]
        _check_plain(v, sources[pos])
        is_t = isinstance(v, torch.Tensor)
        inputs.append(
            InputInfo("", InputKind.USER, sources[pos], is_t, bool(is_t and v.requires_grad))
        )
        fake_primals.append(v)
    for k, inp in enumerate(inputs):
        inp.name = f"primals_{k + 1}"
    n_pb = len(pb_names)
    out_specs: list[pytree.TreeSpec] = []

    def flat_fn(*primals: Any) -> list[Any]:
        leaves = list(template)
        for pos, v in zip(user_positions, primals[n_pb:]):
            leaves[pos] = v
        a, kw = pytree.tree_unflatten(leaves, in_spec)
        if module is not None:
            pb = dict(zip(pb_names, primals[:n_pb]))
            out = torch.func.functional_call(module, pb, tuple(a), kw, strict=False)
        else:
            out = fn(*a, **kw)
        flat, spec = pytree.tree_flatten(out)
        out_specs.append(spec)
        return flat

    joint = _wants_joint(config, inputs)
    # nn.MultiheadAttention and nn.TransformerEncoderLayer take a fused "fast
    # path" in eval mode whose ops (`_transformer_encoder_layer_fwd`) have no
    # fake kernel on torch 2.11: trace their standard path, the same graph on
    # every torch version (the numbers agree with eager's fast path).
    stack.enter_context(_mha_fastpath_disabled())
    stack.enter_context(_lstm_hidden_shape_fixed())
    stack.enter_context(torch_decompositions_fixed())  # torch's wrong decompositions
    stack.enter_context(_saved_tensors_hooks_deferred())
    if joint and _may_run_rnn(fn):
        # The CPU LSTM's oneDNN path saves a workspace its fake kernel cannot describe;
        # trace the portable decomposition instead, for as long as the pipeline runs.
        # Only then: with oneDNN off, a convolution's fake output takes the layout of
        # another backend (NCHW for a channels-last input), not the one it runs with.
        stack.enter_context(_mkldnn_disabled())
    if meta is None:
        meta = forward_meta(flat_fn, fake_primals, inputs, ctx, joint)
        meta.out_spec = out_specs[-1]
    return AOTState(
        flat_fn,
        fake_primals,
        meta,
        ctx,
        config,
        stack,
        joint,
        in_spec,
        template,
        user_positions,
        n_pb,
        module,
        name,
        [_dims_of(s) for s in (*specs[0], *specs[1].values())] if fake_args is None else [],
    )


def _no_sym_float(value: Any, spec: Any) -> Any:
    """Python floats are specialized (as Dynamo does): a float that changes recompiles.

    A symbolic float would be a graph input the backward may need, and no
    partitioner can recompute an input; a constant is baked into the graph.
    """
    return False if isinstance(value, float) and spec is None else spec


def _dims_of(spec: Any) -> dict[int, Dim] | None:
    """The named dims of one argument's dynamic spec (a dict or list of `Dim`)."""
    if isinstance(spec, Mapping):
        return {int(d): v for d, v in spec.items() if isinstance(v, Dim)} or None
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return {d: v for d, v in enumerate(spec) if isinstance(v, Dim)} or None
    return None


def _name_of(fn: Any, module: torch.nn.Module | None) -> str:
    """What errors and reports call the function: a Dynamo graph (a GraphModule of a
    class made per graph, ``GraphModule.__new__.<locals>.GraphModuleImpl``) by its
    compile id, as ``TORCH_LOGS`` and stoker's report name it."""
    if module is None:
        return str(getattr(fn, "__qualname__", "fn"))
    name = type(fn).__qualname__
    if isinstance(fn, torch.fx.GraphModule) and "<locals>" in name:
        cid = torch._guards.CompileContext.current_compile_id()
        return "Dynamo graph" if cid is None else f"Dynamo graph {cid}"
    return name


@contextlib.contextmanager
def _saved_tensors_hooks_deferred() -> Iterator[None]:
    """The caller's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``:
    non-reentrant checkpointing's recomputation, CPU offloading) do not see the tensors
    our tracing saves: they run at run time, around the compiled Function, as they do
    around eager ops.  A compile inside a checkpoint's recomputation otherwise fed the
    fake tensors of the trace to the checkpoint's hook, which stopped the trace with
    its ``_StopRecomputationError``."""
    set_tracing = getattr(torch._C._autograd, "_saved_tensors_hooks_set_tracing", None)
    if set_tracing is None:  # older torch: nothing to defer
        yield
        return
    prior = set_tracing(True)
    try:
        yield
    finally:
        set_tracing(prior)


@contextlib.contextmanager
def _mha_fastpath_disabled() -> Iterator[None]:
    prev = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(prev)


@contextlib.contextmanager
def _lstm_hidden_shape_fixed() -> Iterator[None]:
    """torch 2.11's LSTM decomposition (`one_layer_lstm`, traced whenever oneDNN is
    off or the input needs grad) returns each layer's final hidden state as
    `hx.squeeze(1)`: for a batch > 1 that keeps a leading 1 and `h_n` comes out
    `(layers, 1, batch, hidden)`. torch 2.13 squeezes dim 0. While the pipeline
    runs, reshape the per-layer states to the shape they came in with."""
    from torch._decomp import decompositions as decomp

    orig = getattr(decomp, "one_layer_lstm", None)
    if orig is None or torch_version() >= (2, 12):
        yield
        return

    def one_layer_lstm(
        inp: Any, hidden: Any, params: Any, has_biases: Any, reverse: bool = False
    ) -> Any:
        out, (h, c) = orig(inp, hidden, params, has_biases, reverse)
        return out, (h.reshape(hidden[0].shape), c.reshape(hidden[1].shape))

    decomp.one_layer_lstm = one_layer_lstm
    try:
        yield
    finally:
        decomp.one_layer_lstm = orig


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


_RNN_FUNCTIONS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})


def _may_run_rnn(fn: Callable[..., Any] | torch.nn.Module) -> bool:
    """Whether ``fn`` may run a recurrent layer (oneDNN's RNN kernels): a module that
    holds one, or a graph that calls one; any other function may."""
    if isinstance(fn, torch.fx.GraphModule):
        return any(
            n.op == "call_function" and getattr(n.target, "__name__", "") in _RNN_FUNCTIONS
            for n in fn.graph.nodes
        ) or any(isinstance(m, torch.nn.RNNBase) for m in fn.modules())
    if isinstance(fn, torch.nn.Module):
        return any(isinstance(m, torch.nn.RNNBase) for m in fn.modules())
    return True


@contextlib.contextmanager
def _mkldnn_disabled() -> Iterator[None]:
    prev = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(prev)


def _wants_joint(config: AOTConfig, inputs: list[InputInfo]) -> bool:
    if config.mode == "joint":
        return True
    if config.mode == "inference":
        return False
    return torch.is_grad_enabled() and any(i.requires_grad for i in inputs)


def _check_plain(v: Any, source: Source) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(v, torch.Tensor) and type(v) not in (
        torch.Tensor,
        torch.nn.Parameter,
        torch.nn.Buffer,
        FakeTensor,
    ):
        if not isinstance(v, torch.nn.Parameter):
            raise UnsupportedError(
                f"{source.name}: tensor subclass {type(v).__qualname__} is not supported by "
                "stoker-capture; pass a plain torch.Tensor (e.g. t.as_subclass(torch.Tensor))"
            )


def _leaf_sources(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Source]:
    from stoker_shapes import tree_sources

    out = [s for s, _ in tree_sources(tuple(args), Source.root("args"))]
    out += [s for s, _ in tree_sources(dict(kwargs), Source.root("kwargs"))]
    return out


def _bind_dynamic_shapes(
    fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any], dynamic_shapes: DynamicShapes
) -> tuple[list[Any], dict[str, Any]]:
    """Per-argument dynamic specs from a torch.export-style ``dynamic_shapes``."""
    if dynamic_shapes is None:
        return [None] * len(args), {}
    if isinstance(dynamic_shapes, Mapping):
        import inspect

        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        try:
            bound = inspect.signature(target).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"dynamic_shapes: could not bind the arguments: {e}") from e
        names = list(bound.arguments)
        unknown = set(dynamic_shapes) - set(names)
        if unknown:
            raise TypeError(
                f"dynamic_shapes names {sorted(unknown)}, which are not arguments "
                f"of {getattr(target, '__qualname__', target)} (arguments: {names})"
            )
        pos = [dynamic_shapes.get(n) for n in names[: len(args)]]
        return pos, {k: dynamic_shapes.get(k) for k in kwargs}
    specs = list(dynamic_shapes)
    if len(specs) != len(args):
        raise TypeError(
            f"dynamic_shapes has {len(specs)} entries for {len(args)} positional "
            "arguments; give one spec (or None) per argument"
        )
    return specs, {}
