"""The run directory: config.toml, metrics.jsonl, samples.jsonl and final/ adapters, and the
atomic-write helpers every module that writes a file uses.

Files are written so that a reader never sees half of one: whole files via a temporary file,
fsync and rename (`atomic_file`); JSONL lines appended whole and flushed; directories built under
a temporary name and renamed into place (`atomic_directory`). Temporary names start with '.',
so a resume can find and remove what a killed process left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cory_lora.config import Recipe, to_dict
from cory_lora.errors import UserError

RUN_FILES = (
    "config.toml",
    "metrics.jsonl",
    "samples.jsonl",
    "final",
    "checkpoints",
    "curves.png",
    "eval.json",
    "trackers.json",  # experiment trackers (cory_lora.trackers): run ids, local logs
    "tensorboard",
    "wandb",
)


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


# --------------------------------------------------------------------------- recipe as TOML


def recipe_toml(recipe: Recipe) -> str:
    """The resolved recipe as TOML that `config.load_recipe` reads back to an equal Recipe."""
    lines = []
    for section, table in to_dict(recipe).items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in table.items())
        lines.append("")
    return "\n".join(lines)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # shortest round-trip form; finite by validation
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic strings
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise TypeError(type(value))


# --------------------------------------------------------------------------- the run directory


class RunDir:
    """Owns one run's directory. Refuses to overwrite an existing run unless told to.

    Construction only checks (so a bad --output-dir fails before minutes of model loading);
    `open()` clears a run being overwritten and creates the directory.
    """

    def __init__(self, path: Path, overwrite: bool = False, resume: bool = False):
        self.path, self.overwrite, self.created = Path(path), overwrite, False
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"output directory {str(self.path)!r} is a file")
        if resume:
            check_holds_a_run(self.path)
            return
        existing = self._existing()
        if existing and not overwrite:
            raise UserError(
                f"output directory {str(self.path)!r} is not empty ({', '.join(existing[:5])}); "
                "choose another --output-dir, or pass --overwrite to replace that run"
            )
        foreign = [n for n in existing if n not in RUN_FILES and not n.startswith(".")]
        if foreign:
            raise UserError(
                f"--overwrite refused: {str(self.path)!r} holds files a run does not write "
                f"({', '.join(foreign[:5])}); it does not look like a run directory"
            )

    def _existing(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []

    def open(self) -> RunDir:
        for name in self._existing():
            target = self.path / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        self.created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
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
        directory of the run, checkpoints included. Complete files are never dot-named."""
        for parent in (self.path, self.path / "checkpoints"):
            if parent.is_dir():
                for leftover in parent.glob(".*"):
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()

    def truncate_logs(self, iterations: int) -> None:
        """Keep only the records of the first `iterations` iterations (a resume replays the rest);
        a line cut short by a crash is dropped too."""
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.path / name
            if not path.exists():
                continue
            kept = []
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("iteration", 0) <= iterations:
                    kept.append(line + "\n")
            atomic_write_text(path, "".join(kept))
        final = self.path / "final"
        if final.exists():  # a finished run being extended: its final adapters are rewritten
            shutil.rmtree(final)

    def save_final(self, agents) -> Path:
        """Write final/<agent>/ atomically."""
        with atomic_directory(self.path / "final") as tmp:
            agents.save(tmp)
        return self.path / "final"

    def discard_if_empty_run(self) -> None:
        """After a failure before any iteration finished, remove what this run created."""
        if not (self.path / "metrics.jsonl").exists() and self.created:
            shutil.rmtree(self.path, ignore_errors=True)
