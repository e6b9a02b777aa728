"""Experiment trackers, offline: each sink is fed a real run's metrics.jsonl and samples.jsonl
records (as the training loop feeds them) and what it wrote is read back with the tracker's own
reader; resume continues the same tracker run."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cory_lora.cli import app
from cory_lora.config import recipe_from_dict
from cory_lora.errors import ConfigError, UserError
from cory_lora.integrations.trackers import (
    STATE_FILE,
    Trackers,
    check_trackers,
    open_trackers,
    scalars,
)
from cory_lora.run.rundir import RunDir

from .conftest import tiny_recipe_dict
from .helpers import write_recipe


@pytest.fixture(scope="module")
def history(tmp_path_factory, tiny_model_dir, arith_file):
    """(metrics, samples) of a real 3-iteration CORY run, one list per iteration."""
    tmp = tmp_path_factory.mktemp("tracked")
    raw = tiny_recipe_dict(tiny_model_dir, arith_file, train={"iterations": 3})
    out = tmp / "run"
    result = CliRunner().invoke(
        app, ["run", str(write_recipe(tmp / "r.toml", raw)), "--output-dir", str(out), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    read = lambda name: [json.loads(x) for x in (out / name).read_text().splitlines()]  # noqa: E731
    samples = read("samples.jsonl")
    return [
        (m, [s for s in samples if s["iteration"] == m["iteration"]]) for m in read("metrics.jsonl")
    ]


@pytest.fixture
def recipe_with(tiny_model_dir, arith_file):
    def make(*trackers, **log):
        raw = tiny_recipe_dict(
            tiny_model_dir, arith_file, log={"report_to": list(trackers), "project": "t", **log}
        )
        return recipe_from_dict(raw)

    return make


def feed(trackers: Trackers, history, start: int = 0, bump: float = 0.0) -> None:
    """What the loop does after writing metrics.jsonl and samples.jsonl (bump: other values)."""
    for metrics, records in history[start:]:
        changed = {k: v + bump if isinstance(v, float) else v for k, v in metrics.items()}
        trackers.log(changed, step=metrics["iteration"])
        trackers.log_samples(records, step=metrics["iteration"])


def test_scalars_keep_numbers_under_their_metrics_jsonl_names():
    metrics = {"iteration": 3, "llm1/role": "pioneer", "llm1/kl": None, "llm1/task_reward": 0.5}
    metrics |= {"llm2/score": math.nan, "llm1/update_skipped": 0}
    assert scalars(metrics) == {"iteration": 3.0, "llm1/task_reward": 0.5, "llm1/update_skipped": 0}


def test_no_trackers_by_default_and_unknown_ones_are_recipe_errors(recipe_with, tmp_path):
    recipe = recipe_with()
    check_trackers(recipe)
    with open_trackers(recipe, tmp_path) as trackers:
        assert trackers.sinks == {}
        trackers.log({"iteration": 1, "x": 1.0}, 1)
    assert not (tmp_path / STATE_FILE).exists()
    with pytest.raises(ConfigError, match=r"unknown tracker\(s\) comet \(known: tensorboard, "):
        recipe_with("wandb", "comet")


def test_a_named_tracker_that_is_not_installed_fails_with_the_install_command(
    recipe_with, monkeypatch
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(UserError) as caught:
        check_trackers(recipe_with("wandb", "mlflow"))
    assert str(caught.value) == (
        "log.report_to names wandb, mlflow, which are not installed: "
        "pip install 'cory-lora[wandb,mlflow]'"
    )


def test_tracker_directories_belong_to_the_run(tmp_path):
    for name in ("tensorboard", "wandb"):
        (tmp_path / name).mkdir()
    (tmp_path / STATE_FILE).write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    RunDir(tmp_path, overwrite=True)  # not refused as foreign files


def tensorboard_events(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_scalars_and_samples_read_back_and_resume_replaces_later_steps(
    recipe_with, tmp_path, history
):
    pytest.importorskip("tensorboard")
    recipe = recipe_with("tensorboard")
    check_trackers(recipe)
    with open_trackers(recipe, tmp_path) as trackers:
        feed(trackers, history)
    events = tensorboard_events(tmp_path / "tensorboard")
    expected = scalars(history[0][0]).keys() - {"iteration"}
    assert expected <= set(events.Tags()["scalars"])
    assert "llm1/task_reward" in expected and "llm2/kl" in expected
    for key in ("llm1/task_reward", "llm2/kl_coef", "time/iteration_s"):
        points = [(e.step, e.value) for e in events.Scalars(key)]
        assert points == [(m["iteration"], pytest.approx(m[key])) for m, _ in history]
    assert {"recipe/text_summary", "samples/text_summary"} <= set(events.Tags()["tensors"])
    table = events.Tensors("samples/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert table.startswith("| iteration | query | pioneer_agent | pioneer | pioneer_reward |")
    assert history[-1][1][0]["query"] in table

    # killed after iteration 3, resumed from the checkpoint of iteration 2: 3 is written again
    with open_trackers(recipe, tmp_path, resume=True, done=2) as trackers:
        feed(trackers, history, start=2, bump=100.0)
    points = [
        (e.step, e.value)
        for e in tensorboard_events(tmp_path / "tensorboard").Scalars("time/iteration_s")
    ]
    assert [s for s, _ in points] == [1, 2, 3]  # each iteration once
    assert points[2][1] == pytest.approx(history[2][0]["time/iteration_s"] + 100.0)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    return wandb


def test_wandb_offline_writes_its_run_directory_and_resumes_the_same_run(
    recipe_with, tmp_path, history, wandb_offline
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recipe = recipe_with("wandb")
    check_trackers(recipe)
    trackers = open_trackers(recipe, run_dir)
    run = trackers.sinks["wandb"].run
    assert run.config["ppo"]["batch_size"] == recipe.ppo.batch_size  # the resolved recipe
    feed(trackers, history)
    last = history[-1][0]
    assert run.summary["llm1/task_reward"] == pytest.approx(last["llm1/task_reward"])
    assert run.summary["iteration"] == 3
    trackers.close()
    run_id = json.loads((run_dir / STATE_FILE).read_text())["wandb"]
    assert run_id == run.id
    (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    assert (offline / f"run-{run_id}.wandb").stat().st_size > 0
    assert list((offline / "files" / "media" / "table").glob("samples_*.table.json"))

    with open_trackers(recipe, run_dir, resume=True, done=2) as trackers:
        assert trackers.sinks["wandb"].run.id == run_id  # the same run continues
        feed(trackers, history, start=2)
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory):
    """trackio reads TRACKIO_DIR when first imported: point it at a temporary directory."""
    path = tmp_path_factory.mktemp("trackio")
    previous = os.environ.get("TRACKIO_DIR")
    os.environ["TRACKIO_DIR"] = str(path)
    try:
        trackio = pytest.importorskip("trackio")
        from trackio import utils

        if path != utils.TRACKIO_DIR:
            pytest.skip("trackio was imported earlier with another TRACKIO_DIR")
        yield trackio
    finally:
        if previous is None:
            os.environ.pop("TRACKIO_DIR", None)
        else:
            os.environ["TRACKIO_DIR"] = previous


def test_trackio_logs_locally_and_resumes_the_run_by_name(
    recipe_with, tmp_path, history, trackio_dir
):
    from trackio.sqlite_storage import SQLiteStorage

    run_dir = tmp_path / "run-trackio"
    run_dir.mkdir()
    recipe = recipe_with("trackio")
    check_trackers(recipe)
    with open_trackers(recipe, run_dir) as trackers:
        feed(trackers, history[:2])
    assert json.loads((run_dir / STATE_FILE).read_text()) == {"trackio": "run-trackio"}
    with open_trackers(recipe, run_dir, resume=True, done=2) as trackers:
        feed(trackers, history, start=2)
    logs = SQLiteStorage.get_logs("t", "run-trackio")
    rewards = [(r["step"], r["llm1/task_reward"]) for r in logs if "llm1/task_reward" in r]
    assert rewards == [(m["iteration"], pytest.approx(m["llm1/task_reward"])) for m, _ in history]
    tables = [r["samples"] for r in logs if "samples" in r]
    assert len(tables) == 3 and tables[0]["_value"][0]["query"] == history[0][1][0]["query"]
    assert SQLiteStorage.get_runs("t").count("run-trackio") == 1


@pytest.fixture
def mlflow_local(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow-skinny has no database store
    return mlflow


def test_mlflow_metrics_params_and_samples_and_resume(recipe_with, tmp_path, history, mlflow_local):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recipe = recipe_with("mlflow")
    check_trackers(recipe)
    with open_trackers(recipe, run_dir) as trackers:
        feed(trackers, history[:2])
    run_id = json.loads((run_dir / STATE_FILE).read_text())["mlflow"]
    resumed = recipe_with("mlflow", samples_per_iteration=1)  # a resume may change log keys
    with open_trackers(resumed, run_dir, resume=True, done=2) as trackers:
        assert trackers.sinks["mlflow"].run_id == run_id
        feed(trackers, history, start=2)
    client = mlflow_local.tracking.MlflowClient()
    points = [(m.step, m.value) for m in client.get_metric_history(run_id, "llm2/task_reward")]
    assert points == [(m["iteration"], pytest.approx(m["llm2/task_reward"])) for m, _ in history]
    run = client.get_run(run_id)
    assert run.data.params["ppo.batch_size"] == str(recipe.ppo.batch_size)
    assert run.data.params["log.report_to"] == "['mlflow']"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.toml", "samples.json"} <= artifacts
    downloaded = client.download_artifacts(run_id, "samples.json", str(tmp_path))
    table = json.loads(Path(downloaded).read_text())
    assert len(table["data"]) == sum(len(records) for _, records in history)


def test_a_tracker_that_cannot_start_is_a_user_error(recipe_with, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    with pytest.raises(UserError, match=r"log\.report_to: mlflow could not start a run"):
        open_trackers(recipe_with("mlflow"), tmp_path)


def test_the_cli_refuses_a_missing_tracker_before_creating_anything(
    tmp_path, tiny_model_dir, arith_file, monkeypatch
):
    monkeypatch.setitem(sys.modules, "trackio", None)
    raw = tiny_recipe_dict(tiny_model_dir, arith_file, log={"report_to": ["trackio"]})
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["run", str(write_recipe(tmp_path / "r.toml", raw)), "--output-dir", str(out)]
    )
    assert result.exit_code == 1
    assert "log.report_to names trackio, which is not installed: pip install" in result.output
    assert "cory-lora[trackio]" in result.output
    assert not out.exists()
