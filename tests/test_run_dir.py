"""The run directory: one owner at a time (a second process on a directory being trained is
refused, with real processes; the first is unharmed and resumable; the lock dies with its
process), and logs that checkpoints carry so that damage is mended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cory_lora.config import load_recipe
from cory_lora.errors import UserError
from cory_lora.run.lock import LOCK_FILE, RunLock
from cory_lora.run.records import snapshot_logs
from cory_lora.run.rundir import RunDir

from .conftest import tiny_recipe_dict
from .helpers import write_recipe

ITERATIONS = 3

# Holds the run in its second iteration (says so in a file `waiting`) until the test creates
# the file `go` beside the run directory.
GATED_REWARD = """
import os, time
from pathlib import Path

def score(prompts, completions, answer, **kw):
    run = Path(os.environ["GATED_RUN"])
    while (run / "metrics.jsonl").exists() and not (run.parent / "go").exists():
        (run.parent / "waiting").touch()
        time.sleep(0.05)
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "cory_lora.cli", *map(str, args)]


def files(directory: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_second_process_is_refused_and_the_first_is_unharmed(
    tmp_path, tiny_model_dir, arith_file
):
    (tmp_path / "gated.py").write_text(GATED_REWARD)
    raw = tiny_recipe_dict(
        tiny_model_dir,
        arith_file,
        reward={"function": "gated:score"},
        train={"iterations": ITERATIONS, "checkpoint_every": 1},
    )
    recipe = write_recipe(tmp_path / "recipe.toml", raw)
    out = tmp_path / "run"
    env = {**os.environ, "GATED_RUN": str(out), "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        cli("run", recipe, "--output-dir", out, "--quiet"),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not (tmp_path / "waiting").exists() and first.poll() is None:
            assert time.time() < deadline, "the first run did not start training"
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()
        before = files(out)
        for args in (
            ("run", recipe, "--output-dir", out, "--set", "train.seed=1", "--quiet"),
            ("run", recipe, "--output-dir", out, "--overwrite", "--quiet"),
            ("run", recipe, "--output-dir", out, "--resume", "--quiet"),
            ("resume", out, "--quiet"),
            ("eval", out),
        ):
            second = subprocess.run(
                cli(*args),
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            text = " ".join(second.stderr.split())
            assert second.returncode == 1, (args, second.stdout, second.stderr)
            assert f"run directory '{out}' is in use by process {first.pid}" in text, text
            assert "Traceback" not in second.stderr
            assert files(out) == before, args  # nothing touched
    finally:
        (tmp_path / "go").touch()
        _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    assert load_recipe(out / "config.toml").train.seed == 0
    iterations = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").open()]
    assert iterations == list(range(1, ITERATIONS + 1))
    assert not (out / LOCK_FILE).exists()
    more = subprocess.run(
        cli("resume", out, "--set", f"train.iterations={ITERATIONS + 1}", "--quiet"),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert more.returncode == 0, more.stderr[-3000:]
    iterations = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").open()]
    assert iterations == list(range(1, ITERATIONS + 2))


HOLD_LOCK = """
import sys, time
from cory_lora.run.lock import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_the_lock_dies_with_its_process(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"is in use by process {holder.pid}"):
            RunLock(run).acquire()
    finally:
        holder.kill()  # SIGKILL: no clean-up code runs
        holder.wait()
    assert (run / LOCK_FILE).exists()  # left behind by the killed owner, and taken over at once
    with RunLock(run).acquire():
        assert (run / LOCK_FILE).read_text().startswith(f"{os.getpid()}\n")
    assert not (run / LOCK_FILE).exists()


def test_the_lock_file_is_not_run_content_nor_a_partial_write(tmp_path):
    run = tmp_path / "run"
    run_dir = RunDir(run)
    with run_dir.lock():
        assert (run / LOCK_FILE).exists()
        run_dir.open()  # a new run in the directory the lock created
        (run / ".config.toml.tmp").write_text("half")
        run_dir.remove_partial_writes()
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
        assert run_dir.created
    assert not run.exists()  # created for a run that wrote nothing: removed again
    # A stale lock file (its owner was killed) does not make a directory look like a run.
    run.mkdir()
    (run / LOCK_FILE).write_text("12345\nhost\nthen\ncory-lora run\n")
    RunDir(run)


def record(iteration: int) -> str:
    return json.dumps({"iteration": iteration, "llm1/task_reward": iteration / 10}) + "\n"


def test_a_checkpoint_copies_old_lines_from_the_previous_copy_not_the_damaged_log(tmp_path):
    run = tmp_path / "run"
    previous = run / "checkpoints" / "iter-000002"
    (previous / "logs").mkdir(parents=True)
    (previous / "logs" / "metrics.jsonl").write_text(record(1) + record(2))
    # The live log was damaged after that checkpoint (iteration 1 cut), then iteration 3 ran.
    (run / "metrics.jsonl").write_text(record(1)[:12] + "\n" + record(2) + record(3))
    snapshot_logs(run, 3, tmp_path / "logs", previous)
    assert (tmp_path / "logs" / "metrics.jsonl").read_text() == record(1) + record(2) + record(3)
    assert not (tmp_path / "logs" / "samples.jsonl").exists()  # samples were off


def test_log_damage_names_what_is_missing_and_truncation_restores_it(tmp_path):
    run = tmp_path / "run"
    snapshot = run / "checkpoints" / "iter-000003" / "logs"
    snapshot.mkdir(parents=True)
    (snapshot / "metrics.jsonl").write_text(record(1) + record(2) + record(3))
    live = run / "metrics.jsonl"
    live.write_text(record(1) + "garbage\n" + record(3) + record(4) + record(5)[:9])
    (run / "config.toml").write_text("")
    run_dir = RunDir(run, resume=True)
    warning = run_dir.check_logs(3)
    assert "metrics.jsonl: iteration(s) 2 missing, line(s) 2, 5 cut short or unreadable" in warning
    run_dir.truncate_logs(3)
    assert live.read_text() == record(1) + record(2) + record(3)
    assert run_dir.check_logs(3) is None
    live.unlink()
    assert "metrics.jsonl: missing" in run_dir.check_logs(3)


def test_a_checkpoint_without_a_copy_refuses_a_damaged_log(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "iter-000003").mkdir(parents=True)  # written by an older version
    (run / "config.toml").write_text("")
    (run / "metrics.jsonl").write_text(record(1) + record(3) + record(4))
    run_dir = RunDir(run, resume=True)
    with pytest.raises(UserError, match=r"iteration\(s\) 2 missing.*holds no copy"):
        run_dir.truncate_logs(3)
    assert (run / "metrics.jsonl").read_text() == record(1) + record(3) + record(4)
    (run / "metrics.jsonl").write_text(record(1) + record(2) + record(3) + record(4))
    run_dir.truncate_logs(3)  # an intact log is kept up to the checkpoint
    assert (run / "metrics.jsonl").read_text() == record(1) + record(2) + record(3)
