"""One process owns a run directory at a time: an advisory lock (`RunLock`) that the kernel
releases when its process ends, however it ends."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from cory_lora.errors import UserError, os_error_message

LOCK_FILE = ".lock"  # dot-named: never part of a run's contents, never a partial write


class RunLock:
    """One process's ownership of a run directory: an exclusive `flock` on RUN_DIR/.lock.

    The kernel drops the lock when its process ends, however it ends (SIGKILL, a crash, a lost
    terminal), so a killed run can be resumed at once; the file names its owner for the message
    a second process gets. Released, the file is removed (a file left by a killed owner is taken
    over); a process that opened it just before its removal notices and opens the new one.
    """

    def __init__(self, directory: Path, what: str = "run"):
        self.directory, self.what = Path(directory), what  # what the directory holds
        self.path = self.directory / LOCK_FILE
        self.remove_empty_directory = False  # set by RunDir.lock() for a directory it created
        self._created: list[Path] = []  # directories acquire() made, deepest first
        self._fd: int | None = None

    def acquire(self, create: bool = False) -> RunLock:
        """Take the lock now or raise UserError naming the owner; `create` makes the directory."""
        while True:
            if create:
                missing = [p for p in (self.directory, *self.directory.parents) if not p.exists()]
                make_directory(self.directory)
                self._created = self._created or missing
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                if create:
                    continue  # the directory was removed just now by its previous owner
                raise UserError(f"run directory {str(self.directory)!r} does not exist") from None
            except OSError as e:
                raise UserError(
                    os_error_message(e, f"cannot use {str(self.directory)!r}")
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    break  # a file system without locks: go on unprotected, as before locks
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise UserError(
                        os_error_message(e, f"cannot lock {str(self.directory)!r}")
                    ) from None
                raise UserError(self._in_use_message()) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # we locked a file its owner had just removed: take the current one
        owner = f"{os.getpid()}\n{socket.gethostname()}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        os.ftruncate(fd, 0)
        os.write(fd, (owner + " ".join(["cory-lora", *sys.argv[1:]])[:500] + "\n").encode())
        self._fd = fd
        return self

    def check_free(self) -> None:
        """Raise the in-use message if another process holds the lock now; take nothing (no
        file is created, a free lock is let go at once)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:
            return  # no lock file: nobody holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(self._in_use_message()) from None
        except OSError:
            return  # a file system without locks
        finally:
            os.close(fd)  # closing releases the lock if we got it

    def _in_use_message(self) -> str:
        owner = "another process"
        for _ in range(20):  # the owner writes its name right after locking: give it a moment
            try:
                lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                lines = []
            if len(lines) >= 4:
                pid, host, since, command = lines[:4]
                where = "" if host == socket.gethostname() else f" on {host}"
                owner = f"process {pid}{where} ({command}, since {since})"
                break
            time.sleep(0.025)
        return (
            f"{self.what} directory {str(self.directory)!r} is in use by {owner}; one process at "
            f"a time may write a {self.what}: wait for it to finish, or stop it first (a stopped "
            f"or killed {self.what} can be resumed at once)"
        )

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if _same_file(self._fd, self.path):
                self.path.unlink()  # while still locked: a process that opened it notices
        if self.remove_empty_directory:  # nothing was written: leave no empty directories behind
            for directory in self._created:
                try:
                    directory.rmdir()  # only if empty
                except FileNotFoundError:
                    continue  # already removed with what the failed run wrote
                except OSError:
                    break
        os.close(self._fd)  # closing the descriptor releases the lock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def make_directory(path: Path) -> None:
    """Create a run's directory (and its parents), or raise UserError saying why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            os_error_message(e, f"output directory {str(path)!r} cannot be created")
        ) from None
