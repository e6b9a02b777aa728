"""Atomic writes, which every module that writes a file uses: a reader never sees half a file.

Whole files are written to a temporary file, fsynced and renamed into place (`atomic_file`);
directories are built under a temporary name and renamed into place (`atomic_directory`).
Temporary names start with '.', so a resume can find and remove what a killed process left
behind (`RunDir.remove_partial_writes`).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` (same suffix, so writers that go by the suffix work);
    when the block succeeds it is fsynced and renamed to `path`, else removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; when the block succeeds every file in it is
    fsynced and it replaces `path` (an existing one is removed first), else it is removed.
    Its name holds this process's id, so one left by a killed process (SIGKILL runs no cleanup:
    an `export --merge` leaves a whole model) is removed by the next write of the same path."""
    path = Path(path)
    remove_stale_directories(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}."))
    try:
        yield tmp
        fsync_tree(tmp)
        if path.is_symlink():  # replaced by a directory of ours; what it pointed at is kept
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_directories(path: Path) -> None:
    """Remove temporary directories for `path` whose process is gone."""
    for leftover in Path(path).parent.glob(f".{glob.escape(Path(path).name)}.*.*"):
        pid = leftover.name[len(Path(path).name) + 2 :].split(".")[0]
        if leftover.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def fsync_tree(directory: Path) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
