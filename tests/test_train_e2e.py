"""End to end on CPU through the CLI: outputs, metrics, refusal to overwrite, clean user errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from cory_lora.config import load_recipe

from .conftest import tiny_recipe_dict
from .helpers import invoke, read_jsonl, write_recipe

DESIGN_KEYS = (
    "role",
    "task_reward",
    "kl",
    "combined_reward",
    "kl_coef",
    "policy_loss",
    "value_loss",
    "response_length",
)


run_cli = invoke


@pytest.fixture
def recipe_file(tmp_path, tiny_model_dir, arith_file):
    def make(**sections):
        return write_recipe(
            tmp_path / "recipe.toml", tiny_recipe_dict(tiny_model_dir, arith_file, **sections)
        )

    return make


def test_cory_run_writes_the_run_directory(tmp_path, recipe_file):
    recipe = recipe_file(
        model={"load_in_4bit": True, "gradient_checkpointing": True}, train={"iterations": 3}
    )
    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cory_lora.cli",
            "run",
            str(recipe),
            "--output-dir",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_recipe(out / "config.toml") == load_recipe(recipe)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        for agent in ("llm1", "llm2"):
            for key in DESIGN_KEYS:
                assert f"{agent}/{key}" in m
        assert "time/iteration_s" in m
    # swap_every = 1: roles alternate every iteration
    assert [m["llm1/role"] for m in metrics] == ["pioneer", "observer", "pioneer"]
    assert [m["llm2/role"] for m in metrics] == ["observer", "pioneer", "observer"]
    samples = read_jsonl(out / "samples.jsonl")
    assert (
        len(samples) == 3 * 2
        and {"query", "pioneer", "observer", "pioneer_reward"} <= samples[0].keys()
    )
    for agent in ("llm1", "llm2"):
        adapter = out / "final" / agent
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == load_recipe(recipe).model.name_or_path
        assert (adapter / "value_head.safetensors").exists()
        assert (adapter / "adapter_model.safetensors").exists()
    assert "task reward, last 3" in result.stdout  # the summary table, over the real window
    assert "Traceback" not in result.stderr


def test_existing_run_is_not_overwritten_unless_asked(tmp_path, recipe_file):
    recipe = recipe_file(train={"algorithm": "ppo", "iterations": 1})
    out = tmp_path / "run"
    assert run_cli("run", recipe, "--output-dir", out, "--quiet").exit_code == 0
    before = (out / "metrics.jsonl").read_text()
    again = run_cli("run", recipe, "--output-dir", out, "--quiet")
    assert again.exit_code == 1
    assert "not empty" in again.output and "--overwrite" in again.output
    assert (out / "metrics.jsonl").read_text() == before
    assert run_cli("run", recipe, "--output-dir", out, "--quiet", "--overwrite").exit_code == 0


def test_single_agent_ppo_trains_llm1_only(tmp_path, recipe_file):
    recipe = recipe_file(train={"algorithm": "ppo", "iterations": 2})
    out = tmp_path / "run"
    assert run_cli("run", recipe, "--output-dir", out, "--quiet").exit_code == 0
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(not any(k.startswith("llm2/") for k in m) for m in metrics)
    assert all(m["llm1/role"] == "pioneer" for m in metrics)
    assert sorted(p.name for p in (out / "final").iterdir() if p.is_dir()) == ["llm1"]
    assert "observer" not in read_jsonl(out / "samples.jsonl")[0]


def test_nan_rewards_skip_updates_then_stop_the_run(tmp_path, recipe_file, monkeypatch):
    (tmp_path / "nan_reward.py").write_text(
        "import math\n"
        "def bad(prompts, completions, **kw):\n"
        "    return [math.nan if i == 1 else 1.0 for i in range(len(completions))]\n"
    )
    monkeypatch.chdir(tmp_path)
    recipe = recipe_file(
        reward={"function": "nan_reward:bad"},
        train={"iterations": 6, "max_bad_updates": 3, "checkpoint_every": 1},
    )
    out = tmp_path / "run"
    result = run_cli("run", recipe, "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    expected = "reward 'nan_reward:bad' returned NaN/inf for the pioneer's answers [1]"
    assert f"llm1's update skipped: {expected}" in text
    assert "skipped 3 iterations in a row (train.max_bad_updates = 3)" in text
    assert "Traceback" not in result.output
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["llm1/update_skipped"] for m in metrics] == [1, 1, 1]
    assert [m["llm1/skipped_updates"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["llm1/policy_loss"] is None
    assert metrics[0]["llm1/task_reward"] == 1.0  # the mean of the finite rewards
    # nothing was learned from poisoned scores: the checkpoints hold the initial agents, equal to
    # each other, their LoRA B matrices still zero (the base's own outputs)
    for checkpoint in ("iter-000001", "iter-000002"):
        agents = {
            name: {
                f"{file}/{key}": tensor
                for file in ("adapter_model.safetensors", "value_head.safetensors")
                for key, tensor in load_file(out / "checkpoints" / checkpoint / name / file).items()
            }
            for name in ("llm1", "llm2")
        }
        assert agents["llm1"].keys() == agents["llm2"].keys()
        assert all(agents["llm1"][k].equal(agents["llm2"][k]) for k in agents["llm1"])
        lora_b = [t for k, t in agents["llm1"].items() if "lora_B" in k]
        assert lora_b and all(not t.any() for t in lora_b)
