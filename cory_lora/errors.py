"""User errors: things the user can fix, shown as one message without a traceback.

The CLI catches these two and nothing else; any other exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input or environment, explained in one message (exit code 1)."""

    exit_code = 1


class ConfigError(UserError):
    """Every problem found in a recipe, by dotted key (exit code 2)."""

    exit_code = 2

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the recipe has {len(self.problems)} problem(s):\n{lines}")


class RewardError(UserError):
    """The reward raised, or returned something that is not one number per completion."""
