"""dynamo_backend: the pipeline under torch.compile, with Dynamo installing our guards."""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo
from capture_compare import check_fn

from stoker_capture import dynamo_backend


def test_dynamo_backend_matches_eager() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    ref = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    ref.load_state_dict(m.state_dict())
    compiled = torch.compile(m, backend=dynamo_backend())
    for n in (6, 6):
        x = torch.randn(n, 4)
        out_c, out_e = compiled(x), ref(x)
        torch.testing.assert_close(out_c, out_e)
        out_c.square().sum().backward()
        out_e.square().sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)


def test_specialization_in_the_backend_recompiles_when_violated() -> None:
    torch._dynamo.reset()
    seen: list[int] = []

    def specializing(gm, example_inputs):
        # a compiler that bakes in the batch size (like a code generator choosing a grid)
        x = next(t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2)
        n = int(x.shape[0])  # guard_int: specializes Dynamo's symbol
        seen.append(n)

        def run(*args):
            got = next(a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2)
            assert got.shape[0] == n, "reused with a size it was specialized away from"
            return gm(*args)

        return run

    def f(x, w):
        return (x @ w).tanh() * x.shape[0]

    compiled = torch.compile(f, backend=dynamo_backend(specializing), dynamic=True)
    w = torch.randn(3, 2, requires_grad=True)
    for n in (4, 4, 8):
        check_fn(f, compiled, lambda n=n: [torch.randn(n, 3, requires_grad=True), w])
    assert 4 in seen and 8 in seen, seen  # the violated specialization recompiled


def test_an_input_compiled_without_grad_that_requires_it_now_runs_uncompiled(
    monkeypatch: Any,
) -> None:
    """Dynamo before torch 2.12 does not guard requires_grad of parameters: a graph
    compiled while a parameter was frozen is called after it is unfrozen. The backend's
    function then runs the graph uncompiled (correct gradients) and warns once; with
    the parameter frozen again it runs compiled."""
    import warnings

    import pytest

    from stoker_capture._internal import dynamo
    from stoker_capture._internal.dynamo import RequiresGradCheck

    # the torches whose Dynamo does not guard requires_grad (before 2.12) get the check
    monkeypatch.setattr(dynamo, "DYNAMO_GUARDS_REQUIRES_GRAD", False)

    def f(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(x @ w.t() + b),)

    gm = torch.fx.symbolic_trace(f)
    w, b = torch.randn(3, 4), torch.randn(3, requires_grad=True)
    compiled = dynamo_backend()(gm, [w, b, torch.randn(5, 4)])
    assert isinstance(compiled, RequiresGradCheck) and compiled.frozen == [0, 2]
    assert compiled.cache_outcome is not None  # attributes read through
    runs = []
    real = compiled.compiled
    compiled.compiled = lambda *a: runs.append(1) or real(*a)  # type: ignore[method-assign]
    for step, flag in enumerate((True, True, False)):
        w.requires_grad_(flag)
        w.grad = b.grad = None
        x = torch.randn(5, 4)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            compiled(w, b, x)[0].pow(2).sum().backward()
        assert len(seen) == (1 if step == 0 else 0), [str(s.message) for s in seen]
        if step == 0:
            assert "w requires grad now" in str(seen[0].message)
        wr = w.detach().requires_grad_(flag)
        br = b.detach().requires_grad_()
        f(wr, br, x)[0].pow(2).sum().backward()
        torch.testing.assert_close(b.grad, br.grad)
        if flag:
            torch.testing.assert_close(w.grad, wr.grad)
        else:
            assert w.grad is None
    assert runs == [1]  # compiled only once frozen again
    real.check_guards = False  # as under Dynamo, which checks the guards itself
    with torch.no_grad():
        w.requires_grad_(True)
        compiled(w, b, torch.randn(5, 4))  # no backward: compiled, no warning
    assert runs == [1, 1]
    with pytest.raises(AttributeError):
        compiled.no_such_attribute  # noqa: B018
