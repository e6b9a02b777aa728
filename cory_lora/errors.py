"""User errors: things the user can fix, shown as one message without a traceback.

The CLI shows these as one message; it also reports an OSError of the environment (a full disk,
a permission) this way, and anything else as an internal error (see `cli.user_errors`).
"""

from __future__ import annotations

import errno
import os
import re
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
        errno.EFBIG,
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


# Writers that are not Python's own file objects report a failed write in their own types:
# safetensors (Rust) as SafetensorError("... I/O error: File too large (os error 27)"), torch.save
# (C++) as RuntimeError("[enforce fail at inline_container.cc] . unexpected pos 704 vs 598") or
# "PytorchStreamWriter failed writing file ...", with no errno at all.
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)|\[Errno (\d+)\]")
_TORCH_WRITE_FAILED = ("PytorchStreamWriter failed", "unexpected pos", "file write failed")


def as_os_error(error: BaseException) -> OSError | None:
    """The failure of the machine inside `error`: itself if an OSError; an OSError rebuilt from
    the errno that a library's own error type wraps (safetensors, torch.save); None when it is
    not a failed write or read of the file system."""
    if isinstance(error, OSError):
        return error
    inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if isinstance(inner, OSError):
        return inner
    text = str(error)
    found = _OS_ERROR_CODE.search(text)
    if found:
        code = int(next(g for g in found.groups() if g))
        return OSError(code, os.strerror(code))
    if isinstance(error, RuntimeError) and any(t in text for t in _TORCH_WRITE_FAILED):
        # torch.save gives no reason: a full disk or a file-size limit, most likely
        return OSError(
            errno.EIO,
            "a file could not be written whole (a full disk, a quota or a file-size limit?)",
        )
    return None


def environment_error(error: BaseException) -> OSError | None:
    """`as_os_error(error)` when it is one the user can fix (full disk, file too big, read-only,
    permission): reported in one message, not as a bug."""
    found = as_os_error(error)
    return found if found is not None and found.errno in ENVIRONMENT_ERRNOS else None


def os_error_message(error: OSError, doing: str) -> str:
    """`doing: reason (path)` for an OSError, e.g. "cannot write x: No space left on device"."""
    reason = error.strerror or str(error) or type(error).__name__
    where = f" ({error.filename})" if error.filename and str(error.filename) not in doing else ""
    return f"{doing}: {reason}{where}"
