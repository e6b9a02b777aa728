"""How a run starts: rank 0 checks the run directory (and what a resume will find) and takes its
lock, then gives the other ranks its word before anyone loads a model; they wait for it.

The words (one integer, broadcast from rank 0; a no-op in one process):

* `GO`: train, resuming if asked;
* `GO_FRESH`: train from the start: a resume found no checkpoint of this run yet (a job killed
  in its first minutes and requeued with the same `run --resume` command), so there is nothing
  to lose;
* `NOTHING_TO_DO`: the run already has its iterations; every rank exits 0;
* `FAILED`: a check failed on rank 0 (which says why); the other ranks exit 1.

A word is given once; leaving `main_start` without one (a check raised) gives `FAILED`, so no
rank waits forever for a decision that will not come.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cory_lora.config import Recipe
from cory_lora.run.resume import check_resume
from cory_lora.run.rundir import RunDir, run_path
from cory_lora.services import distributed

GO, NOTHING_TO_DO, FAILED, GO_FRESH = 1, 0, -1, 2


@dataclass(frozen=True)
class Start:
    """Rank 0's decision: train (resuming or not) in `run_dir`, or nothing to do."""

    run_dir: RunDir
    resume: bool  # False when a resume found nothing to continue and starts afresh
    nothing_to_do: bool  # the run already has its iterations: touch nothing
    done: int  # iterations already done (a resume)
    notes: tuple[str, ...]  # lines for the user: logs mended from a checkpoint, a fresh start


def _no_run_yet(path: Path) -> bool:
    """A directory where a run was started but wrote nothing yet (killed while loading its
    model), or none at all."""
    path = run_path(path)
    return not path.exists() or (
        path.is_dir() and all(p.name.startswith(".") for p in path.iterdir())
    )


@contextmanager
def main_start(
    recipe: Recipe,
    path: Path,
    overwrite: bool,
    resume: bool,
    check: Callable[[], None] = lambda: None,
) -> Iterator[Start]:
    """Rank 0: check the run directory and `check()` (before minutes of model loading), lock the
    directory for the whole block, decide, and tell the other ranks. The lock is held while the
    block trains."""
    told = False

    def tell(word: int) -> None:  # the other ranks (if any) wait for this before training
        nonlocal told
        if not told:
            told = True
            distributed.from_main(word)

    notes: list[str] = []
    try:
        if resume and _no_run_yet(path):
            resume = False
            notes.append(
                f"nothing to resume in {run_path(path)} yet (no run was written there): "
                "starting the run from the beginning"
            )
        run_dir = RunDir(path, overwrite=overwrite, resume=resume)
        check()
        with run_dir.lock():  # this process is the directory's only writer until the run ends
            done = 0
            if resume:
                found = check_resume(run_dir, recipe)
                if found.complete:
                    tell(NOTHING_TO_DO)
                    yield Start(run_dir, True, True, found.done, ())
                    return
                if found.fresh:
                    resume = False
                    run_dir.start_afresh()  # refuses files a run does not write, as --overwrite
                    notes.append(
                        f"no checkpoint in {run_dir.path} yet (the run stopped before its "
                        "first): starting it again from the beginning"
                    )
                done = found.done
                notes += [found.warning] if found.warning else []
            tell(GO if resume else GO_FRESH)
            yield Start(run_dir, resume, False, done, tuple(notes))
    finally:
        tell(FAILED)  # a check failed: the other ranks stop too


def follow() -> int:
    """The other ranks: wait for rank 0's word (GO, GO_FRESH, NOTHING_TO_DO or FAILED)."""
    return distributed.from_main(GO)
