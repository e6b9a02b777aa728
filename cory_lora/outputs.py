"""The run directory: config.toml, metrics.jsonl, samples.jsonl and final/ adapters.

Files are written so that a reader never sees half of one: whole files via a temporary file,
fsync and rename; JSONL lines appended whole and flushed; directories built under a temporary
name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

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


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_tree(directory: Path) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


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
            if not (self.path / "config.toml").is_file():
                raise UserError(f"nothing to resume in {str(self.path)!r}: it holds no run")
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

    def write_config(self, toml_text: str) -> None:
        atomic_write_text(self.path / "config.toml", toml_text)

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
        """Write final/<agent>/ atomically: built in a temporary directory, then renamed."""
        final = self.path / "final"
        tmp = Path(tempfile.mkdtemp(dir=self.path, prefix=".final."))
        try:
            agents.save(tmp)
            fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def discard_if_empty_run(self) -> None:
        """After a failure before any iteration finished, remove what this run created."""
        if not (self.path / "metrics.jsonl").exists() and self.created:
            shutil.rmtree(self.path, ignore_errors=True)
