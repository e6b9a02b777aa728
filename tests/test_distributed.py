"""Data parallelism on CPU with the gloo backend and 2 processes, started by torchrun or by our
own `--nproc-per-node`: the 2-rank update equals the 1-rank update on the whole batch, a 2-rank
run survives a kill of one rank and resumes, a SIGTERM stops every rank with a checkpoint, and a
batch that does not split across the ranks is refused before training."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from cory_lora.errors import UserError
from cory_lora.services import distributed

from .conftest import tiny_recipe_dict
from .helpers import ROOT, invoke, read_jsonl, write_recipe

TORCHRUN = shutil.which("torchrun") or "torchrun"


def torchrun(*args, processes: int = 2, kill_at: str | None = None, timeout: int = 600):
    """`torchrun --nproc-per-node K ...` as a real process group (the CLI as users launch it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CORY_LORA_KILL_AT", None)
    if kill_at:
        env["CORY_LORA_KILL_AT"] = kill_at
    command = [
        TORCHRUN,
        "--standalone",  # a free port of its own: tests never collide
        f"--nproc-per-node={processes}",
        *map(str, args),
    ]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_shares_and_batch_split_in_one_process():
    assert distributed.world_size() == 1 and distributed.is_main()
    assert distributed.my_share([1, 2, 3]) == [1, 2, 3]
    distributed.check_batch_split(8, processes=2)
    with pytest.raises(UserError, match=r"ppo.batch_size = 9 does not split across 2 processes"):
        distributed.check_batch_split(9, processes=2)


@pytest.fixture(scope="module")
def one_rank_update(tmp_path_factory, tiny_model_dir, arith_file):
    out = tmp_path_factory.mktemp("update") / "one.pt"
    script = ROOT / "tests" / "distributed_update.py"
    result = subprocess.run(
        [sys.executable, script, tiny_model_dir, arith_file, out],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


def test_two_rank_update_equals_one_rank_update(
    one_rank_update, tmp_path, tiny_model_dir, arith_file
):
    """Given the same 8 episodes, 2 ranks x 4 take the same two updates as 1 rank x 8: adapters
    and value head to 1e-5, and every statistic (losses, KL, the adaptive KL coefficient moved
    by the global KL, score moments through the next iteration's scaling)."""
    out = tmp_path / "two.pt"
    result = torchrun(ROOT / "tests" / "distributed_update.py", tiny_model_dir, arith_file, out)
    assert result.returncode == 0, result.stderr[-3000:]
    two = torch.load(out)
    one = one_rank_update
    assert two["trainable"].keys() == one["trainable"].keys()
    for name, tensor in one["trainable"].items():
        assert torch.allclose(two["trainable"][name], tensor, atol=1e-5, rtol=0), name
        assert not torch.equal(tensor, torch.zeros_like(tensor)) or "lora_B" not in name
    # every rank holds the same agent
    rank0, rank1 = two["ranks"]
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    for a, b in zip(one["stats"], two["stats"], strict=True):
        for key, value in a.items():
            assert b[key] == (value if value is None else pytest.approx(value, rel=1e-4, abs=1e-5))
    assert one["stats"][1]["kl_coef"] != one["stats"][0]["kl_coef"]  # the controller moved


def _recipe(tmp_path, tiny_model_dir, arith_file, **train):
    return write_recipe(
        tmp_path / "recipe.toml",
        tiny_recipe_dict(
            tiny_model_dir,
            arith_file,
            model={"load_in_4bit": True},
            train={"iterations": 6, "checkpoint_every": 2, **train},
        ),
    )


def _adapters(run_dir):
    return {
        f"{agent}/{file}": load_file(run_dir / "final" / agent / file)
        for agent in ("llm1", "llm2")
        for file in ("adapter_model.safetensors", "value_head.safetensors")
    }


def launched(*args, kill_at: str | None = None, timeout: int = 600):
    """`cory-lora ARGS --nproc-per-node 2` as a real process: our own launcher."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CORY_LORA_KILL_AT", None)
    if kill_at:
        env["CORY_LORA_KILL_AT"] = kill_at
    command = [sys.executable, "-m", "cory_lora", *map(str, args), "--nproc-per-node", "2"]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_two_rank_run_killed_then_resumed_equals_an_uninterrupted_one(
    tmp_path, tiny_model_dir, arith_file
):
    """The uninterrupted run under plain torchrun; the killed and the resumed one under
    `--nproc-per-node 2`: both ways of launching train the same."""
    recipe = _recipe(tmp_path, tiny_model_dir, arith_file)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    result = torchrun("-m", "cory_lora", "run", recipe, "--output-dir", whole, "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("iteration 6/6") == 1  # rank 0 alone speaks
    # rank 1 dies after its 11th optimizer step: in iteration 3 (2 agents x 2 steps each)
    killed = launched("run", recipe, "--output-dir", broken, "--quiet", kill_at="update:11@1")
    assert killed.returncode == 137, killed.stderr[-3000:]
    # one line names the rank, how it ended and where its output is; no launcher traceback
    assert "rank 1 was killed by SIGKILL; its output: " in killed.stderr
    assert "Traceback" not in killed.stderr and "ChildFailedError" not in killed.stderr
    assert [m["iteration"] for m in read_jsonl(broken / "metrics.jsonl")] == [1, 2]
    resumed = launched("resume", broken, "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from iter-000002" in resumed.stdout
    assert resumed.stdout.count("iteration 6/6") == 1
    metrics = read_jsonl(broken / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4, 5, 6]

    def untimed(rows):
        return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in rows]

    assert untimed(metrics) == untimed(read_jsonl(whole / "metrics.jsonl"))
    a, b = _adapters(whole), _adapters(broken)
    for key in a:
        assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key


def test_a_batch_that_does_not_split_is_refused_before_training(
    tmp_path, tiny_model_dir, arith_file
):
    recipe = write_recipe(
        tmp_path / "recipe.toml",
        tiny_recipe_dict(
            tiny_model_dir,
            arith_file,
            ppo={"batch_size": 9, "minibatch_size": 3, "micro_batch_size": 3},
        ),
    )
    out = tmp_path / "run"
    result = torchrun("-m", "cory_lora", "run", recipe, "--output-dir", out, "--quiet")
    assert result.returncode != 0
    message = "ppo.batch_size = 9 does not split across 2 processes"
    assert (result.stdout + result.stderr).count(message) == 1  # said once, by rank 0
    assert not out.exists()
    # with our launcher: checked before any rank starts, one line, exit 2
    result = launched("run", recipe, "--output-dir", out, "--quiet")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {message} (--nproc-per-node 2): "
        "each process takes batch_size / 2 queries; choose a multiple of 2"
    ]
    assert not out.exists()


def test_a_study_runs_each_run_under_torchrun(tmp_path, tiny_model_dir, arith_file):
    recipe = write_recipe(
        tmp_path / "base.toml",
        tiny_recipe_dict(tiny_model_dir, arith_file, train={"iterations": 2}),
    )
    study = tmp_path / "study.toml"
    study.write_text(
        f'recipe = "{recipe.name}"\nseeds = [0]\nwindow = 1\nprocesses = 2\n'
        '[arms.cory]\ntrain = { algorithm = "cory" }\n'
    )
    result = invoke("study", study, "--output-dir", tmp_path / "s")
    assert result.exit_code == 0, result.output
    log = (tmp_path / "s" / "logs" / "cory__seed-0.log").read_text()
    assert log.splitlines()[0].endswith("--nproc-per-node=2")  # our launcher, 2 ranks
    assert [m["iteration"] for m in read_jsonl(tmp_path / "s/cory/seed-0/metrics.jsonl")] == [1, 2]
    # a batch that does not split across the ranks is refused when the study is read
    study.write_text(
        study.read_text() + "ppo = { batch_size = 9, minibatch_size = 3, micro_batch_size = 3 }\n"
    )
    refused = invoke("study", study, "--output-dir", tmp_path / "s2")
    assert refused.exit_code == 2
    assert "cory/seed-0: ppo.batch_size = 9 does not split across 2 processes" in " ".join(
        refused.output.split()
    )


def test_under_torchrun_each_rank_takes_the_gpu_of_its_local_rank(monkeypatch):
    from cory_lora.engine.model import resolve_device

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="'cuda:0' names one GPU, but under torchrun"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("advantage", ["rloo", "grpo"])
def test_two_rank_critic_free_update_equals_one_rank(
    tmp_path, tiny_model_dir, arith_file, advantage
):
    """Critic-free: 4 queries x 2 answers; each rank holds whole groups (2 queries)."""
    script = ROOT / "tests" / "distributed_update.py"
    keys = [f"ppo.advantage={advantage!r}", "generation.samples_per_query=2"]
    if advantage == "grpo":
        keys.append("ppo.kl_in='loss'")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    single = subprocess.run(
        [sys.executable, script, tiny_model_dir, arith_file, one, *keys],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    result = torchrun(script, tiny_model_dir, arith_file, two, *keys)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = torch.load(one), torch.load(two)
    assert not any(name.startswith("value_head") for name in one["trainable"])
    for name, tensor in one["trainable"].items():
        assert torch.allclose(two["trainable"][name], tensor, atol=1e-5, rtol=0), name
    for a, b in zip(one["stats"], two["stats"], strict=True):
        for key, value in a.items():
            assert b[key] == (value if value is None else pytest.approx(value, rel=1e-4, abs=1e-5))


def _processes_running(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return found.stdout.split()


@pytest.mark.parametrize("kill", ["SIGTERM", "SIGKILL"])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path, tiny_model_dir, arith_file, kill):
    """SIGTERM (what clusters and Docker send): every rank finishes its iteration, the run
    checkpoints, exit 143. SIGKILL: the launcher cannot act, but no rank outlives it."""
    recipe = _recipe(tmp_path, tiny_model_dir, arith_file, iterations=500)
    out = tmp_path / f"run-{kill}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "cory_lora", "run", recipe, "--output-dir", out, "--quiet"]
    process = subprocess.Popen(
        [*map(str, command), "--nproc-per-node", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").is_file() or len(read_jsonl(out / "metrics.jsonl")) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(getattr(signal, kill))
    stdout, stderr = process.communicate(timeout=300)
    deadline = time.monotonic() + 120  # an orphaned rank finishes its iteration first
    while time.monotonic() < deadline and _processes_running(str(out)):
        time.sleep(0.2)
    assert not _processes_running(str(out)), "a rank outlived the launcher"
    if kill == "SIGKILL":
        return
    assert process.returncode == 143, stderr[-3000:]
    assert "SIGTERM: finishing this iteration, then a checkpoint" in stdout
    done = len(read_jsonl(out / "metrics.jsonl"))
    assert (out / "checkpoints" / f"iter-{done:06d}").is_dir()
    assert f"stopped after iteration {done}" in stderr
    assert f"cory-lora resume {out} --nproc-per-node 2" in stderr
    assert "Traceback" not in stderr
