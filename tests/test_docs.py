"""The documentation holds together: README.md stays a landing page, every relative link in it
and in docs/*.md reaches a file, and every recipe or study a command block names exists."""

from __future__ import annotations

import re

import pytest

from .helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 220

# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional title
# after a space is ignored). Inline code is removed first, so `f(x)` is not taken for a link.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)", re.MULTILINE)
COMMAND_LANGUAGES = {"", "bash", "sh", "shell", "console", "text"}
RECIPE_PATH = re.compile(r"(?<![\w./-])((?:recipes|studies)/[\w./-]*?\.toml)\b")


def ids(path) -> str:
    return str(path.relative_to(ROOT))


def split_fences(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The page's prose (fenced blocks removed) and its fenced blocks as (language, body)."""
    prose, blocks = [], []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        fence, language = opening.group(1), opening.group(2).lower()
        body = []
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        blocks.append((language, "\n".join(body)))
    return "\n".join(prose), blocks


def relative_links(page) -> list[str]:
    prose, _ = split_fences(page.read_text(encoding="utf-8"))
    targets = LINK.findall(INLINE_CODE.sub("", prose))
    return [t for t in targets if not re.match(r"(?i)(https?:|mailto:|#)", t)]


def test_the_pages_are_found():
    names = {p.name for p in PAGES}
    assert {"README.md", "recipe.md", "layout.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=ids)
def test_relative_links_reach_a_file(page):
    broken = []
    for target in relative_links(page):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{ids(page)} links to missing files: {broken}"


def test_the_readme_links_to_every_docs_page():
    linked = {(ROOT / t.split("#", 1)[0]).resolve() for t in relative_links(ROOT / "README.md")}
    missing = [ids(p) for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md's Documentation map does not list {missing}"


@pytest.mark.parametrize("page", PAGES, ids=ids)
def test_recipes_and_studies_in_commands_exist(page):
    _, blocks = split_fences(page.read_text(encoding="utf-8"))
    named = {
        match
        for language, body in blocks
        if language in COMMAND_LANGUAGES
        for match in RECIPE_PATH.findall(body)
    }
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"{ids(page)} runs recipes or studies that do not exist: {missing}"


def test_the_commands_name_recipes_at_all():
    """The check above is not vacuous: the README's command blocks name the real-model recipe."""
    _, blocks = split_fences((ROOT / "README.md").read_text(encoding="utf-8"))
    named = {m for language, body in blocks for m in RECIPE_PATH.findall(body)}
    assert "recipes/smollm2_arith.toml" in named


def test_the_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into docs/"
    )
