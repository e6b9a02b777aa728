"""Imports flow one way: a module imports only modules of lower layers (README, Layout).

cli → report → train / evaluate / export / study → resume / interrupts → checkpoint / metrics /
plots / trackers / heldout → cory / update → state / plan → model → data / generation / rewards /
outputs → config → distributed / fetch → errors / faults / ppo / console / tiny / elastic.
"""

from __future__ import annotations

import ast

import pytest

from .helpers import ROOT

LAYERS = [
    {"errors", "faults", "ppo", "console", "tiny", "elastic"},
    {"distributed", "fetch"},
    {"config"},
    {"outputs", "data", "generation", "rewards"},
    {"model"},
    {"state", "plan"},
    {"cory", "update"},
    {"checkpoint", "metrics", "plots", "trackers", "heldout"},
    {"resume", "interrupts"},
    {"train", "evaluate", "export", "study"},
    {"report"},
    {"cli"},
]
LAYER_OF = {module: i for i, layer in enumerate(LAYERS) for module in layer}
MODULES = sorted(
    p for p in (ROOT / "cory_lora").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")
)


def module_name(path) -> str:
    """Top-level module of the package a file belongs to (rewards/gsm8k.py -> rewards)."""
    return path.relative_to(ROOT / "cory_lora").parts[0].removesuffix(".py")


def imported_modules(path) -> set[str]:
    """cory_lora modules a file imports, at any depth (function-level imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cory_lora"):
            parts = node.module.split(".")
            found |= {a.name for a in node.names} if len(parts) == 1 else {parts[1]}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("cory_lora.")}
    return found


def test_every_module_has_a_layer():
    assert {module_name(p) for p in MODULES} <= LAYER_OF.keys()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path):
    own = module_name(path)
    upward = [
        m for m in imported_modules(path) - {own} if LAYER_OF.get(m, len(LAYERS)) >= LAYER_OF[own]
    ]
    assert not upward, f"{own} (layer {LAYER_OF[own]}) imports {upward}, not below it"
