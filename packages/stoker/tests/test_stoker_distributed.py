"""DDP under stoker on one gloo rank, in this process: modes, errors, the bucketed
reducer's bookkeeping.  The 2-rank parity runs are in tests-integration."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import stoker
from stoker._internal.distributed import distributed
from stoker._internal.distributed.launch import free_port

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="no gloo in this torch"
)


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    stoker.reset()
    yield
    stoker.reset()


class _Net(nn.Module):
    """User code (Dynamo skips the frames of torch.nn's own containers)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 16), nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.norm(self.a(x))))  # type: ignore[no-any-return]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _ddp(m: nn.Module, **kw: object) -> nn.parallel.DistributedDataParallel:
    return nn.parallel.DistributedDataParallel(m, **kw)  # type: ignore[arg-type]


def test_unsupported_settings_are_named_with_what_to_change() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    d = _ddp(_mlp(), find_unused_parameters=True)
    d.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(stoker.StokerConfigError) as e:
        stoker.compile(d)
    msg = str(e.value)
    assert "find_unused_parameters=False" in msg and "register no comm hook" in msg
    assert "compiled_autograd=False" in msg
    # the same settings are fine without compiled autograd (DDP's own reducer runs)
    stoker.compile(_ddp(_mlp(), find_unused_parameters=True), compiled_autograd=False)


@pytest.mark.parametrize("order", ["outer", "inner"])
def test_stoker_reducer_trains_like_eager_ddp_with_no_sync(order: str) -> None:
    eager = _mlp()
    ref = _ddp(copy.deepcopy(eager), bucket_cap_mb=0.0002)
    m = copy.deepcopy(eager)
    if order == "outer":
        d = _ddp(m, bucket_cap_mb=0.0002)
        model: nn.Module = stoker.compile(d)
    else:
        d = _ddp(stoker.compile(m), bucket_cap_mb=0.0002)
        model = d
    for step in range(3):
        for micro in range(2):
            x = torch.randn(5 + step, 4)
            with d.no_sync() if micro == 0 else _nothing():
                model(x).pow(2).mean().backward()
            with ref.no_sync() if micro == 0 else _nothing(), stoker.autograd_enabled(False):
                ref(x).pow(2).mean().backward()
        for p, q in zip(m.parameters(), ref.module.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            p.grad, q.grad = None, None
    rec = d._stoker_ddp  # type: ignore[attr-defined]
    assert rec.mode == "stoker_reducer" and len(rec.buckets) > 1
    assert len(rec.steps) == 3  # one reduction per synchronised backward, none under no_sync
    assert [c.bucket for c in rec.steps[-1]] == list(range(len(rec.buckets)))
    info = distributed.summary()
    assert info["ddp"][-1]["mode"] == "stoker_reducer"
    hooks = [s for s in info["backward_sites"] if s["kind"] == "post_acc_grad_hook"]
    assert len(hooks) == len(rec.buckets) and hooks[0]["compute_after"] > 0  # one per bucket


@pytest.mark.parametrize("setting", ["static_graph", "gradient_as_bucket_view"])
def test_static_graph_and_gradient_as_bucket_view_train_like_eager_ddp(setting: str) -> None:
    """static_graph: DDP's delayed first all-reduce is its C++ reducer's, which stoker's
    replaces (its buckets are static anyway); gradient_as_bucket_view: each .grad stays
    its own tensor, the reduced bucket is copied into it."""
    eager = _mlp()
    ref = _ddp(copy.deepcopy(eager), bucket_cap_mb=0.0002, **{setting: True})
    m = copy.deepcopy(eager)
    d = _ddp(m, bucket_cap_mb=0.0002, **{setting: True})
    compiled = stoker.compile(d)
    for step in range(3):
        x = torch.randn(5 + step, 4)
        compiled(x).pow(2).mean().backward()
        with stoker.autograd_enabled(False):
            ref(x).pow(2).mean().backward()
        for p, q in zip(m.parameters(), ref.module.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            p.grad, q.grad = None, None
    assert d._stoker_ddp.mode == "stoker_reducer"  # type: ignore[attr-defined]
    assert len(d._stoker_ddp.steps) == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize("order", ["outer", "inner"])
def test_join_is_refused_with_what_to_change(order: str) -> None:
    """DDP's join() shadows the all-reduces of DDP's C++ reducer, which stoker's replaces
    (a rank out of data would wait on collectives nobody issues): refused, in either order
    and whether join() is entered before or after the first forward."""
    m = _mlp()
    d = _ddp(m) if order == "outer" else _ddp(stoker.compile(m))
    model = stoker.compile(d) if order == "outer" else d
    with pytest.raises(stoker.StokerConfigError, match=r"join\(\).*same number of batches"):
        with d.join():
            model(torch.randn(3, 4)).sum().backward()
    model(torch.randn(3, 4)).sum().backward()  # adopted now, if not before
    with pytest.raises(stoker.StokerConfigError, match=r"join\(\)"):
        with d.join():
            pass


def test_join_works_without_compiled_autograd() -> None:
    m = _mlp()
    ref = _ddp(copy.deepcopy(m))
    d = _ddp(m)
    compiled = stoker.compile(d, compiled_autograd=False)
    x = torch.randn(3, 4)
    with d.join():
        compiled(x).sum().backward()
    with stoker.autograd_enabled(False), ref.join():
        ref(x).sum().backward()
    for p, q in zip(m.parameters(), ref.module.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_parameter_without_gradient_is_an_error_not_a_hang() -> None:
    m = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    d = _ddp(m)
    compiled = stoker.compile(lambda x: d.module["used"](x))
    distributed.adopt(d, compiled_autograd=True)
    with pytest.raises(stoker.StokerConfigError, match=r"unused\.weight, unused\.bias"):
        compiled(torch.randn(2, 4)).sum().backward()


def _newest_graph() -> Any:
    from stoker._internal.api.backend import SWITCH

    assert SWITCH.session is not None
    return SWITCH.session.graphs[-1]


def _newest_segments() -> int:
    return len(_newest_graph().variants[-1].fn.segments)


def _sites() -> list[dict[str, Any]]:
    return distributed.summary()["backward_sites"]  # type: ignore[no-any-return]


def _assert_grads_equal(m: nn.Module, ref: nn.Module) -> None:
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_after_the_rebuild_the_backward_is_cut_once_per_bucket_not_per_parameter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first backward hooks every parameter (one segment each); after the rebuild only
    each bucket's last gradient is hooked, so the backward has a segment per bucket (one
    more if compute follows the last hook).  An eager backward in between (no picture of
    .grad to check against) reduces every bucket from the final callback.  The graph
    with a hook per parameter is not compiled (an empty disk cache: none is loaded)."""
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    eager = _mlp()
    ref = _ddp(copy.deepcopy(eager), bucket_cap_mb=0.0002)
    m = copy.deepcopy(eager)
    d = _ddp(m, bucket_cap_mb=0.0002)
    compiled = stoker.compile(d)
    n_params = len(list(m.parameters()))
    for step in range(4):
        x = torch.randn(5, 4)
        with stoker.autograd_enabled(step != 2):
            compiled(x).pow(2).mean().backward()
        with stoker.autograd_enabled(False):
            ref(x).pow(2).mean().backward()
        _assert_grads_equal(m, ref.module)
        buckets = len(d._stoker_ddp.buckets)  # type: ignore[attr-defined]
        if step == 0:  # a hook per parameter, a graph not compiled: the hooks changed
            assert not _newest_graph().variants
            assert sum(s["kind"] == "post_acc_grad_hook" for s in _sites()) == n_params
        else:
            assert _newest_segments() in (buckets, buckets + 1), (step, buckets)
        m.zero_grad(set_to_none=step % 2 == 0)
        ref.zero_grad(set_to_none=step % 2 == 0)
    assert 1 < buckets < n_params
    assert len(d._stoker_reducer.handles) == buckets  # type: ignore[attr-defined]
    assert sum(s["kind"] == "post_acc_grad_hook" for s in _sites()) == buckets
    steps = d._stoker_ddp.steps  # type: ignore[attr-defined]
    assert [c.ready for c in steps[-1]][-1] == n_params and len(steps) == 4


class _Two(nn.Module):
    """Two Linears in one bucket whose gradients arrive in the order opposite to their
    use (the engine runs the later node first): ``flip`` swaps them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p, self.q = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, flip: bool = False, use_q: bool = True) -> torch.Tensor:
        if not use_q:
            return self.p(x).sum()
        if flip:
            b = self.q(x)
            a = self.p(x)
        else:
            a = self.p(x)
            b = self.q(x)
        return (a * b).sum()


def test_a_bucket_hooked_before_its_other_gradients_waits_for_the_final_callback() -> None:
    """Another graph order after the rebuild: the bucket's hooked gradient comes first.
    Its hook sees the others not accumulated yet (grads zeroed in place: a premature
    reduction would write back stale values) and leaves the bucket to the final
    callback; the reducer then hooks every parameter again."""
    m = _Two()
    ref = _ddp(copy.deepcopy(m))
    d = _ddp(m)
    compiled = stoker.compile(d)
    params = [*m.parameters(), *ref.module.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    for step, flip in enumerate([False, False, True, True]):
        x = torch.randn(3, 4)
        for p in params:
            assert p.grad is not None
            p.grad.zero_()
        compiled(x, flip).backward()
        with stoker.autograd_enabled(False):
            ref(x, flip).backward()
        _assert_grads_equal(m, ref.module)
        reducer = d._stoker_reducer  # type: ignore[attr-defined]
        assert reducer.counting == (step >= 2), step
        assert len(reducer.handles) == (4 if step >= 2 else 1)


def test_a_parameter_without_gradient_after_the_rebuild_is_an_error() -> None:
    m = _Two()
    compiled = stoker.compile(_ddp(m))
    for _ in range(2):
        compiled(torch.randn(3, 4)).backward()
    with pytest.raises(stoker.StokerConfigError, match=r"q\.weight, q\.bias"):
        compiled(torch.randn(3, 4), use_q=False).backward()


def test_without_compiled_autograd_the_graph_splits_at_small_buckets() -> None:
    m = _mlp()
    d = _ddp(m, bucket_cap_mb=0.0002)
    compiled = stoker.compile(d, compiled_autograd=False)
    compiled(torch.randn(3, 4)).sum().backward()
    assert d._stoker_ddp.mode == "ddp_optimizer"  # type: ignore[attr-defined]
    report = stoker.last_report()
    assert report is not None and report.n_graphs > 1  # unsplit, this is one graph


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def test_demo_cli_takes_ranks_and_parallel_and_prints_where_collectives_sit() -> None:
    from stoker._internal.bench.demo_distributed import format_distributed
    from stoker.cli import build_parser

    args = build_parser().parse_args(["demo", "--ranks", "2", "--parallel", "fsdp2"])
    assert (args.ranks, args.parallel) == (2, "fsdp2")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--parallel", "tp"])
    m = _mlp()
    d = _ddp(m, bucket_cap_mb=0.0002)
    compiled = stoker.compile(d)
    compiled(torch.randn(3, 4)).sum().backward()
    text = format_distributed("ddp", 1, distributed.summary())
    assert "DDP reducer mode: stoker_reducer" in text
    assert "started after" in text and "post_acc_grad_hook ×6" in text


def test_collectives_per_step_in_the_summary_demo_and_report(tmp_path: Path) -> None:
    """Eager steps (a hand-written reducer: an all-reduce per gradient from a hook) and
    compiled DDP steps (stoker's reducer: one per bucket) alternate, as in the demo; each
    collective is recorded at c10d's ProcessGroup with its phase, the compiled ones with
    the backward node that issued them; the demo text and the report show both.  (FSDP2
    issues no collectives on one rank: its counts are checked on 2 in tests-integration.)"""
    from stoker._internal.bench.demo_distributed import format_distributed
    from stoker._internal.distributed import collectives

    eager = _mlp()
    for p in eager.parameters():
        p.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad))
    m = _mlp()
    d = _ddp(m, bucket_cap_mb=0.0002)
    compiled = stoker.compile(d, report=str(tmp_path / "r.html"))
    collectives.install()
    collectives.clear()
    for step in range(3):
        x = torch.randn(3 + step, 4)
        with stoker.autograd_enabled(False):
            eager(x).sum().backward()
        compiled(x).sum().backward()
    assert [s.compiled for s in collectives.steps()] == [False, True] * 3
    info = distributed.summary()
    buckets = len(d._stoker_ddp.buckets)  # type: ignore[attr-defined]
    assert info["last_eager"]["counts"] == {"all_reduce": {"backward": 6}}
    assert info["last_compiled"]["counts"] == {"all_reduce": {"backward": buckets}}
    issued = info["last_compiled"]["issued"]
    assert all(c["site"]["kind"] == "post_acc_grad_hook" for c in issued)
    at = [c["site"]["at"] for c in issued]
    assert at == sorted(at) and at[0] < issued[0]["site"]["of"] - 1  # inside the backward
    text = format_distributed("ddp", 1, info)
    assert re.search(rf"all_reduce +backward 6 \| {buckets}\n", text), text
    assert "by post_acc_grad_hook at" in text
    report = stoker.last_report()
    assert report is not None
    report.distributed = info
    html = report.to_html()
    assert "Collectives per step" in html and "post_acc_grad_hook" in html


def test_a_model_without_ddp_or_fsdp2_has_no_distributed_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain model's backward ends in the final callbacks too: that alone is not a
    distributed run (the report would show an empty Distributed section)."""
    from stoker._internal.distributed import collectives

    monkeypatch.setattr(distributed, "_RECORDS", [])  # DDP modules of earlier tests
    collectives.clear()
    compiled = stoker.compile(_mlp())
    compiled(torch.randn(3, 4)).sum().backward()
    sites = distributed.backward_collectives()
    assert [s["kind"] for s in sites] == ["final callbacks"]
    assert distributed.summary() == {}
