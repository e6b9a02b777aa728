"""Studies: a base recipe run over named arms × an optional grid × seeds, one ordinary run
directory each, one after another, resumable, then a report (report.py).

A study file (TOML):

    recipe = "../recipes/tiny_cpu.toml"     # the base recipe, relative to the study file
    seeds = [0, 1, 2]
    set = ["train.iterations=200"]           # overrides for every run (optional)
    window = 50                              # final window of the report, in iterations
    etas = [0.03, 0.1, 0.3]                  # frontier: each arm's best point under task - η·KL
    eval_limit = 100                         # > 0: held-out `cory-lora eval` of each run
                                             # (greedy; sampled on train.eval_sampled_limit), on
                                             # data.eval_split and each of data.eval_splits
    processes = 1                            # > 1: each run in that many ranks (--nproc-per-node)

    [grid]                                   # optional, crossed with every arm
    "ppo.init_kl_coef" = [0.03, 0.1, 0.3]

    [arms.cory]                              # an arm is a partial recipe over the base
    train = { algorithm = "cory" }
    [arms.ppo]
    train = { algorithm = "ppo" }

Runs live in `STUDY_DIR/<arm>[/<grid point>]/seed-<s>/`. Each is a separate process running
`cory-lora run` (or `resume`), so a failure, or the memory of one run, never reaches the next;
its console output goes to `STUDY_DIR/logs/`. Running the study again skips finished runs,
resumes an interrupted one from its checkpoint, reruns a failed or never-checkpointed one, and
runs what is left; `study.json` records every run's state. Every run's recipe is validated before
the first one starts.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from cory_lora.config import SECTIONS, Recipe, load_recipe, toml_value
from cory_lora.config.problems import schema_problems
from cory_lora.errors import ConfigError, Problem, UserError
from cory_lora.run.atomic import atomic_write_text
from cory_lora.run.interrupts import Terminated, child_environment, stopped_by_signal
from cory_lora.run.lock import RunLock
from cory_lora.run.records import read_metrics
from cory_lora.run.resume import resume_differences
from cory_lora.services.distributed import check_batch_split

STATE_FILE = "study.json"


@dataclass(frozen=True)
class Run:
    """One run of a study: an arm, a grid point (key -> value, maybe empty) and a seed."""

    arm: str
    grid: dict
    seed: int
    overrides: tuple[str, ...]  # --set arguments that make this run's recipe from the base
    iterations: int
    recipe: Recipe | None = field(default=None, compare=False, repr=False)  # once validated

    @property
    def relative_dir(self) -> Path:
        parts = [self.arm]
        if self.grid:
            parts.append(",".join(point_name(k, v) for k, v in self.grid.items()))
        return Path(*parts, f"seed-{self.seed}")

    @property
    def id(self) -> str:
        return str(self.relative_dir)


def point_name(key: str, value) -> str:
    """`key=value` as one directory name: the value as TOML, with the characters a file name
    cannot hold (/ and NUL: a chat template's [/INST]) written as %2F and %00."""
    return f"{key}={toml_value(value)}".replace("%", "%25").replace("/", "%2F").replace("\0", "%00")


@dataclass(frozen=True)
class Study:
    path: Path  # the study file
    recipe: Path  # the base recipe
    seeds: tuple[int, ...]
    overrides: tuple[str, ...]  # `set` plus the command line's --set
    window: int
    etas: tuple[float, ...]
    eval_limit: int
    processes: int = 1  # ranks per run (torchrun --nproc-per-node)
    grid: dict = field(default_factory=dict)  # dotted key -> list of values
    arms: dict = field(default_factory=dict)  # name -> partial recipe (section -> key -> value)

    def runs(self) -> list[Run]:
        """Every (arm, grid point, seed): seeds outermost, then grid points, then arms in file
        order, so that a study stopped part-way (or cut short by a session's end) has compared
        every arm at every grid point on the same seeds, rather than finished one arm."""
        keys = list(self.grid)
        points = [
            dict(zip(keys, values, strict=True))
            for values in itertools.product(*(self.grid[k] for k in keys))
        ]
        out = []
        for seed in self.seeds:
            for point in points:
                for arm, table in self.arms.items():
                    overrides = (
                        *self.overrides,
                        *_arm_overrides(table),
                        *(f"{k}={toml_value(v)}" for k, v in point.items()),
                        f"train.seed={seed}",
                    )
                    out.append(Run(arm, point, seed, overrides, 0))
        return out


def _arm_overrides(table: dict) -> list[str]:
    return [
        f"{section}.{key}={toml_value(value)}"
        for section, keys in table.items()
        for key, value in keys.items()
    ]


class StudyFile(BaseModel):
    """A study file's keys (the module docstring shows one); unknown keys are refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    recipe: Annotated[str, Strict(), Field(min_length=1)]
    """The base recipe's path, relative to the study file."""
    seeds: list[Annotated[int, Strict(), Field(ge=0)]] = Field([0], min_length=1)
    """Seeds, each run of every arm and grid point once per seed."""
    set: list[Annotated[str, Strict()]] = []
    """`section.key=value` overrides for every run."""
    window: Annotated[int, Strict(), Field(gt=0)] = 10
    """The report's final window, in iterations."""
    etas: list[Annotated[float, Strict(), Field(ge=0)]] = []
    """Frontier: each arm's best point under task reward - eta * KL, per eta."""
    eval_limit: Annotated[int, Strict(), Field(ge=0)] = 0
    """> 0: held-out `cory-lora eval` of each run on this many prompts."""
    processes: Annotated[int, Strict(), Field(ge=1)] = 1
    """> 1: each run under torchrun with this many ranks."""
    grid: dict[str, Any] = {}
    """Dotted recipe key -> the values it takes (crossed with every arm)."""
    arms: dict[str, Any] = Field(min_length=1)
    """Arm name -> a partial recipe (section -> key -> value)."""

    @field_validator("grid")
    @classmethod
    def _grid_of_lists(cls, grid: dict) -> dict:
        if not all("." in k and isinstance(v, list) and v for k, v in grid.items()):
            raise ValueError('expected a table of "section.key" = [values]')
        return grid

    @field_validator("arms")
    @classmethod
    def _arms_of_sections(cls, arms: dict) -> dict:
        tables = arms.values()
        if not all(isinstance(t, dict) and _sections_only(t) for t in tables):
            raise ValueError(
                "expected [arms.NAME] tables, each a partial recipe (sections of keys)"
            )
        return arms


def _sections_only(table: dict) -> bool:
    return all(s in SECTIONS and isinstance(keys, dict) for s, keys in table.items())


def load_study(
    path: Path, extra_overrides: tuple[str, ...] = (), processes: int | None = None
) -> tuple[Study, list[Run]]:
    """Read and check a study file, and validate every run's recipe; one ConfigError lists every
    problem. `processes` (--nproc-per-node) replaces the file's `processes`."""
    path = Path(path)
    raw = _read_study_file(path)
    try:
        spec = StudyFile.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(schema_problems(e, StudyFile, raw), "the study") from None
    if problems := _naming_problems(spec.seeds, spec.arms, spec.grid):
        raise ConfigError(problems, "the study")
    study = Study(
        path=path,
        recipe=(path.parent / spec.recipe).resolve(),
        seeds=tuple(spec.seeds),
        overrides=(*spec.set, *extra_overrides),
        window=spec.window,
        etas=tuple(spec.etas),
        eval_limit=spec.eval_limit,
        processes=processes or spec.processes,
        grid=spec.grid,
        arms=spec.arms,
    )
    return study, _checked_runs(study)


def _read_study_file(path: Path) -> dict:
    """The study file's TOML table; UserError when there is no such file, ConfigError when it
    is not TOML."""
    if not path.is_file():
        raise UserError(f"study {str(path)!r}: no such file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        problem = Problem((), f"study {str(path)!r} is not valid TOML: {e}")
        raise ConfigError([problem], "the study") from None


RESERVED = {
    STATE_FILE,
    "logs",
    "report.md",
    "report.json",
    "frontier.png",
    "curves.png",
    "base-eval.json",
}
UNSAFE = '/\\:*?"<>|\0'  # arm names: path separators and what Windows or a shell trips on


def _naming_problems(seeds: list[int], arms: dict, grid: dict) -> list[Problem]:
    """Seeds, arm names and grid values name run directories: a seed or a value twice, or a
    name that is not a plain directory name (a path, `..`, one of the study's own files), would
    make two runs share a directory, or put one outside the study."""
    problems = []
    if len(set(seeds)) != len(seeds):
        problems.append(Problem(("seeds",), f"seeds = {seeds}: a seed appears twice"))
    for name in arms:
        if not name or any(c in name for c in UNSAFE) or name.startswith(".") or name in RESERVED:
            problems.append(Problem(("arms",), f"arms.{name}: not usable as a directory name"))
    for key, values in grid.items():
        names = [point_name(key, v) for v in values]
        if len(set(names)) != len(names):
            problems.append(Problem(("grid",), f"grid.{key}: a value appears twice"))
    return problems


def _checked_runs(study: Study) -> list[Run]:
    """Every run of the study with its iterations, once its recipe (the base with the run's
    overrides) is valid and its batch splits over the study's processes; ConfigError listing
    every run's problems otherwise."""
    runs, problems = [], []
    for run in study.runs():
        try:
            recipe_of_run = load_recipe(study.recipe, run.overrides)
        except ConfigError as e:
            problems += [Problem(p.keys, f"{run.id}: {p.text}") for p in e.problems]
            continue
        try:
            check_batch_split(recipe_of_run.ppo.batch_size, study.processes)
        except UserError as e:
            problems.append(Problem(("processes", "ppo.batch_size"), f"{run.id}: {e}"))
            continue
        iterations = recipe_of_run.train.iterations
        runs.append(Run(run.arm, run.grid, run.seed, run.overrides, iterations, recipe_of_run))
    if problems:
        raise ConfigError(problems, "the study")
    return runs


# --------------------------------------------------------------------------- running


def changed_runs(study_dir: Path, runs: list[Run]) -> list[Problem]:
    """Runs already in the study directory (finished or checkpointed) whose saved recipe differs
    from what the study asks for now (the recipe, a --set or the study file changed): one
    problem each, naming the keys. Keys that cannot change what is learned are not counted."""
    problems = []
    for run in runs:
        config = study_dir / run.relative_dir / "config.toml"
        if run.recipe is None or not config.is_file() or run_state(config.parent) == "fresh":
            continue
        try:
            saved = load_recipe(config)
        except ConfigError:
            continue  # a damaged record: the run's own resume says so
        refused, noted = resume_differences(saved, run.recipe)
        if keys := refused + noted:
            problems.append(
                Problem(
                    tuple(keys),
                    f"{run.id} was made with other values of {', '.join(keys)} than the study "
                    "asks for now; a run already made is not made again: undo the change "
                    "(recipe, --set or study file), or use another --output-dir",
                )
            )
    return problems


def shorter_runs(study_dir: Path, runs: list[Run]) -> list[Problem]:
    """Finished runs with fewer iterations than the study asks for now (train.iterations raised):
    one problem each. A run still in progress is resumed to the new count, but a finished one is
    not extended: its evaluation and report rows would describe the shorter run, and skipping it
    would mix two lengths in one report."""
    problems = []
    for run in runs:
        out = study_dir / run.relative_dir
        if run_state(out) == "done" and (done := _iterations_done(out)) < run.iterations:
            problems.append(
                Problem(
                    ("train.iterations",),
                    f"{run.id} finished at {done} iterations and the study asks for "
                    f"{run.iterations}; a finished run is not extended: set train.iterations "
                    "back, or use another --output-dir",
                )
            )
    return problems


def run_state(run_dir: Path) -> str:
    """`done` (final adapters written, or the run's records complete: a study kept in a
    repository without its adapters and checkpoints), `resume` (a checkpoint to continue from),
    `fresh`."""
    if (run_dir / "final").is_dir():
        return "done"
    if list(run_dir.glob("checkpoints/iter-*")):
        return "resume"
    return "done" if records_complete(run_dir) else "fresh"


def records_complete(run_dir: Path) -> bool:
    """Whether the run's metrics hold every iteration its config.toml asks for (what a finished
    run leaves once its adapters and checkpoints are deleted)."""
    config, metrics = run_dir / "config.toml", run_dir / "metrics.jsonl"
    if not (config.is_file() and metrics.is_file()):
        return False
    try:
        wanted = tomllib.loads(config.read_text(encoding="utf-8"))["train"]["iterations"]
        return len(read_metrics(metrics)) >= int(wanted)
    except (OSError, UserError, ValueError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return False


def cli_command(*args, processes: int = 1) -> list[str]:
    """`cory-lora ARGS` as a process, in `processes` ranks when more than 1."""
    ranks = [f"--nproc-per-node={processes}"] if processes > 1 else []
    return [sys.executable, "-m", "cory_lora", *map(str, args), *ranks]


class StudyRunner:
    """Runs a study's runs one after another, each in its own process, with one progress view."""

    def __init__(self, study: Study, runs: list[Run], study_dir: Path, display):
        self.study, self.runs, self.dir, self.display = study, runs, Path(study_dir), display
        self.records: dict[str, dict] = {}
        self.interrupt: KeyboardInterrupt | None = None  # a signal that stopped the study

    def write_state(self) -> None:
        state = {
            "study": str(self.study.path),
            "recipe": str(self.study.recipe),
            "seeds": list(self.study.seeds),
            "window": self.study.window,
            "etas": list(self.study.etas),
            "grid": {k: list(v) for k, v in self.study.grid.items()},
            "arms": list(self.study.arms),
            "runs": [self.records[r.id] for r in self.runs],
        }
        atomic_write_text(self.dir / STATE_FILE, json.dumps(state, indent=2) + "\n")

    def run(self) -> dict[str, dict]:
        """Every run not done yet, one after another, while this process owns the study's
        directory (a second study process on it is refused, naming this one)."""
        with RunLock(self.dir, what="study").acquire(create=True):
            if problems := changed_runs(self.dir, self.runs) + shorter_runs(self.dir, self.runs):
                raise ConfigError(problems, "the study directory")
            return self._run_all()

    def _run_all(self) -> dict[str, dict]:
        (self.dir / "logs").mkdir(exist_ok=True)
        for run in self.runs:
            self.records[run.id] = {
                "id": run.id,
                "arm": run.arm,
                "grid": run.grid,
                "seed": run.seed,
                "dir": str(run.relative_dir),
                "iterations": run.iterations,
                "status": "done" if run_state(self.dir / run.relative_dir) == "done" else "pending",
                "error": None,
            }
        self.write_state()
        self.display.start(self.runs, self.records)
        try:
            for run in self.runs:
                if self.records[run.id]["status"] != "done":
                    self._one(run)
                if self.study.eval_limit and self.records[run.id]["status"] == "done":
                    self._evaluate(run)
        finally:
            self.display.stop()
        return self.records

    def _one(self, run: Run) -> None:
        out = self.dir / run.relative_dir
        state = run_state(out)
        if state == "resume":
            # the study's train.iterations, not the saved one: raising it in the study file (or
            # lowering it to no fewer than the checkpoint holds) is how a stopped run is resized
            size = _sets((f"train.iterations={run.iterations}",))
            command = cli_command(
                "resume", out, *size, "--quiet", *_trusted(out), processes=self.study.processes
            )
        else:  # never started, or died before its first checkpoint: start it again
            out.parent.mkdir(parents=True, exist_ok=True)
            command = cli_command(
                "run",
                self.study.recipe,
                *_sets(run.overrides),
                "--output-dir",
                out,
                "--quiet",
                processes=self.study.processes,
            )
            if out.exists():
                command.append("--overwrite")
        self.display.begin(run, state)
        code = self._watch(command, run, out)
        record = self.records[run.id]
        if code == 0 and run_state(out) == "done":
            record.update(status="done", error=None)
        elif self.interrupt or stopped_by_signal(code):
            record.update(status="interrupted")
            self.write_state()
            raise self.interrupt or Terminated(abs(code) % 128)
        else:
            record.update(status="failed", error=_last_error(self._log(run)))
        self.write_state()
        self.display.end(run, record)

    def _log(self, run: Run) -> Path:
        return self.dir / "logs" / (run.id.replace(os.sep, "__") + ".log")

    def _watch(self, command: list[str], run: Run, out: Path) -> int:
        """Run `command`, its output appended to the run's log, and follow its metrics."""
        with open(self._log(run), "a", encoding="utf-8") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            env = child_environment()  # the child dies with the study, even by kill -9
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                while process.poll() is None:
                    self.display.progress(run, _iterations_done(out))
                    time.sleep(0.5)
            except KeyboardInterrupt as e:
                # A Ctrl-C reached the child too (one process group); SIGTERM and SIGHUP were
                # sent to the study alone: pass them on. The child finishes its iteration and
                # checkpoints; the caller records the run as interrupted.
                if isinstance(e, Terminated):
                    process.send_signal(e.signum)
                process.wait()
                self.interrupt = e
        self.display.progress(run, _iterations_done(out))
        return process.returncode

    def _evaluate(self, run: Run) -> None:
        """`cory-lora eval` of the run on its held-out split (eval.json) and on each of
        data.eval_splits (eval-<split>.json), each once."""
        out = self.dir / run.relative_dir
        data = run.recipe.data if run.recipe else None
        splits = [s for s in data.eval_splits if s != data.eval_split] if data else []
        for split in (None, *splits):
            if (out / eval_file_name(split)).is_file():
                continue
            chosen = ["--split", split] if split else []
            limit = ["--limit", self.study.eval_limit]
            command = cli_command("eval", out, *chosen, *limit, *_trusted(out))
            code = self._watch(command, run, out)
            if self.interrupt:
                raise self.interrupt
            if code != 0:
                self.records[run.id]["error"] = "eval: " + _last_error(self._log(run))
                self.write_state()
                return


def eval_file_name(split: str | None) -> str:
    """eval.json for a run's own held-out split (None); eval-<split>.json for any other, so that
    an evaluation of one split never overwrites another's."""
    if split is None:
        return "eval.json"
    return f"eval-{re.sub(r'[^A-Za-z0-9._-]', '_', split)}.json"


def _trusted(run_dir: Path) -> list[str]:
    """--trust-remote-code for a run of this study whose recipe (the user's own study) sets
    model.trust_remote_code: the user asked for it when writing the study."""
    try:
        trusted = load_recipe(run_dir / "config.toml").model.trust_remote_code
    except ConfigError:
        return []  # the command itself reports the damaged config
    return ["--trust-remote-code"] if trusted else []


def _sets(overrides: tuple[str, ...]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def _iterations_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(read_metrics(path)) if path.is_file() else 0


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error:", "stopped:"))]
    return (errors or lines or ["(no output)"])[-1][:500]


def default_study_dir(study: Study, raw_output_dir: str | None) -> Path:
    return Path(raw_output_dir) if raw_output_dir else Path("runs") / study.path.stem
