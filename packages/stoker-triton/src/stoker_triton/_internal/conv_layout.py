"""Channels-last convolutions: a pass over a captured (joint or inference) graph.

oneDNN's convolutions on a CPU are faster on channels-last (NHWC) tensors than on
NCHW ones where their planes are large, and slower where the planes are small and
the channels many (`wants_channels_last` holds the measurements). So each 2-d
convolution of a graph runs in the layout that suits it, whatever layout the
model's tensors have (Inductor runs every convolution channels-last on a CPU):

- each convolution's input and weight, and each convolution backward's gradient,
  input and weight, are cloned into its layout (once per value and layout; none
  where the value already has it); a view (a classifier's flatten) of a value now
  channels-last views an NCHW copy of it, as `reshape` does in eager;
- the fake values of everything downstream are computed again, so that each later
  op sees the layout eager would give it on those inputs. The C kernels store a
  channels-last value channels-last (`TensorValue.stored_stride`), so a
  BatchNorm, an activation or a pooling between two convolutions is computed
  channels-last, in memory order, and the next convolution reads it as it is;
- every output of the graph keeps the layout it had: a user's output, a gradient,
  a mutated buffer. One whose layout changed is copied back (contiguous, or
  channels-last) at the end; if an output's layout is neither, the graph is left
  as it was.

The values saved for backward are intermediate nodes, so the partitioner hands
them over in their new layout, and the backward graph's fake values say so.

Graphs with symbolic sizes are left alone: computing their fake values again could
add guards that capture did not need.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, NamedTuple

import torch
from torch import fx

aten = torch.ops.aten

_Key = tuple[fx.Node, torch.memory_format]  # a value cloned into a layout

log = logging.getLogger("stoker.kernels")

# (op, the argument positions run in the convolution's layout)
_CONV_ARGS: dict[Any, tuple[int, ...]] = {
    aten.convolution.default: (0, 1),
    aten.convolution_backward.default: (0, 1, 2),
}
# views of a value that capture saw contiguous (a classifier's flatten): one whose
# input is now in another layout views an NCHW copy of it, as `reshape` would in eager
_VIEWS = (aten.view.default, aten._unsafe_view.default)


def channels_last_convolutions(gm: fx.GraphModule) -> bool:
    """Run each 2-d convolution of ``gm`` in the layout that suits it: channels-last
    where `wants_channels_last`, else NCHW (see the module's text); True when the
    graph changed. The graph's outputs keep their layouts."""
    graph = gm.graph
    convs = [n for n in graph.nodes if n.op == "call_function" and n.target in _CONV_ARGS]
    if not convs or not all(_plain_cpu_4d(n.args[1].meta.get("val")) for n in convs):
        return False
    if any(_symbolic(n.meta.get("val")) for n in graph.nodes):
        return False
    fake_mode = _fake_mode(graph)
    if fake_mode is None:
        return False
    try:
        plan = _propagate(graph, fake_mode)
    except Exception as e:  # an op whose fake value cannot be computed again: keep the graph
        log.debug("convolution layouts: the graph is kept as it was (%s: %s)", type(e).__name__, e)
        return False
    if plan is None:
        log.debug("convolution layouts: the graph is kept as it was (an output's layout)")
        return False
    if not plan.clones:
        return False
    _commit(graph, plan)
    gm.recompile()
    return True


def _plain_cpu_4d(v: Any) -> bool:
    return (
        isinstance(v, torch.Tensor)
        and v.ndim == 4
        and v.layout == torch.strided
        and v.device.type == "cpu"
        and v.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _symbolic(v: Any) -> bool:
    if isinstance(v, list | tuple):
        return any(_symbolic(x) for x in v)
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(v, torch.Tensor):
        return any(not isinstance(s, int) for s in (*v.shape, *v.stride()))
    return False


def _fake_mode(graph: fx.Graph) -> Any:
    for n in graph.nodes:
        mode = getattr(n.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def wants_channels_last(node: fx.Node) -> bool:
    """Whether the convolution (or convolution backward) ``node`` runs channels-last: a
    plane of at least `MIN_PLANE` outputs and `MIN_MACS` multiply-adds. Measured with
    oneDNN on a CPU, forward and backward, one thread, channels-last ÷ NCHW (`stoker
    bench conv_layout`, a loaded 2-core AMD EPYC): 64→64 channels at 56² 0.72, 128→128
    at 28² 0.87, 256→256 at 14² 0.92, 64→128 at 8² 0.85, but 512→512 at 7² 1.05 and
    256→256 at 4² 1.09 (a ResNet's last layers); a convolution with little work
    (8→8 at 16², 0.3 ms) saves less than the copies into and out of its layout cost."""
    forward = node.target is aten.convolution.default
    out_node, w_node = (node, node.args[1]) if forward else (node.args[0], node.args[2])
    assert isinstance(out_node, fx.Node) and isinstance(w_node, fx.Node)
    out, w = out_node.meta["val"], w_node.meta["val"]
    plane = int(out.shape[2]) * int(out.shape[3])
    macs = int(out.numel()) * int(w.shape[1]) * int(w.shape[2]) * int(w.shape[3])
    return plane >= MIN_PLANE and macs >= MIN_MACS


MIN_PLANE = 64
MIN_MACS = 8_000_000


class _Plan(NamedTuple):
    new: dict[fx.Node, Any]  # the new fake value of each node downstream of a convolution
    # each convolution's layout, and a view's that copies its input back to NCHW: the
    # argument positions given in that layout, and the layout
    formats: dict[fx.Node, tuple[tuple[int, ...], torch.memory_format]]
    clones: dict[_Key, Any]  # the values to clone into another layout (fake values)
    restore: dict[fx.Node, torch.memory_format]  # the outputs to copy back, to this format


def _propagate(graph: fx.Graph, fake_mode: Any) -> _Plan | None:
    """The pass's plan; None when an output's old layout cannot be given back."""
    new: dict[fx.Node, Any] = {}
    formats: dict[fx.Node, tuple[tuple[int, ...], torch.memory_format]] = {}
    clones: dict[_Key, Any] = {}

    def val(a: Any) -> Any:
        return new.get(a, a.meta.get("val")) if isinstance(a, fx.Node) else a

    def relaid(a: fx.Node, fmt: torch.memory_format) -> Any:
        v = val(a)
        if not isinstance(v, torch.Tensor) or v.ndim != 4 or v.is_contiguous(memory_format=fmt):
            return v
        if (a, fmt) not in clones:
            clones[a, fmt] = v.clone(memory_format=fmt)
        return clones[a, fmt]

    with fake_mode:
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            positions = _CONV_ARGS.get(n.target, ())
            if not positions and not any(a in new for a in n.all_input_nodes):
                continue
            fmt = torch.contiguous_format
            if positions:
                fmt = torch.channels_last if wants_channels_last(n) else fmt
            elif n.target in _VIEWS and n.args[0] in new and not val(n.args[0]).is_contiguous():
                positions = (0,)
            if positions:
                formats[n] = (positions, fmt)
            args = [
                relaid(a, fmt)
                if i in positions and isinstance(a, fx.Node)
                else fx.node.map_arg(a, val)
                for i, a in enumerate(n.args)
            ]
            kwargs = fx.node.map_arg(n.kwargs, val)
            if n.target is operator.getitem:
                out = args[0][args[1]]
            else:
                out = n.target(*args, **kwargs)
            if _same_layouts(out, n.meta.get("val")):
                continue  # same sizes and strides: later ops see nothing new
            new[n] = out
    restore: dict[fx.Node, torch.memory_format] = {}
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    for a in out_node.all_input_nodes:
        if a not in new:
            continue
        old = a.meta.get("val")
        if not isinstance(old, torch.Tensor):
            return None
        if old.is_contiguous():
            restore[a] = torch.contiguous_format
        elif old.is_contiguous(memory_format=torch.channels_last):
            restore[a] = torch.channels_last
        else:
            return None
    return _Plan(new, formats, clones, restore)


def _same_layouts(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_layouts(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def _commit(graph: fx.Graph, plan: _Plan) -> None:
    """Write the pass's plan into the graph: the clones, the new values, the copies back."""
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    made: dict[_Key, fx.Node] = {}
    for (src, fmt), v in plan.clones.items():
        where = first_op if src.op == "placeholder" else src.next
        with graph.inserting_before(where):
            c = graph.call_function(aten.clone.default, (src,), {"memory_format": fmt})
        _set_val(c, v, src)
        made[src, fmt] = c
    for n, (positions, fmt) in plan.formats.items():
        args = list(n.args)
        for i in positions:
            a = args[i]
            if isinstance(a, fx.Node) and (a, fmt) in made:
                args[i] = made[a, fmt]
        n.args = tuple(args)
    for n, v in plan.new.items():
        n.meta["val"] = v
        _set_tensor_meta(n, v)
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    back: dict[fx.Node, fx.Node] = {}
    for a, fmt in plan.restore.items():
        with graph.inserting_before(out_node):
            c = graph.call_function(aten.clone.default, (a,), {"memory_format": fmt})
        with a.meta["val"].fake_mode:
            _set_val(c, a.meta["val"].clone(memory_format=fmt), a)
        back[a] = c
    out_node.args = fx.node.map_arg(out_node.args, lambda a: back.get(a, a))


def _set_val(node: fx.Node, v: Any, like: fx.Node) -> None:
    node.meta["val"] = v
    _set_tensor_meta(node, v)
    for key in ("stoker_phase", "stoker_module_path", "nn_module_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]


def _set_tensor_meta(node: fx.Node, v: Any) -> None:
    if isinstance(v, torch.Tensor):
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        node.meta["tensor_meta"] = _extract_tensor_metadata(v)
    else:
        node.meta.pop("tensor_meta", None)
