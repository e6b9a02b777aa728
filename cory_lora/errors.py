"""User errors: things the user can fix, shown as one message without a traceback.

The CLI shows these as one message; it also reports an OSError of the environment (a full disk,
a permission) this way, and anything else as an internal error (see `cli.user_errors`).
"""

from __future__ import annotations

import errno
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

    def __init__(self, problems: list[Problem], subject: str = "the recipe"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p.text}" for p in self.problems)
        super().__init__(f"{subject} has {len(self.problems)} problem(s):\n{lines}")


PEER_LOST_EXIT = 3  # a rank whose collectives lost another rank (which failed or was stopped)


class RewardError(UserError):
    """The reward raised, or returned something that is not one number per completion."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (library errors can run to pages), or its type."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class Stopped(UserError):
    """The user stopped the command (Ctrl-C); the message says what is left (exit code 130)."""

    exit_code = 130


# Failures of the machine or the file system that the user can fix (full disk, permissions,
# read-only mounts, a path through a file): reported in one message, not as a bug.
ENVIRONMENT_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.EIO,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENAMETOOLONG,
        errno.EMFILE,
        errno.ENFILE,
        errno.ELOOP,
    }
)


def os_error_message(error: OSError, doing: str) -> str:
    """`doing: reason (path)` for an OSError, e.g. "cannot write x: No space left on device"."""
    reason = error.strerror or str(error) or type(error).__name__
    where = f" ({error.filename})" if error.filename and str(error.filename) not in doing else ""
    return f"{doing}: {reason}{where}"
