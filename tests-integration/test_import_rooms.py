"""The import architecture of ``packages/*/src``, read from the source (``ast``).

Three rules, each a test below:

* **Layering.** A package imports only the packages below it (docs/contributing.md,
  "Layout"): stoker-shapes < stoker-capture < stoker-autograd, stoker-shapes <
  stoker-triton, and the umbrella ``stoker`` on top of all four; only packages its
  ``pyproject.toml`` declares (so each one installs alone); and only stoker-triton
  and ``stoker`` import ``triton``.
* **Rooms.** Inside a package, a *room* is a folder of ``_internal/`` or a module at
  the top of ``_internal/``; outside ``_internal/``, each public module or subpackage
  is a room (``stoker_autograd.passes``), and so is the package's ``__init__``
  (``(package)``).  No two rooms import each other, directly or around a circle.
* **Stages of stoker-autograd.** Its modules belong to stages (`AUTOGRAD_STAGES`), in
  the order data flows through a compiled backward: the shared helpers at the bottom,
  capture, the reordering passes, retrace, segments, the disk cache, the runtime, and
  the engine that drives them on top.  A module imports only modules of its own stage
  or of an earlier one, no two of its files import each other around a circle, and
  the stages import in this order in a fresh interpreter, each without loading a
  later one.

Which imports count: every ``import`` statement, at module level, under ``if
TYPE_CHECKING:``, and inside functions.  Module-level imports decide what loads with
what; an import inside a function defers the loading (start-up time, an optional
dependency), not the dependency: the function still needs the other room to run, so
a circle through a deferred import is still two rooms that cannot be understood,
tested or moved apart.  Type-only imports count for the same reason (they are one
refactor away from a real one).  Calls of ``importlib.import_module`` are not read.

An import is resolved to the longest module of ``packages/*/src`` it names: ``from
. import ops`` in ``stoker_autograd/_internal/capture.py`` is an edge to
``stoker_autograd._internal.ops``; ``from .retrace import fake_inputs`` one to
``stoker_autograd._internal.retrace``.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
import tomllib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES_DIR = Path(__file__).resolve().parent.parent / "packages"

# import name -> the packages it may import (the layering)
LAYERS: dict[str, frozenset[str]] = {
    "stoker_shapes": frozenset(),
    "stoker_capture": frozenset({"stoker_shapes"}),
    "stoker_autograd": frozenset({"stoker_shapes", "stoker_capture"}),
    "stoker_triton": frozenset({"stoker_shapes"}),
    "stoker": frozenset({"stoker_shapes", "stoker_capture", "stoker_autograd", "stoker_triton"}),
}

TRITON_USERS = frozenset({"stoker_triton", "stoker"})

# stoker-autograd's stages, bottom first: (stage, its modules, relative to the package)
AUTOGRAD_STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "shared helpers",
        (
            "__about__",
            "_internal",
            "_internal.graph",
            "_internal.final_callbacks",
            "_internal.ops",
            "_internal.functions",
            "_internal.origins",
            "_internal.forward_dims",
            "_internal.recapture",
            "_internal.session",
        ),
    ),
    ("capture", ("_internal.aot_inline", "_internal.capture")),
    ("passes", ("passes._common", "passes.dce", "passes.reorder", "passes.undefined", "passes")),
    ("retrace", ("_internal.symbolic_decomps", "_internal.retrace")),
    ("segments", ("_internal.segments",)),
    ("disk cache", ("_internal.graphstore",)),
    ("runtime", ("_internal.runtime",)),
    ("engine", ("_internal.engine", "")),
)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module of packages/*/src it resolves to ("" when none does)
    name: str  # the module named, as written and made absolute
    where: str  # "module" | "typing" | "function"
    line: int

    def at(self) -> str:
        return f"{MODULES[self.source].path}:{self.line}"


@dataclass(frozen=True)
class Module:
    path: str  # relative to packages/
    file: Path
    is_package: bool


def _modules() -> dict[str, Module]:
    out: dict[str, Module] = {}
    for src in sorted(PACKAGES_DIR.glob("*/src")):
        for f in sorted(src.rglob("*.py")):
            parts = list(f.relative_to(src).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            out[".".join(parts)] = Module(str(f.relative_to(PACKAGES_DIR)), f, is_package)
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The longest module of packages/*/src that ``name`` names ("" when none)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str) -> list[Import]:
    """Every import statement of ``module``, resolved (see the module's docstring)."""
    mod = MODULES[module]
    package = module.split(".") if mod.is_package else module.split(".")[:-1]
    found: list[Import] = []

    def add(name: str, where: str, line: int) -> None:
        imp = Import(module, _resolve(name), name, where, line)
        if imp not in found:  # `from m import a, b`: one import of m
            found.append(imp)

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = where
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                here = "function"
            elif isinstance(child, ast.If) and where == "module" and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_one(stmt, "typing")
                for stmt in child.orelse:
                    visit_one(stmt, "module")
                continue
            visit_one(child, here)

    def visit_one(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, where, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"  # `from pkg import submodule`
                add(sub if sub in MODULES else target, where, node.lineno)
        visit(node, where)

    visit(ast.parse(mod.file.read_text(), str(mod.file)), "module")
    return found


IMPORTS = {m: imports_of(m) for m in MODULES}


def _top(name: str) -> str:
    return name.split(".")[0]


def room_of(module: str) -> str:
    """``_internal/<folder or module>``, a public module or subpackage, or ``(package)``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "(package)"
    if parts[1] == "_internal":
        return "_internal/" + parts[2] if len(parts) > 2 else "_internal/__init__"
    return parts[1]


def shortest_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle through each node that lies on one, without repeats
    (each as ``[a, b, ..., a]``, started at its smallest node)."""
    cycles: set[tuple[str, ...]] = set()
    for start in sorted(edges):
        prev: dict[str, str] = {}
        queue = deque(sorted(edges[start]))
        for n in queue:
            prev.setdefault(n, start)
        while queue:
            n = queue.popleft()
            if n == start:
                path = [start]
                while True:
                    path.append(prev[path[-1]])
                    if path[-1] == start:
                        break
                path.reverse()
                ring = path[:-1]
                k = ring.index(min(ring))
                cycles.add(tuple([*ring[k:], *ring[:k], ring[k]]))
                break
            for m in sorted(edges.get(n, ())):
                if m not in prev:
                    prev[m] = n
                    queue.append(m)
    return [list(c) for c in sorted(cycles)]


def _describe(
    cycles: Iterable[list[str]], why: dict[tuple[str, str], list[Import]], what: str
) -> str:
    lines = []
    for cycle in cycles:
        lines.append(f"{what}: " + " -> ".join(cycle))
        for a, b in itertools.pairwise(cycle):
            first = why[(a, b)][0]
            more = len(why[(a, b)]) - 1
            extra = f" (and {more} more)" if more else ""
            lines.append(
                f"    {a} -> {b}: {first.at()} imports {first.name} ({first.where}){extra}"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------ layering
def _declared(package_dir: Path) -> set[str]:
    deps = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in deps}
    return {n.replace("-", "_") for n in names if n.startswith("stoker")}


def test_every_package_is_in_the_layering() -> None:
    found = {_top(m) for m in MODULES}
    assert found == set(LAYERS), (
        f"packages/*/src holds {sorted(found)}; LAYERS names {sorted(LAYERS)}"
    )


@pytest.mark.parametrize("package", list(LAYERS))
def test_a_package_imports_only_packages_below_it(package: str) -> None:
    declared = _declared(PACKAGES_DIR / package.replace("_", "-"))
    wrong = []
    for m in MODULES:
        if _top(m) != package:
            continue
        for imp in IMPORTS[m]:
            top = _top(imp.name)
            if top == "triton" and package not in TRITON_USERS:
                wrong.append(f"{imp.at()} imports {imp.name}: {package} never imports triton")
            if top in LAYERS and top != package:
                if top not in LAYERS[package]:
                    wrong.append(f"{imp.at()} imports {imp.name}: {top} is not below {package}")
                elif top not in declared:
                    wrong.append(
                        f"{imp.at()} imports {imp.name}: {top} is not among the "
                        f"dependencies in {package.replace('_', '-')}/pyproject.toml"
                    )
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------------ rooms
@pytest.mark.parametrize("package", list(LAYERS))
def test_no_circle_between_rooms(package: str) -> None:
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[Import]] = {}
    for m in MODULES:
        if _top(m) != package:
            continue
        a = room_of(m)
        edges.setdefault(a, set())
        for imp in IMPORTS[m]:
            if _top(imp.target) != package:
                continue
            b = room_of(imp.target)
            if a != b:
                edges[a].add(b)
                why.setdefault((a, b), []).append(imp)
    cycles = shortest_cycles(edges)
    assert not cycles, _describe(cycles, why, f"{package}: an import circle between rooms")


def test_the_cycle_finder_finds_a_circle() -> None:
    """The finder the room test relies on: a circle of three, and none in a chain."""
    assert shortest_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"]
    ]
    assert shortest_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# ------------------------------------------------------------------------ stoker-autograd
def _stage_of() -> dict[str, int]:
    out: dict[str, int] = {}
    for k, (_, modules) in enumerate(AUTOGRAD_STAGES):
        for rel in modules:
            out["stoker_autograd" + (f".{rel}" if rel else "")] = k
    return out


STAGE_OF = _stage_of()


def test_every_autograd_module_has_a_stage() -> None:
    have = {m for m in MODULES if _top(m) == "stoker_autograd"}
    assert have - set(STAGE_OF) == set(), (
        "new stoker-autograd modules: add each to AUTOGRAD_STAGES in the stage it belongs to: "
        f"{sorted(have - set(STAGE_OF))}"
    )
    assert set(STAGE_OF) - have == set(), f"gone: {sorted(set(STAGE_OF) - have)}"


def test_autograd_stages_import_only_earlier_stages() -> None:
    wrong = []
    for m, k in STAGE_OF.items():
        if m not in MODULES:
            continue
        for imp in IMPORTS[m]:
            j = STAGE_OF.get(imp.target)
            if j is not None and j > k:
                wrong.append(
                    f"{imp.at()}: {m} ({AUTOGRAD_STAGES[k][0]}) imports {imp.name} "
                    f"({AUTOGRAD_STAGES[j][0]}, a later stage; {imp.where})"
                )
    assert not wrong, "\n".join(wrong)


def test_no_circle_between_autograd_files() -> None:
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[Import]] = {}
    for m in STAGE_OF:
        edges.setdefault(m, set())
        for imp in IMPORTS.get(m, []):
            if imp.target in STAGE_OF and imp.target != m:
                edges[m].add(imp.target)
                why.setdefault((m, imp.target), []).append(imp)
    cycles = shortest_cycles(edges)
    assert not cycles, _describe(cycles, why, "an import circle in stoker-autograd")


_IMPORT_IN_ORDER = """
import importlib, importlib.util, json, sys, types

stages = json.loads(sys.argv[1])
# the package without its __init__ (which imports the engine, so every stage)
spec = importlib.util.find_spec("stoker_autograd")
pkg = types.ModuleType("stoker_autograd")
pkg.__path__ = list(spec.submodule_search_locations)
sys.modules["stoker_autograd"] = pkg
for k, (stage, modules) in enumerate(stages):
    for m in modules:
        importlib.import_module(m)
    later = {m for _, ms in stages[k + 1:] for m in ms}
    early = sorted(later & set(sys.modules))
    if early:
        sys.exit(f"importing the {stage} stage loaded later stages' modules: {early}")
print("ok")
"""


def test_autograd_stages_import_in_order() -> None:
    """Importing each stage's modules, bottom first, loads no module of a later stage."""
    stages = [
        [stage, [f"stoker_autograd.{rel}" for rel in modules if rel]]
        for stage, modules in AUTOGRAD_STAGES
    ]
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_IN_ORDER, json.dumps(stages)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
