"""Each reordering pass on small hand-built graphs: where it moves a node, where it
must not, that it never edits its argument, and that the result stays well formed."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from stoker_autograd import passes
from stoker_autograd._internal import ops

aten = torch.ops.aten


class B:
    """Builds a captured-backward-shaped graph: inputs/hooks placeholders and items."""

    def __init__(self) -> None:
        self.g = fx.Graph()
        self.inputs = self.g.placeholder("inputs")
        self.hooks = self.g.placeholder("hooks")

    def item(self, ph: fx.Node, i: int, name: str) -> fx.Node:
        n = self.g.call_function(operator.getitem, (ph, i))
        n.name = name
        return n

    def op(self, target: object, *args: object, name: str, **kwargs: object) -> fx.Node:
        n = self.g.call_function(target, args, kwargs)  # type: ignore[arg-type]
        n.name = name
        return n

    def hook(self, i: int, *args: object, kind: str, name: str) -> fx.Node:
        h = self.item(self.hooks, i, f"{name}_fn")
        return self.op(ops.call_hook, h, *args, name=name, hook_type=kind)

    def acc(self, param: fx.Node, grad: fx.Node, name: str) -> fx.Node:
        return self.op(ops.accumulate_grad, param, None, grad, False, name=name)

    def done(self, *outs: fx.Node) -> fx.Graph:
        self.g.output(list(outs))
        self.g.lint()
        return self.g


def order(g: fx.Graph) -> list[str]:
    return [n.name for n in g.nodes]


def pos(g: fx.Graph, name: str) -> int:
    return order(g).index(name)


def check_pure(p: passes.Pass, g: fx.Graph) -> fx.Graph:
    before = order(g)
    out = p(g)
    assert order(g) == before, "a pass must not edit its argument"
    assert out is not g
    out.lint()
    assert sorted(order(out)) == sorted(before) or p is passes.dce
    return out


# --------------------------------------------------------------- accumulate-grad
def test_accumulate_grad_moves_right_after_its_last_input() -> None:
    b = B()
    x, w = b.item(b.inputs, 0, "x"), b.item(b.inputs, 1, "w")
    g1 = b.op(aten.mul.Tensor, x, 2.0, name="g1")
    other = b.op(aten.sin.default, x, name="other")
    more = b.op(aten.cos.default, other, name="more")
    b.acc(w, g1, "acc_w")
    out = check_pure(passes.reorder_accumulate_grad, b.done(more))
    assert pos(out, "acc_w") == pos(out, "g1") + 1
    assert pos(out, "other") > pos(out, "acc_w")


def test_accumulate_grad_not_moved_when_inputs_are_graph_inputs_or_adjacent() -> None:
    b = B()
    x, w = b.item(b.inputs, 0, "x"), b.item(b.inputs, 1, "w")
    other = b.op(aten.sin.default, x, name="other")
    b.acc(w, x, "acc_inputs_only")  # grad is a graph input: stays where it is
    g2 = b.op(aten.cos.default, other, name="g2")
    b.acc(w, g2, "acc_adjacent")  # already right after its input
    g = b.done(other)
    out = check_pure(passes.reorder_accumulate_grad, g)
    assert order(out) == order(g)


def test_accumulates_of_one_multi_output_node_keep_their_captured_order() -> None:
    """A layer norm's backward yields the weight's and the bias's gradients as items of
    one node: both accumulates move up behind it in the order they were captured (the
    engine's), not reversed. A hook placed after the last one (stoker's DDP reducer
    hooks only a bucket's last gradient) must find the others accumulated."""
    b = B()
    x, w, bias = (b.item(b.inputs, i, n) for i, n in enumerate(("x", "w", "bias")))
    ln = b.op(aten.native_layer_norm_backward.default, x, name="ln_bw")
    gx = b.op(operator.getitem, ln, 0, name="gx")
    other = b.op(aten.sin.default, gx, name="other")
    gw = b.op(operator.getitem, ln, 1, name="gw")
    gb = b.op(operator.getitem, ln, 2, name="gb")
    b.acc(w, gw, "acc_w")
    b.acc(bias, gb, "acc_b")
    out = check_pure(passes.reorder_accumulate_grad, b.done(other))
    names = order(out)
    at = names.index("ln_bw")
    assert names[at + 1 : at + 5] == ["gw", "acc_w", "gb", "acc_b"], names


def _two_leaves(bias_first: bool, between: bool = False) -> fx.Graph:
    """A layer norm's backward: the bias's block (item, tensor hook, accumulate,
    post-accumulate-grad hook) captured before the weight's, with another node between
    them (``between``)."""
    b = B()
    x, w, bias = (b.item(b.inputs, i, n) for i, n in enumerate(("x", "w", "bias")))
    ln = b.op(aten.native_layer_norm_backward.default, x, name="ln_bw")
    gx = b.op(operator.getitem, ln, 0, name="gx")
    order_ = [("b", bias, 2), ("w", w, 1)] if bias_first else [("w", w, 1), ("b", bias, 2)]
    for k, (tag, param, idx) in enumerate(order_):
        item = b.op(operator.getitem, ln, idx, name=f"g{tag}")
        th = b.hook(2 * k, item, kind="tensor_pre_hook", name=f"th_{tag}")
        b.acc(param, th, f"acc_{tag}")
        b.hook(2 * k + 1, param, kind="post_acc_grad_hook", name=f"post_{tag}")
        if between and k == 0:
            b.op(aten.cos.default, gx, name="between")
    return b.done(b.op(aten.sin.default, gx, name="other"))


def test_leaves_of_one_node_take_its_output_order() -> None:
    """Eager runs the accumulate-grads one node makes ready in the node's output order
    (weight, then bias), each with its hooks: the blocks exchange places; the node in
    between keeps its place."""
    out = check_pure(passes.order_leaves_by_output, _two_leaves(bias_first=True, between=True))
    names = [n for n in order(out) if n.startswith(("th_", "acc_", "post_", "between", "g"))]
    assert names == [
        "gx", "gw", "th_w_fn", "th_w", "acc_w", "post_w_fn", "post_w",
        "between",
        "gb", "th_b_fn", "th_b", "acc_b", "post_b_fn", "post_b",
    ], names  # fmt: skip


def test_leaves_already_in_output_order_not_moved() -> None:
    g = _two_leaves(bias_first=False)
    assert order(check_pure(passes.order_leaves_by_output, g)) == order(g)


def test_leaves_not_exchanged_where_another_node_reads_a_block() -> None:
    """A node between the blocks that reads the first block's hook result would come
    before it: nothing moves."""
    b = B()
    x, w, bias = (b.item(b.inputs, i, n) for i, n in enumerate(("x", "w", "bias")))
    ln = b.op(aten.native_layer_norm_backward.default, x, name="ln_bw")
    gb = b.op(operator.getitem, ln, 2, name="gb")
    acc_b = b.acc(bias, gb, "acc_b")
    reader = b.op(aten.sin.default, acc_b, name="reader")
    gw = b.op(operator.getitem, ln, 1, name="gw")
    b.acc(w, gw, "acc_w")
    g = b.done(reader)
    assert order(check_pure(passes.order_leaves_by_output, g)) == order(g)


# ---------------------------------------------------------------- unpack hooks
def test_unpack_hook_delayed_to_its_first_user() -> None:
    b = B()
    packed = b.item(b.inputs, 0, "packed")
    un = b.hook(0, packed, kind="unpack_hook", name="unpack")
    a = b.op(aten.sin.default, packed, name="a")
    c = b.op(aten.cos.default, a, name="c")
    use = b.op(aten.mul.Tensor, c, un, name="use")
    out = check_pure(passes.delay_unpack_hooks, b.done(use))
    assert pos(out, "unpack") == pos(out, "use") - 1
    assert pos(out, "unpack_fn") < pos(out, "unpack")  # its input still comes first


def test_unpack_hook_without_users_not_moved() -> None:
    b = B()
    packed = b.item(b.inputs, 0, "packed")
    b.hook(0, packed, kind="unpack_hook", name="unpack")
    a = b.op(aten.sin.default, packed, name="a")
    g = b.done(a)
    assert order(check_pure(passes.delay_unpack_hooks, g)) == order(g)


def test_accumulate_grad_carries_the_check_of_its_gradient_along() -> None:
    """An inlined AOT backward yields all grads in one block, each checked by its own
    ``validate_outputs``: the check and the item move up with the accumulate."""
    check = ops.BoundBackward("validate_outputs", lambda grads, metas: grads, False, True)
    b = B()
    x, w1, w2 = (b.item(b.inputs, i, n) for i, n in enumerate(("x", "w1", "w2")))
    g1 = b.op(aten.mul.Tensor, x, 2.0, name="g1")
    g2 = b.op(aten.sin.default, x, name="g2")
    c1 = b.op(check, [g1], [None], name="check1")
    c2 = b.op(check, [g2], [None], name="check2")
    i1 = b.op(operator.getitem, c1, 0, name="item1")
    i2 = b.op(operator.getitem, c2, 0, name="item2")
    b.acc(w1, i1, "acc1")
    b.acc(w2, i2, "acc2")
    out = check_pure(passes.reorder_accumulate_grad, b.done())
    names = order(out)
    assert names[names.index("g1") + 1 : names.index("g1") + 4] == ["check1", "item1", "acc1"]
    assert names.index("acc1") < names.index("g2")


# ------------------------------------------------------------ tensor pre-hooks
def test_tensor_pre_hook_right_after_its_gradient() -> None:
    """A leaf's hook (its result goes to the leaf's accumulate-grad) moves up to the
    gradient: eager accumulates a leaf as soon as its gradient is ready."""
    b = B()
    x, w = b.item(b.inputs, 0, "x"), b.item(b.inputs, 1, "w")
    grad = b.op(aten.mul.Tensor, x, 3.0, name="grad")
    later = b.op(aten.sin.default, x, name="later")
    h = b.hook(0, grad, kind="tensor_pre_hook", name="th")
    b.acc(w, h, "acc_w")
    out = check_pure(passes.reorder_tensor_pre_hooks, b.done(later))
    assert order(out).index("th_fn") == pos(out, "grad") + 1
    assert pos(out, "th") == pos(out, "grad") + 2
    assert pos(out, "later") > pos(out, "th")


def test_tensor_pre_hook_of_a_non_leaf_stays_with_its_node() -> None:
    """A hook on a non-leaf's gradient runs when the node it feeds runs (eager runs
    other ready nodes first, by priority): it stays where the capture put it."""
    b = B()
    x = b.item(b.inputs, 0, "x")
    grad = b.op(aten.mul.Tensor, x, 3.0, name="grad")
    later = b.op(aten.sin.default, x, name="later")
    h = b.hook(0, grad, kind="tensor_pre_hook", name="th")
    g = b.done(b.op(aten.add.Tensor, h, later, name="use"))
    assert order(check_pure(passes.reorder_tensor_pre_hooks, g)) == order(g)


def test_tensor_pre_hook_on_graph_input_not_moved() -> None:
    b = B()
    x = b.item(b.inputs, 0, "x")
    later = b.op(aten.sin.default, x, name="later")
    h = b.hook(0, x, kind="tensor_pre_hook", name="th")
    g = b.done(b.op(aten.add.Tensor, h, later, name="use"))
    assert order(check_pure(passes.reorder_tensor_pre_hooks, g)) == order(g)


# ------------------------------------------------------------------ pre-hooks
def _pre_hook_graph() -> fx.Graph:
    b = B()
    x, w = b.item(b.inputs, 0, "x"), b.item(b.inputs, 1, "w")
    grad = b.op(aten.mul.Tensor, x, 2.0, name="grad")
    unrelated = b.op(aten.sin.default, x, name="unrelated")
    unrelated2 = b.op(aten.cos.default, unrelated, name="unrelated2")
    pre = b.hook(0, [grad], kind="pre_hook", name="pre")
    item = b.op(operator.getitem, pre, 0, name="pre_out")
    b.acc(w, item, "acc_w")
    return b.done(unrelated2)


def test_pre_hook_scheduled_early_then_before_its_node() -> None:
    g = _pre_hook_graph()
    early = check_pure(passes.schedule_pre_hooks_early, g)
    assert pos(early, "pre") < pos(early, "unrelated")  # as early as its input allows
    acc = check_pure(passes.reorder_accumulate_grad, early)
    assert pos(acc, "acc_w") < pos(acc, "unrelated")  # so the accumulate can follow
    final = check_pure(passes.place_pre_hooks_before_node, acc)
    names = order(final)
    i = names.index("acc_w")
    assert names[i - 3 : i] == ["pre_fn", "pre", "pre_out"]  # right before its node


def test_pre_hook_already_before_its_node_not_moved() -> None:
    b = B()
    x, w = b.item(b.inputs, 0, "x"), b.item(b.inputs, 1, "w")
    grad = b.op(aten.mul.Tensor, x, 2.0, name="grad")
    pre = b.hook(0, [grad], kind="pre_hook", name="pre")
    item = b.op(operator.getitem, pre, 0, name="pre_out")
    b.acc(w, item, "acc_w")
    g = b.done(grad)
    for p in (passes.schedule_pre_hooks_early, passes.place_pre_hooks_before_node):
        assert order(check_pure(p, g)) == order(g)


# ------------------------------------------------- post-accumulate-grad hooks
def test_post_acc_grad_hooks_follow_their_accumulate_in_order() -> None:
    b = B()
    x, w = b.item(b.inputs, 0, "x"), b.item(b.inputs, 1, "w")
    grad = b.op(aten.mul.Tensor, x, 2.0, name="grad")
    b.acc(w, grad, "acc_w")
    other = b.op(aten.sin.default, x, name="other")
    b.hook(0, w, kind="post_acc_grad_hook", name="first")
    b.hook(1, w, kind="post_acc_grad_hook", name="second")
    out = check_pure(passes.reorder_post_acc_grad_hooks, b.done(other))
    names = order(out)
    i = names.index("acc_w")
    assert names[i + 1 : i + 5] == ["first_fn", "first", "second_fn", "second"]


def test_post_acc_grad_hook_without_accumulate_not_moved() -> None:
    b = B()
    x, w = b.item(b.inputs, 0, "x"), b.item(b.inputs, 1, "w")
    other = b.op(aten.sin.default, x, name="other")
    b.hook(0, w, kind="post_acc_grad_hook", name="lonely")
    g = b.done(other)
    assert order(check_pure(passes.reorder_post_acc_grad_hooks, g)) == order(g)


# ------------------------------------------------------------------ post-hooks
def test_post_hook_without_outputs_follows_its_inputs() -> None:
    b = B()
    x = b.item(b.inputs, 0, "x")
    gin = b.op(aten.mul.Tensor, x, 2.0, name="gin")
    user = b.op(aten.neg.default, gin, name="user")
    other = b.op(aten.sin.default, x, name="other")
    other2 = b.op(aten.cos.default, other, name="other2")
    b.hook(0, [], [gin], kind="post_hook", name="post")
    out = check_pure(passes.reorder_post_hooks, b.done(user, other2))
    assert pos(out, "post") == pos(out, "user") + 2  # after its input's users (and its fn)
    assert pos(out, "post") < pos(out, "other")


def test_post_hook_with_outputs_not_moved() -> None:
    b = B()
    x = b.item(b.inputs, 0, "x")
    gout = b.op(aten.mul.Tensor, x, 2.0, name="gout")
    other = b.op(aten.sin.default, x, name="other")
    post = b.hook(0, [gout], [x], kind="post_hook", name="post")
    use = b.op(operator.getitem, post, 0, name="use")
    g = b.done(use, other)
    assert order(check_pure(passes.reorder_post_hooks, g)) == order(g)


# ---------------------------------------------------------------- size checks
def test_size_check_follows_the_call_it_checks() -> None:
    from stoker_autograd._internal.graph import check_sizes

    b = B()
    x = b.item(b.inputs, 0, "x")
    h = b.hook(0, x, kind="tensor_pre_hook", name="th")
    other = b.op(aten.sin.default, x, name="other")
    chk = b.op(check_sizes, h, [3], "hook", name="chk")
    out = check_pure(passes.place_size_checks_after_their_call, b.done(chk, other))
    assert pos(out, "chk") == pos(out, "th") + 1
    b2 = B()
    x2 = b2.item(b2.inputs, 0, "x")
    chk2 = b2.op(check_sizes, x2, [3], "input", name="chk")  # checks a graph input
    g2 = b2.done(chk2)
    assert order(check_pure(passes.place_size_checks_after_their_call, g2)) == order(g2)


# ------------------------------------------------------------------------- DCE
def test_dce_keeps_side_effects() -> None:
    b = B()
    x, w = b.item(b.inputs, 0, "x"), b.item(b.inputs, 1, "w")
    b.op(aten.sin.default, x, name="dead")
    b.op(aten.sym_size.int, x, 0, name="dead_size")
    b.hook(0, x, kind="tensor_pre_hook", name="unused_hook")
    buf = b.op(aten.empty.memory_format, [3], name="buf")
    b.op(aten.copy_.default, buf, x, name="inplace")
    g1 = b.op(aten.mul.Tensor, x, 2.0, name="g1")
    b.acc(w, g1, "acc_w")
    b.op(ops.call_backward, None, [], g1, name="custom_bw")
    out = check_pure(passes.dce, b.done())
    names = set(order(out))
    assert "dead" not in names and "dead_size" not in names
    assert {"unused_hook", "inplace", "acc_w", "custom_bw", "inputs", "hooks"} <= names


def test_run_all_applies_every_pass_and_keeps_the_graph_well_formed() -> None:
    g = _pre_hook_graph()
    out = passes.run_all(g)
    out.lint()
    assert pos(out, "acc_w") < pos(out, "unrelated")
    assert len(passes.PIPELINE) == 10


def test_mark_undefined_leaves_lists_the_leaves_only_a_custom_backward_reaches() -> None:
    """``w`` is reached from output 1 of the custom backward alone (through a built-in
    node); ``v`` from output 0 and the loss's seed (a defined gradient): only ``w``."""
    b = B()
    seed = b.item(b.inputs, 0, "seed")
    v, w = b.item(b.inputs, 1, "v"), b.item(b.inputs, 2, "w")
    ctx = b.item(b.hooks, 0, "ctx")
    call = b.op(ops.call_backward, ctx, [], seed, name="call")
    g0, g1 = b.item(call, 0, "g0"), b.item(call, 1, "g1")
    tanh = ops.BoundBackward("TanhBackward0", lambda *a: a, False, True)
    t = b.op(tanh, [g1], [True], name="tanh_bw")
    t0 = b.item(t, 0, "t0")
    both = b.op(torch.add, g0, seed, name="both")
    b.acc(v, both, "acc_v")
    b.acc(w, t0, "acc_w")
    g = check_pure(passes.mark_undefined_leaves, b.done())
    call_new = next(n for n in g.nodes if n.name == "call")
    leaves = call_new.kwargs["undefined_leaves"]
    assert [(leaf.name, idx) for leaf, idx in leaves] == [("w", (1,))]
    # a C++ custom Function's backward materializes zeros: no leaf behind it is listed
    b2 = B()
    seed2, w2 = b2.item(b2.inputs, 0, "seed"), b2.item(b2.inputs, 1, "w")
    call2 = b2.op(ops.call_backward, b2.item(b2.hooks, 0, "ctx"), [], seed2, name="call")
    cpp = ops.BoundBackward("CppNodeX0", lambda *a: a, True, False)
    c = b2.op(cpp, [b2.item(call2, 0, "g0")], name="cpp_bw")
    b2.acc(w2, b2.item(c, 0, "c0"), "acc_w")
    g2 = passes.mark_undefined_leaves(b2.done())
    assert "undefined_leaves" not in next(n for n in g2.nodes if n.name == "call").kwargs
