"""Built-in task rewards (TRL convention: keyword lists in, one float per completion out)."""

from __future__ import annotations


def exact_match(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, equals the `answer` column."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]
