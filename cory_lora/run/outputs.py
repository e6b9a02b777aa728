"""The run directory: config.toml, metrics.jsonl, samples.jsonl and final/ adapters, and the
atomic-write helpers every module that writes a file uses.

Files are written so that a reader never sees half of one: whole files via a temporary file,
fsync and rename (`atomic_file`); JSONL lines appended whole and flushed; directories built under
a temporary name and renamed into place (`atomic_directory`). Temporary names start with '.',
so a resume can find and remove what a killed process left behind.

One process owns a run directory at a time (`RunDir.lock()`: an advisory lock that the kernel
releases when its process ends, however it ends). Every checkpoint carries a copy of the logs up
to it (`snapshot_logs`), so a resume restores them whole (`RunDir.truncate_logs`) even when a
line of the live log was damaged.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cory_lora.config import Recipe, recipe_toml
from cory_lora.errors import UserError, os_error_message

CHECKPOINTS = "checkpoints"


def checkpoint_name(iteration: int) -> str:
    """The directory of the checkpoint after `iteration` iterations: checkpoints/iter-NNNNNN."""
    return f"iter-{iteration:06d}"


RUN_FILES = (
    "config.toml",
    "metrics.jsonl",
    "samples.jsonl",
    "final",
    "checkpoints",
    "curves.png",
    "eval.json",
    "trackers.json",  # experiment trackers (cory_lora.integrations.trackers): run ids, local logs
    "tensorboard",
    "wandb",
    "eval-*.json",  # `cory-lora eval --split S` for a split other than the run's held-out one
)
LOGS = ("metrics.jsonl", "samples.jsonl")
LOCK_FILE = ".lock"  # dot-named: never part of a run's contents, never a partial write
LOG_SNAPSHOT = "logs"  # inside each checkpoint: the logs up to it


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
    fsynced and it replaces `path` (an existing one is removed first), else it is removed."""
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield tmp
        fsync_tree(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def read_jsonl(path: Path) -> list[dict]:
    """Every complete JSON line of a file; a last line cut short by a crash is left out."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def nothing_to_resume(path: Path, why: str) -> UserError:
    return UserError(f"nothing to resume in {str(path)!r}: {why}")


def check_holds_a_run(path: Path) -> None:
    """A directory to resume must hold a run (its config.toml)."""
    if not (Path(path) / "config.toml").is_file():
        raise nothing_to_resume(path, "it holds no run")


# --------------------------------------------------------------------------- the run directory
class RunLock:
    """One process's ownership of a run directory: an exclusive `flock` on RUN_DIR/.lock.

    The kernel drops the lock when its process ends, however it ends (SIGKILL, a crash, a lost
    terminal), so a killed run can be resumed at once; the file names its owner for the message
    a second process gets. Released, the file is removed (a file left by a killed owner is taken
    over); a process that opened it just before its removal notices and opens the new one.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.remove_empty_directory = False  # set by RunDir.lock() for a directory it created
        self._created: list[Path] = []  # directories acquire() made, deepest first
        self._fd: int | None = None

    def acquire(self, create: bool = False) -> RunLock:
        """Take the lock now or raise UserError naming the owner; `create` makes the directory."""
        while True:
            if create:
                missing = [p for p in (self.directory, *self.directory.parents) if not p.exists()]
                _make_directory(self.directory)
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
            f"run directory {str(self.directory)!r} is in use by {owner}; one process at a time "
            "may write a run: wait for it to finish, or stop it first (a stopped or killed run "
            "can be resumed at once)"
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


def _make_directory(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            os_error_message(e, f"output directory {str(path)!r} cannot be created")
        ) from None


class RunDir:
    """Owns one run's directory. Refuses to overwrite an existing run unless told to.

    Construction only checks (so a bad --output-dir fails before minutes of model loading);
    `lock()` makes this process the directory's only writer and checks again; `open()` clears a
    run being overwritten and creates the directory.
    """

    def __init__(self, path: Path, overwrite: bool = False, resume: bool = False):
        self.path, self.overwrite, self.resume, self.created = Path(path), overwrite, resume, False
        self._check()

    def _check(self, locked: bool = False) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"output directory {str(self.path)!r} is a file")
        if not locked:
            RunLock(self.path).check_free()  # "in use by process N" says more than "not empty"
        for parent in self.path.absolute().parents:
            if parent.exists():
                if not parent.is_dir():
                    raise UserError(
                        f"output directory {str(self.path)!r} cannot be created: "
                        f"{str(parent)!r} is a file"
                    )
                break
        if self.resume:
            check_holds_a_run(self.path)
            return
        existing = self._existing()
        if existing and not self.overwrite:
            raise UserError(
                f"output directory {str(self.path)!r} is not empty ({', '.join(existing[:5])}); "
                "choose another --output-dir, or pass --overwrite to replace that run"
            )
        foreign = [
            n
            for n in existing
            if not any(fnmatch.fnmatch(n, pattern) for pattern in RUN_FILES)
            and not n.startswith(".")
        ]
        if foreign:
            raise UserError(
                f"--overwrite refused: {str(self.path)!r} holds files a run does not write "
                f"({', '.join(foreign[:5])}); it does not look like a run directory"
            )

    def _existing(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if p.name != LOCK_FILE)

    def lock(self) -> RunLock:
        """Make this process the run directory's only writer until the lock is released (use it
        as a context manager); a new run's directory is created here. What the constructor
        checked is checked again, now that no other process can change it."""
        existed = self.path.is_dir()
        lock = RunLock(self.path).acquire(create=not self.resume)
        self.created = self.created or not existed
        lock.remove_empty_directory = self.created
        try:
            self._check(locked=True)
        except BaseException:
            lock.release()
            raise
        return lock

    def open(self) -> RunDir:
        for name in self._existing():
            target = self.path / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        self.created = self.created or not self.path.exists()
        _make_directory(self.path)
        return self

    def write_config(self, recipe: Recipe) -> None:
        atomic_write_text(self.path / "config.toml", recipe_toml(recipe))

    def append(self, filename: str, records: list[dict]) -> None:
        """Append JSON lines; each line is written whole and flushed to disk."""
        if not records:
            return
        with open(self.path / filename, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())

    def remove_partial_writes(self) -> None:
        """Delete what a killed process left half-written: every temporary (dot-named) file or
        directory of the run, checkpoints included. Complete files are never dot-named; the
        lock file is not a partial write (and is ours)."""
        for parent in (self.path, self.path / "checkpoints"):
            if parent.is_dir():
                for leftover in parent.glob(".*"):
                    if leftover.name == LOCK_FILE:
                        continue
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()

    def _snapshot(self, iterations: int) -> Path:
        return self.path / CHECKPOINTS / checkpoint_name(iterations) / LOG_SNAPSHOT

    def truncate_logs(self, iterations: int) -> None:
        """Make the logs hold exactly the records of iterations 1..`iterations` (a resume
        replays the rest): the copy in that iteration's checkpoint, which also mends lines of
        the live log damaged since. A checkpoint without a copy (written by an older version)
        keeps the live log's lines up to it, and refuses when some of them are missing."""
        self.check_logs(iterations)
        snapshot = self._snapshot(iterations)
        for name in LOGS:
            path, copy = self.path / name, snapshot / name
            if copy.is_file():
                atomic_write_text(path, copy.read_text(encoding="utf-8"))
            elif path.exists():
                kept = [
                    line for it, line in _log_lines(path) if it is not None and it <= iterations
                ]
                atomic_write_text(path, "".join(kept))
        final = self.path / "final"
        if final.exists():  # a finished run being extended: its final adapters are rewritten
            shutil.rmtree(final)

    def check_logs(self, iterations: int) -> str | None:
        """A warning when the live logs are damaged before the checkpoint at `iterations` and
        its copy will mend them; UserError when it has no copy (written by an older version)."""
        damage = self.log_damage(iterations)
        if damage is None:
            return None
        if not self._snapshot(iterations).is_dir():
            raise UserError(
                f"{damage}; its checkpoint (written by an older version) holds no copy to "
                "restore them from. Repair those lines, or move the log aside to resume "
                "without that history"
            )
        return f"warning: {damage}; they are restored from the checkpoint's copy"

    def log_damage(self, iterations: int) -> str | None:
        """What is wrong with the live logs up to iteration `iterations`, or None: lines cut
        short or unreadable, iterations missing or repeated (compared with the checkpoint's copy
        when it has one, else with 1..iterations)."""
        snapshot = self._snapshot(iterations)
        problems = []
        for name in LOGS:
            path = self.path / name
            if not path.exists():
                if (snapshot / name).is_file() and (snapshot / name).stat().st_size:
                    problems.append(f"{name}: missing")
                continue
            lines = _log_lines(path)
            cut = [n for n, (it, _) in enumerate(lines, 1) if it is None]
            ours = [(it, line) for it, line in lines if it is not None and it <= iterations]
            copy = snapshot / name
            if copy.is_file():
                expected = _log_lines(copy)
                if ours == expected:
                    continue
                missing = sorted({it for it, _ in expected} - {it for it, _ in ours})
            else:
                if name != "metrics.jsonl":
                    continue  # one line per iteration only in metrics.jsonl
                wanted = list(range(1, iterations + 1))
                if [it for it, _ in ours] == wanted:
                    continue
                missing = sorted(set(wanted) - {it for it, _ in ours})
            detail = []
            if missing:
                detail.append(f"iteration(s) {_ranges(missing)} missing")
            if cut:
                detail.append(f"line(s) {_ranges(cut)} cut short or unreadable")
            if not detail:
                detail.append("lines changed, repeated or out of order")
            problems.append(f"{name}: {', '.join(detail)}")
        if not problems:
            return None
        return (
            f"the log of {self.path} is damaged before its checkpoint at iteration {iterations}: "
            + "; ".join(problems)
        )

    def save_final(self, agents) -> Path:
        """Write final/<agent>/ atomically."""
        with atomic_directory(self.path / "final") as tmp:
            agents.save(tmp)
        return self.path / "final"

    def discard_if_empty_run(self) -> None:
        """After a failure before any iteration finished, remove what this run created."""
        if not (self.path / "metrics.jsonl").exists() and self.created:
            shutil.rmtree(self.path, ignore_errors=True)


class FollowerRunDir(RunDir):
    """The run directory as ranks other than 0 see it under torchrun: they read it (a resume's
    checkpoint) but never write; rank 0's RunDir owns it."""

    def __init__(self, path: Path, resume: bool = False):
        self.path, self.overwrite, self.resume, self.created = Path(path), False, resume, False

    def open(self) -> RunDir:
        return self

    def write_config(self, recipe: Recipe) -> None:
        pass

    def append(self, filename: str, records: list[dict]) -> None:
        pass

    def remove_partial_writes(self) -> None:
        pass

    def truncate_logs(self, iterations: int) -> None:
        pass

    def save_final(self, agents) -> Path:
        return self.path / "final"

    def discard_if_empty_run(self) -> None:
        pass


def _log_lines(path: Path) -> list[tuple[int | None, str]]:
    """(iteration, line with its newline) per line; iteration None for a line that is not a
    whole JSON record with an integer iteration (cut short by a crash, or damaged)."""
    out = []
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace")
            try:
                record = json.loads(line) if line.endswith("\n") else None
            except ValueError:
                record = None
            iteration = record.get("iteration") if isinstance(record, dict) else None
            ok = isinstance(iteration, int) and not isinstance(iteration, bool)
            out.append((iteration if ok else None, line if line.endswith("\n") else line + "\n"))
    return out


def _ranges(numbers: list[int]) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    out, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def snapshot_logs(run_dir: Path, iteration: int, target: Path, previous: Path | None) -> None:
    """Write into `target` the log records of iterations 1..`iteration`, for a checkpoint:
    those up to the `previous` checkpoint from its own copy (so damage to old lines of the live
    log is not carried forward), the newer ones from the live logs."""
    target.mkdir()
    earlier = previous / LOG_SNAPSHOT if previous is not None else None
    if earlier is not None and not earlier.is_dir():
        earlier = None  # written by an older version: take everything from the live logs
    since = int(previous.name.split("-")[-1]) if earlier is not None else 0
    for name in LOGS:
        live = Path(run_dir) / name
        old = (
            _log_lines(earlier / name) if earlier is not None and (earlier / name).is_file() else []
        )
        new = []
        if live.exists():
            new = [
                (it, line)
                for it, line in _log_lines(live)
                if it is not None and since < it <= iteration
            ]
        if old or new or live.exists():
            (target / name).write_text("".join(line for _, line in old + new), encoding="utf-8")
