"""Which backwards stoker compiles, blocks that nest (and fail loudly when they do not),
the engine hook never left pointing at stoker, and the engine's cache kept across blocks.

Every gradient is checked against eager's on fresh random inputs.
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import stoker_autograd
from stoker_autograd._internal import engine
from stoker_autograd._internal.capture import CaptureInstance

stoker_capture = pytest.importorskip("stoker_capture")
from stoker_capture._internal.runtime import function as runtime_fn  # noqa: E402

WORKER = Path(__file__).with_name("scope_sequence_worker.py")
_spec = importlib.util.spec_from_file_location("scope_sequence_worker", WORKER)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

hook = torch._C._dynamo.compiled_autograd


def _hook_unset() -> bool:
    prior = hook.set_autograd_compiler(None, False)
    return prior[0] is None


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))


def _grads(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ scope
def test_compiled_scope_takes_only_backwards_through_a_stoker_forward() -> None:
    plain, ref_plain = _mlp(1), _mlp(1)
    base, ref = _mlp(2), _mlp(2)
    fwd = stoker_capture.aot_module(base)
    x = torch.randn(5, 4)
    ref(x).pow(2).sum().backward()
    ref_plain(x).pow(2).sum().backward()
    with stoker_autograd.enable(scope="compiled"):
        out = fwd(x)
        assert runtime_fn.LIVE[0] > 0
        assert engine.holds_stoker_node([out.pow(2).sum()])
        before = stoker_autograd.stats()
        plain(x).pow(2).sum().backward()  # beside a live stoker graph: walked, eager
        assert stoker_autograd.stats() == before
        _close(_grads(plain), _grads(ref_plain))
        out.pow(2).sum().backward(retain_graph=True)
        assert stoker_autograd.stats()["captures"] == before["captures"] + 1
        _close(_grads(base), _grads(ref))
        assert runtime_fn.LIVE[0] == 1  # retained: it may be backwarded again
        base.zero_grad(set_to_none=True)
        out.pow(2).sum().backward()
        _close(_grads(base), _grads(ref))
        assert runtime_fn.LIVE[0] == 0  # backwarded without retain_graph: the O(1) check
        again = fwd(x)
        assert runtime_fn.LIVE[0] == 1
    del again
    assert runtime_fn.LIVE[0] == 0  # the graph is gone
    assert _hook_unset()


def test_gradient_edge_roots_inputs_and_autograd_grad_are_routed() -> None:
    base, ref = _mlp(3), _mlp(3)
    fwd = stoker_capture.aot_module(base)
    x = torch.randn(6, 4)
    g = torch.randn(6, 3)
    with stoker_autograd.enable(scope="compiled"):
        # a GradientEdge root
        out = fwd(x)
        edge = torch.autograd.graph.get_gradient_edge(out)
        assert engine.holds_stoker_node([edge])
        c0 = stoker_autograd.stats()["captures"]
        torch.autograd.backward([edge], [g])  # type: ignore[list-item]
        assert stoker_autograd.stats()["captures"] == c0 + 1
        ref(x).backward(g)
        _close(_grads(base), _grads(ref))
        # inputs=
        base.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        w0, w_ref = base[0].weight, ref[0].weight
        fwd(x).backward(g, inputs=[w0])
        ref(x).backward(g, inputs=[w_ref])
        assert base[2].weight.grad is None
        torch.testing.assert_close(w0.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
        # torch.autograd.grad
        h0 = stoker_autograd.stats()
        got = torch.autograd.grad(fwd(x).pow(2).sum(), list(base.parameters()))
        h1 = stoker_autograd.stats()
        assert h1["captures"] + h1["cache_hits"] > h0["captures"] + h0["cache_hits"]
        want = torch.autograd.grad(ref(x).pow(2).sum(), list(ref.parameters()))
        _close(list(got), list(want))
    assert _hook_unset()


def test_default_scope_and_explicit_blocks_over_it() -> None:
    plain, ref_plain = _mlp(4), _mlp(4)
    base, ref = _mlp(5), _mlp(5)
    fwd = stoker_capture.aot_module(base)
    x = torch.randn(3, 4)
    try:
        session = stoker_autograd.set_default()
        assert stoker_autograd.default_session() is session
        c0 = stoker_autograd.stats()["captures"]
        plain(x).sum().backward()
        assert stoker_autograd.stats()["captures"] == c0  # eager model: eager engine
        fwd(x).sum().backward()
        assert stoker_autograd.stats()["captures"] == c0 + 1
        assert len(session.graphs) == 1
        with stoker_autograd.enable():  # all backwards in the block
            plain(x).sum().backward()
        assert stoker_autograd.stats()["captures"] == c0 + 2
        with stoker_autograd.disabled():  # none
            fwd(x).sum().backward()
        assert stoker_autograd.stats()["captures"] == c0 + 2
    finally:
        stoker_autograd.clear_default()
    for _ in range(2):
        ref_plain(x).sum().backward()
        ref(x).sum().backward()
    _close(_grads(plain), _grads(ref_plain))
    _close(_grads(base), _grads(ref))
    assert _hook_unset() and not stoker_autograd.is_enabled()


def test_a_scope_is_checked() -> None:
    with pytest.raises(ValueError, match="scope='everything'"):
        with stoker_autograd.enable(scope="everything"):
            pass
    assert not stoker_autograd.is_enabled()


# ------------------------------------------------------------------ nesting and teardown
@pytest.mark.parametrize("name", sorted(worker.CASES))
def test_sequence_case_in_process(name: str) -> None:
    worker.CASES[name]()


@pytest.mark.slow  # a fresh process (~10 s of CPU to start and compile)
def test_sequences_in_one_process_in_both_orders() -> None:
    """Every case, then every case again in reverse order, in one fresh process: each
    case follows each other one at least once (the in-process runs follow the order the
    test runner picks)."""
    names = list(worker.CASES)
    order = names + names[::-1]
    p = subprocess.run(
        [sys.executable, str(WORKER), ",".join(order)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert p.stdout.split() == [w for n in order for w in ("ok", n)], p.stdout


def test_the_inner_block_closed_by_off_out_of_order() -> None:
    s = stoker_autograd.on()
    with pytest.raises(RuntimeError, match="closed before on"):
        with stoker_autograd.enable():
            stoker_autograd.on()  # never closed inside the block
    # the enable() block is closed; both on() blocks are still open, innermost first
    assert stoker_autograd.is_enabled()
    stoker_autograd.off()
    stoker_autograd.off()
    assert not stoker_autograd.is_enabled()
    assert isinstance(s, stoker_autograd.Session)
    with pytest.raises(RuntimeError, match="without a matching on"):
        stoker_autograd.off()
    assert _hook_unset()


def test_disabled_closed_out_of_order() -> None:
    d = stoker_autograd.disabled()
    d.__enter__()
    stoker_autograd.on()
    with pytest.raises(RuntimeError, match=r"disabled\(\) opened at .* was closed before on"):
        d.__exit__(None, None, None)
    assert stoker_autograd.is_enabled()
    stoker_autograd.off()
    assert not stoker_autograd.is_enabled() and _hook_unset()


def test_a_failure_inside_capture_leaves_the_engine_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    m, ref = _mlp(6), _mlp(6)
    x = torch.randn(3, 4)
    real = CaptureInstance.begin_capture

    def failing(self: Any, *args: Any) -> Any:
        raise RuntimeError("capture failed on purpose")

    monkeypatch.setattr(CaptureInstance, "begin_capture", failing)
    with stoker_autograd.enable():
        with pytest.raises(RuntimeError, match="capture failed on purpose"):
            m(x).sum().backward()
        assert _hook_unset()
        monkeypatch.setattr(CaptureInstance, "begin_capture", real)
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    ref(x).sum().backward()
    _close(_grads(m), _grads(ref))
    assert stoker_autograd.stats()["captures"] == 1
    assert _hook_unset()


def test_clear_cache_inside_a_compiled_backward_waits_for_its_end() -> None:
    m, ref = _mlp(7), _mlp(7)
    x = torch.randn(3, 4)
    cleared: list[bool] = []

    def clear_in_hook(g: torch.Tensor) -> None:
        stoker_autograd.clear_cache()  # the engine is running this backward's graph
        cleared.append(True)

    m[2].weight.register_hook(clear_in_hook)
    ref[2].weight.register_hook(lambda g: None)
    with stoker_autograd.enable():
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
    for _ in range(2):
        ref.zero_grad(set_to_none=True)
        ref(x).sum().backward()
    _close(_grads(m), _grads(ref))
    assert cleared == [True, True]
    assert stoker_autograd.stats()["captures"] == 2
    (reason,) = stoker_autograd.recapture_reasons()
    assert "the engine's cache was cleared (clear_cache() was called)" in reason, reason


def test_a_compiled_backward_on_worker_threads() -> None:
    models = [_mlp(8), _mlp(8)]
    refs = [_mlp(8), _mlp(8)]
    xs = [torch.randn(3, 4), torch.randn(5, 4)]
    errors: list[BaseException] = []

    def train(i: int) -> None:
        try:
            for _ in range(3):
                models[i].zero_grad(set_to_none=True)
                models[i](xs[i]).pow(2).sum().backward()
        except BaseException as e:  # reported below
            errors.append(e)

    with stoker_autograd.enable():
        threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for r, x in zip(refs, xs, strict=True):
        r(x).pow(2).sum().backward()
    for m, r in zip(models, refs, strict=True):
        _close(_grads(m), _grads(r))
    assert stoker_autograd.stats()["cache_hits"] >= 1
    assert _hook_unset()


# ------------------------------------------------------------------ the cache across blocks
def _train(per_step: bool) -> tuple[dict[str, int], list[list[torch.Tensor]], list[str]]:
    stoker_autograd.clear_cache()
    stoker_autograd.reset_stats()
    model = _mlp(9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(10)
    xs = [torch.randn(4, 4), torch.randn(4, 4), torch.randn(6, 4)]
    grads = []
    with nullcontext() if per_step else stoker_autograd.enable():
        for x in xs:
            with stoker_autograd.enable() if per_step else nullcontext():
                opt.zero_grad()
                model(x).pow(2).sum().backward()
            grads.append(_grads(model))
            opt.step()
    return stoker_autograd.stats(), grads, stoker_autograd.recompile_reasons()


def test_enable_entered_every_step_replays_what_it_captured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STOKER_AUTOGRAD_CACHE", "0")  # the second run compiles as the first
    whole, grads_whole, why_whole = _train(per_step=False)
    per_step, grads_step, why_step = _train(per_step=True)
    assert per_step == whole, (per_step, whole)
    assert per_step["captures"] == 1 and per_step["cache_hits"] == 2, per_step
    assert stoker_autograd.recapture_reasons() == []
    # the same reasons (the graphs' numbers run on over the process)
    assert [w.split(": ", 1)[1] for w in why_step] == [w.split(": ", 1)[1] for w in why_whole]
    if per_step["recompiles"]:  # the batch-6 step compiled a symbolic variant: said why
        assert len(why_step) == per_step["recompiles"] and "4 -> 6" in why_step[0], why_step
    # eager, the same steps
    model = _mlp(9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(10)
    for x, got in zip([torch.randn(4, 4), torch.randn(4, 4), torch.randn(6, 4)], grads_step):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        _close(got, _grads(model))
        opt.step()
    _close(grads_whole[-1], grads_step[-1])


def test_another_compiler_object_each_step_recaptures_with_a_reason() -> None:
    m = _mlp(11)
    x = torch.randn(3, 4)
    for _ in range(2):
        with stoker_autograd.enable(compiler=lambda gm, ex: gm):  # a new object each time
            m.zero_grad()
            m(x).sum().backward()
    assert stoker_autograd.stats()["captures"] == 2
    (reason,) = stoker_autograd.recapture_reasons()
    assert "cache was cleared (compiled for another compiler" in reason, reason


def test_captures_and_compiles_are_mirrored_in_torchs_counters() -> None:
    from torch._dynamo.utils import counters

    counters["compiled_autograd"].clear()
    m = _mlp(12)
    with stoker_autograd.enable():
        for _ in range(3):
            m.zero_grad()
            m(torch.randn(3, 4)).sum().backward()
    st = stoker_autograd.stats()
    assert st["captures"] == 1 and st["compiles"] == 1, st
    assert counters["compiled_autograd"]["captures"] == st["captures"]
    assert counters["compiled_autograd"]["compiles"] == st["compiles"]


def test_a_backward_inside_a_compiled_function_traces_no_stoker_frame() -> None:
    """Dynamo converts every frame that starts inside a graph break; stoker's engine
    callbacks must not be among them."""
    seen: list[str] = []

    def record(code: Any, out_code: Any) -> None:
        seen.append(code.co_filename)

    handle = torch._dynamo.convert_frame.register_bytecode_hook(record)
    try:
        worker.case_compiled_fn_backward()
    finally:
        handle.remove()
    pkg_dirs = [str(Path(m.__file__).parent) for m in (stoker_autograd, stoker_capture)]
    assert seen, "Dynamo converted nothing: the test is not testing"
    bad = [f for f in seen if any(f.startswith(d) for d in pkg_dirs)]
    assert not bad, bad


def test_plain_eager_backward_is_untouched_beside_a_compiled_one() -> None:
    """Hooks on an eager model fire in eager's order, its gradients bit for bit, while
    the default scope compiles a stoker model's backward."""
    torch.manual_seed(13)
    plain = nn.Sequential(nn.Linear(3, 3))
    ref = copy.deepcopy(plain)
    order: list[list[str]] = [[], []]
    for k, mod in enumerate((plain, ref)):
        for name, p in mod.named_parameters():
            p.register_hook(lambda g, n=name, k=k: order[k].append(f"t {n}"))
            p.register_post_accumulate_grad_hook(lambda t, n=name, k=k: order[k].append(f"a {n}"))
    fwd = stoker_capture.aot_module(_mlp(14))
    x = torch.randn(4, 3, requires_grad=True)
    ref(x).sum().backward()
    try:
        stoker_autograd.set_default()
        loss = fwd(torch.randn(2, 4)).sum()  # a live stoker graph beside it
        c0 = stoker_autograd.stats()
        plain(x).sum().backward()
        assert stoker_autograd.stats() == c0
        loss.backward()
        assert stoker_autograd.stats()["captures"] == c0["captures"] + 1
    finally:
        stoker_autograd.clear_default()
    assert order[0] == order[1] and order[0]
    for p, r in zip(plain.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, r.grad)  # type: ignore[arg-type]


def test_clear_cache_between_backwards_gives_the_recapture_its_reason() -> None:
    m, ref = _mlp(15), _mlp(15)
    x = torch.randn(3, 4)
    with stoker_autograd.enable():
        m(x).sum().backward()
        stoker_autograd.clear_cache()
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    ref(x).sum().backward()
    _close(_grads(m), _grads(ref))
    assert stoker_autograd.stats()["captures"] == 2
    (reason,) = stoker_autograd.recapture_reasons()
    assert "the engine's cache was cleared (clear_cache() was called)" in reason, reason
