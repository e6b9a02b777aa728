"""Studies: every run's recipe validated first, runs as ordinary run directories, resumable after
a kill, failures recorded, and a report whose numbers match an independent calculation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from cory_lora.errors import ConfigError
from cory_lora.science.report import build_report, markdown
from cory_lora.science.study import load_study

from .conftest import tiny_recipe_dict
from .helpers import cli_command, invoke, read_jsonl, write_jsonl, write_recipe


@pytest.fixture
def study_file(tmp_path, tiny_model_dir, arith_file):
    recipe = write_recipe(
        tmp_path / "base.toml",
        tiny_recipe_dict(
            tiny_model_dir,
            arith_file,
            data={"eval_holdout": 6},
            train={"iterations": 3, "checkpoint_every": 1},
        ),
    )

    def make(arms: str, extra: str = "") -> object:
        path = tmp_path / "study.toml"
        path.write_text(
            f'recipe = "{recipe.name}"\nseeds = [0, 1]\nwindow = 2\netas = [0.1]\n{extra}\n{arms}'
        )
        return path

    return make


ARM_NAMES = ("cory", "ppo")
ARMS = """
[arms.cory]
train = { algorithm = "cory" }
[arms.ppo]
train = { algorithm = "ppo" }
"""


def test_every_run_is_validated_before_any_starts(study_file, tmp_path):
    path = study_file(
        ARMS + "[arms.bad]\nppo = { learning_rat = 1.0 }\n", "[grid]\n'ppo.epochs' = [1, 0]"
    )
    result = invoke("study", path, "--output-dir", tmp_path / "s")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "bad/ppo.epochs=1/seed-0: ppo.learning_rat: unknown key" in text
    assert "cory/ppo.epochs=0/seed-1: ppo.epochs = 0: must be > 0" in text
    assert not (tmp_path / "s").exists()


def test_study_file_errors_are_listed_at_once(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text("recipe = 3\nseeds = []\nwindw = 2\n[arms.x]\nnope = { a = 1 }\n")
    result = invoke("study", path)
    assert result.exit_code == 2
    for text in (
        "the study has 4 problem(s)",
        "recipe = 3: expected a string",
        "seeds = []: must not be empty",
        "windw: unknown key (did you mean window?)",
        "arms = ",
    ):
        assert text in " ".join(result.output.split())


def test_runs_are_named_by_arm_grid_point_and_seed_and_run_seed_by_seed(study_file):
    _, runs = load_study(study_file(ARMS, "[grid]\n'ppo.init_kl_coef' = [0.05, 0.2]"))
    # seeds outermost: a study cut short has compared every arm at every point on its seeds
    assert [r.id for r in runs][:5] == [
        "cory/ppo.init_kl_coef=0.05/seed-0",
        "ppo/ppo.init_kl_coef=0.05/seed-0",
        "cory/ppo.init_kl_coef=0.2/seed-0",
        "ppo/ppo.init_kl_coef=0.2/seed-0",
        "cory/ppo.init_kl_coef=0.05/seed-1",
    ]
    assert len(runs) == 8
    assert "train.seed=1" in runs[4].overrides and "ppo.init_kl_coef=0.05" in runs[4].overrides


def test_a_run_kept_as_records_only_counts_as_done(tmp_path):
    """A study kept in a repository holds each run's config, metrics, samples and eval, not its
    adapters or checkpoints: such a run is finished, not to be run again."""
    from cory_lora.science.study import run_state

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[train]\niterations = 3\n")
    write_jsonl(run / "metrics.jsonl", [{"iteration": i} for i in (1, 2)])
    assert run_state(run) == "fresh"  # two of three iterations, no checkpoint: start again
    (run / "checkpoints" / "iter-000002").mkdir(parents=True)
    assert run_state(run) == "resume"
    write_jsonl(run / "metrics.jsonl", [{"iteration": i} for i in (1, 2, 3)])
    assert run_state(run) == "resume"  # a checkpoint says the process did not finish
    (run / "checkpoints" / "iter-000002").rmdir()
    assert run_state(run) == "done"
    (run / "config.toml").write_text("[train\n")  # damaged: not known to be finished
    assert run_state(run) == "fresh"


def test_a_stopped_run_resumes_to_the_iterations_the_study_asks_for_now(study_file, tmp_path):
    """train.iterations is the one key a study may change under a run it has started: a run
    stopped at a checkpoint continues to the study file's current count, not its saved one."""
    arm = "[arms.ppo]\ntrain = { algorithm = 'ppo' }\n"
    out = tmp_path / "study"
    path = study_file(arm, 'eval_limit = 2\nset = ["train.iterations=2"]')
    assert invoke("study", str(path), "--output-dir", str(out)).exit_code == 0
    for seed in (0, 1):  # both runs as if stopped after iteration 1
        (out / "ppo" / f"seed-{seed}" / "eval.json").unlink()
        for name in ("final", "checkpoints/iter-000002"):
            shutil.rmtree(out / "ppo" / f"seed-{seed}" / name)
    run = out / "ppo" / "seed-0"
    path = study_file(arm, 'eval_limit = 2\nset = ["train.iterations=3"]')
    result = invoke("study", str(path), "--output-dir", str(out))
    assert result.exit_code == 0, result.output
    assert [m["iteration"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert (run / "final").is_dir() and (run / "eval.json").is_file()
    # a finished run is not extended (nor silently kept beside longer ones): refused, untouched
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    path = study_file(arm, 'eval_limit = 2\nset = ["train.iterations=4"]')
    result = invoke("study", str(path), "--output-dir", str(out))
    assert result.exit_code != 0
    assert "ppo/seed-0 finished at 3 iterations and the study asks for 4" in result.output
    assert "Traceback" not in result.output
    assert before == {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_killed_study_resumes_skipping_finished_runs(study_file, tmp_path):
    path, out = study_file(ARMS, "eval_limit = 4"), tmp_path / "study"
    command, env = cli_command("study", path, "--output-dir", out)
    process = subprocess.Popen(
        command,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    second = out / "cory" / "seed-1"
    while time.time() < deadline and not list(second.glob("checkpoints/iter-*")):
        time.sleep(0.05)
    assert process.poll() is None, "the study ended before the kill"
    os.killpg(process.pid, signal.SIGKILL)  # the study and its run in progress
    process.wait()
    assert not (second / "final").exists()
    result = subprocess.run(
        cli_command("study", path, "--output-dir", out)[0],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    state = json.loads((out / "study.json").read_text())
    assert [r["status"] for r in state["runs"]] == ["done"] * 4
    for run in state["runs"]:
        metrics = read_jsonl(out / run["dir"] / "metrics.jsonl")
        assert [m["iteration"] for m in metrics] == [1, 2, 3]
        assert (out / run["dir"] / "eval.json").is_file()
    logs = {p.name: p.read_text() for p in (out / "logs").iterdir()}
    assert logs["cory__seed-0.log"].count("$ ") == 2  # one run, one eval: not run again
    assert " resume " in logs["cory__seed-1.log"]  # the interrupted run resumed
    # the base's row: computed once per seed, by the first run evaluated, and reused by the other
    for seed in (0, 1):
        evals = [
            json.loads((out / arm / f"seed-{seed}" / "eval.json").read_text()) for arm in ARM_NAMES
        ]
        assert sorted(e["base_cached"] for e in evals) == [False, True]
        assert (
            evals[0]["rows"][-1] == evals[1]["rows"][-1] and evals[0]["rows"][-1]["name"] == "base"
        )
    assert len(json.loads((out / "base-eval.json").read_text())) == 2  # one entry per seed
    report = json.loads((out / "report.json").read_text())
    assert [p["label"] for p in report["points"]] == ["cory", "ppo"]
    assert report["points"][0]["heldout"]["task_reward"]["n"] == 2
    assert (out / "frontier.png").read_bytes()[:4] == b"\x89PNG"


def test_a_failing_run_is_recorded_and_the_study_goes_on(study_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nan_reward.py").write_text(
        # usable in the trial call (completions = the prompts), NaN in training
        "def nan(prompts, completions, **kw):\n"
        "    return [0.0 if c == p else float('nan') for p, c in zip(prompts, completions)]\n"
    )
    arms = ARMS + '[arms.broken]\nreward = { function = "nan_reward:nan" }\n'
    path = study_file(arms, 'set = ["train.max_bad_updates=1"]').name
    out = tmp_path / "study"
    result = invoke("study", path, "--output-dir", out)
    assert result.exit_code == 1
    assert "2 run(s) failed" in result.output
    state = json.loads((out / "study.json").read_text())
    statuses = {r["id"]: r["status"] for r in state["runs"]}
    assert statuses["broken/seed-0"] == "failed" and statuses["ppo/seed-1"] == "done"
    errors = {r["id"]: r["error"] for r in state["runs"]}
    assert "skipped 1 iterations in a row" in errors["broken/seed-0"]
    report = (out / "report.md").read_text()
    assert "## Runs not in the report" in report and "broken/seed-0: failed" in report


def fake_run(root, run_dir, rows):
    write_jsonl(root / run_dir / "metrics.jsonl", rows)
    (root / run_dir / "final").mkdir(parents=True)


def test_report_numbers_match_an_independent_calculation(tmp_path):
    rng = np.random.default_rng(1)
    runs, truth = [], {}
    for arm, agents in (("cory", ("llm1", "llm2")), ("ppo", ("llm1",))):
        for beta in (0.1, 0.3):
            for seed in (0, 1, 2):
                rows = []
                for i in range(1, 21):
                    row = {"iteration": i}
                    for a in agents:
                        row |= {
                            f"{a}/task_reward": float(rng.random()),
                            f"{a}/kl": float(rng.random() * beta * 10),
                            f"{a}/combined_reward": float(rng.random()),
                        }
                    rows.append(row)
                run_dir = f"{arm}/ppo.init_kl_coef={beta}/seed-{seed}"
                fake_run(tmp_path, run_dir, rows)
                runs.append(
                    {
                        "id": run_dir,
                        "arm": arm,
                        "grid": {"ppo.init_kl_coef": beta},
                        "seed": seed,
                        "dir": run_dir,
                        "iterations": 20,
                        "status": "done",
                        "error": None,
                    }
                )
                # independent: the last 5 iterations, every agent's value pooled
                tail = rows[-5:]
                for key in ("task_reward", "kl"):
                    value = np.mean([r[f"{a}/{key}"] for r in tail for a in agents])
                    truth.setdefault((arm, beta, key), []).append(value)
    state = {"study": "s.toml", "window": 5, "etas": [0.0, 1.0], "runs": runs}
    (tmp_path / "study.json").write_text(json.dumps(state))
    report = build_report(tmp_path)
    by_label = {p["label"]: p for p in report["points"]}
    for (arm, beta, key), values in truth.items():
        got = by_label[f"{arm} β={beta}"]["train"][key]
        assert got["values"] == pytest.approx(values)
        assert got["mean"] == pytest.approx(np.mean(values))
        assert got["std"] == pytest.approx(np.std(values, ddof=1))
        # three seeds: the range of the seeds, no 95% interval
        assert got["ci95"] is None and got["range"] == pytest.approx([min(values), max(values)])
    # every pair of arms at each grid point, paired by seed: cory − ppo, 3 figures x 2 points
    differences = report["differences"]
    assert len(differences) == 2 * 3
    for d in differences:
        beta = float(d["a"].split("=")[1])
        if d["key"] in ("task_reward", "kl"):
            cory, ppo = truth[("cory", beta, d["key"])], truth[("ppo", beta, d["key"])]
            assert d["differences"] == pytest.approx(np.subtract(cory, ppo))
        assert d["n"] == 3 and not d["clear"]  # 3 seeds are never called clear
    text = markdown(report)
    assert "Comparisons: 6 paired differences" in text and "range of 3 seeds" in text
    # η = 0 picks each arm's highest task reward; η = 1 trades it against KL
    for eta in (0.0, 1.0):
        for arm in ("cory", "ppo"):
            objective = {
                beta: np.mean(truth[(arm, beta, "task_reward")])
                - eta * np.mean(truth[(arm, beta, "kl")])
                for beta in (0.1, 0.3)
            }
            best = max(objective, key=objective.get)
            chosen = [b for b in report["best"]["train"] if b["eta"] == eta and b["arm"] == arm]
            assert chosen[0]["label"] == f"{arm} β={best}"


def test_report_names_the_independent_arm_as_the_noise_floor(tmp_path):
    runs = []
    for arm in ("ppo", "independent"):
        for seed in range(4):
            run_dir = f"{arm}/seed-{seed}"
            fake_run(
                tmp_path, run_dir, [{"iteration": 1, "llm1/task_reward": seed + (arm == "ppo")}]
            )
            runs.append(
                {"id": run_dir, "arm": arm, "grid": {}, "seed": seed, "dir": run_dir}
                | {"iterations": 1, "status": "done", "error": None}
            )
    state = {"study": "s.toml", "window": 1, "etas": [], "runs": runs}
    (tmp_path / "study.json").write_text(json.dumps(state))
    report = build_report(tmp_path)
    # ppo is 1 above independent in every seed: the differences have no spread, a clear gap
    (d,) = report["differences"]
    assert d["differences"] == [1.0] * 4 and d["clear"] and d["p_floor"] == 2 / 16
    text = markdown(report)
    assert "`independent` is the A/A noise floor" in text and "1 of them clear" in text
    assert "n=4" in text


@pytest.mark.parametrize(
    "name",
    [
        "micro",
        "tiny_frontier",
        "tiny_ablations",
        "tiny_beyond",
        "gpt2_imdb",
        "llama2_7b_gsm8k",
        "smollm2_sentiment_frontier",
        "smollm2_arith_frontier",
        "smollm2_arith_long",
    ],
)
def test_shipped_studies_validate(name):
    from .helpers import ROOT

    study, runs = load_study(ROOT / "studies" / f"{name}.toml")
    assert len(runs) == len(study.seeds) * len(study.arms) * max(
        1, int(np.prod([len(v) for v in study.grid.values()]))
    )


def _running(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return found.stdout.split()


@pytest.mark.parametrize("kill", ["SIGTERM", "SIGKILL"])
def test_a_signal_to_the_study_reaches_its_run(study_file, tmp_path, kill):
    """SIGTERM to the study alone (a scheduler's stop): passed on to the run in progress, which
    checkpoints; the study records it as interrupted and exits 143. SIGKILL: the study cannot
    act, but its run does not outlive it."""
    path, out = study_file(ARMS, 'set = ["train.iterations=500"]'), tmp_path / "study"
    command, env = cli_command("study", path, "--output-dir", out)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = out / "cory" / "seed-0"
    deadline = time.time() + 240
    while time.time() < deadline and not list(first.glob("checkpoints/iter-*")):
        time.sleep(0.05)
    assert process.poll() is None, "the study ended before the signal"
    process.send_signal(getattr(signal, kill))
    _, stderr = process.communicate(timeout=300)
    # the kernel's SIGTERM reaches the orphan, which finishes its iteration and checkpoints
    deadline = time.time() + 120
    while time.time() < deadline and _running(str(first)):
        time.sleep(0.2)
    assert not _running(str(first)), "the run outlived the study"
    if kill == "SIGKILL":
        return
    assert process.returncode == 143, stderr.decode()[-2000:]
    state = json.loads((out / "study.json").read_text())
    assert state["runs"][0]["status"] == "interrupted"
    done = len(read_jsonl(first / "metrics.jsonl"))
    assert (first / "checkpoints" / f"iter-{done:06d}").is_dir()
    assert "study interrupted" in stderr.decode()


def test_grid_values_become_safe_unique_directory_names_and_bad_arm_names_are_refused(
    study_file,
):
    # a chat template's [/INST] is a value like any other: its / must not make a subdirectory
    values = "['../../{query}', '[INST] {query} [/INST]', '100% {query}']"
    _, runs = load_study(study_file(ARMS, f"[grid]\n'data.prompt_template' = {values}"))
    names = {run.relative_dir.parts[1] for run in runs}
    assert names == {
        'data.prompt_template="..%2F..%2F{query}"',
        'data.prompt_template="[INST] {query} [%2FINST]"',
        'data.prompt_template="100%25 {query}"',
    }
    assert all(len(run.relative_dir.parts) == 3 for run in runs)  # arm / point / seed
    twice = "[grid]\n'data.prompt_template' = ['{query}', '{query}']"
    arms = ARMS + '[arms."report.md"]\ntrain = { algorithm = "ppo" }\n'
    with pytest.raises(ConfigError) as e:
        load_study(study_file(arms, twice))
    text = "\n".join(p.text for p in e.value.problems)
    assert "grid.data.prompt_template: a value appears twice" in text
    assert "arms.report.md: not usable as a directory name" in text


def test_a_study_directory_has_one_writer(study_file, tmp_path):
    from cory_lora.run.lock import RunLock

    out = tmp_path / "study"
    with RunLock(out, what="study").acquire(create=True):  # another study process, say
        result = invoke("study", study_file(ARMS), "--output-dir", out)
    assert result.exit_code == 1
    assert f"study directory '{out}' is in use by process {os.getpid()}" in " ".join(
        result.output.split()
    )
    assert not (out / "study.json").exists()


def test_a_rerun_that_would_change_runs_already_made_is_refused_naming_the_keys(
    study_file, tmp_path
):
    one_arm = '[arms.ppo]\ntrain = { algorithm = "ppo" }\n'
    path, out = study_file(one_arm, 'set = ["train.iterations=1"]'), tmp_path / "study"
    first = invoke("study", path, "--output-dir", out)
    assert first.exit_code == 0, first.output
    changed = invoke("study", path, "--output-dir", out, "--set", "ppo.learning_rate=0.5")
    assert changed.exit_code == 2
    text = " ".join(changed.output.split())
    assert "ppo/seed-0 was made with other values of ppo.learning_rate" in text
    assert "ppo/seed-1 was made with other values of ppo.learning_rate" in text
    # a study extended by a seed only adds runs: nothing made is changed
    path.write_text(path.read_text().replace("seeds = [0, 1]", "seeds = [0, 1, 2]"))
    extended = invoke("study", path, "--output-dir", out)
    assert extended.exit_code == 0, extended.output
    assert (out / "ppo" / "seed-2" / "metrics.jsonl").is_file()


OUTSIDE = {"id": "a", "arm": "a", "grid": {}, "seed": 0, "dir": "../../etc", "status": "done"}


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda p: p.write_text('{"window": 2, "runs": [{"dir": '), "not valid JSON"),
        (lambda p: p.write_bytes(b'{"window": "\xff\xfe"}'), "not UTF-8 text"),
        (lambda p: p.write_text("[1, 2]"), "expected a JSON object"),
        (lambda p: p.write_text('{"window": 2}'), "is damaged (etas: missing)"),
        (
            lambda p: p.write_text('{"window": 2, "etas": [], "runs": [3]}'),
            "is damaged (runs.0: Input should be a valid dictionary",
        ),
        (
            lambda p: p.write_text(json.dumps({"window": 2, "etas": [], "runs": [OUTSIDE]})),
            "is damaged (runs.0.dir: Value error, must be a path inside the study directory)",
        ),
        (lambda p: p.mkdir(), "is a directory where a file should be"),
    ],
    ids=["truncated", "not-utf8", "not-an-object", "missing-key", "wrong-type", "outside", "dir"],
)
def test_a_damaged_study_json_is_one_message_naming_it(tmp_path, damage, said):
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    (study_dir / "study.json").touch()
    if said.startswith("is a directory"):
        (study_dir / "study.json").unlink()
    damage(study_dir / "study.json")
    result = invoke("report", study_dir)
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "study.json" in text and said in text, text
    assert "Traceback" not in result.output and "internal error" not in text


def test_curves_keep_training_and_held_out_figures_apart():
    """Training curves average the agents' own keys only (an in-training evaluation's
    eval/llmK/kl is not training KL); held-out curves take the iterations every seed evaluated."""
    from cory_lora.science.report import curve

    def row(i, kl, eval_kl=None, offtask=None):
        m = {"iteration": i, "llm1/kl": kl, "llm2/kl": kl + 2}
        if offtask is not None:
            m |= {"eval/llm1/kl": eval_kl, "eval/llm1/offtask_kl": offtask}
            m |= {"eval/llm2/offtask_kl": offtask + 1}
        return m

    seed_a = [row(1, 1.0), row(2, 3.0, eval_kl=50.0, offtask=0.5), row(3, 5.0)]
    seed_b = [row(1, 1.0), row(2, 1.0, eval_kl=70.0, offtask=1.5), row(3, 1.0, 0, 9.0), row(4, 1)]
    x, values = curve([seed_a, seed_b], "kl", smooth=2)
    assert list(x) == [1, 2, 3]  # the iterations both seeds have
    # agents' mean 2, 4, 6 (seed a): moving average of 2 with the first value repeated
    assert values[0].tolist() == [2.0, 3.0, 5.0] and values[1].tolist() == [2.0, 2.0, 2.0]
    x, values = curve([seed_a, seed_b], "offtask_kl", smooth=2)
    assert list(x) == [2] and values.tolist() == [[1.0], [2.0]]
    x, values = curve([seed_a], "distinct_2", smooth=2)
    assert len(x) == 0 and values.shape == (1, 0)
