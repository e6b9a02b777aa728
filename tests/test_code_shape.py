"""The package's functions stay readable: none is longer than 60 lines (from its `def` to its
last line, decorators aside) and none nests control-flow blocks (for, while, if, with, try,
match) more than 4 deep. An `elif` is not a level of its own; a function, class or lambda
defined inside a function starts a count of its own (and is checked as a function itself)."""

from __future__ import annotations

import ast

from .helpers import ROOT

MAX_LINES = 60
MAX_DEPTH = 4
PACKAGE = ROOT / "cory_lora"
BLOCKS = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try, ast.Match)
BLOCKS += (ast.TryStar,) if hasattr(ast, "TryStar") else ()
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
OWN_SCOPE = (*FUNCTIONS, ast.ClassDef, ast.Lambda)


def functions():
    """(file:qualified name, function node) for every function and method in the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(ROOT)
        yield from _named(tree, f"{where}:")


def _named(node, prefix: str):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, FUNCTIONS):
            yield f"{prefix}{child.name}", child
            yield from _named(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _named(child, f"{prefix}{child.name}.")
        else:
            yield from _named(child, prefix)


def _is_elif(node, parent) -> bool:
    return isinstance(parent, ast.If) and parent.orelse == [node] and isinstance(node, ast.If)


def depth(node, parent=None) -> int:
    """How deep control-flow blocks nest below `node`, within its own scope."""
    deepest = 0
    for child in ast.iter_child_nodes(node):
        if isinstance(child, OWN_SCOPE):
            continue
        below = depth(child, node)
        if isinstance(child, BLOCKS) and not _is_elif(child, node):
            below += 1
        deepest = max(deepest, below)
    return deepest


def test_no_function_is_longer_than_60_lines():
    long = [
        f"{name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, node in functions()
        if node.end_lineno - node.lineno + 1 > MAX_LINES
    ]
    assert not long, f"over {MAX_LINES} lines; split by idea: " + ", ".join(long)


def test_no_function_nests_blocks_deeper_than_4():
    deep = [f"{name} ({d} deep)" for name, node in functions() if (d := depth(node)) > MAX_DEPTH]
    assert not deep, f"control blocks nested over {MAX_DEPTH} deep: " + ", ".join(deep)


def test_the_measures_count_what_they_say():
    tree = ast.parse(
        "def f(x):\n"
        "    for a in x:\n"  # 1
        "        if a:\n"  # 2
        "            pass\n"
        "        elif a > 1:\n"  # still 2
        "            while a:\n"  # 3
        "                with a:\n"  # 4
        "                    try:\n"  # 5
        "                        pass\n"
        "                    except E:\n"
        "                        pass\n"
        "    def g():\n"  # its own count
        "        if x:\n"
        "            pass\n"
    )
    f = tree.body[0]
    assert depth(f) == 5 and depth(f.body[1]) == 1
    assert [name for name, _ in _named(tree, "m:")] == ["m:f", "m:f.g"]
