"""Nothing lost: a run SIGKILLed at arbitrary moments and resumed, several times, ends with
bit-identical adapters to an uninterrupted run; Ctrl-C checkpoints and exits 130; a resume that
would change the run is refused; a damaged checkpoint is reported."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import tiny_recipe_dict
from .helpers import cli_command, run_cli_process, write_recipe

ITERATIONS = 8


cli = cli_command
run = run_cli_process


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_model_dir, arith_file):
    raw = tiny_recipe_dict(
        tiny_model_dir,
        arith_file,
        model={"load_in_4bit": True},
        cory={"swap_every": 3},
        generation={"temperature": 1.0, "top_k": 0},
        train={"iterations": ITERATIONS, "checkpoint_every": 2, "keep_checkpoints": 2},
    )
    return write_recipe(tmp_path_factory.mktemp("recipe") / "recipe.toml", raw)


@pytest.fixture(scope="module")
def reference(recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    result = run("run", recipe, "--output-dir", out, "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def final_tensors(run_dir: Path) -> dict:
    tensors = {}
    for agent in ("llm1", "llm2"):
        for name in ("adapter_model.safetensors", "value_head.safetensors"):
            for key, value in load_file(run_dir / "final" / agent / name).items():
                tensors[f"{agent}/{name}/{key}"] = value
    return tensors


def assert_same_run(run_dir: Path, reference: Path):
    ours, theirs = final_tensors(run_dir), final_tensors(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].equal(theirs[key]), f"{key} differs"

    def metrics(path):
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]

    ours_metrics = metrics(run_dir)
    assert [m["iteration"] for m in ours_metrics] == list(range(1, ITERATIONS + 1))
    assert ours_metrics == metrics(reference)
    samples = [
        json.loads(line)["iteration"]
        for line in (run_dir / "samples.jsonl").read_text().splitlines()
    ]
    assert samples == sorted(samples) and len(samples) == 2 * ITERATIONS


def test_killed_repeatedly_then_resumed_equals_an_uninterrupted_run(recipe, reference, tmp_path):
    out = tmp_path / "run"
    # 1. killed during generation of iteration 3 (its pioneer's micro-batch: the 5th sampling)
    first = run("run", recipe, "--output-dir", out, "--quiet", kill_at="generation:5")
    assert first.returncode == -signal.SIGKILL
    # 2. resumed (from iteration 2), killed during the second optimizer step
    second = run("resume", out, "--quiet", kill_at="update:2")
    assert second.returncode == -signal.SIGKILL
    # 3. resumed, killed inside its second checkpoint write (weights written, not renamed)
    third = run("resume", out, "--quiet", kill_at="checkpoint:2")
    assert third.returncode == -signal.SIGKILL
    assert any(
        p.name.startswith(".") for p in (out / "checkpoints").iterdir()
    )  # the half-written one
    # 4. resumed, killed from outside as soon as a new checkpoint appears
    before = {p.name for p in (out / "checkpoints").iterdir()}
    command, env = cli("resume", out, "--quiet")
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        now = {p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")}
        if now - before:
            break
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before the kill: nothing was interrupted"
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    # 5. resumed to the end
    last = run("resume", out, "--quiet")
    assert last.returncode == 0, last.stderr[-3000:]
    assert "resuming from iter-" in last.stdout
    assert_same_run(out, reference)
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["iter-000006", "iter-000008"]  # keep_checkpoints = 2, no leftovers


@pytest.mark.parametrize(
    "signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_a_stop_signal_checkpoints_exits_128_plus_it_and_resumes_identically(
    recipe, reference, tmp_path, signum, code
):
    """Ctrl-C, and SIGTERM (clusters, Docker, schedulers) and SIGHUP (a closed terminal) alike."""
    out = tmp_path / "run"
    command, env = cli("run", recipe, "--output-dir", out, "--quiet")
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.02)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr[-3000:]
    assert "Resume with: cory-lora resume" in " ".join(stderr.split())
    assert "Traceback" not in stderr
    done = len((out / "metrics.jsonl").read_text().splitlines())
    assert (out / "checkpoints" / f"iter-{done:06d}").is_dir()
    assert not (out / "final").exists()
    result = run("resume", out, "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(out, reference)


def test_second_ctrl_c_stops_at_once_leaving_the_checkpoint_intact(recipe, tmp_path):
    out = tmp_path / "run"
    command, env = cli("run", recipe, "--output-dir", out, "--quiet")
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(out.glob("checkpoints/iter-*")):
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    # 130 from our handler; if the second press lands in interpreter shutdown, after the first
    # one's checkpoint, Python has restored the default action and the process dies of SIGINT
    # (which a shell reports as 130 too).
    assert process.returncode in (130, -signal.SIGINT), stderr[-3000:]
    assert "Traceback" not in stderr
    result = run("resume", out, "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]


def test_resume_refuses_a_different_run_and_reports_damage(recipe, reference, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    refused = run("resume", out, "--set", "lora.r=8", "--set", "train.algorithm=ppo")
    assert refused.returncode == 1
    said = " ".join(refused.stderr.split())
    assert 'changed lora.r (4 -> 8); train.algorithm ("cory" -> "ppo")' in said
    # what a checkpoint holds (agents, value heads, EMAs) cannot change either: named, not
    # called damage (nor an optimizer's ValueError)
    for key, value in (("cory.agents", "3"), ("ppo.advantage", "rloo"), ("reset.every", "2")):
        more = ["--set", "generation.samples_per_query=2"] if key == "ppo.advantage" else []
        other = run("resume", out, "--set", f"{key}={value}", *more)
        assert other.returncode == 1
        assert f"the recipe changed {key} (" in " ".join(other.stderr.split()), other.stderr
    newest = sorted((out / "checkpoints").iterdir())[-1]
    damaged = newest / "llm1" / "adapter_model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-8] + b"\0" * 8)
    broken = run("resume", out, "--set", "train.iterations=9")
    assert broken.returncode == 1
    assert "is damaged (llm1/adapter_model.safetensors" in " ".join(broken.stderr.split())
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = run("resume", empty)
    assert nothing.returncode == 1 and "nothing to resume" in nothing.stderr


class NotPlainData:  # what a checkpoint from elsewhere might hold; unpickling it could run code
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_a_checkpoint_pickle_that_is_not_plain_data_is_refused_in_our_words(reference, tmp_path):
    import hashlib
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    newest = sorted((out / "checkpoints").iterdir())[-1]
    shutil.rmtree(out / "final")
    planted = newest / "optimizer-llm1.pt"
    torch.save({"state": NotPlainData()}, planted)
    record = json.loads((newest / "state.json").read_text())  # checksums made to match
    record["files"]["optimizer-llm1.pt"] = hashlib.sha256(planted.read_bytes()).hexdigest()
    (newest / "state.json").write_text(json.dumps(record))
    result = run("resume", out, "--quiet")
    assert result.returncode == 1
    said = " ".join(result.stderr.split())
    assert "optimizer-llm1.pt holds objects other than plain data" in said
    assert "weights_only" not in said and "Traceback" not in said
    assert "unpickled!" not in result.stdout + result.stderr
