"""Experiment trackers: sinks fed the same metrics dict that goes to metrics.jsonl.

`log.report_to` names any of `tensorboard`, `wandb`, `trackio`, `mlflow` (default: none). Each
is an optional extra (`pip install 'cory-lora[wandb]'`), imported only when named; a named one
that is not installed fails before training (`check_trackers`), with the install command.

Every sink gets, per iteration, the numeric entries of the metrics dict under their
metrics.jsonl names (`llm1/task_reward`, ..., strings such as `llm1/role` and nulls left out),
at step = the iteration; the resolved recipe as the run's configuration; and the sample texts
of samples.jsonl as a table (a text table in TensorBoard).

Resume continues the same tracker run where the tracker allows it: the run ids are kept in
`RUN_DIR/trackers.json`.
* TensorBoard writes `RUN_DIR/tensorboard/`; a resumed run purges the steps after the checkpoint,
  so each iteration is shown once (as metrics.jsonl holds it once).
* wandb writes `RUN_DIR/wandb/` and resumes the run by id. Its charts use `iteration` as the
  x axis (wandb's own step only grows), so iterations replayed after a crash are logged again
  at the same x.
* trackio (local SQLite under TRACKIO_DIR, or a Space) resumes the run by name.
* MLflow (MLFLOW_TRACKING_URI; its default is a local database) resumes the run by id; the recipe
  becomes the run's parameters (at its start) and a `config.toml` artifact.
Project (wandb, trackio) or experiment (MLflow): `log.project`; run name: the run directory's.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path
from typing import Protocol

from cory_lora.config import Recipe, recipe_toml, to_dict
from cory_lora.errors import UserError, first_line
from cory_lora.run.atomic import atomic_write_text
from cory_lora.run.records import read_json

STATE_FILE = "trackers.json"
# What each tracker imports (only when named), and so what must be installed.
MODULES = {
    "tensorboard": "torch.utils.tensorboard",  # needs the tensorboard package
    "wandb": "wandb",
    "trackio": "trackio",
    "mlflow": "mlflow",
}
SAMPLE_COLUMNS = (
    "iteration",
    "query",
    "pioneer_agent",
    "pioneer",
    "pioneer_reward",
    "observer_agent",
    "observer",
    "observer_reward",
)


class Sink(Protocol):
    """One tracker. `run_id` (None when the tracker has no resumable run) goes to trackers.json."""

    run_id: str | None

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def log_samples(self, records: list[dict], step: int) -> None: ...

    def close(self) -> None: ...


def install_command(names: list[str]) -> str:
    return f"pip install 'cory-lora[{','.join(names)}]'"


def check_trackers(recipe: Recipe) -> None:
    """Import every tracker the recipe names; fail before training, with the install command,
    when one is missing."""
    missing = []
    for name in recipe.log.report_to:
        try:
            importlib.import_module(MODULES[name])
        except ImportError:
            missing.append(name)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise UserError(
            f"log.report_to names {', '.join(missing)}, which {verb} not installed: "
            f"{install_command(missing)}"
        )


def scalars(metrics: dict) -> dict[str, float]:
    """The numeric, finite entries of a metrics dict (roles are strings; skipped values null)."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and math.isfinite(value)
    }


def sample_rows(records: list[dict]) -> tuple[list[str], list[list]]:
    """Columns (those the records have, in SAMPLE_COLUMNS order) and one row per record."""
    columns = [c for c in SAMPLE_COLUMNS if any(c in r for r in records)]
    return columns, [[r.get(c) for c in columns] for r in records]


class Trackers:
    """Every sink the recipe names, behind one interface; with none, each call does nothing."""

    def __init__(self, sinks: dict[str, Sink]):
        self.sinks = sinks

    def log(self, metrics: dict, step: int) -> None:
        """Feed one iteration's metrics dict (as written to metrics.jsonl)."""
        values = scalars(metrics)
        for sink in self.sinks.values():
            sink.log(values, step)

    def log_samples(self, records: list[dict], step: int) -> None:
        """Feed one iteration's sample records (as written to samples.jsonl)."""
        if records:
            for sink in self.sinks.values():
                sink.log_samples(records, step)

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()
        self.sinks = {}

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_trackers(recipe: Recipe, run_dir: Path, resume: bool = False, done: int = 0) -> Trackers:
    """Start (or, with `resume`, continue) a run in each named tracker. `done`: iterations
    already in the run (the checkpoint's), whose later steps a resumed TensorBoard log drops."""
    run_dir = Path(run_dir)
    state_path = run_dir / STATE_FILE
    state = read_json(state_path) if resume and state_path.is_file() else {}
    openers = {
        "tensorboard": TensorBoardSink,
        "wandb": WandbSink,
        "trackio": TrackioSink,
        "mlflow": MlflowSink,
    }
    sinks: dict[str, Sink] = {}
    try:
        for name in recipe.log.report_to:
            try:
                sinks[name] = openers[name](recipe, run_dir, state.get(name), resume, done)
            except ImportError:
                raise UserError(
                    f"log.report_to names {name}, which is not installed: {install_command([name])}"
                ) from None
            except Exception as e:  # a tracker's service or settings: say which one failed
                raise UserError(
                    f"log.report_to: {name} could not start a run: {type(e).__name__}: "
                    f"{first_line(e)}"
                ) from None
    except BaseException:
        Trackers(sinks).close()
        raise
    ids = {name: sink.run_id for name, sink in sinks.items() if sink.run_id is not None}
    if ids:
        atomic_write_text(state_path, json.dumps(ids, indent=1) + "\n")
    return Trackers(sinks)


def _markdown_table(records: list[dict]) -> str:
    columns, rows = sample_rows(records)
    cell = lambda v: "" if v is None else str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardSink:
    """Event files in RUN_DIR/tensorboard/ (torch's SummaryWriter)."""

    run_id = None

    def __init__(self, recipe: Recipe, run_dir: Path, run_id, resume: bool, done: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the events a crashed process wrote after the checkpoint
        self.writer = SummaryWriter(
            log_dir=str(run_dir / "tensorboard"), purge_step=done + 1 if resume else None
        )
        self.writer.add_text(
            "recipe", "```toml\n" + recipe_toml(recipe) + "\n```", global_step=done
        )
        self.writer.flush()

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            if key != "iteration":  # the step itself
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a killed run keeps every finished iteration

    def log_samples(self, records: list[dict], step: int) -> None:
        self.writer.add_text("samples", _markdown_table(records), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run in RUN_DIR/wandb/ (online, or offline with WANDB_MODE=offline)."""

    def __init__(self, recipe: Recipe, run_dir: Path, run_id, resume: bool, done: int):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=recipe.log.project,
            name=run_dir.name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=str(run_dir),
            config=to_dict(recipe),
            allow_val_change=True,  # a resume may change logging or iteration settings
        )
        self.run_id = self.run.id
        self.run.define_metric("iteration")
        self.run.define_metric("*", step_metric="iteration")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({**scalars, "iteration": step})

    def log_samples(self, records: list[dict], step: int) -> None:
        columns, rows = sample_rows(records)
        table = self.wandb.Table(columns=columns, data=rows)
        self.run.log({"samples": table, "iteration": step})

    def close(self) -> None:
        self.run.finish()


class TrackioSink:
    """A trackio run (local SQLite under TRACKIO_DIR, or a Space when trackio is told so)."""

    def __init__(self, recipe: Recipe, run_dir: Path, run_id, resume: bool, done: int):
        import trackio

        self.trackio = trackio
        self.run_id = run_id or run_dir.name
        trackio.init(
            project=recipe.log.project,
            name=self.run_id,
            config=to_dict(recipe),
            resume="allow" if run_id else "never",
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.trackio.log({k: v for k, v in scalars.items() if k != "iteration"}, step=step)

    def log_samples(self, records: list[dict], step: int) -> None:
        columns, rows = sample_rows(records)
        self.trackio.log({"samples": self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.trackio.finish()


class MlflowSink:
    """An MLflow run in the experiment `log.project` (tracking URI from MLFLOW_TRACKING_URI)."""

    def __init__(self, recipe: Recipe, run_dir: Path, run_id, resume: bool, done: int):
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(recipe.log.project)
        if run_id:
            run = mlflow.start_run(run_id=run_id)
        else:
            run = mlflow.start_run(run_name=run_dir.name)
            # MLflow refuses to change a parameter, so they are the recipe the run started with
            mlflow.log_params(
                {
                    f"{section}.{key}": str(value)[:6000]
                    for section, table in to_dict(recipe).items()
                    if isinstance(table, dict)  # [[agents]] are in the config.toml below
                    for key, value in table.items()
                }
            )
        self.run_id = run.info.run_id
        mlflow.log_text(recipe_toml(recipe), "config.toml")  # the recipe now running

    def log(self, scalars: dict[str, float], step: int) -> None:
        values = {k: v for k, v in scalars.items() if k != "iteration"}
        self.mlflow.log_metrics(values, step=step)

    def log_samples(self, records: list[dict], step: int) -> None:
        columns, rows = sample_rows(records)
        data = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self.mlflow.log_table(data=data, artifact_file="samples.json")  # appends

    def close(self) -> None:
        self.mlflow.end_run()
