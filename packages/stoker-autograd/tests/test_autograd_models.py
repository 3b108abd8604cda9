"""Gradients AND hook order under stoker_autograd vs the eager engine.

Each test builds the same model twice from one seed, runs the same steps once
eagerly and once inside ``stoker_autograd.enable()``, and compares every
parameter's gradient after every step and the log each hook appends to.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import stoker_autograd

Step = Callable[[nn.Module, list[str], int], None]

_COMPILER: list[Any] = [None]


def _segmented(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return gm


@pytest.fixture(autouse=True, params=["aten", "segmented"])
def _executor(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test runs twice: the whole retraced graph on the aten executor,
    and split into segments handed to a compiler, as stoker-triton gets it (there the
    runtime applies each segment's accumulate-grads after it, before the next hook)."""
    _COMPILER[0] = None if request.param == "aten" else _segmented
    yield
    _COMPILER[0] = None


def run(
    model: nn.Module, step: Step, steps: int, compiled: bool, **kw: Any
) -> tuple[list[list[torch.Tensor | None]], list[str]]:
    log: list[str] = []
    grads: list[list[torch.Tensor | None]] = []
    if _COMPILER[0] is not None:
        kw.setdefault("compiler", _COMPILER[0])
    ctx = stoker_autograd.enable(**kw) if compiled else _null()
    with ctx:
        for i in range(steps):
            step(model, log, i)
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            log.append(f"-- end of step {i}")
    return grads, log


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def compare(
    make: Callable[[], nn.Module], step: Step, steps: int = 3, atol: float = 1e-5, **kw: Any
) -> tuple[list[str], nn.Module]:
    torch.manual_seed(0)
    eager_model = make()
    compiled_model = copy.deepcopy(eager_model)
    torch.manual_seed(1)
    g_e, log_e = run(eager_model, step, steps, compiled=False)
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g_c, log_c = run(compiled_model, step, steps, compiled=True, **kw)
    stoker_warnings = [str(w.message) for w in caught if "stoker-autograd" in str(w.message)]
    assert not stoker_warnings, stoker_warnings
    st = stoker_autograd.stats()
    assert st["compiles"] >= 1 and st["cache_hits"] >= 1, st  # compiled graphs really ran
    assert log_c == log_e
    for s, (ge, gc) in enumerate(zip(g_e, g_c)):
        for i, (a, b) in enumerate(zip(ge, gc)):
            assert (a is None) == (b is None), f"step {s} param {i}"
            if a is not None and b is not None:
                torch.testing.assert_close(b, a, atol=atol, rtol=1e-4, msg=f"step {s} param {i}")
    for pe, pc in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(pc, pe, atol=atol, rtol=1e-4)
    return log_e, compiled_model


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def simple_step(batch: int = 5) -> Step:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        x = torch.randn(batch, 6)
        m(x).pow(2).mean().backward()

    return step


def test_mlp_gradients_and_replay() -> None:
    compare(mlp, simple_step(), steps=4)
    st = stoker_autograd.stats()
    assert st["captures"] == 1 and st["cache_hits"] == 3 and st["compiles"] == 1


def test_mlp_hooks_fire_in_eager_order() -> None:
    def make() -> nn.Module:
        m = mlp()
        return m

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        handles = []
        for name, mod in m.named_children():
            handles.append(
                mod.register_full_backward_pre_hook(
                    lambda mod, go, n=name: log.append(f"pre {n} {go[0].shape}")
                )
            )
            handles.append(
                mod.register_full_backward_hook(lambda mod, gi, go, n=name: log.append(f"bw {n}"))
            )
        for name, p in m.named_parameters():
            handles.append(p.register_hook(lambda g, n=name: log.append(f"grad {n}")))
            handles.append(
                p.register_post_accumulate_grad_hook(lambda p, n=name: log.append(f"acc {n}"))
            )
        x = torch.randn(4, 6, requires_grad=True)
        h = m[0](x)
        h.retain_grad()
        h.register_hook(lambda g: log.append("h hook"))
        assert h.grad_fn is not None
        h.grad_fn.register_prehook(lambda go: log.append("node pre"))
        h.grad_fn.register_hook(lambda gi, go: log.append("node post"))
        y = m[1:](h)
        y.sum().backward()
        log.append(f"retained {h.grad is not None} x {x.grad is not None}")
        for hd in handles:
            hd.remove()

    log, _ = compare(make, step, steps=3)
    assert any(s.startswith("acc") for s in log) and "node pre" in log and "node post" in log


def test_hook_modifying_gradient() -> None:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        scale = 2.0 + i  # the hook closes over a value that changes between steps
        hs = [p.register_hook(lambda g, s=scale: g * s) for p in m.parameters()]
        x = torch.randn(3, 6, requires_grad=True)
        y = m(x)
        y.register_hook(lambda g: g.clamp(-0.1, 0.1))
        y.sum().backward()
        log.append(f"x.grad {x.grad.abs().sum().item():.4f}")
        for h in hs:
            h.remove()

    compare(mlp, step, steps=3, atol=1e-4)


class ScaledCube(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.scale = scale  # a Python attribute on ctx: not in the engine's cache key
        return x**3 * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return g * 3 * x**2 * ctx.scale, None


def test_custom_function_ctx_scalar_changes_between_steps() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 4)

        def forward(self, x: torch.Tensor, s: float) -> torch.Tensor:
            return ScaledCube.apply(self.lin(x), s)

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(3, 6), 0.5 + i).sum().backward()

    compare(M, step, steps=4)
    st = stoker_autograd.stats()
    assert st["captures"] == 1, st  # ctx.scale changed every step: replayed, not recaptured


def test_transformer_block() -> None:
    def make() -> nn.Module:
        return nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(2, 5, 16)).pow(2).sum().backward()

    compare(make, step, steps=3, atol=1e-4)


def test_gradient_accumulation_micro_batches() -> None:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        for _ in range(3):
            (m(torch.randn(4, 6)).sum() / 3).backward()

    compare(mlp, step, steps=2)


def test_retain_graph() -> None:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        loss = m(torch.randn(4, 6)).pow(2).sum()
        loss.backward(retain_graph=True)
        (loss * 2).backward()

    compare(mlp, step, steps=2)


def test_torch_autograd_grad_returns_grads() -> None:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        x = torch.randn(4, 6, requires_grad=True)
        (gx,) = torch.autograd.grad(m(x).sum(), [x])
        log.append(f"{gx.sum().item():.5f}")

    compare(mlp, step, steps=2)


def test_non_reentrant_checkpointing() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = mlp(), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(checkpoint(self.a, x, use_reentrant=False))

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(4, 6)).sum().backward()

    compare(M, step, steps=3)


def test_saved_tensor_hooks_run_every_step() -> None:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()

        def pack(t: torch.Tensor) -> torch.Tensor:
            return t * 1.0

        def unpack(t: torch.Tensor) -> torch.Tensor:
            log.append(f"unpack {tuple(t.shape)}")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = m(torch.randn(3 + i, 6))  # the unpacked tensors change size too
        y.sum().backward()

    compare(mlp, step, steps=5)
    assert stoker_autograd.stats()["compiles"] <= 2  # sizes of unpacked tensors go symbolic


def test_in_place_on_view() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            h[:, 2:5].mul_(3.0)  # CopySlices
            h.select(1, 0).add_(1.0)
            return h

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(4, 6)).pow(2).sum().backward()

    with stoker_autograd.enable() as probe:
        M()(torch.randn(4, 6)).sum().backward()
        M()(torch.randn(4, 6)).sum().backward()
    compiled = probe.graphs[0].variants[0].gm
    mutating = [
        n.format_node()
        for n in compiled.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
    ]
    assert not mutating, mutating  # CopySlices is retraced functionally
    compare(M, step, steps=3)


def test_optimizer_in_backward_post_accumulate_grad_sgd() -> None:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        hs = []
        for name, p in m.named_parameters():

            def sgd(p: torch.Tensor, n: str = name) -> None:
                log.append(f"sgd {n}")
                assert p.grad is not None
                with torch.no_grad():
                    p.add_(p.grad, alpha=-0.1)
                p.grad = None

            hs.append(p.register_post_accumulate_grad_hook(sgd))
        m(torch.randn(4, 6)).pow(2).mean().backward()
        for h in hs:
            h.remove()

    log, _ = compare(mlp, step, steps=3)
    assert sum(s.startswith("sgd") for s in log) == 3 * 6


def test_zero_grad_to_zeros_then_accumulate() -> None:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad(set_to_none=False)
        m(torch.randn(4, 6)).sum().backward()

    compare(mlp, step, steps=4)


@pytest.mark.parametrize("dynamic", [True, False])
def test_varying_batch_size(dynamic: bool) -> None:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(3 + i, 6)).sum().backward()

    compare(mlp, step, steps=4, dynamic=dynamic)


def test_reentrant_checkpointing_runs_eagerly_inside() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = mlp(), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(checkpoint(self.a, x, use_reentrant=True))

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(4, 6, requires_grad=True)).sum().backward()

    compare(M, step, steps=3)


def test_stats_one_capture_over_ten_steps_dynamic_batch() -> None:
    torch.manual_seed(0)
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    ref = copy.deepcopy(m)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    with stoker_autograd.enable(dynamic=True):
        for i in range(10):
            x = torch.randn(3 + (i % 4) * 2, 6)
            for model, o in ((m, opt), (ref, ref_opt)):
                o.zero_grad(set_to_none=(i % 2 == 0))
                if model is ref:
                    with stoker_autograd.disabled():
                        model(x).pow(2).mean().backward()
                else:
                    model(x).pow(2).mean().backward()
                o.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    st = stoker_autograd.stats()
    # zero_grad alternates None / zeros: the engine keys on "grad defined", so two
    # captures at most; the changing batch size never recaptures.
    assert st["captures"] <= 2, st
    assert st["recompiles"] <= 2, st
    assert st["cache_hits"] >= 8, st


def test_stats_one_capture_over_ten_steps_zero_grad_to_none() -> None:
    torch.manual_seed(0)
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with stoker_autograd.enable(dynamic=True):
        for i in range(10):
            opt.zero_grad()
            m(torch.randn(3 + i, 6)).pow(2).mean().backward()
            opt.step()
    st = stoker_autograd.stats()
    assert st["captures"] == 1, st
    assert st["cache_hits"] == 9, st
    assert st["compiles"] <= 2, st  # static first, then the batch dim becomes symbolic


def test_zero_grad_to_zeros_no_recapture_after_second_step() -> None:
    torch.manual_seed(0)
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with stoker_autograd.enable(dynamic=True):
        for i in range(10):
            opt.zero_grad(set_to_none=False)
            m(torch.randn(4 + i, 6)).pow(2).mean().backward()
            opt.step()
            if i == 1:
                after_two = stoker_autograd.stats()["captures"]
    st = stoker_autograd.stats()
    assert after_two <= 2 and st["captures"] == after_two, st  # grad None, then zeros
    assert st["cache_hits"] >= 8, st


def test_stoker_capture_aot_backward_is_inlined() -> None:
    stoker_capture = pytest.importorskip("stoker_capture")
    from stoker_autograd._internal import ops

    torch.manual_seed(0)
    m = mlp()
    ref = copy.deepcopy(m)
    cm = stoker_capture.aot_module(m)
    with stoker_autograd.enable(compiler=_COMPILER[0]) as session:
        for _ in range(3):
            m.zero_grad()
            ref.zero_grad()
            x = torch.randn(5, 6)
            cm(x).pow(2).sum().backward()
            with stoker_autograd.disabled():
                ref(x).pow(2).sum().backward()
            for p, q in zip(m.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    assert len(session.graphs) == 1, "captured more than once"
    captured = session.graphs[-1].gm.graph
    assert not [n for n in captured.nodes if n.target is ops.call_backward]
    aot_nodes = [n for n in captured.nodes if n.name.startswith("aot")]
    assert any(n.meta.get("stoker_aot") for n in aot_nodes)
    assert stoker_autograd.stats()["cache_hits"] >= 2


class BoxedSquare(torch.autograd.Function):
    boxed_grads_call = True  # torch 2.13: grads arrive boxed in one list

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, *args: Any) -> torch.Tensor:
        grads = args[0] if len(args) == 1 and isinstance(args[0], list) else list(args)
        (x,) = ctx.saved_tensors
        g = grads.pop()  # frees the grad early, as boxed Functions may
        return 2 * x * g


def test_boxed_grads_call_function() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return BoxedSquare.apply(self.lin(x))

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(3, 6)).sum().backward()

    compare(M, step, steps=3)


def test_stoker_capture_model_hooks_follow_eager_order() -> None:
    """The AOT backward is one block; once retraced, its accumulate-grads and their
    hooks follow each gradient as in the uncompiled model (optimizer in backward)."""
    stoker_capture = pytest.importorskip("stoker_capture")
    torch.manual_seed(0)
    m = mlp()
    ref = copy.deepcopy(m)
    cm = stoker_capture.aot_module(m)

    def install(model: nn.Module, log: list[str]) -> None:
        for n, p in model.named_parameters():
            p.register_hook(lambda g, n=n: (log.append(f"grad {n}"), g * 0.5)[1])

            def sgd(p: torch.Tensor, n: str = n) -> None:
                log.append(f"acc {n}")
                with torch.no_grad():
                    p.add_(p.grad, alpha=-0.1)  # type: ignore[arg-type]
                p.grad = None

            p.register_post_accumulate_grad_hook(sgd)

    log_c: list[str] = []
    log_e: list[str] = []
    install(m, log_c)
    install(ref, log_e)
    with stoker_autograd.enable(compiler=_COMPILER[0]):
        for _ in range(3):
            x = torch.randn(5, 6)
            n_c, n_e = len(log_c), len(log_e)
            cm(x).pow(2).sum().backward()
            with stoker_autograd.disabled():
                ref(x).pow(2).sum().backward()
            for p, q in zip(m.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
    assert stoker_autograd.stats()["cache_hits"] >= 1
    assert log_c[n_c:] == log_e[n_e:]  # the last step ran the compiled graph
    assert log_c == log_e  # the first (uncompiled) run too


def test_saved_slices_with_varying_batch() -> None:
    """Saved tensors that are slices (strides not implied by sizes) stay correct and
    compile when the batch size changes."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k = self.lin(x).split(4, dim=-1)
            return q * k.tanh()

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(3 + i, 6)).sum().backward()

    compare(M, step, steps=4)


def test_parameter_with_transposed_layout_gets_grad_of_the_same_layout() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 4).t())  # strides (1, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w.t()

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(3, 6)).sum().backward()
        log.append(f"stride {m.w.grad.stride()}")

    compare(M, step, steps=3)


def _batch_step(make_input: Callable[[int], torch.Tensor]) -> Step:
    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(make_input((3, 5, 7, 9)[i])).pow(2).mean().backward()

    return step


class _TokenModel(nn.Module):
    """Embedding of token ids, a product with a position table, a linear head (GPT-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 8)
        self.pos = nn.Embedding(4, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) * self.pos(torch.arange(idx.shape[1])).tanh()
        return self.head(x.reshape(-1, 8))  # batch x T rows


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced_ids", "dense_ids"])
def test_new_batch_sizes_recompile_once_with_token_inputs(sliced: bool) -> None:
    """Batches 3, 5, 7, 9: one static compile, one symbolic recompile, then none, also
    when the saved ids are a slice ``seq[:, :-1]`` (strides not implied by sizes), as
    the zoo GPT's batches are.  A static batch dim there used to specialize every
    size derived from it (``batch x T`` of the head's input) and recompile per size."""

    def ids(n: int) -> torch.Tensor:
        seq = torch.randint(0, 11, (n, 5))
        return seq[:, :-1] if sliced else seq[:, :-1].contiguous()

    compare(_TokenModel, _batch_step(ids), steps=4)
    st = stoker_autograd.stats()
    assert st["captures"] == 1 and st["fallbacks"] == 0, st
    assert st["compiles"] <= 2 and st["recompiles"] <= 1, st


def test_new_batch_sizes_recompile_once_mlp() -> None:
    compare(mlp, _batch_step(lambda n: torch.randn(n, 6)[:, :6]), steps=4)
    st = stoker_autograd.stats()
    assert st["captures"] == 1 and st["compiles"] <= 2 and st["recompiles"] <= 1, st


def test_a_backward_recompile_says_which_size_changed() -> None:
    """`recompile_reasons()` and the ``stoker.recompiles`` log: one line per recompile, the
    failed size guard with the value seen, worded for stoker-autograd's automatic dynamic
    (the static size is static until it changes, not "declare it with a Dim")."""
    import logging

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("stoker.recompiles")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        compare(mlp, _batch_step(lambda n: torch.randn(n, 6)), steps=4)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    st, why = stoker_autograd.stats(), stoker_autograd.recompile_reasons()
    assert st["recompiles"] == len(why) == 1, (st, why)
    assert "size()[0] == 3 failed: got 5" in why[0] and "until it changes" in why[0], why
    assert "Dim" not in why[0], why
    assert seen == [f"recompiling {why[0]}"], seen
    # in user terms first: which autograd node's tensor, which dim, the old and new value
    named = re.match(r"backward graph \d+: dim 0 of (.*) of (\w+) changed 3 -> 5 \(args", why[0])
    assert named is not None, why
    assert named[2] in _node_classes(mlp(), torch.randn(3, 6)), why
    stoker_autograd.reset_stats()
    assert stoker_autograd.recompile_reasons() == []


def _node_classes(model: nn.Module, x: torch.Tensor) -> set[str]:
    """The class names of the autograd nodes of eager ``model(x).pow(2).mean()``."""
    names: set[str] = set()
    todo = [model(x).pow(2).mean().grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and type(fn).__name__ not in names:
            names.add(type(fn).__name__)
            todo += [f for f, _ in fn.next_functions]
    return names


def test_a_recompile_without_the_origin_table_keeps_the_guard_text() -> None:
    """A captured graph with no table of what its inputs are (as one restored from
    elsewhere might be) still says why it recompiled: the guard's own text."""
    from stoker_autograd._internal.origins import describe

    torch.manual_seed(0)
    m = mlp()
    with stoker_autograd.enable(dynamic=True) as session:
        for n in (3, 5, 7):
            m.zero_grad()
            m(torch.randn(n, 6)).pow(2).mean().backward()
            for graph in session.graphs:
                graph.origins = None
    why = stoker_autograd.recompile_reasons()
    assert len(why) == 1 and why[0].split(": ", 1)[1].startswith("args[0]["), why
    raw = "args[1][4] == 3 failed: got args[1][4] = 5"
    assert describe(raw, None) == describe(raw, {}) == raw
    assert describe(raw, {("inputs", 4): "x"}) == raw  # another list's index 4


def test_recompile_reason_names_a_size_input() -> None:
    """A guard on a lifted size (``args[1][k]``) and on a tensor's stride translate too."""
    from stoker_autograd._internal.origins import describe

    table = {("sizes", 4): "dim 1 of a shape saved by MmBackward0", ("inputs", 2): "t"}
    got = describe("args[1][4] == 3 failed: got args[1][4] = 5; static", table)
    assert got.startswith("dim 1 of a shape saved by MmBackward0 changed 3 -> 5 (args[1][4]"), got
    got = describe("args[0][2].stride()[0] == 8 failed: got 6", table)
    assert got == "stride 0 of t changed 8 -> 6 (args[0][2].stride()[0] == 8 failed: got 6)", got
    got = describe("2*args[1][4] >= 3 failed: got args[1][4] = 1", table)
    assert got.startswith("dim 1 of a shape saved by MmBackward0 (2*args"), got


def test_guards_added_while_retracing_name_the_backward_node() -> None:
    """explain() of a miss names the autograd node whose retrace added the guard,
    not just the user's ``loss.backward()`` line (or nothing: "origin unknown")."""
    model = _TokenModel()
    with stoker_autograd.enable() as session:
        for n in (3, 5, 7):
            out = model(torch.randint(0, 11, (n, 5))[:, :-1])
            # padding the batch x T rows: its backward guards on them (`!= 1`)
            nn.functional.pad(out, (0, 0, 1, 1)).pow(2).mean().backward()
    # the graph replayed with .grad defined compiled a symbolic variant: retrace guards
    graph = next(g for g in session.graphs if len(g.variants) == 2)
    text = str(graph.variants[-1].guards)
    named = [line for line in text.splitlines() if "while retracing" in line]
    assert any("Backward" in line for line in named), text
    assert "origin unknown" not in text, text


class _NoGradForSecond(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g, None  # no gradient for b, which requires grad


def test_custom_backward_returning_none_for_an_input_that_requires_grad() -> None:
    """The captured graph reads the Function's grad for b (through b's expand and slice
    backwards); a None there crashed the compiled backward ("add(): argument 'input'
    must be Tensor, not NoneType").  It now reads zeros: eager's values."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = self.b(x)
            out = _NoGradForSecond.apply(self.a(x), b[:, :1].expand(-1, 4))
            return out.pow(2).sum() + b.sum() * 0.1

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(5, 6)).backward()

    compare(M, step, steps=3)


def test_custom_backward_returning_none_for_a_parameter_leaves_its_grad_none() -> None:
    """None straight into a parameter's accumulate-grad: .grad stays None, as in eager."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.c = nn.Linear(6, 4), nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _NoGradForSecond.apply(self.a(x), self.c).pow(2).sum()

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(5, 6)).backward()

    _, model = compare(M, step, steps=3)
    assert model.c.grad is None


def test_custom_backward_none_reaching_a_parameter_through_other_nodes_leaves_its_grad_none() -> (
    None
):
    """The None reaches ``b``'s parameters through tanh's and the Linear's backwards
    (no other gradient does): eager's engine propagates it undefined and never touches
    their ``.grad``; the compiled graph computed with zeros there and gave a zero
    ``.grad``.  Now `passes.mark_undefined_leaves` finds them and ``.grad`` stays None,
    on the first (uncompiled) run and the compiled ones, both executors."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _NoGradForSecond.apply(self.a(x), self.b(x).tanh()).pow(2).sum()

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(5, 6)).backward()
        log.append(f"b.weight.grad is None: {m.b.weight.grad is None}")

    log, model = compare(M, step, steps=3)
    assert model.b.weight.grad is None and model.b.bias.grad is None
    assert model.a.weight.grad is not None
    assert log.count("b.weight.grad is None: True") == 3


class _MaybeNoGradForSecond(torch.autograd.Function):
    """Gradient for b only when the forward was told so (a ctx attribute: not in the
    engine's key, so one captured graph serves both)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, give: bool) -> torch.Tensor:
        ctx.give = give
        return a + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g, (g * 2 if ctx.give else None), None


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads_to_none", "accumulate"])
def test_custom_backward_none_on_some_steps_only(set_to_none: bool) -> None:
    """None on steps 0 and 2, a gradient on steps 1 and 3, from one captured graph: the
    parameter behind it is None until a step gives it a gradient, then follows eager
    (accumulating: a later None leaves the sum alone)."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 4)

        def forward(self, x: torch.Tensor, give: bool) -> torch.Tensor:
            h = self.b(x).tanh().view(5, 2, 2).sum(-1)  # several nodes: view, sum, tanh
            return _MaybeNoGradForSecond.apply(self.a(x)[:, :2], h, give).pow(2).sum()

    def step(m: nn.Module, log: list[str], i: int) -> None:
        if set_to_none or i == 0:
            m.zero_grad(set_to_none=True)
        m(torch.randn(5, 6), i % 2 == 1).backward()
        log.append(f"step {i}: b.weight.grad is None: {m.b.weight.grad is None}")

    log, _ = compare(M, step, steps=4)
    assert "step 0: b.weight.grad is None: True" in log
    assert "step 1: b.weight.grad is None: False" in log
    assert any(s == f"step 2: b.weight.grad is None: {set_to_none}" for s in log), log


class _NoneBehindTanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NoGradForSecond.apply(self.a(x), self.b(x).tanh()).pow(2).sum()


def test_custom_backward_none_behind_other_nodes_after_a_disk_cache_hit() -> None:
    """The leaves travel with the retraced graph into the disk cache (node arguments of
    the custom backward's call): a graph loaded from disk keeps ``.grad`` None too."""
    torch.manual_seed(0)
    m = _NoneBehindTanh()
    ref = copy.deepcopy(m)
    with stoker_autograd.enable(compiler=_COMPILER[0]):
        for i in range(4):
            if i == 2:  # the engine captures again and finds the compile on disk
                torch._C._dynamo.compiled_autograd.clear_cache()
            x = torch.randn(5, 6)
            m.zero_grad()
            ref.zero_grad()
            m(x).backward()
            with stoker_autograd.disabled():
                ref(x).backward()
            assert m.b.weight.grad is None and m.b.bias.grad is None, i
            assert m.a.weight.grad is not None and ref.a.weight.grad is not None
            torch.testing.assert_close(m.a.weight.grad, ref.a.weight.grad)
    st = stoker_autograd.stats()
    assert st["disk_hits"] == 1 and st["captures"] == 2 and st["fallbacks"] == 0, st


class _NoneForSecondToo(_NoGradForSecond):
    pass


def test_limitation_none_from_two_custom_backwards_still_gives_zeros() -> None:
    """Documents a limitation (docs/autograd.md, *A custom backward returning None*):
    ``b`` is reached from two custom backwards, each returning None for it.  Eager
    leaves ``b.weight.grad`` None; stoker-autograd decides per custom backward (each
    call knows only its own outputs), so a leaf whose gradients come from two of them is
    never listed and gets zeros: the same values, a zero tensor instead of None."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.b(x)
            y = _NoGradForSecond.apply(self.a(x), h) + _NoneForSecondToo.apply(self.a(x), h)
            return y.pow(2).sum()

    torch.manual_seed(0)
    m = M()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 6)
    ref(x).backward()
    assert ref.b.weight.grad is None
    with stoker_autograd.enable(compiler=_COMPILER[0]):
        for _ in range(2):
            m.zero_grad()
            m(x).backward()
    assert m.b.weight.grad is not None and not m.b.weight.grad.any()  # zeros, not None
    assert m.a.weight.grad is not None and ref.a.weight.grad is not None
    torch.testing.assert_close(m.a.weight.grad, ref.a.weight.grad)


def test_custom_backward_none_through_an_inlined_aot_backward_leaves_its_grad_none() -> None:
    """The None reaches a stoker-capture compiled block (``aot_module``) whose backward is
    inlined: eager's Function returns None for the gradients that read only undefined
    tangents (``undefined_grads``); the pass follows the block's gradients to the
    grads they read, so the block's parameters keep ``.grad`` None too."""
    stoker_capture = pytest.importorskip("stoker_capture")

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 4)
            self.b = nn.Sequential(nn.Linear(6, 4), nn.Tanh())
            self.cb = stoker_capture.aot_module(self.b)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _NoGradForSecond.apply(self.a(x), self.cb(x)).pow(2).sum()

    def step(m: nn.Module, log: list[str], i: int) -> None:
        m.zero_grad()
        m(torch.randn(5, 6)).backward()
        log.append(f"b grads None: {[p.grad is None for p in m.b.parameters()]}")

    log, model = compare(M, step, steps=3)
    assert log.count("b grads None: [True, True]") == 3, log
    assert model.a.weight.grad is not None
