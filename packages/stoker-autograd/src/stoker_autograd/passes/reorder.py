"""The reordering passes: restore the eager engine's schedule in a captured graph.

Each pass is a pure function ``fx.Graph -> fx.Graph`` (an in-place body wrapped by
`graph_pass`, which copies its input first; `run_all` copies once for all): it
only moves nodes (never adds, removes or rewires one), and only to places where
every input of the moved node is already defined.  See README.md for the rules.
"""

from __future__ import annotations

import itertools

import torch.fx as fx

from ._common import (
    graph_pass,
    hook_kind,
    is_accumulate_grad,
    is_getitem,
    is_input_like,
    move_after,
    node_inputs,
)


def _hook_getitem(hook: fx.Node) -> list[fx.Node]:
    """The ``hooks[i]`` node feeding ``hook`` when only it uses it (it moves along)."""
    h = hook.args[0]
    if isinstance(h, fx.Node) and is_getitem(h) and len(h.users) == 1:
        return [h]
    return []


@graph_pass
def reorder_accumulate_grad(g: fx.Graph) -> None:
    """Each accumulate-grad right after its last input (eager runs it as soon as its
    gradient is ready).  When the gradient is an item of a multi-output node, the
    item moves along, so the accumulate can follow the node itself.  Not moved when
    its inputs are all graph inputs.

    Accumulates that follow the same node keep their order (the engine's, as
    captured): the items of a multi-output node (a layer norm's weight and bias
    gradients) are accumulated in the same order in every capture of a backward,
    whatever hooks it has, so a hook placed after the last of them sees them all.
    """
    placed: dict[fx.Node, fx.Node] = {}  # anchor -> the last block moved after it
    for node in [n for n in g.nodes if is_accumulate_grad(n)]:
        grad = node.args[2]
        block: list[fx.Node] = [*_grad_chain(grad), node]
        deps = [a for b in block for a in b.all_input_nodes if a not in block]
        last = max(deps)
        if is_input_like(last):
            continue
        after = placed.get(last, last)
        if after.next is not block[0] or any(a.next is not b for a, b in itertools.pairwise(block)):
            move_after(after, *block)
        placed[last] = node


def _grad_chain(grad: object) -> list[fx.Node]:
    """Nodes that move along with the one consumer of ``grad``: its item node when it
    is an item of a multi-output node, and before it the engine's check of that one
    gradient (see `_is_single_check`)."""
    if not (isinstance(grad, fx.Node) and is_getitem(grad) and len(grad.users) == 1):
        return []
    src = grad.args[0]
    if isinstance(src, fx.Node) and _is_single_check(src):
        return [src, grad]
    return [grad]


def _is_single_check(n: fx.Node) -> bool:
    """The engine's ``validate_outputs`` of one gradient, used only by its item."""
    name = getattr(n.target, "__name__", "")
    return (
        n.op == "call_function"
        and name == "validate_outputs"
        and len(n.users) == 1
        and isinstance(n.args[0], list)
        and len(n.args[0]) == 1
    )


@graph_pass
def delay_unpack_hooks(g: fx.Graph) -> None:
    """Each saved-tensor unpack hook right before its first user (as late as possible:
    the unpacked tensor lives shortest)."""
    for node in [n for n in g.nodes if hook_kind(n) == "unpack_hook"]:
        if node.users:
            first = min(node.users)
            if node.next is not first:
                first.prepend(node)


@graph_pass
def reorder_tensor_pre_hooks(g: fx.Graph) -> None:
    """Each tensor pre-hook (``Tensor.register_hook``) right after the gradient it
    receives is computed.  Not moved when that gradient is a graph input."""
    for node in [n for n in g.nodes if hook_kind(n) == "tensor_pre_hook"]:
        grad = node.args[1]
        if not isinstance(grad, fx.Node) or is_input_like(grad):
            continue
        chain = _grad_chain(grad)
        block = [*chain, *_hook_getitem(node), node]
        anchor = (
            max(a for b in chain for a in b.all_input_nodes if a not in chain) if chain else grad
        )
        if is_input_like(anchor):
            anchor, block = grad, block[len(chain) :]
        if anchor.next is not block[0] or any(
            a.next is not b for a, b in itertools.pairwise(block)
        ):
            move_after(anchor, *block)


def _pre_hook_inputs(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(producers of the grads a pre-hook takes, the getitems in between that move along)."""
    producers, getitems = [], []
    for n in node_inputs(node.args[1]):
        if is_getitem(n) and isinstance(n.args[0], fx.Node) and len(n.users) == 1:
            producers.append(n.args[0])
            getitems.append(n)
        else:
            producers.append(n)
    return producers, getitems


@graph_pass
def schedule_pre_hooks_early(g: fx.Graph) -> None:
    """Each node pre-hook right after its last input, so that accumulate-grad
    reordering (which follows) can see through it.  Not eager's order by itself:
    `place_pre_hooks_before_node` restores that."""
    for node in [n for n in g.nodes if hook_kind(n) == "pre_hook"]:
        producers, getitems = _pre_hook_inputs(node)
        if not producers:
            continue
        last = max(producers)
        if is_input_like(last):
            continue
        block = [*_hook_getitem(node), *getitems, node]
        if last.next is not block[0]:
            move_after(last, *block)


@graph_pass
def place_pre_hooks_before_node(g: fx.Graph) -> None:
    """Each node pre-hook (and the items it returns) right before the node it is
    registered on, where the eager engine calls it."""
    pre_hooks = [n for n in g.nodes if hook_kind(n) == "pre_hook"]
    for node in reversed(pre_hooks):
        users = list(node.users)
        if not users or not all(is_getitem(u) for u in users):
            continue
        consumers = [c for u in users for c in u.users]
        if not consumers:
            continue
        registered = min(consumers)
        block = [*_hook_getitem(node), node, *sorted(users)]
        if block[-1].next is registered and all(a.next is b for a, b in itertools.pairwise(block)):
            continue
        for n in block:
            registered.prepend(n)


@graph_pass
def reorder_post_acc_grad_hooks(g: fx.Graph) -> None:
    """Each post-accumulate-grad hook right after the accumulate-grad of its
    parameter (several on one parameter keep their order)."""
    hooks = [n for n in g.nodes if hook_kind(n) == "post_acc_grad_hook"]
    for node in reversed(hooks):
        param = node.args[1]
        if not isinstance(param, fx.Node):
            continue
        acc = next((u for u in param.users if is_accumulate_grad(u)), None)
        if acc is None or acc > node:  # never move a hook before the grad it reads
            continue
        move_after(acc, *_hook_getitem(node), node)


@graph_pass
def reorder_post_hooks(g: fx.Graph) -> None:
    """Each node post-hook that returns nothing new (no grad outputs) right after
    the last of its inputs and their users, or after that parameter's
    post-accumulate-grad hook when the last is an accumulate-grad.  Post-hooks
    whose outputs the graph uses already sit where eager calls them: not moved."""
    hooks = [n for n in g.nodes if hook_kind(n) == "post_hook"]
    for node in reversed(hooks):
        outputs, inputs = node_inputs(node.args[1]), node_inputs(node.args[2])
        if outputs or not inputs:
            continue
        candidates = list(inputs)
        for i in inputs:
            candidates += [u for u in i.users if hook_kind(u) != "post_hook" and u is not node]
        last = max(candidates)
        if last > node:
            continue
        if is_accumulate_grad(last):
            param = last.args[0]
            post_acc = (
                [u for u in param.users if hook_kind(u) == "post_acc_grad_hook"]
                if isinstance(param, fx.Node)
                else []
            )
            if post_acc:
                last = max(post_acc)
        if is_input_like(last) or last.next is node:
            continue
        move_after(last, *_hook_getitem(node), node)


@graph_pass
def place_size_checks_after_their_call(g: fx.Graph) -> None:
    """(Retraced graphs) each ``check_sizes`` right after the last of its inputs, so
    it travels with the hook or custom backward whose result it checks."""
    from .._internal.retrace import check_sizes

    for node in [n for n in g.nodes if n.op == "call_function" and n.target is check_sizes]:
        last = max(node.all_input_nodes)
        if last.next is not node and not is_input_like(last):
            last.append(node)
