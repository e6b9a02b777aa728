"""Imports flow one way between the package's parts (docs/layout.md):

cli → integrations → science → run → algorithm → engine / rewards → config → services → errors.

A module imports modules of its own part or of lower parts, never of a higher one, and no two
modules import each other, directly or around a loop (function-level imports count).
"""

from __future__ import annotations

import ast

import pytest

from .helpers import ROOT

PARTS = [
    "errors",
    "services",
    "config",
    "engine rewards",
    "algorithm",
    "run",
    "science",
    "integrations",
    "cli",
]
LEVEL = {part: i for i, line in enumerate(PARTS) for part in line.split()}
PACKAGE = ROOT / "cory_lora"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


def module_of(path) -> str:
    """Dotted module name of a file: cory_lora/run/train.py -> run.train."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    return module.split(".")[0]


def imported_modules(path) -> set[str]:
    """cory_lora modules a file imports, at any depth; `from cory_lora.run import train` names
    run.train when that is a module."""
    known = {module_of(p) for p in MODULES}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cory_lora"):
            base = node.module.removeprefix("cory_lora").lstrip(".")
            for alias in node.names:
                inner = f"{base}.{alias.name}".lstrip(".")
                found.add(inner if inner in known else base)
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("cory_lora.") for a in node.names if "cory_lora." in a.name
            }
    return found - {""}


GRAPH = {module_of(p): imported_modules(p) - {module_of(p)} for p in MODULES}


def test_every_module_belongs_to_a_part():
    assert {part_of(m) for m in GRAPH if m} <= LEVEL.keys()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path):
    own = module_of(path)
    if not own:
        return
    upward = [m for m in GRAPH[own] if LEVEL[part_of(m)] > LEVEL[part_of(own)]]
    assert not upward, f"{own} ({part_of(own)}) imports {upward}, from a part above it"


def test_no_import_cycles():
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            raise AssertionError("import cycle: " + " -> ".join([*on_path, module]))
        if module in done:
            return
        on_path.append(module)
        for target in GRAPH.get(module, ()):
            # A package imports its own submodules to re-export them: not a cycle back into it.
            if not target.startswith(f"{module}."):
                visit(target)
        on_path.pop()
        done.add(module)

    for module in GRAPH:
        visit(module)
