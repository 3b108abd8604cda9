"""The captured-graph cache (capcache.py): a second process loads every Dynamo graph's
capture instead of running it, trains as eager does, and ends with the same guards;
anything else is a miss that says why, and a broken entry is a miss with one warning."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

from stoker_capture import dynamo_backend
from stoker_capture._internal import capcache

# Trains a model (BatchNorm: a mutated buffer; LayerNorm, GELU; a view output) with
# dynamic sizes against eager on fresh inputs, twice per batch size, then prints the
# cache counters and every shape guard with its origin.
_TRAIN = """
import json, torch, torch.nn as nn
from stoker_capture import dynamo_backend
from stoker_capture._internal import capcache

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.ln, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 4)
    def forward(self, x):
        h = self.ln(torch.nn.functional.gelu(self.bn(self.fc1(x))))
        out = self.fc2(h)
        return out, out.view(-1)

torch.manual_seed(0)
model, ref = Net(), Net()
ref.load_state_dict(model.state_dict())
guards = []
inner = dynamo_backend()

def backend(gm, example_inputs):
    compiled = inner(gm, example_inputs)
    ctx = compiled.state.ctx
    o = ctx.guard_origins
    guards.append([(str(g.expr), o[i].describe() if i in o else None)
                   for i, g in enumerate(ctx.shape_env.guards)])
    return compiled

cm = torch.compile(model, backend=backend, dynamic=True)
losses = []
for n in (4, 4, 6):
    x = torch.randn(n, 8)
    (a, va), (b, vb) = cm(x), ref(x)
    torch.testing.assert_close(va, vb)
    la, lb = a.pow(2).mean(), b.pow(2).mean()
    torch.testing.assert_close(la, lb)
    la.backward(); lb.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        p.grad = q.grad = None
    losses.append(la.item())
torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
with torch.no_grad():
    torch.testing.assert_close(cm(torch.randn(5, 8))[0].shape, torch.Size([5, 4]))
print(json.dumps({"stats": capcache.stats, "guards": guards, "losses": losses}))
"""


def _run(cache: Path) -> dict[str, Any]:
    env = {**os.environ, "STOKER_CACHE_DIR": str(cache), "STOKER_CAPTURE_CACHE": "1"}
    p = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _TRAIN],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_second_process_loads_every_capture_and_trains_as_eager(tmp_path: Path) -> None:
    cold, warm = _run(tmp_path), _run(tmp_path)
    n = cold["stats"]["captures"]
    assert n >= 2 and cold["stats"] == {"misses: new key": n, "captures": n, "writes": n}
    assert warm["stats"] == {"hits": n}, warm["stats"]  # capture ran 0 times
    # the same guards, each with the origin the cold capture recorded
    assert warm["guards"] == cold["guards"]
    assert any(origin for graph in cold["guards"] for _, origin in graph)


# ---------------------------------------------------------------------- in one process


class _Outcomes:
    """A backend recording each graph's cache outcome."""

    def __init__(self, **kwargs: Any) -> None:
        self.inner = dynamo_backend(**kwargs)
        self.outcomes: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled = self.inner(gm, example_inputs)
        self.outcomes.append(compiled.cache_outcome)
        return compiled


def _train(
    model: torch.nn.Module, x: torch.Tensor, dynamic: bool = False, **kwargs: Any
) -> list[str]:
    """One compiled forward and backward, checked against eager; the outcomes."""
    torch._dynamo.reset()
    be = _Outcomes(**kwargs)
    cm = torch.compile(model, backend=be, dynamic=dynamic)
    out = cm(x)
    grads = torch.autograd.grad(out.float().sum(), list(model.parameters()))
    want_out = model(x)
    want = torch.autograd.grad(want_out.float().sum(), list(model.parameters()))
    tol = {"atol": 2e-2, "rtol": 2e-2} if out.dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, want_out, **tol)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, **tol)
    return be.outcomes


def _mlp(hidden: int = 16, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4)
    ).to(dtype)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STOKER_CAPTURE_CACHE", "1")
    return tmp_path


def test_what_decides_the_result_is_in_the_key(cache_dir: Path) -> None:
    x = torch.randn(4, 8)

    def changed(outcomes: list[str]) -> set[str]:
        """The key parts a miss names (it compares with the last entry of the site)."""
        (o,) = outcomes
        assert o.startswith("miss (new key: ") and o.endswith(" changed)"), o
        return set(o.removeprefix("miss (new key: ").removesuffix(" changed)").split(", "))

    assert _train(_mlp(), x) == ["miss (new key)"]
    assert _train(_mlp(), torch.randn(4, 8)) == ["hit"]  # fresh values, same metadata
    assert changed(_train(_mlp(), x, memory_budget=0.5)) == {"config"}  # config
    assert "inputs" in changed(_train(_mlp(hidden=12), x))  # another model
    assert "inputs" in changed(_train(_mlp(), torch.randn(6, 8)))  # another (static) size
    assert "inputs" in changed(_train(_mlp(dtype=torch.float64), x.double()))  # dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "config" in changed(_train(_mlp(), x))  # autocast state
    with torch.no_grad():
        torch._dynamo.reset()
        be = _Outcomes()
        torch.compile(_mlp(), backend=be)(x)
        assert "config" in changed(be.outcomes)  # grad mode: an inference capture
    assert _train(_mlp(), x) == ["hit"]
    assert _train(_mlp(), x, cache=False) == [""]  # off: neither read nor written


def test_another_torch_or_stoker_version_misses(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stoker_capture
    import stoker_shapes
    from stoker_capture._internal.capcache import key

    x = torch.randn(4, 8)
    assert _train(_mlp(), x) == ["miss (new key)"]
    code = key._code_version()
    for v in (torch.__version__, stoker_capture.__version__, stoker_shapes.__version__):
        assert v in code, code
    # a context of its own: `monkeypatch.undo()` would also undo `cache_dir`'s settings
    # (the cache directory), so the last run read another directory (a flaky miss in CI)
    with monkeypatch.context() as m:
        m.setattr(key, "_code_version", lambda: code.replace("torch ", "torch 0", 1))
        assert _train(_mlp(), x) == ["miss (new key: code changed)"]
    assert _train(_mlp(), x) == ["hit"]


def test_the_cache_off_by_environment(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CAPTURE_CACHE", "0")
    assert _train(_mlp(), torch.randn(4, 8)) == [""]
    assert not (cache_dir / "capture").exists()


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 3  # not the derivative: a loaded graph would have to reproduce this


class _WithFunction(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(self.fc(x))  # type: ignore[no-any-return]


def _user_fn(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


torch._dynamo.allow_in_graph(_user_fn)


class _WithUserCall(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _user_fn(self.fc(x))


@pytest.mark.parametrize(
    ("make", "why"),
    [(_WithFunction, "a subgraph"), (_WithUserCall, "whose code the key cannot see")],
)
def test_what_the_key_cannot_see_is_captured_every_time(
    cache_dir: Path, make: Callable[[], torch.nn.Module], why: str
) -> None:
    x = torch.randn(4, 8)
    for _ in range(2):
        model = make()
        torch._dynamo.reset()
        be = _Outcomes()
        cm = torch.compile(model, backend=be)
        got = cm(x)
        (g,) = torch.autograd.grad(got.sum(), [model.fc.weight])  # type: ignore[union-attr]
        want = make()
        want.load_state_dict(model.state_dict())
        (w,) = torch.autograd.grad(want(x).sum(), [want.fc.weight])  # type: ignore[union-attr]
        torch.testing.assert_close(g, w)
        assert len(be.outcomes) == 1 and be.outcomes[0].startswith("uncacheable: "), be.outcomes
        assert why in be.outcomes[0], be.outcomes
    assert not any((cache_dir / "capture" / "graphs").glob("*"))


def _entry_file(cache_dir: Path) -> Path:
    (f,) = (cache_dir / "capture" / "graphs").iterdir()
    return f


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: f.write_bytes(b""),  # empty
        lambda f: f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2]),  # truncated
        lambda f: f.write_bytes(os.urandom(64)),  # random bytes
        lambda f: f.write_bytes(f.read_bytes().replace(b" graphs 1 ", b" graphs 0 ", 1)),  # version
        lambda f: capcache.store().put(f.name, pickle.dumps({"not": "an entry"})),  # foreign body
    ],
)
def test_a_broken_entry_is_a_miss_with_one_warning_then_rewritten(
    cache_dir: Path, damage: Callable[[Path], Any], caplog: pytest.LogCaptureFixture
) -> None:
    x = torch.randn(4, 8)
    assert _train(_mlp(), x) == ["miss (new key)"]
    f = _entry_file(cache_dir)
    damage(f)
    with caplog.at_level(logging.WARNING, logger="stoker.cache"):
        assert _train(_mlp(), x) == ["miss (corrupt entry)"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(f) in warnings[0].getMessage(), warnings
    assert capcache.store().get(f.name) is not None  # the cold run rewrote it
    assert _train(_mlp(), x) == ["hit"]


def test_guards_false_at_these_sizes_are_a_miss(cache_dir: Path) -> None:
    import sympy

    x = torch.randn(4, 8)
    assert _train(_mlp(), x, dynamic=True) == ["miss (new key)"]
    f = _entry_file(cache_dir)
    (entry,) = pickle.loads(capcache.store().get(f.name) or b"")
    env_syms = sorted(
        {s for g in entry.guards for s in g.expr.free_symbols}
        | {s for gd in entry.graphs for v in gd.vals for s in _syms(v)},
        key=str,
    )
    assert env_syms, "a dynamic capture has symbols"
    from torch.fx.experimental.symbolic_shapes import ShapeGuard

    entry.guards = [ShapeGuard(sympy.Eq(env_syms[0], 1000), None, True)]  # false at 4
    entry.guard_origins = [None]
    capcache.store().put(f.name, pickle.dumps([entry]))
    assert _train(_mlp(), x, dynamic=True) == ["miss (guard replay failed)"]


def _syms(v: Any) -> set[Any]:
    out: set[Any] = set()
    if isinstance(v, tuple | list):
        for x in v:
            out |= _syms(x)
    elif hasattr(v, "free_symbols"):
        out |= set(v.free_symbols)
    return out
