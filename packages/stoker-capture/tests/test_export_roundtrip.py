"""export(): guarded graphs, save/load, torch.export hand-over, and bad input."""

from __future__ import annotations

import pytest
import torch
from capture_compare import assert_same

from stoker_capture import ExportFormatError, GuardViolationError, export, load
from stoker_shapes import DataDependentError, Dim


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x, scale: float = 2.0):
        return {"y": self.fc2(self.bn(self.fc1(x)).relu()) * scale, "n": x.shape[0]}


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


def test_export_dynamic_batch_runs_at_several_sizes() -> None:
    m = _model()
    batch = Dim("batch", max=64)
    ep = export(m, (torch.randn(4, 8),), dynamic_shapes={"x": {0: batch}})
    for n in (2, 5, 33):
        x = torch.randn(n, 8)
        with torch.no_grad():
            assert_same(ep(x), m(x))
    assert "batch" in ep.as_text() or "s" in ep.as_text()


def test_save_load_round_trip(tmp_path) -> None:
    m = _model()
    ep = export(m, (torch.randn(4, 8),), dynamic_shapes=[{0: Dim("batch")}])
    path = tmp_path / "mlp.stoker"
    ep.save(path)
    loaded = load(path)
    for n in (3, 17):
        x = torch.randn(n, 8)
        with torch.no_grad():
            assert_same(loaded(x), m(x))
    with pytest.raises(GuardViolationError, match=r"args\[0\]\.size\(\)\[1\] == 8"):
        loaded(torch.randn(3, 9))
    assert loaded.signature.as_text() == ep.signature.as_text()


def test_to_torch_export_with_dynamic_dims(tmp_path) -> None:
    m = _model()
    ep = export(m, (torch.randn(4, 8),), dynamic_shapes=[{0: Dim("batch", max=128)}])
    for exported in (ep, _reload(ep, tmp_path)):
        prog = exported.to_torch_export()
        assert isinstance(prog, torch.export.ExportedProgram)
        for n in (2, 7, 100):
            x = torch.randn(n, 8)
            with torch.no_grad():
                assert_same(prog.module()(x), m(x))


def _reload(ep, tmp_path):
    path = tmp_path / "re.stoker"
    ep.save(path)
    return load(path)


def test_buffer_mutation_exported() -> None:
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)  # training mode: running stats updated
    ref = torch.nn.BatchNorm1d(3)
    ep = export(bn, (torch.randn(4, 3),))
    assert ep.signature.mutated_buffers == ["running_mean", "running_var", "num_batches_tracked"]
    x = torch.randn(4, 3)
    with torch.no_grad():
        assert_same(ep(x), ref(x))
    for name, b in ref.named_buffers():
        torch.testing.assert_close(ep.params[name], b)


def test_guard_violation_is_explained() -> None:
    m = _model()
    ep = export(m, (torch.randn(4, 8),))  # static batch
    with pytest.raises(GuardViolationError) as info:
        ep(torch.randn(5, 8))
    assert "args[0].size()[0] == 4" in str(info.value) and "got 5" in str(info.value)
    with pytest.raises(GuardViolationError, match="dtype"):
        ep(torch.randn(4, 8, dtype=torch.float64))


def test_truncated_corrupt_and_other_version_files(tmp_path) -> None:
    ep = export(_model(), (torch.randn(4, 8),))
    good = tmp_path / "good.stoker"
    ep.save(good)
    data = good.read_bytes()
    cases = {
        "truncated": data[: len(data) // 2],
        "corrupt": data[:-20] + bytes(20),
        "version": data[:14] + (99).to_bytes(4, "little") + data[18:],
        "garbage": b"hello world",
    }
    want = {
        "truncated": "truncated",
        "corrupt": "corrupt",
        "version": "version 99",
        "garbage": "not a stoker export",
    }
    for name, blob in cases.items():
        path = tmp_path / f"{name}.stoker"
        path.write_bytes(blob)
        with pytest.raises(ExportFormatError) as info:
            load(path)
        assert str(path) in str(info.value) and want[name] in str(info.value), str(info.value)


def test_data_dependent_branch_names_the_user_line() -> None:
    def f(x):
        if x.sum() > 0:  # the data-dependent line
            return x * 2
        return x

    with pytest.raises(DataDependentError) as info:
        export(f, (torch.randn(3),))
    msg = str(info.value)
    assert "test_export_roundtrip.py" in msg and "the data-dependent line" in msg
    assert "torch.where" in msg  # says what to do


def test_specializing_a_dim_is_an_error() -> None:
    def f(x):
        return x.view(4, -1)  # needs batch * 8 divisible by 4 ... and fixes the leading size

    from stoker_shapes import SpecializationError

    with pytest.raises(SpecializationError, match="batch"):
        export(f, (torch.randn(4, 8),), dynamic_shapes=[{0: Dim("batch")}])


def test_keyword_inputs_and_float_constants(tmp_path) -> None:
    def f(x, *, scale, mask=None):
        y = x * scale
        return y if mask is None else y.masked_fill(mask, 0.0)

    b = Dim("b")
    mask = torch.rand(3, 4) > 0.5
    ep = export(
        f,
        (torch.randn(3, 4),),
        {"scale": 2.0, "mask": mask},
        dynamic_shapes={"x": {0: b}, "mask": {0: b}},
    )
    x2, m2 = torch.randn(5, 4), torch.rand(5, 4) > 0.5
    want = f(x2, scale=2.0, mask=m2)
    assert_same(ep(x2, scale=2.0, mask=m2), want)
    with pytest.raises(GuardViolationError, match="scale"):
        ep(x2, scale=3.0, mask=m2)  # floats are specialized
    prog = _reload(ep, tmp_path).to_torch_export()
    assert_same(prog.module()(x2, scale=2.0, mask=m2), want)


@pytest.mark.slow  # torch.export of a transformer layer takes several seconds of CPU
def test_transformer_layer_export_with_two_dynamic_dims() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    b, s = Dim("b", max=16), Dim("s", max=64)
    ep = export(layer, (torch.randn(2, 5, 16),), dynamic_shapes=[{0: b, 1: s}])
    prog = ep.to_torch_export()
    for shape in ((3, 7), (2, 5), (4, 12)):
        x = torch.randn(*shape, 16)
        with torch.no_grad():
            want = layer(x)
            assert_same(ep(x), want, atol=1e-5, rtol=1e-4)
            assert_same(prog.module()(x), want, atol=1e-5, rtol=1e-4)


def test_mha_fast_path_is_traced_as_the_standard_path_and_restored() -> None:
    # the eval fast path's fused op has no fake kernel on torch 2.11
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    assert torch.backends.mha.get_fastpath_enabled()
    ep = export(layer, (torch.randn(2, 3, 8),))
    assert torch.backends.mha.get_fastpath_enabled()  # switched back on after the pipeline
    ops = {str(n.target) for n in ep.gm.graph.nodes if n.op == "call_function"}
    assert not any("_transformer_encoder_layer_fwd" in o for o in ops), ops
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        assert_same(ep(x), layer(x), atol=1e-5, rtol=1e-4)
