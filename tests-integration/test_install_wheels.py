"""A user's install: the five wheels into a fresh venv, then the README's quickstart.

The wheels are built the way ``nox -s build`` builds them (``tools/build_wheels.py``,
hatchling in a venv of its own). A second, fresh venv gets this process's torch
build (never an unpinned torch, which resolves to a multi-GB CUDA build) and its
triton, then ``pip install --no-index`` of the wheels: offline, each sibling's
floor met by the files given. Both venvs get what they need before the wheels
(hatchling; torch and triton) as links to this environment's installed files,
each distribution with its metadata and its requirements: the venv sees them
installed as pip would have put them, without unpacking 2 GB again (15 CPU s). The quickstart is taken from README.md (so the two
cannot drift apart) and run in that venv, outside the checkout and with no
PYTHONPATH, once as written and once with ``stoker.compile`` and ``torch.compile``
replaced by the identity (eager); losses and final parameters must agree.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Runs the quickstart in the fresh venv. argv: mode (eager|stoker), snippet, out dir.
DRIVER = textwrap.dedent("""
    import json, os, runpy, sys
    import torch
    import stoker

    mode, snippet, out = sys.argv[1:]
    modules = []

    def recording(real):
        def compile_fn(model, *args, **kwargs):
            modules.append(model)
            return model if mode == "eager" else real(model, *args, **kwargs)
        return compile_fn

    stoker.compile = recording(stoker.compile)
    torch.compile = recording(torch.compile)
    runpy.run_path(snippet, run_name="__main__")
    torch.save([m.state_dict() for m in modules], os.path.join(out, "params.pt"))
    facts = {"stoker": stoker.__file__, "torch": torch.__file__, "modules": len(modules)}
    if mode == "stoker":
        import stoker_autograd
        facts["graphs"] = stoker.last_report().summary()["graphs"]
        facts["backend_graphs"] = len(stoker.backend.report.compiles)
        facts["captures"] = stoker_autograd.stats()["captures"]
    with open(os.path.join(out, "facts.json"), "w") as f:
        json.dump(facts, f)
""")


def quickstart(path: Path) -> str:
    """The first ```python block under the ``## Quickstart`` heading of ``path``."""
    text = path.read_text(encoding="utf-8")
    found = re.search(r"^## Quickstart\n(.*?)^```python\n(.*?)^```$", text, re.M | re.S)
    assert found, f"{path.name} has no ```python block under '## Quickstart'"
    return found.group(2)


def test_quickstart_is_the_same_in_readme_and_docs() -> None:
    snippet = quickstart(ROOT / "README.md")
    assert "_internal" not in snippet, "the quickstart must use only public names"
    assert "stoker.compile(" in snippet and 'backend="stoker"' in snippet
    assert snippet in (ROOT / "docs" / "stoker.md").read_text(encoding="utf-8"), (
        "docs/stoker.md must show the README's quickstart unchanged"
    )


def _pip(python: Path, *args: str) -> None:
    """pip of this process, installing into the venv of ``python`` (which has no pip)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), *args],
        check=True,
        timeout=900,
    )


def _venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    return where / "bin" / "python"


def _requirements(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` and everything they require, recursively
    (requirements whose environment marker is false here left out, extras too)."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in found:
            continue
        found[key] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def _install_by_links(python: Path, names: list[str]) -> None:
    """Install ``names`` (with their requirements) from this environment into the venv
    of ``python``: each top-level entry of each distribution's files (packages, modules,
    its .dist-info) becomes a link in the venv's site-packages. Scripts outside
    site-packages are left out."""
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for dist in _requirements(names):
        base = Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}
        assert tops, f"{dist.metadata['Name']} lists no files (no RECORD): cannot link it"
        for top in sorted(tops):
            link = site / top
            if not link.exists() and (base / top).exists():
                link.symlink_to(base / top)


def _user_env(home: Path) -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH to the checkout, no stoker settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STOKER_", "PYTHON", "TORCH_", "TORCHINDUCTOR_"))
    }
    env["STOKER_CACHE_DIR"] = str(home / "stoker-cache")
    return env


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A folder deleted at the end (two venvs with torch: pytest keeps old tmp_paths)."""
    where = Path(tempfile.mkdtemp(prefix="stoker-install-test-"))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.slow
def test_wheels_install_offline_in_a_fresh_venv_and_run_the_quickstart(scratch: Path) -> None:
    if torch.version.cuda or getattr(torch.version, "hip", None):
        pytest.skip(
            f"this process's torch ({torch.__version__}) is a GPU build: installing it into a "
            "fresh venv would fetch gigabytes of GPU libraries; CI's CPU torch runs this test"
        )
    try:
        importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("stoker needs triton, which is not installed here (the full group has it)")

    # 1. the wheels, as nox -s build makes them
    spec = importlib.util.spec_from_file_location(
        "build_wheels", ROOT / "tools" / "build_wheels.py"
    )
    assert spec is not None and spec.loader is not None
    build_wheels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_wheels)
    builder = _venv(scratch / "build-venv")
    try:
        _install_by_links(builder, ["hatchling"])
    except importlib.metadata.PackageNotFoundError:  # not here: the build venv fetches it
        _pip(builder, "install", "--quiet", "--no-compile", "hatchling>=1.18")
    wheels = build_wheels.build(
        scratch / "dist", pip=[sys.executable, "-m", "pip", "--python", str(builder)]
    )
    names = sorted(w.name.split("-")[0] for w in wheels)
    assert names == sorted(
        ["stoker", "stoker_autograd", "stoker_capture", "stoker_shapes", "stoker_triton"]
    )

    # 2. a fresh venv: this process's torch (its CPU build) and triton first, then the
    #    wheels with no index at all
    python = _venv(scratch / "venv")
    _install_by_links(python, ["torch", "triton"])
    _pip(python, "install", "--quiet", "--no-compile", "--no-index", *map(str, wheels))
    _pip(python, "check")

    # 3. the README's quickstart, as written and eagerly, outside the checkout
    home = scratch / "home"
    home.mkdir()
    (home / "quickstart.py").write_text(quickstart(ROOT / "README.md"), encoding="utf-8")
    (home / "driver.py").write_text(DRIVER, encoding="utf-8")
    env = _user_env(home)
    outputs: dict[str, str] = {}
    for mode in ("eager", "stoker"):
        out = home / mode
        out.mkdir()
        p = subprocess.run(
            [str(python), "driver.py", mode, "quickstart.py", str(out)],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, f"quickstart ({mode}) failed:\n{p.stdout}\n{p.stderr[-4000:]}"
        outputs[mode] = p.stdout
    facts = json.loads((home / "stoker" / "facts.json").read_text())
    venv = str(scratch / "venv")
    assert facts["stoker"].startswith(venv) and facts["torch"].startswith(venv), facts
    assert facts["modules"] == 2, "the quickstart compiles two models"
    assert facts["graphs"] >= 1 and facts["backend_graphs"] >= 1, facts
    assert facts["captures"] >= 1, "the backward did not run through stoker-autograd"

    # the same printed losses and the same trained parameters as eager
    def losses(text: str) -> list[float]:
        return [float(x) for x in re.findall(r"loss (-?\d+\.\d+)", text)]

    got, want = losses(outputs["stoker"]), losses(outputs["eager"])
    assert len(got) == 2 and len(want) == 2, outputs
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    compiled_params = torch.load(home / "stoker" / "params.pt")
    eager_params = torch.load(home / "eager" / "params.pt")
    assert len(compiled_params) == len(eager_params) == 2
    for i, (c, e) in enumerate(zip(compiled_params, eager_params)):
        assert c.keys() == e.keys()
        for k in c:
            torch.testing.assert_close(
                c[k], e[k], rtol=1e-4, atol=1e-5, msg=lambda m, i=i, k=k: f"model {i} {k}: {m}"
            )

    # the console script came with the wheels
    p = subprocess.run(
        [str(scratch / "venv" / "bin" / "stoker"), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "demo" in p.stdout, p.stderr
