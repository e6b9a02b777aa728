"""User errors: things the user can fix, shown as one message without a traceback.

The CLI catches these two and nothing else; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import NamedTuple


class UserError(Exception):
    """A problem with the user's input or environment, explained in one message (exit code 1)."""

    exit_code = 1


class Problem(NamedTuple):
    """One problem of a recipe: the dotted keys it concerns and the sentence that explains it."""

    keys: tuple[str, ...]
    text: str


class ConfigError(UserError):
    """Every problem found in a recipe, by dotted key (exit code 2)."""

    exit_code = 2

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p.text}" for p in self.problems)
        super().__init__(f"the recipe has {len(self.problems)} problem(s):\n{lines}")


class RewardError(UserError):
    """The reward raised, or returned something that is not one number per completion."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (library errors can run to pages), or its type."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
