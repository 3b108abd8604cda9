"""The reordering passes: restore the eager engine's schedule in a captured graph.

Each pass is a pure function ``fx.Graph -> fx.Graph`` (an in-place body wrapped by
`graph_pass`, which copies its input first; `run_all` copies once for all): it
only moves nodes (never adds, removes or rewires one), and only to places where
every input of the moved node is already defined.  See README.md for the rules.
"""

from __future__ import annotations

import itertools

import torch.fx as fx

from .._internal import ops
from .._internal.graph import check_sizes
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
    """Each tensor pre-hook (``Tensor.register_hook``) of a leaf right after the
    gradient it receives is computed: eager runs a leaf's accumulate-grad, and its
    hooks, as soon as the gradient is ready.  A hook on a non-leaf runs when its node
    runs, where the capture put it: not moved.  Not moved when the gradient is a graph
    input either."""
    for node in [n for n in g.nodes if hook_kind(n) == "tensor_pre_hook"]:
        grad = node.args[1]
        if not isinstance(grad, fx.Node) or is_input_like(grad) or not _feeds_a_leaf(node):
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


def _feeds_a_leaf(node: fx.Node) -> bool:
    """Does ``node``'s result go to an accumulate-grad alone (through other hooks of the
    same leaf, ``retain_grad`` or the size check of a hook's result)?"""
    n = node
    while len(n.users) == 1:
        (u,) = n.users
        if is_accumulate_grad(u):
            return True
        if not (hook_kind(u) == "tensor_pre_hook" or _is_retain_grad(u) or _is_size_check(u)):
            return False
        n = u
    return False


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
    for node in [n for n in g.nodes if n.op == "call_function" and n.target is check_sizes]:
        last = max(node.all_input_nodes)
        if last.next is not node and not is_input_like(last):
            last.append(node)


@graph_pass
def order_leaves_by_output(g: fx.Graph) -> None:
    """The leaves one multi-output node feeds, in the order of its outputs.

    When a node yields the gradients of several leaves at once (a layer norm's, batch
    norm's or group norm's weight and bias; the outputs of a custom backward or of a
    compiled forward's backward), eager's engine pushes their accumulate-grads onto its
    ready queue in the node's output order and runs them before anything else (they
    have the highest priority), each with its tensor pre-hooks, ``retain_grad`` and
    post-accumulate-grad hooks.  The capture walks them in its own order, and the
    passes before this one place each relative to its own input; here each leaf's
    block (the item of the node's output, the engine's check of it, the tensor
    pre-hooks, the accumulate-grad, the post-accumulate-grad hooks) is put back in
    output order: the blocks exchange places, every other node keeps its own.  Two
    ready leaves run in output order in eager whatever else is queued; with three or
    more the engine's heap may order them otherwise (torch's compiled autograd also
    takes output order).  Nothing moves where a node outside the blocks reads a block
    or a block reads a node defined after the first of them.
    """
    by_anchor: dict[fx.Node, list[tuple[int, list[fx.Node]]]] = {}
    for acc in [n for n in g.nodes if is_accumulate_grad(n)]:
        found = _leaf_block(acc)
        if found is not None:
            anchor, index, block = found
            by_anchor.setdefault(anchor, []).append((index, block))
    for blocks in by_anchor.values():
        if len(blocks) > 1:
            _exchange(g, blocks)


def _leaf_block(acc: fx.Node) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """``(the multi-output node, the output index, the leaf's nodes in graph order)``
    for an accumulate-grad whose gradient is one output of a multi-output node and
    passes only through nodes of this leaf on its way; else None."""
    if len(acc.args) < 3 or not isinstance(acc.args[2], fx.Node):
        return None
    nodes: list[fx.Node] = [acc]
    v: fx.Node = acc.args[2]
    while True:
        if len(v.users) != 1:
            return None
        index = v.args[1] if is_getitem(v) else None
        if isinstance(index, int) and isinstance(v.args[0], fx.Node):
            src = v.args[0]
            if _is_single_check(src):  # the engine's check of this one gradient
                nodes += [v, src]
                first = src.args[0][0]  # type: ignore[index]
                if not isinstance(first, fx.Node):
                    return None
                v = first
                continue
            if is_input_like(v):
                return None
            nodes.append(v)
            param = acc.args[0]
            if isinstance(param, fx.Node):
                for u in param.users:  # its post-accumulate-grad hooks
                    if hook_kind(u) == "post_acc_grad_hook" and u > acc:
                        nodes += [*_hook_getitem(u), u]
            return src, index, sorted(nodes)
        kind = hook_kind(v)
        if kind == "tensor_pre_hook" or _is_retain_grad(v) or _is_size_check(v):
            nodes += [*(_hook_getitem(v) if kind else []), v]
            first = v.args[1] if kind or _is_retain_grad(v) else v.args[0]
            if not isinstance(first, fx.Node):
                return None
            v = first
            continue
        return None


def _is_retain_grad(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is ops.call_cpp_tensor_pre_hooks


def _is_size_check(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is check_sizes


def _exchange(g: fx.Graph, blocks: list[tuple[int, list[fx.Node]]]) -> None:
    """Put ``blocks`` in output order in the places they hold now."""
    current = sorted(blocks, key=lambda b: b[1][0])
    wanted = sorted(blocks, key=lambda b: b[0])  # stable: equal indices keep their order
    if [b[1] for b in current] == [b[1] for b in wanted]:
        return
    members = {n: i for i, (_, block) in enumerate(current) for n in block}
    start, end = current[0][1][0], max(b[1][-1] for b in current)
    span: list[fx.Node] = []
    n = start
    while True:
        span.append(n)
        if n is end:
            break
        n = n.next
    # the new order: block slot i (where block i's first node was) gets wanted block i;
    # a block's other nodes follow its first at once; other nodes stay in place
    slot = {b[1][0]: j for j, b in enumerate(current)}
    order: list[fx.Node] = []
    for n in span:
        if n in slot:
            order += wanted[slot[n]][1]
        elif n not in members:
            order.append(n)
    where = {n: i for i, n in enumerate(order)}
    for n in order:
        for a in n.all_input_nodes:
            if a in where and where[a] > where[n]:
                return  # a dependency the exchange would break: leave the graph as it is
    prev = start.prev
    for n in order:
        if prev.next is not n:
            prev.append(n)
        prev = n
