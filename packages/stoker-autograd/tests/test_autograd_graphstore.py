"""The warm-start cache (``STOKER_CACHE_DIR/autograd/graphs``): a second process with
the same cache directory loads the retraced backward instead of running the captured
graph and retracing it, and its gradients equal eager's on a fresh input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import stoker_autograd
from stoker_autograd._internal import graphstore

WORKER = Path(__file__).with_name("graphstore_worker.py")


def run_worker(model: str, seed: int, cache: Path) -> tuple[dict[str, Any], str]:
    env = {**os.environ, "STOKER_CACHE_DIR": str(cache)}
    env.pop("STOKER_AUTOGRAD_CACHE", None)
    p = subprocess.run(
        [sys.executable, str(WORKER), model, str(seed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "autograd" / "graphs").iterdir())


@pytest.mark.parametrize("model", ["mlp", "function", "hooks", "aot-linear", "aot-dynamic"])
def test_second_process_loads_the_backward(model: str, tmp_path: Path) -> None:
    cold, _ = run_worker(model, 1, tmp_path)
    assert cold["stats"]["compiles"] == 1 and cold["stats"]["disk_misses"] == 1, cold
    assert cold["outcomes"] == {"miss (new key)": 1, "write": 1}, cold
    assert len(entries(tmp_path)) == 1
    warm, _ = run_worker(model, 2, tmp_path)  # a fresh input (and another float on ctx)
    st = warm["stats"]
    assert st["disk_hits"] == 1 and st["compiles"] == 0 and st["eager_runs"] == 0, warm
    assert warm["outcomes"] == {"hit": 1}, warm
    assert warm["diff"] < 1e-5, warm
    assert warm["seen"] == warm["seen_eager"], warm  # post-accumulate-grad hooks, eager order
    # keyed on the engine's walk: a capture makes no FX node; the cold process makes the
    # captured graph (its eager run), runs the reordering passes and makes a module of it
    assert cold["counts"]["fx nodes made while capturing"] == 0, cold
    assert cold["counts"]["captured graphs made"] == 1, cold
    assert cold["counts"]["passes"] >= 1 and cold["counts"]["captured graph modules"] == 1, cold
    # the code of the backward run as is was stored with it: a hit generates none
    assert cold["counts"]["code generated"] == 1 and cold["counts"]["code loaded"] == 0, cold
    # a hit makes no node of the captured graph at all: no graph, no pass, no module
    assert warm["counts"] == {
        "passes": 0,
        "captured graph modules": 0,
        "code generated": 0,
        "code loaded": 1,
        "fx nodes made while capturing": 0,
        "captured graphs made": 0,
    }, warm


def test_a_changed_model_misses(tmp_path: Path) -> None:
    run_worker("mlp", 1, tmp_path)
    other, _ = run_worker("mlp-wide", 1, tmp_path)
    assert other["stats"]["disk_hits"] == 0 and other["stats"]["compiles"] == 1, other
    assert other["outcomes"] == {"miss (new key)": 1, "write": 1}, other
    assert other["diff"] < 1e-5
    assert len(entries(tmp_path)) == 2


def test_two_processes_writing_one_entry_both_succeed(tmp_path: Path) -> None:
    env = {**os.environ, "STOKER_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "hooks", str(seed)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["diff"] < 1e-5 and not err, (got, err)
    assert len(entries(tmp_path)) == 1  # one sound entry (the last rename won)
    warm, err = run_worker("hooks", 3, tmp_path)
    assert warm["outcomes"] == {"hit": 1} and not err, (warm, err)


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _garbage(data: bytes) -> bytes:
    return os.urandom(len(data))


def _foreign_version(data: bytes) -> bytes:
    nl = data.index(b"\n")
    magic, kind, _version, _digest = data[:nl].decode().rsplit(" ", 3)
    body = data[nl + 1 :]
    digest = hashlib.sha256(body).hexdigest()
    return f"{magic} {kind} 0-another-stoker {digest}\n".encode() + body


def _bad_body(data: bytes) -> bytes:
    """A sound file (header, checksum) whose JSON names an operator torch lacks."""
    nl = data.index(b"\n")
    body = data[nl + 1 :].replace(b'"op:aten.mm.default"', b'"op:aten.no_such_op.default"')
    head = data[:nl].decode().rsplit(" ", 1)[0]
    return f"{head} {hashlib.sha256(body).hexdigest()}\n".encode() + body


@pytest.fixture(scope="module")
def cold_mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding the entry of one cold mlp process."""
    cache = tmp_path_factory.mktemp("cold-mlp")
    run_worker("mlp", 1, cache)
    return cache


@pytest.mark.parametrize("damage", [_truncate, _garbage, _foreign_version, _bad_body])
def test_a_broken_entry_is_one_warning_and_a_miss(
    damage: Any, cold_mlp: Path, tmp_path: Path
) -> None:
    shutil.copytree(cold_mlp, tmp_path, dirs_exist_ok=True)
    (path,) = entries(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    warm, err = run_worker("mlp", 2, tmp_path)
    assert err.count(str(path)) == 1, err  # one warning, naming the file
    assert warm["stats"]["disk_hits"] == 0 and warm["stats"]["compiles"] == 1, warm
    assert warm["outcomes"] == {"miss (corrupt entry)": 1, "write": 1}, warm
    assert warm["diff"] < 1e-5
    if damage is _truncate:
        again, err = run_worker("mlp", 3, tmp_path)  # the cold compile rewrote it
        assert again["outcomes"] == {"hit": 1} and not err, (again, err)


def test_unpack_hooks_are_uncacheable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    graphstore.outcomes.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with stoker_autograd.enable():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t):
            loss = model(x).sum()
        loss.backward()
    assert any(k.startswith("uncacheable (a saved-tensor unpack hook") for k in graphstore.outcomes)
    assert not (tmp_path / "autograd").exists()


def test_the_cache_can_be_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STOKER_AUTOGRAD_CACHE", "0")
    model = nn.Linear(4, 2)
    with stoker_autograd.enable():
        model(torch.randn(3, 4)).sum().backward()
    assert stoker_autograd.stats()["compiles"] == 1
    assert not (tmp_path / "autograd").exists()


def test_tensor_constants_are_stored_and_keyed_by_value() -> None:
    """An inlined AOT backward may hold tensor constants (HF GPT-2's does)."""
    from stoker_shapes import GuardSet

    g = torch.fx.Graph()
    x = g.placeholder("inputs_0")
    c = g.get_attr("aot0_const")
    g.output([g.call_function(torch.ops.aten.mul.Tensor, (x, c))])
    root = nn.Module()
    root.aot0_const = torch.randn(4, 3).t()  # not contiguous: strides kept too
    gm = torch.fx.GraphModule(root, g)
    body = graphstore.entry(graphstore.graph_json(gm), [(0, 0)], GuardSet([], [], []), {})
    loaded, arg_spec, _guards, _values, _code = graphstore.from_json(body)
    const = loaded.aot0_const
    assert torch.equal(const, root.aot0_const) and const.stride() == root.aot0_const.stride()
    inp = torch.randn(3, 4)
    torch.testing.assert_close(loaded(inp)[0], inp * root.aot0_const)
    assert arg_spec == [(0, 0)]

    before = graphstore.graph_text(gm, {})
    gm.aot0_const = gm.aot0_const + 1  # other values: another key
    assert graphstore.graph_text(gm, {}) != before


def test_a_recompile_after_a_warm_load_names_what_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variant that missed came from the disk (its guards as stored); the reason is
    still in user terms, from this process's capture of the graph."""
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    for sizes in ((3,), (3, 5)):  # cold (writes batch 3); then warm for 3, cold for 5
        stoker_autograd.clear_cache()  # as in a new process: the engine captures again
        graphstore.outcomes.clear()
        stoker_autograd.reset_stats()
        with stoker_autograd.enable():
            for n in sizes:
                model.zero_grad()
                model(torch.randn(n, 4)).pow(2).mean().backward()
    assert graphstore.outcomes.get("hit", 0) >= 1, graphstore.outcomes
    why = stoker_autograd.recompile_reasons()
    assert len(why) == 1 and "changed 3 -> 5 (args[0][" in why[0], why
    assert "Backward0" in why[0].split(" changed ")[0], why


def test_symbolic_sizes_are_stored_as_expressions_and_read_back() -> None:
    """A symbolic size is stored as its expression (torch's ``FloorDiv`` included, which
    ``str`` prints as ``//``, read back as sympy's floor: not the same expression) and
    read back over the input symbols another context makes for the same call."""
    from stoker_autograd._internal.retrace import fake_inputs
    from stoker_shapes import ShapeContext

    x, dynamic = torch.randn(6, 4), frozenset({(0, 0, 0)})
    (fake,) = fake_inputs(ShapeContext(policy="auto"), [x], [], [], dynamic)["inputs"]
    n = fake.shape[0]
    warm = ShapeContext(policy="auto")  # as in a new process: same call, same symbol names
    fake_inputs(warm, [x], [], [], dynamic)
    reader = graphstore._Reader(warm, symbolic=True)
    for v in (n, n // 4, 3 * n + 1, (n + 1) // 2, n * fake.shape[1]):
        text = graphstore._size_json(v)
        assert isinstance(text, str) and reader.size(text) == v.node.expr, text
    assert graphstore._size_json(fake.shape[1]) == 4


def test_a_cpp_autograd_function_is_not_stored() -> None:
    """The engine names a C++ ``autograd::Function``'s node ``CppNode<class><n>``, ``n``
    counting the classes of that name in the order this process met them: in another
    process the same name may be another extension's Function (PyTorch's own tests
    define a dozen ``CustomOpAutogradFunction`` structs), so a stored backward keyed by
    it could load another Function's traced backward.  A built-in node's name is its
    type's and stays a key."""
    from stoker_autograd._internal import ops

    def functional(grads: list[Any], *saved: Any) -> list[Any]:
        return list(grads)

    def graph_calling(target: Any) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        x = g.placeholder("inputs")
        g.output([g.call_function(target, ([x],))])
        return torch.fx.GraphModule(nn.Module(), g)

    cpp = ops.REGISTRY.get(ops.REGISTRY.bind("StokerTestFn", functional, True, True))
    with pytest.raises(graphstore.Uncacheable, match="C\\+\\+ autograd::Function"):
        graphstore.graph_text(graph_calling(cpp), {})
    builtin = ops.REGISTRY.get(ops.REGISTRY.bind("StokerTestBackward0", functional, False, True))
    assert "bound:StokerTestBackward0" in graphstore.graph_text(graph_calling(builtin), {})
