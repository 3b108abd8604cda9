"""Unit tests of the umbrella's own pieces: options, logging, the report, the CLI parser,
the model zoo, and `import stoker` staying light."""

from __future__ import annotations

import dataclasses
import html.parser
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

import stoker
from stoker import cli
from stoker._internal import config
from stoker._internal.bench.models import get_model, model_zoo
from stoker._internal.config import CompileOptions, StokerConfigError, resolve_backend
from stoker._internal.report import logs
from stoker._internal.report.report import (
    SECTIONS,
    GraphRecord,
    GuardRecord,
    KernelRecord,
    PartitionRecord,
    ReadableCode,
    RecompileRecord,
    Report,
    SavedValue,
)

# ----------------------------------------------------------------------------- import


def test_import_is_light() -> None:
    """`import stoker` must not import triton, torch._dynamo or the sibling packages."""
    code = (
        "import sys, stoker; "
        "bad = [m for m in ('triton', 'torch._dynamo', 'stoker_capture', 'stoker_triton', "
        "'stoker_autograd') if m in sys.modules]; print(','.join(bad))"
    )
    # a fresh interpreter: the tests' processes are otherwise forked with Dynamo imported
    env = {**os.environ, "STOKER_TEST_FRESH_PROCESS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "", f"import stoker pulled in: {out.stdout.strip()}"


def test_public_names_resolve() -> None:
    for name in (
        "compile",
        "backend",
        "StokerBackend",
        "Report",
        "last_report",
        "set_logs",
        "reset",
        "autograd_enabled",
        "CompileOptions",
    ):
        assert getattr(stoker, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        stoker.nope  # noqa: B018


def test_backend_entry_point_registered() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="torch_dynamo_backends")}
    assert "stoker" in eps, "the torch_dynamo_backends entry point is not installed"
    assert eps["stoker"].load() is stoker.backend


# ----------------------------------------------------------------------------- options


def test_options_validate() -> None:
    assert CompileOptions.from_kwargs().backend == "auto"
    with pytest.raises(StokerConfigError, match="not a stoker backend"):
        CompileOptions.from_kwargs(backend="cuda")
    with pytest.raises(StokerConfigError, match=r"memory_budget=1.5"):
        CompileOptions.from_kwargs(memory_budget=1.5)
    with pytest.raises(StokerConfigError, match=r"unknown stoker option.*fulgraph"):
        CompileOptions.from_kwargs(fulgraph=True)
    with pytest.raises(StokerConfigError, match="dynamic="):
        CompileOptions.from_kwargs(dynamic="yes")


def test_report_path_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("STOKER_REPORT", "/tmp/x.html")
    assert CompileOptions.from_kwargs().report == "/tmp/x.html"
    assert CompileOptions.from_kwargs(report="y.html").report == "y.html"


def test_resolve_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOKER_BACKEND", raising=False)
    monkeypatch.delenv("STOKER_CC", raising=False)
    monkeypatch.setattr(config, "_C_MISSING", [])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", [cpu]) == "c"  # gcc is on every machine here
    assert resolve_backend("c", [cpu]) == "c"
    with pytest.raises(StokerConfigError, match="backend='c' compiles C kernels for CPU"):
        resolve_backend("c", [cuda])
    assert resolve_backend("aten", [cuda]) == "aten"
    assert resolve_backend("auto", [cuda]) == "triton"  # triton is installed here
    with pytest.raises(StokerConfigError, match="backend='interpret'"):
        resolve_backend("triton", [cpu])
    monkeypatch.setenv("STOKER_BACKEND", "interpret")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", [cpu]) == "interpret"
    monkeypatch.setenv("STOKER_BACKEND", "bogus")
    with pytest.raises(StokerConfigError, match="STOKER_BACKEND"):
        resolve_backend("auto", [cpu])


def test_no_c_compiler_runs_the_aten_executor_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("STOKER_BACKEND", raising=False)
    monkeypatch.setenv("STOKER_CC", "/nonexistent/cc")
    monkeypatch.setattr(config, "_C_MISSING", [])
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="stoker.backend"):
        assert resolve_backend("auto", [cpu]) == "aten"
        assert resolve_backend("auto", [cpu]) == "aten"
    lines = [r.getMessage() for r in caplog.records if r.name == "stoker.backend"]
    assert len(lines) == 1, lines  # said once, not per graph
    assert "/nonexistent/cc" in lines[0] and "apt-get install gcc" in lines[0], lines
    assert "aten executor" in lines[0]
    with pytest.raises(StokerConfigError, match=r"backend='c' needs a C compiler"):
        resolve_backend("c", [cpu])


# ----------------------------------------------------------------------------- logging


def test_parse_log_spec() -> None:
    assert logs.parse_spec("graphs,+guards") == {"graphs": logging.INFO, "guards": logging.DEBUG}
    assert set(logs.parse_spec("all")) == set(logs.TOPICS)
    assert logs.parse_spec("") == {}
    with pytest.raises(logs.LogSpecError, match="unknown stoker log topic 'graph'"):
        logs.parse_spec("graph")


def test_set_logs_routes_through_logging(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        stoker.set_logs("recompiles")
        assert logs.enabled("recompiles") and not logs.enabled("graphs")
        logs.logger("recompiles").info("hello %s", "there")
        logs.logger("graphs").info("not shown")
        err = capsys.readouterr().err
        assert "[stoker.recompiles] hello there" in err
        assert "not shown" not in err
        stoker.set_logs(graphs=True)
        assert logs.enabled("graphs") and not logs.enabled("recompiles")
    finally:
        stoker.set_logs("")
    assert not any(logs.enabled(t) for t in logs.TOPICS)


def test_stoker_logs_env_applies_at_import() -> None:
    code = "import stoker, logging; print(logging.getLogger('stoker.guards').level)"
    env = {**os.environ, "STOKER_LOGS": "guards"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == str(logging.INFO)
    env["STOKER_LOGS"] = "nonsense"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert "STOKER_LOGS ignored" in out.stderr


# ----------------------------------------------------------------------------- report


def _sample_report(path: str | None = None) -> Report:
    r = Report(path=path)
    r.options = {"backend": "auto", "dynamic": None}
    c = r.new_compile("forward (model.py:12) #0/0", "aten")
    c.graphs.append(GraphRecord("dynamo", "def forward(self, x):\n    return x <b>", 1))
    c.graphs.append(GraphRecord("forward", "def forward(self, primals_1): ...", 4))
    c.guards.append(
        GuardRecord("L['x'].size()[0] % 2 == 0", "made by aten.view at model.py:12", "shape")
    )
    c.guards.append(GuardRecord("L['x'] matches float32[8, 4] on cpu", "input", "tensor"))
    c.partition = PartitionRecord(
        [SavedValue("mm", "8×4", "float32", 128)], ["relu_1"], "min_cut", 0.5
    )
    c.kernels.append(KernelRecord("triton_poi_0", "pointwise", "add, relu"))
    c.fallbacks.append("aten.sort: no lowering")
    c.time("capture", 12.5)
    r.recompiles.append(
        RecompileRecord("forward", "tensor 'x' size mismatch at index 0. expected 8, actual 16")
    )
    r.autograd = {"captures": 1, "cache_hits": 3}
    return r


def test_a_graph_s_code_is_printed_only_when_a_report_shows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    printed = []
    real = type(gm).print_readable
    monkeypatch.setattr(
        type(gm), "print_readable", lambda self, **k: printed.append(1) or real(self, **k)
    )
    r = Report()
    r.new_compile("f #0/0", "aten").graphs.append(GraphRecord("dynamo", ReadableCode(gm), 2))
    assert printed == []  # recorded, not printed
    code = gm.print_readable(print_output=False)
    printed.clear()
    assert json.loads(r.to_json())["compiles"][0]["graphs"][0]["code"] == code
    assert html.escape(code).split("\n")[0] in r.to_html()
    assert printed == [1]  # once, then kept


class _Collect(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.ids += [v for k, v in attrs if k == "id" and v]
        for k, v in attrs:
            if k in ("src", "href") and v and not (v.startswith("#") or v.startswith("data:")):
                raise AssertionError(f"external resource in the report: {k}={v}")

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_report_html_sections_and_content(tmp_path: object) -> None:
    r = _sample_report()
    page = r.to_html()
    p = _Collect()
    p.feed(page)
    assert [sid for sid, _ in SECTIONS] == [i for i in p.ids]
    text = "".join(p.text)
    for needle in (
        "L['x'].size()[0] % 2 == 0",
        "made by aten.view at model.py:12",
        "relu_1",
        "triton_poi_0",
        "aten.sort: no lowering",
        "expected 8, actual 16",
        "cache_hits",
        "return x <b>",
        "128 B",
    ):
        assert needle in text, needle
    assert "script" not in p.tags, "the report must not contain scripts"
    assert "<b>" not in page.split("<pre>", 1)[1], "graph code must be escaped"
    assert r.summary() == {
        "graphs": 1,
        "guards": 2,
        "kernels": 1,
        "backward_kernels": 0,
        "fallbacks": 1,
        "recompiles": 1,
        "graph_breaks": 0,
        "cache": "off",
        "cache_hits": 0,
        "cache_misses": 0,
        "capture_cache_hits": 0,
        "capture_cache_misses": 0,
        "graph_cache_hits": 0,
        "graph_cache_misses": 0,
        "autograd_cache_hits": 0,
        "autograd_cache_misses": 0,
        "compile_ms": 12.5,
        "first_step_ms": None,
        "first_step_other_ms": None,
    }
    json.loads(r.to_json())


def test_report_empty_sections_say_so() -> None:
    page = Report().to_html()
    assert page.count("none recorded") >= 5


def test_report_write_and_flush(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(os.fspath(tmp_path), "sub", "r.html")
    r = _sample_report(path)
    r.flush()
    assert open(path, encoding="utf-8").read().startswith("<!DOCTYPE html>")


# ----------------------------------------------------------------------------- CLI


def test_cli_parses() -> None:
    p = cli.build_parser()
    a = p.parse_args(["demo", "--steps", "5", "--backend", "aten"])
    assert (a.command, a.steps, a.backend) == ("demo", 5, "aten")
    a = p.parse_args(["bench", "--models", "mlp,gpt", "--no-warm"])
    assert (a.models, a.no_warm, a.json) == ("mlp,gpt", True, "bench-results/bench.json")
    a = p.parse_args(["explain", "train.py", "--lr", "3"])
    assert (a.script, a.args) == ("train.py", ["--lr", "3"])
    with pytest.raises(SystemExit):
        p.parse_args(["demo", "--backend", "cuda"])
    with pytest.raises(SystemExit):
        p.parse_args([])


def test_cli_explain_missing_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "/nonexistent/script.py"]) == 2
    assert "no such script" in capsys.readouterr().err


def test_console_script_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "--help"], capture_output=True, text=True, check=True
    )
    for cmd in ("demo", "bench", "explain"):
        assert cmd in out.stdout


# ----------------------------------------------------------------------------- zoo


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_zoo_models_train_one_step(name: str) -> None:
    spec = get_model(name)
    model = spec.build(seed=1)
    inputs, target = spec.batch(4, torch.Generator().manual_seed(0))
    loss = spec.loss(model(*inputs), target)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    again = spec.build(seed=1)
    for a, b in zip(model.parameters(), again.parameters()):
        torch.testing.assert_close(a, b)  # builds are deterministic per seed


def test_zoo_unknown_name() -> None:
    assert {"mlp", "gpt", "cnn"} <= set(model_zoo())
    with pytest.raises(KeyError, match=r"no model 'resnet'.*available: mlp"):
        get_model("resnet")


# ----------------------------------------------------------------------------- bench


def test_bench_table(tmp_path: os.PathLike[str]) -> None:
    from stoker._internal.bench import bench

    rows = [
        {
            "model": "mlp",
            "backend": "eager",
            "first_step_s": 0.5,
            "warm_first_step_s": 0.4,
            "steady_ms": 1.25,
            "peak_mem": 4096,
            "recompiles": 0,
        },
        {"model": "mlp", "backend": "stoker", "error": "exit 1: boom"},
    ]
    table = bench.format_table(rows)
    assert "cold first step s" in table and "1.25" in table and "4 KiB" in table
    assert "error: exit 1: boom" in table


def test_bench_rows_from_any_json_shape() -> None:
    from stoker._internal.bench.registry import flatten_rows

    doc = {
        "torch": "2.13",
        "models": {"mlp": {"ms": 1.5, "stats": {"hits": 2}}, "gpt": {"ms": 3.0}},
        "compile": [{"model": "cnn", "first_s": 0.25, "losses": [1.0, 0.5]}],
    }
    rows = {r["case"]: r["metrics"] for r in flatten_rows(doc)}
    assert rows == {
        "models mlp": {"ms": 1.5, "stats.hits": 2.0},
        "models gpt": {"ms": 3.0},
        "compile cnn": {"first_s": 0.25},
    }
    top = flatten_rows({"us": 1.5, "rows": [{"name": "a", "gbs": 9}]})
    assert [(r["case"], r["metrics"]) for r in top] == [("", {"us": 1.5}), ("rows a", {"gbs": 9.0})]


def test_bench_harness_json_markdown_and_baseline(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program benchmark runs in its own process (the env the registry gives it, empty
    caches); its JSON becomes rows; a second run against the first as baseline flags the
    metric that got worse beyond the threshold, in the right direction for each."""
    from stoker._internal.bench import harness, registry

    root = os.fspath(tmp_path)
    os.makedirs(os.path.join(root, "fakebench"))
    open(os.path.join(root, "fakebench", "__init__.py"), "w").close()
    with open(os.path.join(root, "fakebench", "prog.py"), "w") as f:
        f.write(
            "import argparse, json, os\n"
            "p = argparse.ArgumentParser(); p.add_argument('--ms', type=float)\n"
            "p.add_argument('--gbs', type=float); p.add_argument('--json')\n"
            "a = p.parse_args(); print('prog table', os.environ['FAKE'])\n"
            "assert os.environ['STOKER_CACHE_DIR'] != 'outer'\n"
            "json.dump({'step_ms': a.ms, 'copy_gbs': a.gbs}, open(a.json, 'w'))\n"
        )
    monkeypatch.setattr(registry, "PACKAGE", "fakebench")
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("STOKER_CACHE_DIR", "outer")
    prog = registry.Benchmark(
        "fake",
        "stoker",
        "a fake",
        module="prog",
        args=("--ms", "10", "--gbs", "100"),
        smoke_args=("--ms", "1", "--gbs", "1"),
        env={"FAKE": "env-given"},
    )
    monkeypatch.setitem(registry.REGISTRY, "fake", prog)
    js, md = os.path.join(root, "a.json"), os.path.join(root, "a.md")
    doc = harness.run(["fake"], registry.Options(), json_path=js, markdown_path=md)
    entry = doc["benchmarks"]["fake"]
    assert entry["status"] == "ok" and "prog table env-given" in entry["stdout"], entry
    assert doc["rows"] == [
        {"benchmark": "fake", "case": "", "metrics": {"step_ms": 10.0, "copy_gbs": 100.0}}
    ]
    assert json.load(open(js, encoding="utf-8"))["machine"]["torch"] == torch.__version__
    assert "| fake | ok |" in open(md, encoding="utf-8").read()
    # slower and less bandwidth: both regress; --smoke's sizes against the full run's
    js2, md2 = os.path.join(root, "b.json"), os.path.join(root, "b.md")
    opts = registry.Options(extra=("--ms", "12", "--gbs", "80"))
    doc = harness.run(["fake"], opts, json_path=js2, markdown_path=md2, baseline=js)
    (row,) = doc["rows"]
    assert row["ratio"] == pytest.approx({"step_ms": 1.2, "copy_gbs": 0.8})
    assert sorted(row["regressions"]) == ["copy_gbs", "step_ms"]
    assert harness.regressions(doc) == ["fake step_ms", "fake copy_gbs"]
    assert "**regressed**" in open(md2, encoding="utf-8").read()
    opts = registry.Options(extra=("--ms", "10.5", "--gbs", "120"))
    doc = harness.run(["fake"], opts, json_path=js2, markdown_path=md2, baseline=js)
    assert doc["rows"][0]["regressions"] == []  # within 10 %, and faster
    # a program past --timeout is stopped with the processes it started
    with open(os.path.join(root, "fakebench", "hang.py"), "w") as f:
        f.write(
            "import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print('started', flush=True); time.sleep(60)\n"
        )
    hang = dataclasses.replace(prog, name="hang", module="hang", args=())
    monkeypatch.setitem(registry.REGISTRY, "hang", hang)
    t0 = time.perf_counter()
    entry, raw = harness.run_program(hang, registry.Options(timeout=3.0))
    assert time.perf_counter() - t0 < 30 and raw is None
    assert entry["status"] == "timed out after 3 s" and entry["stdout"] == "started\n", entry
    # without --timeout, the benchmark's own limit (hf_zoo's runs for hours: its models'
    # processes have their own limits, and the harness's 900 s had lost every row)
    entry, raw = harness.run_program(dataclasses.replace(hang, limit=2.0), registry.Options())
    assert entry["status"] == "timed out after 2 s", entry
    assert registry.Options().timeout is None and registry.REGISTRY["hf_zoo"].limit >= 4 * 3600


def test_bench_registry_names_every_benchmark_module() -> None:
    """Each module of `benchmarks` is registered (a new one cannot be left out of
    `stoker bench`), and `import stoker` loads no benchmark."""
    import pkgutil

    from stoker._internal.bench import benchmarks
    from stoker._internal.bench.registry import REGISTRY

    modules = {m.name for m in pkgutil.iter_modules(benchmarks.__path__)}
    assert modules == {b.module for b in REGISTRY.values() if b.module}
    code = "import stoker, sys; print([m for m in sys.modules if 'stoker._internal.bench' in m])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_bench_worker_eager_mlp() -> None:
    code = "from stoker._internal.bench.bench import _main; _main(['worker', 'mlp', 'eager', '--steps', '2'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["model"] == "mlp" and row["backend"] == "eager" and row["recompiles"] == 0
    assert row["peak_mem"] > 0 and row["steady_ms"] > 0
    assert row["steady_ms_min"] <= row["steady_ms"] <= row["steady_ms_max"]
    assert row["steady_repeats"] == 2


# ----------------------------------------------------------------------------- per call


def test_forward_wrapper_patches_dynamos_ddp_config_only_with_a_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`stoker.compile`'s forward turns Dynamo's DDPOptimizer off around the call only
    where a DDP can run (a process group is up): the patch costs more per call than a
    small model's whole compiled forward."""
    import torch._dynamo

    from stoker._internal.distributed import distributed

    seen: list[object] = []

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch._dynamo.config.optimize_ddp)
            return x + 1

    net = Net()
    distributed.wrap_forward(net, compiled_autograd=True)
    default = torch._dynamo.config.optimize_ddp
    x = torch.randn(3)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert torch.equal(net(x), x + 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.collectives, "install", lambda: None)
    assert torch.equal(net(x), x + 1)
    assert seen == [default, False]
    assert torch._dynamo.config.optimize_ddp == default


def test_demo_loop_freezes_its_setup_and_gives_it_back() -> None:
    """`frozen_heap` (the demo's loop): garbage of the setup is collected, not frozen;
    what is alive is frozen inside; nothing stays frozen after; a heap someone else
    froze is left as it is."""
    import gc
    import weakref

    from stoker._internal.bench.demo import frozen_heap

    class Cycle:
        pass

    dead = Cycle()
    dead.me = dead  # type: ignore[attr-defined]
    gone = weakref.ref(dead)
    del dead
    alive = [object()]
    with frozen_heap():
        assert gone() is None  # collected before freezing
        assert gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # in the permanent generation
    assert gc.get_freeze_count() == 0
    assert any(o is alive for o in gc.get_objects())
    canary = [object()]
    gc.freeze()
    try:
        with frozen_heap():
            pass
        # not unfrozen by the demo: the canary is still in the permanent generation (the
        # frozen count itself may drop while it runs, as frozen objects die by refcount)
        assert gc.get_freeze_count() > 0
        assert not any(o is canary for o in gc.get_objects())
    finally:
        gc.unfreeze()
