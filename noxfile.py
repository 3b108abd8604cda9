"""Sessions for the stoker monorepo.  `nox -l` lists them.

Every venv pins torch (``STOKER_TORCH``, default ``torch==2.13.0``) *before*
anything else is installed, so a fresh machine takes the CPU build from disk
instead of resolving an unpinned ``torch`` to a multi-GB CUDA build.

On a machine that already has torch and triton and no network (the GPU
machine), use ``nox -s here`` or ``tools/run_here.sh``: they run the same
tests with the current interpreter and create no venv.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import nox

ROOT = Path(__file__).parent
TORCH = os.environ.get("STOKER_TORCH", "torch==2.13.0")
TRITON = os.environ.get("STOKER_TRITON", "triton>=3.6")

nox.options.sessions = ["lint", "types", "tests"]
nox.options.reuse_existing_virtualenvs = True

# package key -> (directory, sibling packages it depends on, needs triton)
PACKAGES: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "shapes": ("stoker-shapes", (), False),
    "capture": ("stoker-capture", ("shapes",), False),
    "autograd": ("stoker-autograd", ("shapes", "capture"), False),
    "triton": ("stoker-triton", ("shapes",), True),
    "stoker": ("stoker", ("shapes", "capture", "autograd", "triton"), True),
}
TEST_DEPS = [
    "pytest>=8",
    "hypothesis>=6.100",
    "numpy",
    "expecttest",
    "ninja",
]  # expecttest: torch.testing._internal (OpInfo); ninja: torch.utils.cpp_extension builds
# the C++ autograd::Function of stoker-autograd's test_autograd_torch_tests.py with it
# transformers: the zoo's tiny HF GPT-2/BERT/Llama (pure Python, no torch); tlparse (a
# binary wheel): reads a TORCH_TRACE of a stoker compile in test_e2e_report_cli.py;
# accelerate: what transformers' Trainer runs on (test_hf_trainer.py)
INTEGRATION_DEPS = ["transformers", "tlparse", "accelerate"]
INTERPRET_ENV = {"TRITON_INTERPRET": "1"}
# timm (test_timm_training.py) needs torchvision's Python parts only. PyPI's torchvision
# for torch 2.13 is a CUDA build whose C ops cannot load beside the CPU torch, and its
# import then fails; installed in the venv, it would also break every transformers import
# (transformers imports torchvision whenever it finds it). So timm is installed without
# its requirements (transformers brings the others) and torchvision, with --no-deps, into
# a folder of its own that only the timm test puts on sys.path (STOKER_TEST_TORCHVISION).
# STOKER_TORCHVISION: the release built for STOKER_TORCH's torch.
TIMM = "timm"
TORCHVISION = os.environ.get("STOKER_TORCHVISION", "torchvision==0.28.0")
# Each test venv holds its own torch (about 1 GB) and triton (1 GB more), so six
# of them need 9 GB at once: CI's disk has run out at the fifth. The `tests` and
# `types` sessions delete their venv when they end, so only one exists at a
# time; STOKER_KEEP_VENVS=1 keeps them for reuse.
KEEP_VENVS = os.environ.get("STOKER_KEEP_VENVS", "") not in ("", "0")


# The test sessions let Python write bytecode caches, even where the image turns them
# off (PYTHONDONTWRITEBYTECODE=1 on CI's machine): without them every process the
# tests start (pytest's workers, the second processes of the warm-start tests, the
# benchmark smoke runs) compiled torch's sources again, about 6 CPU s of each
# `import torch, torch._dynamo` (10 s → 4 s). Each module is compiled on its first
# import in the venv and read back after; nothing is byte-compiled that no test
# imports. The benchmarks and the demo keep the caller's setting.
WRITE_BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}


# One intra-op thread per test process unless the caller sets OMP_NUM_THREADS. The
# suites already use every core through their xdist workers, and CI runs both groups
# at once: four workers, each with an OpenMP pool as wide as the machine, whose idle
# threads spin while they wait for a core. Measured on the 2-core machine (triton
# and autograd suites side by side, two rounds each): 5 % less CPU and wall time.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _tests_env() -> dict[str, str]:
    """Triton's interpreter for the test sessions unless the caller chose
    (TRITON_INTERPRET set: passed through) or a GPU is visible: then each
    suite's conftest decides (stoker-triton runs natively when torch sees CUDA).
    Bytecode caches on (`WRITE_BYTECODE`); one intra-op thread (`ONE_THREAD`)."""
    env = {**WRITE_BYTECODE}
    if "OMP_NUM_THREADS" not in os.environ:
        env.update(ONE_THREAD)
    if "TRITON_INTERPRET" in os.environ or shutil.which("nvidia-smi"):
        return env
    return {**INTERPRET_ENV, **env}


# pip byte-compiles every module it installs (torch alone: about 25 s of CPU per venv);
# Python compiles on import the few each process loads, and in the test sessions
# caches them the same way (`WRITE_BYTECODE`).
NO_COMPILE = "--no-compile"


# The build backend of the five packages. The test groups install it once and build each
# editable install with it (--no-build-isolation): pip otherwise made a fresh build env
# with hatchling for every install call, about 5 CPU s each, 4 calls per group.
HATCHLING = ["hatchling>=1.18", "editables"]  # editables: hatchling's editable builds


def _install(
    session: nox.Session,
    keys: list[str],
    extra: Sequence[str] = (),
    with_torch: bool = True,
    build_isolation: bool = True,
) -> None:
    """Pin torch first, then install the given packages (editable) and extras
    (``build_isolation=False``: built with the venv's own `HATCHLING`)."""
    if with_torch:
        session.install(NO_COMPILE, TORCH)
    needs_triton = any(PACKAGES[k][2] for k in keys)
    if needs_triton:
        session.install(NO_COMPILE, TRITON)
    args: list[str] = []
    for k in keys:
        args += ["-e", str(ROOT / "packages" / PACKAGES[k][0])]
    if args or extra:
        isolation = [] if build_isolation else ["--no-build-isolation"]
        session.install(NO_COMPILE, *isolation, *args, *extra, TORCH)


def _install_timm(session: nox.Session) -> dict[str, str]:
    """timm in the venv and torchvision's files beside it (`TORCHVISION`); the
    environment variable that shows the timm test where they are."""
    # pillow: torchvision's Python parts import it (its datasets and transforms)
    session.install(NO_COMPILE, "--no-deps", TIMM, "pillow")
    venv = getattr(session.virtualenv, "location", None) or str(ROOT / ".nox")
    where = Path(venv) / "torchvision-only"
    session.install(NO_COMPILE, "--no-deps", "--upgrade", "--target", str(where), TORCHVISION)
    return {"STOKER_TEST_TORCHVISION": str(where)}


def _drop_venv(session: nox.Session) -> None:
    """Delete this session's venv (unless STOKER_KEEP_VENVS=1) to free its disk."""
    where = getattr(session.virtualenv, "location", None)
    if KEEP_VENVS or not where or not os.path.isdir(where):
        return
    shutil.rmtree(where, ignore_errors=True)
    session.log(f"removed {where} to free disk (STOKER_KEEP_VENVS=1 keeps it)")


def _closure(key: str) -> list[str]:
    return [*PACKAGES[key][1], key]


# Test groups: each shares one venv, installed step by step in this order, so every
# package's tests run when exactly its declared closure is installed (each still
# "installs alone"), while torch and triton are installed twice, not six times.
GROUPS: dict[str, tuple[str, ...]] = {
    "capture-only": ("shapes", "capture", "autograd"),  # never installs triton
    "full": ("triton", "stoker", "integration"),
}
# pytest-xdist workers per suite (`auto`: one per core); STOKER_TEST_WORKERS=0 runs serially.
WORKERS = os.environ.get("STOKER_TEST_WORKERS", "auto")
# Suites too small to gain from workers: each worker imports torch and collects the
# suite again, which cost stoker-shapes more than it saved (17 s on 2 workers, 9 s alone).
SERIAL = {"shapes"}
# The root conftest puts tests marked `slow` first; `worksteal` gives each worker half of
# the tests, in order, and an idle worker takes the back half of the other's queue, so
# the long tests start early and no worker ends alone on one. (`load` handed the first
# worker its whole first chunk, every slow test; `loadgroup` no longer groups on
# pytest 9.2, pytest-xdist issue 1386.)
XDIST = ["--dist", "worksteal"]
# pytest-xdist workers per suite in `compat` (STOKER_COMPAT_WORKERS): two, as on CI's machine
COMPAT_WORKERS = os.environ.get("STOKER_COMPAT_WORKERS", "2")


@nox.session
@nox.parametrize("group", list(GROUPS))
def tests(session: nox.Session, group: str) -> None:
    """The group's suites, each with only its package's declared dependencies installed."""
    try:
        _run_group(session, GROUPS[group])
    finally:
        _drop_venv(session)


def _run_group(session: nox.Session, order: Sequence[str]) -> None:
    installed: list[str] = []
    session.install(NO_COMPILE, TORCH)
    session.install(NO_COMPILE, *TEST_DEPS, "pytest-xdist>=3.2", *HATCHLING, TORCH)
    env = _tests_env()
    for package in order:
        keys = list(PACKAGES) if package == "integration" else _closure(package)
        needed = [k for k in keys if k not in installed]
        if needed or package == "integration":
            _install(
                session,
                needed,
                INTEGRATION_DEPS if package == "integration" else [],
                with_torch=False,
                build_isolation=False,
            )
            installed += needed
        if package == "integration":
            env.update(_install_timm(session))
        if not any(PACKAGES[k][2] for k in installed):
            # The capture-only install must not drag in triton.
            session.run(
                "python",
                "-c",
                "import importlib.util as u, sys; "
                "sys.exit('triton is installed in a capture-only venv') if u.find_spec('triton') else None",
            )
        where = (
            "tests-integration"
            if package == "integration"
            else f"packages/{PACKAGES[package][0]}/tests"
        )
        serial = WORKERS in ("", "0") or package in SERIAL
        workers = [] if serial else ["-n", WORKERS, *XDIST]
        # the slowest tests of each suite in the log: where CI's time goes
        durations = ["--durations=20", "--durations-min=5"]
        session.run("pytest", where, *workers, *durations, *session.posargs, env=env)


@nox.session
def compat(session: nox.Session) -> None:
    """Every suite on the GPU machine's stack (torch 2.11, triton 3.6), on the CPU.

    Heavy: PyPI's torch 2.11 is a CUDA build (about 3 GB of CUDA libraries come
    with it), so this is not in CI. Triton 3.6's interpreter needs numpy<2.4.
    Kernels are also cross-compiled for sm_90 with Triton 3.6's own compiler,
    the one the GPU machine runs. Each suite runs on `COMPAT_WORKERS` pytest-xdist
    workers (the `SERIAL` ones alone), and the session ends with how long each
    suite and the whole took."""
    session.install("torch==2.11.0", "triton==3.6.0")
    args: list[str] = []
    for k in PACKAGES:
        args += ["-e", str(ROOT / "packages" / PACKAGES[k][0])]
    session.install(
        *args,
        *TEST_DEPS,
        "pytest-xdist>=3.2",
        "numpy<2.4",
        *INTEGRATION_DEPS,
        TIMM,  # and torchvision for torch 2.11, a CUDA build like that torch: its C ops load
        "torch==2.11.0",
    )
    env = {**INTERPRET_ENV, **WRITE_BYTECODE, "CUDA_VISIBLE_DEVICES": ""}
    if "OMP_NUM_THREADS" not in os.environ:
        env.update(ONE_THREAD)
    suites = [(k, f"packages/{PACKAGES[k][0]}/tests") for k in PACKAGES]
    suites.append(("integration", "tests-integration"))
    took: list[tuple[str, float]] = []
    start = time.monotonic()
    try:
        for key, where in suites:
            workers = [] if key in SERIAL else ["-n", COMPAT_WORKERS, *XDIST]
            t0 = time.monotonic()
            try:
                session.run("pytest", where, *workers, *session.posargs, env=env)
            finally:
                took.append((where, time.monotonic() - t0))
    finally:
        for where, seconds in took:
            session.log(f"compat: {where} took {seconds:.0f} s")
        session.log(f"compat: {len(took)} suites took {time.monotonic() - start:.0f} s in all")


@nox.session
def integration(session: nox.Session) -> None:
    """The full install plus tests-integration/."""
    _install(session, list(PACKAGES), TEST_DEPS + INTEGRATION_DEPS)
    env = {**_tests_env(), **_install_timm(session)}
    session.run("pytest", "tests-integration", *session.posargs, env=env)


@nox.session
def build(session: nox.Session) -> None:
    """The five wheels in dist/: `pip install dist/*.whl` installs them (offline once torch is in)."""
    session.install(NO_COMPILE, HATCHLING[0])
    session.run("python", "tools/build_wheels.py", *(session.posargs or ["dist"]))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def types(session: nox.Session) -> None:
    """mypy --strict on packages/*/src."""
    try:
        _install(session, list(PACKAGES), ["mypy>=1.11"])
        session.run("mypy")
    finally:
        _drop_venv(session)


@nox.session
def bench(session: nox.Session) -> None:
    """Every registered benchmark through the harness (`stoker bench`; `stoker bench
    --list` names them): `nox -s bench -- --smoke`, `nox -s bench -- capture autograd`,
    `nox -s bench -- --baseline bench-results/old.json`."""
    _install(session, list(PACKAGES), ["numpy"])
    session.run("stoker", "bench", *session.posargs, env=INTERPRET_ENV)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: `stoker demo` (trains a small GPT eager vs compiled)."""
    _install(session, list(PACKAGES), ["numpy"])
    session.run("stoker", "demo", *session.posargs)


@nox.session
def opinfo(session: nox.Session) -> None:
    """Full OpInfo sweep through aot_function (aten executor; `-- --triton` adds Triton)."""
    _install(session, list(PACKAGES), TEST_DEPS)
    session.run("python", "tools/opinfo_sweep.py", *session.posargs, env=INTERPRET_ENV)


@nox.session(python=False)
def here(session: nox.Session) -> None:
    """All tests with the current interpreter, no venv (GPU machine, no network)."""
    session.run("bash", "tools/run_here.sh", *session.posargs, external=True)
