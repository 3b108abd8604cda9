"""mode="reduce-overhead": CUDA graph planning, static buffers, fallbacks and the re-record limit.

On the CPU a `HostRecorder` stands in for torch's CUDA graphs: recording runs the
function, replaying runs it again and writes the results into the recorded
outputs, as a graph writes its static buffers. So an output handed out and then
overwritten by a later replay shows up as a wrong value here, as it would on a GPU.
The GPU tests at the end train on CUDA with real graphs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from interpret_script import run_interpreted
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import stoker
from stoker._internal.bench.models import GPT, MLP, GPTConfig, lm_loss
from stoker._internal.cudagraphs import cudagraphs as cg
from stoker._internal.cudagraphs.plan import plan_graph
from stoker._internal.report.report import autograd_stats


@pytest.fixture(autouse=True)
def _reset_stoker() -> Iterator[None]:
    """Compiled autograd is a process-wide switch: off after every test, failed ones too."""
    yield
    stoker.reset()


def _graphed(fn: Callable[..., Any], examples: list[Any], gm: Any = None, limit: int = 4) -> Any:
    stats = cg.CudaGraphStats("test")
    return cg.graphed(fn, gm, examples, stats, limit), stats


def _mlp_fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():  # as compiled graphs run (autograd would hold h for backward)
        h = torch.relu(x @ w)
        return h, h.sum()


def test_records_after_one_warmup_then_replays_fresh_values() -> None:
    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()) as rec:
        fn, stats = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        for _ in range(4):
            x = torch.randn(2, 4)
            h, s = fn(x, w)
            want_h, want_s = _mlp_fn(x, w)
            torch.testing.assert_close(h, want_h)
            torch.testing.assert_close(s, want_s)
            del h, s
    assert rec.events == ["record", "replay", "replay"]
    assert (stats.warmups, stats.records, stats.replays, stats.plain) == (1, 1, 2, {})
    assert stats.copied_in == 1  # x is copied in, the parameter is read where it is


def test_output_held_across_a_replay_keeps_its_value() -> None:
    """A loss kept across steps: the replay that would overwrite it records the graph
    again (new static outputs; the held one stays with its holder), and the output is a
    copy from then on; no held value ever changes."""
    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        fn(torch.randn(2, 4), w)  # warm-up; nothing held
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(4):
            x = torch.randn(2, 4)
            kept.append((fn(x, w)[1], _mlp_fn(x, w)[1]))
        for got, want in kept:
            torch.testing.assert_close(got, want)
    assert (stats.records, stats.replays, stats.plain, stats.copied_out) == (2, 2, {}, 1)


def test_output_held_since_the_warmup_is_a_copy_from_the_start() -> None:
    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        kept = []
        for _ in range(4):
            x = torch.randn(2, 4)
            kept.append((fn(x, w)[1], _mlp_fn(x, w)[1]))  # the sum is kept, h is not
        for got, want in kept:
            torch.testing.assert_close(got, want)
    assert (stats.records, stats.replays, stats.plain, stats.copied_out) == (1, 2, {}, 1)


def test_held_output_of_a_later_graph_in_the_pool_makes_an_earlier_one_record_again() -> None:
    """Graph b, recorded after a, may keep its outputs in a's freed temporaries: while one
    is held, a does not replay over it but records again, after b."""
    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()) as rec:
        a, sa = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        b, sb = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        x = torch.randn(2, 4)
        for f in (a, a, b, b):
            f(x, w)  # warm-up and record each: a first
        held = b(x, w)[0]  # b replays; its output is held
        a(x, w)
        assert (sa.records, sa.replays, sb.records) == (2, 0, 1)
        a(x, w)  # a now sits after b: replays
        assert sa.replays == 1
        torch.testing.assert_close(held, _mlp_fn(x, w)[0])
    assert rec.events.count("record") == 3


def test_held_outputs_of_a_graph_recorded_again_stay_watched() -> None:
    """b (recorded after a, so its outputs may sit in a's freed temporaries) records
    again while one of its outputs is held: the held output stays where it is, and a
    must not replay over it until it is released."""
    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()):
        a, sa = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        b, sb = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        x = torch.randn(2, 4)
        for f in (a, a, b, b):
            f(x, w)
        held = b(x, w)[0]  # b replays; h held
        b(x, w)  # b records again; the old b is gone, its held output stays
        assert (sb.records, sa.records) == (2, 1)
        a(x, w)
        assert (sa.records, sa.replays) == (2, 0)  # recorded again, after the held output
        torch.testing.assert_close(held, _mlp_fn(x, w)[0])
        del held
        a(x, w)
        assert sa.replays == 1
        pool = cg._POOLS[a.pool_id]
        pool.live()
        assert pool.held == []  # released: no longer watched


def test_parameter_at_a_new_address_records_again_then_runs_plain() -> None:
    """``param.data = ...`` (``model.half()``, a reload) moves a tensor the graph reads in
    place: the graph records again (up to the limit), never reads the old memory."""
    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(_mlp_fn, [torch.randn(2, 4), w], limit=2)
        x = torch.randn(2, 4)
        fn(x, w), fn(x, w)
        for _ in range(4):
            w.data = torch.randn(4, 3)
            torch.testing.assert_close(fn(x, w)[0], _mlp_fn(x, w)[0])
    assert stats.records == 3 and sum(stats.plain.values()) == 2
    assert "another address" in next(iter(stats.plain))


def test_a_new_parameter_object_at_the_same_position_records_again() -> None:
    """The read-in-place check compares addresses, not objects: another parameter passed
    where the recorded one was (a module rebuilt, a parameter replaced) records again."""
    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        x = torch.randn(2, 4)
        for _ in range(2):
            fn(x, w)
        w2 = nn.Parameter(torch.randn(4, 3))
        torch.testing.assert_close(fn(x, w2)[0], _mlp_fn(x, w2)[0])
        torch.testing.assert_close(fn(x, w2)[0], _mlp_fn(x, w2)[0])  # replays on w2
    assert (stats.records, stats.replays, stats.plain) == (2, 1, {})


def test_a_graph_recorded_after_anothers_replays_is_watched_by_it() -> None:
    """Each graph watches its own outputs and those of graphs recorded after it in the
    pool, as a list built once: a graph recorded later (b, after a already replayed)
    must join a's list, or a's replay would overwrite b's held output."""
    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()):
        a, sa = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        x = torch.randn(2, 4)
        for _ in range(3):
            a(x, w)  # warm-up, record, replay: a's watch list is built
        b, sb = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        for _ in range(3):
            b(x, w)
        held = b(x, w)[0]
        a(x, w)
        assert sb.replays == 2
        assert (sa.records, sa.replays) == (2, 1)  # recorded again, after b
        torch.testing.assert_close(held, _mlp_fn(x, w)[0])


def test_outputs_viewing_a_parameter_do_not_pin_its_memory() -> None:
    """A recorded graph keeps the addresses of the inputs it reads in place, not the
    tensors: ``param.data = ...`` frees the old memory (a reload, ``model.half()``)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return x @ w, w.t()

    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(f, [torch.randn(2, 4), w])
        x = torch.randn(2, 4)
        for _ in range(3):
            fn(x, w)
        old = StorageWeakRef(w.untyped_storage())  # type: ignore[no-untyped-call]
        w.data = torch.randn(4, 3)
        assert old.expired()  # type: ignore[no-untyped-call]
        y, wt = fn(x, w)  # recorded again on the new memory
        torch.testing.assert_close(wt, w.t())
        torch.testing.assert_close(y, x @ w)
    assert (stats.records, stats.replays) == (2, 1)


def test_an_input_passed_twice_is_copied_once_and_split_records_again() -> None:
    """Compiled autograd passes a saved tensor once per node that saved it: one buffer
    (static bytes counted once). Passed as two tensors later, the graph records again
    with a buffer each, never reading one where the other was."""

    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return (a * 2 + b,)

    a = torch.randn(64)
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(f, [a, a])
        for _ in range(3):
            a = torch.randn(64)
            torch.testing.assert_close(fn(a, a)[0], a * 3)
        assert (stats.records, stats.replays, stats.copied_in) == (1, 1, 1)
        assert stats.bytes_in == 64 * 4
        a, b = torch.randn(64), torch.randn(64)
        torch.testing.assert_close(fn(a, b)[0], a * 2 + b)
        assert (stats.records, stats.copied_in, stats.bytes_in) == (2, 2, 2 * 64 * 4)
        a, b = torch.randn(64), torch.randn(64)
        torch.testing.assert_close(fn(a, b)[0], a * 2 + b)
    assert stats.replays == 2


def test_static_bytes_are_counted_per_graph() -> None:
    """The report's static memory: input buffers (bytes of each buffer copied into per
    replay) and outputs kept in the pool (storages counted once: two views of one count
    once; an output that views an input is the caller's memory, not counted)."""

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            h = x @ w  # 2 x 3 floats
            return h, h[0], x[1:], w.t(), torch.zeros(5, dtype=torch.float64)

    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(f, [torch.randn(2, 4), w])
        for _ in range(3):
            fn(torch.randn(2, 4), w)
    assert stats.bytes_in == 2 * 4 * 4
    assert stats.bytes_out == 2 * 3 * 4 + 5 * 8
    html = cg_report_html(stats)
    assert "outputs kept MiB" in html and "static memory kept by the recorded graphs" in html


def cg_report_html(stats: cg.CudaGraphStats) -> str:
    from stoker._internal.report.report import _render_cudagraphs

    return _render_cudagraphs([stats], "reduce-overhead")


def test_an_input_kept_at_one_address_is_read_in_place_until_it_moves() -> None:
    """A copied input found at one address over the first replays is read where it is
    (no buffer, no copy); once it arrives elsewhere the graph records again and copies
    it for good, never reading the old address."""
    w = nn.Parameter(torch.randn(4, 3))
    x = torch.randn(2, 4)
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(_mlp_fn, [x, w])
        for _ in range(8):
            x.copy_(torch.randn(2, 4))  # new values, same memory
            torch.testing.assert_close(fn(x, w)[0], _mlp_fn(x, w)[0])
        # warm-up, record, 3 probed replays, record again reading x in place, 2 replays
        assert (stats.records, stats.replays, stats.copied_in, stats.bytes_in) == (2, 5, 0, 0)
        kept = [torch.randn(2, 4) for _ in range(6)]  # all at other addresses
        for x2 in kept:
            torch.testing.assert_close(fn(x2, w)[0], _mlp_fn(x2, w)[0])
    assert (stats.records, stats.copied_in, stats.plain) == (3, 1, {})


def test_inputs_that_move_are_copied_for_good() -> None:
    w = nn.Parameter(torch.randn(4, 3))
    xs = [torch.randn(2, 4) for _ in range(10)]  # held: ten addresses
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(_mlp_fn, [xs[0], w])
        for x in xs:
            torch.testing.assert_close(fn(x, w)[0], _mlp_fn(x, w)[0])
    assert (stats.records, stats.replays, stats.copied_in) == (1, 8, 1)


def test_a_mutated_input_read_in_place_is_written_where_it_is() -> None:
    def bump(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        x.add_(y)
        return (x * 2,)

    x, y = torch.randn(3), torch.randn(3)
    gm = make_fx(bump)(x.clone(), y.clone())
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(gm, [x, y], gm)
        for _ in range(8):
            x.copy_(torch.randn(3))
            y.copy_(torch.randn(3))
            x_ref = x.clone()
            (out,) = fn(x, y)
            want = bump(x_ref, y)[0]
            torch.testing.assert_close(x, x_ref)
            torch.testing.assert_close(out, want)
            del out  # (held across the next call, it would be a copy: another record)
    assert (stats.records, stats.copied_in) == (2, 0)


def test_input_mutated_in_place_is_copied_back() -> None:
    def bump(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        x.add_(y)
        return (x * 2,)

    ex = [torch.randn(3), torch.randn(3)]
    gm = make_fx(bump)(*ex)
    assert plan_graph(gm, ex).mutated == frozenset({0})
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(gm, ex, gm)
        for _ in range(4):
            x, y = torch.randn(3), torch.randn(3)
            x_ref = x.clone()
            (out,) = fn(x, y)
            want = bump(x_ref, y)[0]
            torch.testing.assert_close(x, x_ref)  # the caller's tensor was written
            torch.testing.assert_close(out, want)
    assert stats.replays == 2


def test_output_viewing_a_copied_input_views_the_callers_tensor() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[1:], x.sum()

    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(f, [torch.randn(4)])
        for _ in range(3):
            x = torch.randn(4)
            v, _ = fn(x)
            assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            torch.testing.assert_close(v, x[1:])
    assert stats.replays == 1


def test_outputs_that_are_inputs_come_back_as_the_callers_tensors() -> None:
    """A forward returns parameters (saved for backward) as themselves and their views:
    a replay returns the caller's objects, as a plain call does."""

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return x @ w, w, w.t(), x

    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(cg.HostRecorder()):
        fn, stats = _graphed(f, [torch.randn(2, 4), w])
        for _ in range(3):
            x = torch.randn(2, 4)
            y, w1, wt, x1 = fn(x, w)
            assert w1 is w and x1 is x
            assert wt._base is w and wt.data_ptr() == w.data_ptr()
            torch.testing.assert_close(wt, w.t())
            torch.testing.assert_close(y, x @ w)
    assert stats.replays == 1


def test_new_size_keys_record_up_to_the_limit_then_run_plain() -> None:
    def scale(x: torch.Tensor, n: int) -> tuple[torch.Tensor]:
        return (x * n,)

    with cg.use_recorder(cg.HostRecorder()) as rec:
        fn, stats = _graphed(scale, [torch.randn(3), 2], limit=2)
        for n in (2, 2, 3, 3, 2, 3, 4, 4, 4):
            x = torch.randn(3)
            torch.testing.assert_close(fn(x, n)[0], x * n)
    assert rec.events.count("record") == 2
    assert (stats.records, stats.replays) == (2, 2)
    assert sum(stats.plain.values()) == 3
    assert "cudagraph_limit" in next(iter(stats.plain))
    assert stats.reason is None  # the recorded keys keep replaying


def test_each_record_and_the_limit_are_logged(capsys: pytest.CaptureFixture[str]) -> None:
    """A record per new size key is counted and logged (``STOKER_LOGS=cudagraphs``) with
    the running count, and so is the switch to plain launches at the limit."""

    def scale(x: torch.Tensor, n: int) -> tuple[torch.Tensor]:
        return (x * n,)

    try:
        stoker.set_logs("cudagraphs")
        with cg.use_recorder(cg.HostRecorder()):
            fn, stats = _graphed(scale, [torch.randn(3), 2], limit=2)
            for n in (2, 2, 3, 3, 4, 4, 4):
                fn(torch.randn(3), n)
    finally:
        stoker.set_logs("")
    err = capsys.readouterr().err
    recorded = [ln for ln in err.splitlines() if "recorded size key" in ln]
    assert len(recorded) == stats.records == 2, err
    assert "(2,)" in recorded[0] and "1 keys, 1 records" in recorded[0], recorded
    assert "(3,)" in recorded[1] and "2 keys, 2 records" in recorded[1], recorded
    assert "[stoker.cudagraphs]" in recorded[0]


def test_forward_and_backward_graphs_share_one_pool() -> None:
    """One private memory pool per device, shared by every graph of the forward and of
    the compiled-autograd backward (a backward reads the forward's outputs in place)."""
    torch.manual_seed(0)
    model = MLP(8, 16, 4, depth=1)
    graphs: list[cg.GraphedCallable] = []
    make = cg.GraphedCallable.__init__

    def spy(self: cg.GraphedCallable, *args: Any, **kwargs: Any) -> None:
        make(self, *args, **kwargs)
        graphs.append(self)

    stoker.reset()
    with pytest.MonkeyPatch.context() as mp, cg.use_recorder(cg.HostRecorder()):
        mp.setattr(cg.GraphedCallable, "__init__", spy)
        compiled = stoker.compile(model, backend="aten", dynamic=False, mode="reduce-overhead")
        batches = [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(5)]
        _train(compiled, batches, _ce, True)
    labels = [g.stats.label for g in graphs]
    assert any(lb.endswith("forward") for lb in labels), labels
    assert any(lb.startswith("compiled autograd") for lb in labels), labels
    assert len({id(g.pool) for g in graphs}) == 1, labels
    assert all(g.stats.replays >= 1 for g in graphs), [g.stats for g in graphs]  # all recorded


def test_sizes_that_never_repeat_stop_recording() -> None:
    def scale(x: torch.Tensor, n: int) -> tuple[torch.Tensor]:
        return (x * n,)

    with cg.use_recorder(cg.HostRecorder()) as rec:
        fn, stats = _graphed(scale, [torch.randn(3), 2], limit=2)
        for n in range(6):
            x = torch.randn(3)
            torch.testing.assert_close(fn(x, n)[0], x * n)
    assert rec.events == []
    assert stats.reason is not None and "re-record without bound" in stats.reason


def test_symbolic_sizes_make_the_key() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = mode.from_tensor(torch.randn(5, 3), static_shapes=False)
    plan = plan_graph(None, [fake, torch.randn(3)])
    assert plan.symbolic == (0,) and plan.reason is None
    with cg.use_recorder(cg.HostRecorder()) as rec:
        fn, stats = _graphed(lambda x, b: (x + b,), [fake, torch.randn(3)])
        b = torch.randn(3)
        for rows in (5, 5, 5, 7, 7, 7):
            x = torch.randn(rows, 3)
            torch.testing.assert_close(fn(x, b)[0], x + b)
    assert rec.events.count("record") == 2 and stats.replays == 2


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (lambda x: (x * x.sum().item(),), "CPU sync"),
        (lambda x: (torch.nn.functional.dropout(x, 0.5, training=True),), "random"),
        (lambda x: (torch.rand_like(x) + x,), "random"),
        (lambda x: (x[x > 0],), "depend on tensor data"),
    ],
    ids=["item", "dropout", "rand", "nonzero"],
)
def test_plan_falls_back_with_a_reason(body: Callable[..., Any], words: str) -> None:
    x = torch.randn(8)
    gm = make_fx(body, tracing_mode="real" if words == "random" else "symbolic")(x)
    reason = plan_graph(gm, [x]).reason
    assert reason is not None and words in reason, reason
    with cg.use_recorder(cg.HostRecorder()) as rec:
        fn, stats = _graphed(gm, [x], gm)
        fn(x), fn(x), fn(x)
    assert rec.events == [] and stats.reason == reason


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_collectives_fall_back() -> None:
    import torch.distributed._functional_collectives  # registers the ops

    g = torch.fx.Graph()
    x = g.placeholder("x")
    red = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    g.output((g.call_function(torch.ops._c10d_functional.wait_tensor.default, (red,)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    reason = plan_graph(gm, [torch.randn(3)]).reason
    assert reason is not None and reason.startswith("collective"), reason


def test_cpu_tensor_beside_device_inputs_falls_back() -> None:
    ex = [torch.empty(3, device="meta"), torch.randn(3)]
    reason = plan_graph(None, ex).reason
    assert reason is not None and "input 1 is a CPU tensor" in reason


def test_no_cuda_device_is_a_reason_not_an_error() -> None:
    reason = cg.CudaRecorder().unsupported([torch.randn(3)])
    assert reason is not None and reason.startswith("no CUDA device")


def test_failed_capture_falls_back() -> None:
    class Failing(cg.HostRecorder):
        def record(self, fn: Any, args: Any, pool_id: Any) -> Any:
            raise RuntimeError("operation not permitted when stream is capturing")

    w = nn.Parameter(torch.randn(4, 3))
    with cg.use_recorder(Failing()):
        fn, stats = _graphed(_mlp_fn, [torch.randn(2, 4), w])
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(fn(x, w)[0], _mlp_fn(x, w)[0])
    assert stats.reason is not None and "recording failed" in stats.reason


def test_invalid_limit_is_a_config_error() -> None:
    with pytest.raises(stoker.StokerConfigError, match="cudagraph_limit"):
        stoker.compile(nn.Linear(2, 2), mode="reduce-overhead", cudagraph_limit=0)


# ---------------------------------------------------------------------- through stoker.compile


def _train(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[..., torch.Tensor],
    compiled: bool,
    accumulate: int = 1,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SGD steps; ``accumulate`` forwards (and then as many backwards) per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses: list[torch.Tensor] = []
    i = 0
    while i < len(batches):
        opt.zero_grad()
        group = batches[i : i + accumulate]
        ls = [loss_fn(model(x), y) for x, y in group]
        with stoker.autograd_enabled(compiled):
            for loss in reversed(ls):
                loss.backward()
        losses += ls  # kept across steps, as a training log does
        opt.step()
        i += accumulate
    return losses, [p.detach().clone() for p in model.parameters()]


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("accumulate", [1, 2], ids=["plain-steps", "two-forwards-per-backward"])
def test_stoker_compile_reduce_overhead_trains_like_eager_on_the_host_stand_in(
    accumulate: int,
) -> None:
    torch.manual_seed(0)
    model = MLP(8, 16, 4, depth=2)
    ref = copy.deepcopy(model)
    batches = [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(6 * accumulate)]
    stoker.reset()
    captures = autograd_stats()["captures"]
    with cg.use_recorder(cg.HostRecorder()) as rec:
        compiled = stoker.compile(model, backend="aten", dynamic=False, mode="reduce-overhead")
        got_losses, got = _train(compiled, batches, _ce, True, accumulate)
    captures = autograd_stats()["captures"] - captures
    want_losses, want = _train(ref, batches, _ce, False, accumulate)
    stoker.reset()
    for a, b in zip(got_losses, want_losses, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    stats = compiled.stoker_report.cudagraphs
    assert "replay" in rec.events
    # replayed outputs look like plain ones to compiled autograd: no extra capture (with
    # two backwards per step the second finds .grad defined: a second key, as without graphs)
    assert captures == accumulate
    fwd = [s for s in stats if s.label.endswith("forward")]
    assert fwd and fwd[0].records == 1 and fwd[0].replays >= 2
    assert any(s.label.startswith("compiled autograd") and s.replays >= 1 for s in stats)
    html = compiled.stoker_report.to_html()
    assert "CUDA graphs" in html and "graphed" in html


def test_backward_copies_a_saved_tensor_once_through_stoker_compile() -> None:
    """The loss outside the compiled model (eager cross-entropy): compiled autograd hands
    log_softmax's result to two of its nodes; the backward's graph copies it into one
    buffer (it did into two: 2x the logits' bytes on gpt-m, 256 MiB)."""
    torch.manual_seed(0)
    model = MLP(8, 16, 40, depth=1)
    batches = [(torch.randn(32, 8), torch.randint(0, 40, (32,))) for _ in range(4)]
    stoker.reset()
    with cg.use_recorder(cg.HostRecorder()):
        compiled = stoker.compile(model, backend="aten", dynamic=False, mode="reduce-overhead")
        _train(compiled, batches, _ce, True)
    stoker.reset()
    seg = [s for s in compiled.stoker_report.cudagraphs if s.label.startswith("compiled")]
    logits = 32 * 40 * 4
    assert seg and seg[0].records == 1, seg
    assert logits <= seg[0].bytes_in < 2 * logits, seg  # one buffer, plus a few scalars
    fwd = [s for s in compiled.stoker_report.cudagraphs if s.label.endswith("forward")]
    assert fwd[0].bytes_out >= logits, fwd  # the logits, kept in the pool


_TRITON_SCRIPT = """
import copy, torch, stoker
from torch import nn
from stoker._internal.cudagraphs import cudagraphs as cg
from stoker._internal.bench.models import MLP
torch.manual_seed(0)
model = MLP(8, 16, 4, depth=1)
ref = copy.deepcopy(model)
batches = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(4)]
def train(m, compiled):
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        with stoker.autograd_enabled(compiled):
            loss.backward()
        losses.append(loss)
        opt.step()
    return losses
with cg.use_recorder(cg.HostRecorder()):
    compiled = stoker.compile(model, backend="interpret", dynamic=False, mode="reduce-overhead")
    got = train(compiled, True)
want = train(ref, False)
for a, b in zip([*got, *model.parameters()], [*want, *ref.parameters()], strict=True):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
report = compiled.stoker_report
assert report.n_kernels > 0, "no Triton kernels"
fwd = [s for s in report.cudagraphs if s.label.endswith("forward")]
assert fwd and fwd[0].replays >= 2, report.cudagraphs
assert any(s.replays for s in report.cudagraphs if s.label.startswith("compiled autograd"))
print("ok")
"""


def test_reduce_overhead_wraps_triton_graphs_on_the_host_stand_in() -> None:
    """The Triton executor's compiled graphs (under the interpreter, in a fresh process)
    recorded and replayed by the host stand-in, trained against eager."""
    run_interpreted(_TRITON_SCRIPT)


def _inference_outputs_are_never_overwritten(device: str, backend: str) -> None:
    torch.manual_seed(0)
    model = MLP(8, 16, 4, depth=1).to(device).eval()
    stoker.reset()
    compiled = stoker.compile(model, backend=backend, dynamic=False, mode="reduce-overhead")
    xs = [torch.randn(6, 8, device=device) for _ in range(5)]
    with torch.no_grad():
        outs = [compiled(x) for x in xs]  # all kept
        for x, out in zip(xs, outs, strict=True):
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    stats = compiled.stoker_report.cudagraphs
    stoker.reset()
    assert stats[0].replays >= 3 and stats[0].copied_out >= 1, stats


def test_inference_outputs_kept_across_calls_are_never_overwritten() -> None:
    with cg.use_recorder(cg.HostRecorder()):
        _inference_outputs_are_never_overwritten("cpu", "aten")


def _bn_parity(device: str, backend: str) -> list[Any]:
    """BatchNorm: buffers (running stats, a step counter) read in place, written by the
    runtime after each replay; they must track eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 4))
    model = model.to(device)
    ref = copy.deepcopy(model)
    batches = [
        (torch.randn(6, 8, device=device), torch.randint(0, 4, (6,), device=device))
        for _ in range(5)
    ]
    stoker.reset()
    compiled = stoker.compile(model, backend=backend, dynamic=False, mode="reduce-overhead")
    got_losses, got = _train(compiled, batches, _ce, True)
    want_losses, want = _train(ref, batches, _ce, False)
    stoker.reset()
    for a, b in zip([*got_losses, *got], [*want_losses, *want], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(model.buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    stats: list[Any] = compiled.stoker_report.cudagraphs
    return stats


def test_module_buffers_are_read_in_place() -> None:
    with cg.use_recorder(cg.HostRecorder()):
        stats = _bn_parity("cpu", "aten")
    fwd = [s for s in stats if s.label.endswith("forward")]
    assert fwd[0].replays >= 2 and fwd[0].copied_in == 1, stats  # only x is copied


def test_gradients_of_a_graph_are_copied_not_stolen() -> None:
    """Two backwards into the same ``.grad``: a stolen static gradient would be
    overwritten by the second replay and count twice."""
    torch.manual_seed(1)
    model = MLP(8, 16, 4, depth=1)
    ref = copy.deepcopy(model)
    stoker.reset()
    with cg.use_recorder(cg.HostRecorder()):
        compiled = stoker.compile(model, backend="aten", dynamic=False, mode="reduce-overhead")
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            xs = [torch.randn(6, 8) for _ in range(2)]
            y = torch.randint(0, 4, (6,))
            for x in xs:
                _ce(compiled(x), y).backward()
                with stoker.autograd_enabled(False):
                    _ce(ref(x), y).backward()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                torch.testing.assert_close(p.grad, q.grad)
    stoker.reset()
    # A stolen gradient would be held as .grad at the next replay: caught there (the graph
    # recorded again), never wrong, but it must not happen.
    stats = compiled.stoker_report.cudagraphs
    assert any(s.replays for s in stats if s.label.startswith("compiled autograd"))
    assert all(s.records <= 1 and not s.plain for s in stats), stats


def test_reduce_overhead_on_the_cpu_reports_no_cuda_device() -> None:
    torch.manual_seed(0)
    model = MLP(8, 16, 4, depth=1)
    ref = copy.deepcopy(model)
    stoker.reset()
    compiled = stoker.compile(model, backend="aten", mode="reduce-overhead")
    batches = [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(3)]
    _, got = _train(compiled, batches, _ce, True)
    _, want = _train(ref, batches, _ce, False)
    stoker.reset()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    stats = compiled.stoker_report.cudagraphs
    assert stats and all(s.reason and s.reason.startswith("no CUDA device") for s in stats)
    assert "no CUDA device" in compiled.stoker_report.to_html()


# ---------------------------------------------------------------------- on a GPU


def _gpu_parity(
    build: Callable[[], nn.Module],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[..., torch.Tensor],
    sizes: list[int],
    accumulate: int = 1,
) -> list[Any]:
    torch.manual_seed(0)
    model = build().cuda()
    ref = copy.deepcopy(model)
    batches = [batch(n) for n in sizes]
    stoker.reset()
    compiled = stoker.compile(model, mode="reduce-overhead")
    got_losses, got = _train(compiled, batches, loss_fn, True, accumulate)
    want_losses, want = _train(ref, batches, loss_fn, False, accumulate)
    torch.cuda.synchronize()
    stoker.reset()
    for a, b in zip(got_losses, want_losses, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    stats: list[Any] = compiled.stoker_report.cudagraphs
    print("\n".join(map(str, stats)))
    return stats


def _mlp_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 32, device="cuda"), torch.randint(0, 10, (n,), device="cuda")


def _gpt_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 65, (4, t + 1), device="cuda")
    return idx[:, :-1], idx[:, 1:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mlp_reduce_overhead_matches_eager_with_a_size_change() -> None:
    stats = _gpu_parity(MLP, _mlp_batch, _ce, [16] * 4 + [24] * 4 + [16] * 2)
    fwd = [s for s in stats if s.label.endswith("forward") and s.records]
    assert fwd and all(s.reason is None for s in fwd)
    assert sum(s.records for s in stats) >= 3  # forward + backward, and a new size
    assert sum(s.replays for s in stats) >= 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tiny_gpt_reduce_overhead_matches_eager() -> None:
    cfg = GPTConfig()
    stats = _gpu_parity(lambda: GPT(cfg), _gpt_batch, lm_loss, [16] * 5 + [24] * 4)
    assert sum(s.records for s in stats) >= 2
    assert sum(s.replays for s in stats) >= 4
    graphed = [s for s in stats if s.records]
    assert graphed and all(not s.reason for s in graphed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gradient_accumulation_under_graphs_matches_eager() -> None:
    stats = _gpu_parity(MLP, _mlp_batch, _ce, [16] * 10, accumulate=2)
    assert sum(s.replays for s in stats) >= 4


def _peak_training_mib(model: nn.Module, mode: str, steps: int = 6) -> tuple[float, list[Any]]:
    """Peak allocated memory over steady training steps (after 3 to warm up and record),
    as `stoker bench` measures it."""
    import gc

    gc.collect()  # what an earlier run left is not this run's
    torch.manual_seed(0)
    batches = [_gpt_batch(32) for _ in range(3)]
    stoker.reset()
    compiled = stoker.compile(model, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(3 + steps):
        if i == 3:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        x, y = batches[i % 3]
        loss = lm_loss(compiled(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del loss
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20
    stats: list[Any] = compiled.stoker_report.cudagraphs
    stoker.reset()
    return peak, stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_reduce_overhead_peak_memory_is_close_to_plain() -> None:
    """Reduce-overhead's peak within plain stoker's plus the static gradients
    (the backward's outputs stay in the pool and are copied into ``.grad``: one
    parameter-sized copy, the known remaining cost) and 2 MiB."""
    cfg = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=128)
    model = GPT(cfg).cuda()
    state = copy.deepcopy(model.state_dict())
    plain, _ = _peak_training_mib(model, "default")
    model.load_state_dict(state)
    graphed, stats = _peak_training_mib(model, "reduce-overhead")
    grads = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    kept = sum(s.bytes_in + s.bytes_out for s in stats) / 2**20
    print(f"peak MiB: plain {plain:.1f}, reduce-overhead {graphed:.1f}; static kept {kept:.1f}")
    print("\n".join(map(str, stats)))
    assert any(s.replays for s in stats), stats
    assert graphed <= plain + grads + 2, (plain, graphed, grads, stats)


def test_torch_compile_passes_mode_to_the_stoker_backend() -> None:
    """``torch.compile(model, backend="stoker", mode="reduce-overhead")``: Dynamo hands the
    mode to the backend, which compiles with it (here on the CPU: no CUDA device)."""
    from stoker._internal.api.backend import StokerBackend

    torch.manual_seed(0)
    model = MLP(8, 16, 4, depth=1)
    be = StokerBackend(stoker.CompileOptions(backend="aten"))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=be, mode="reduce-overhead")
    x = torch.randn(6, 8)
    torch.testing.assert_close(compiled(x), model(x))
    stats = be.report.cudagraphs
    assert stats and stats[0].reason is not None and "no CUDA device" in stats[0].reason
    with pytest.raises(Exception, match="no_such_option"):
        torch._dynamo.reset()
        torch.compile(model, backend=be, options={"no_such_option": 1})(x)
    stoker.reset()  # the backend switched compiled autograd on for the process


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_inference_outputs_kept_across_calls_are_never_overwritten() -> None:
    _inference_outputs_are_never_overwritten("cuda", "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_batchnorm_buffers_under_graphs_match_eager() -> None:
    stats = _bn_parity("cuda", "auto")
    assert sum(s.replays for s in stats) >= 3
