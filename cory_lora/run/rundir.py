"""The run directory: its layout (config.toml, metrics.jsonl, samples.jsonl, checkpoints/,
final/ adapters, ...) and `RunDir`, which owns one: it refuses to overwrite what is not a run,
takes the directory's lock (lock.py), writes through atomic writes (atomic.py) and keeps the
record files (records.py) consistent with the checkpoints on a resume.

Under torchrun only rank 0 writes; the other ranks hold a `FollowerRunDir`, which writes
nothing.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

from cory_lora.config import Recipe, recipe_toml
from cory_lora.errors import UserError, environment_error, os_error_message
from cory_lora.run.atomic import atomic_directory, atomic_write_text
from cory_lora.run.lock import LOCK_FILE, RunLock, make_directory
from cory_lora.run.records import LOG_SNAPSHOT, append_jsonl, log_damage, restore_logs
from cory_lora.services.distributed import cli

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


def run_path(path: str | Path) -> Path:
    """A run directory's path as every writer uses it: `~` expanded, absolute (not resolved: a
    symlinked directory keeps the name the user gave it)."""
    return Path(os.path.abspath(Path(path).expanduser()))


def remove(path: Path) -> None:
    """Delete a file or a directory tree; a symbolic link is removed itself, never followed (a
    run's `final` linked to elsewhere loses the link, not what it points at)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)  # does not follow links inside the tree either


def check_removable(path: Path) -> None:
    """UserError unless `remove(path)` can delete all of it (checked before anything is
    deleted, so `--overwrite` never leaves half an old run)."""
    folders = [path.parent]
    if path.is_dir() and not path.is_symlink():
        folders += [Path(root) for root, _, _ in os.walk(path, followlinks=False)]
    for folder in folders:
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UserError(
                f"--overwrite refused: {str(folder)!r} cannot be changed (no permission to "
                "delete what it holds); nothing was deleted"
            )


def nothing_to_resume(path: Path, why: str) -> UserError:
    return UserError(f"nothing to resume in {str(path)!r}: {why}")


def check_holds_a_run(path: Path) -> None:
    """A directory to resume must hold a run (its config.toml)."""
    if Path(path).is_file():
        raise UserError(
            f"{str(path)!r} is a file; resume takes a run directory (to continue a run with a "
            "recipe: cory-lora run RECIPE --output-dir RUN_DIR --resume)"
        )
    if not (Path(path) / "config.toml").is_file():
        raise nothing_to_resume(path, "it holds no run")


class RunDir:
    """Owns one run's directory. Refuses to overwrite an existing run unless told to.

    Construction only checks (so a bad --output-dir fails before minutes of model loading);
    `lock()` makes this process the directory's only writer and checks again; `open()` clears a
    run being overwritten and creates the directory.
    """

    def __init__(self, path: Path, overwrite: bool = False, resume: bool = False):
        # Absolute once, here: user code (a reward calling os.chdir) cannot move the run's writes.
        self.path = run_path(path)
        self.overwrite, self.resume, self.created = overwrite, resume, False
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

    def start_afresh(self) -> None:
        """A resume that found no checkpoint of this run: start it from the beginning, replacing
        what the stopped attempt wrote (checked as `--overwrite` checks)."""
        self.resume, self.overwrite = False, True
        self._check(locked=True)

    def open(self) -> RunDir:
        doomed = [self.path / name for name in self._existing()]
        for target in doomed:  # every check before the first deletion: all of the old run or none
            check_removable(target)
        for target in doomed:
            remove(target)
        self.created = self.created or not self.path.exists()
        make_directory(self.path)
        return self

    def write_config(self, recipe: Recipe) -> None:
        atomic_write_text(self.path / "config.toml", recipe_toml(recipe))

    def append(self, filename: str, records: list[dict]) -> None:
        """Append JSON lines to one of the run's record files; each written whole and flushed."""
        append_jsonl(self.path / filename, records)

    def remove_partial_writes(self) -> None:
        """Delete what a killed process left half-written: every temporary (dot-named) file or
        directory of the run, checkpoints included. Complete files are never dot-named; the
        lock file is not a partial write (and is ours)."""
        for parent in (self.path, self.path / "checkpoints"):
            if parent.is_dir():
                for leftover in parent.glob(".*"):
                    if leftover.name == LOCK_FILE:
                        continue
                    remove(leftover)

    def _snapshot(self, iterations: int) -> Path:
        return self.path / CHECKPOINTS / checkpoint_name(iterations) / LOG_SNAPSHOT

    def truncate_logs(self, iterations: int) -> None:
        """Make the logs hold exactly the records of iterations 1..`iterations` (a resume
        replays the rest): the copy in that iteration's checkpoint, which also mends lines of
        the live log damaged since. A checkpoint without a copy (written by an older version)
        keeps the live log's lines up to it, and refuses when some of them are missing."""
        self.check_logs(iterations)
        restore_logs(self.path, self._snapshot(iterations), iterations)
        final = self.path / "final"
        if final.exists() or final.is_symlink():  # a finished run being extended: rewritten
            remove(final)

    def check_logs(self, iterations: int) -> str | None:
        """A warning when the live logs are damaged before the checkpoint at `iterations` and
        its copy will mend them; UserError when it has no copy (written by an older version)."""
        damage = log_damage(self.path, self._snapshot(iterations), iterations)
        if damage is None:
            return None
        if not self._snapshot(iterations).is_dir():
            raise UserError(
                f"{damage}; its checkpoint (written by an older version) holds no copy to "
                "restore them from. Repair those lines, or move the log aside to resume "
                "without that history"
            )
        return f"warning: {damage}; they are restored from the checkpoint's copy"

    def save_final(self, agents) -> Path:
        """Write final/<agent>/ atomically. A full disk (file-size limit, read-only mount) is
        one UserError saying that the checkpoints are intact and how to write final/ again."""
        try:
            with atomic_directory(self.path / "final") as tmp:
                agents.save(tmp)
        except Exception as error:  # safetensors wraps a full disk in its own type
            e = environment_error(error)
            if e is None:
                raise
            raise UserError(
                os_error_message(e, f"{self.path / 'final'} could not be written")
                + "; the run's checkpoints are intact. Once that is fixed: "
                + cli("resume", self.path)
                + " writes it"
            ) from None
        return self.path / "final"

    def discard_if_empty_run(self) -> None:
        """After a failure before any iteration finished, remove what this run created."""
        if not (self.path / "metrics.jsonl").exists() and self.created:
            shutil.rmtree(self.path, ignore_errors=True)


class FollowerRunDir(RunDir):
    """The run directory as ranks other than 0 see it under torchrun: they read it (a resume's
    checkpoint) but never write; rank 0's RunDir owns it."""

    def __init__(self, path: Path, resume: bool = False):
        self.path, self.overwrite, self.resume, self.created = run_path(path), False, resume, False

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
