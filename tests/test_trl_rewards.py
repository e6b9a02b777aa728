"""TRL's own reward functions drop in: they get completions in TRL's conversational form
(`[{"role": "assistant", "content": ...}]`), our built-ins keep plain text, and a key chooses."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from cory_lora.cli import app
from cory_lora.config import DataConfig, RewardConfig
from cory_lora.errors import RewardError
from cory_lora.rewards import load_reward

from .conftest import tiny_recipe_dict
from .helpers import write_recipe

CHAT = DataConfig(dataset="x.jsonl", chat_template=True, system_prompt="Be brief.")
PLAIN = DataConfig(dataset="x.jsonl")


@pytest.fixture
def seen(tmp_path, monkeypatch):
    """A module:function reward that records what it was given."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spy_rewards.py").write_text(
        "CALLS = []\n"
        "def spy(prompts, completions, **columns):\n"
        "    CALLS.append((prompts, completions))\n"
        "    return [1.0] * len(completions)\n"
        "def strip_text(prompts, completions, **columns):\n"
        "    return [float(len(c.strip())) for c in completions]\n"
    )
    sys.modules.pop("spy_rewards", None)
    yield lambda: sys.modules["spy_rewards"].CALLS
    sys.modules.pop("spy_rewards", None)


def test_trl_think_format_reward_gets_messages_whatever_the_prompts():
    for data in (None, PLAIN, CHAT):
        reward = load_reward(RewardConfig(function="trl.rewards:think_format_reward"), data=data)
        assert reward.completion_format == "conversational"
        out = reward(["q", "q"], ["<think>\nhm\n</think>\n42", "42"], {})
        assert out.tolist() == [1.0, 0.0]


def test_trl_accuracy_reward_with_its_solution_column():
    pytest.importorskip("math_verify")
    reward = load_reward(RewardConfig(function="trl.rewards:accuracy_reward"), data=CHAT)
    reward.check_signature(["question", "solution"])
    out = reward(
        ["What is 1/3 + 0?", "What is 1/3 + 0?"],
        [r"The answer is $\boxed{\frac{1}{3}}$", r"The answer is $\boxed{\frac{1}{2}}$"],
        {"question": ["q", "q"], "solution": [r"$\frac{1}{3}$", r"$\frac{1}{3}$"]},
    )
    assert out.tolist() == [1.0, 0.0]


def test_with_a_chat_template_auto_gives_module_rewards_trl_s_conversational_form(seen):
    load_reward(RewardConfig(function="spy_rewards:spy"), data=CHAT)(["2+2="], ["4"], {})
    prompts, completions = seen()[-1]
    assert completions == [[{"role": "assistant", "content": "4"}]]
    assert prompts == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    ]


def test_without_a_chat_template_auto_gives_text(seen):
    load_reward(RewardConfig(function="spy_rewards:spy"), data=PLAIN)(["2+2="], ["4"], {})
    assert seen()[-1] == (["2+2="], ["4"])


def test_the_key_chooses_either_form(seen):
    text = RewardConfig(function="spy_rewards:spy", completion_format="text")
    load_reward(text, data=CHAT)(["p"], ["a"], {})
    assert seen()[-1] == (["p"], ["a"])
    chat = RewardConfig(function="spy_rewards:spy", completion_format="conversational")
    load_reward(chat, data=PLAIN)(["p"], ["a"], {})
    assert seen()[-1] == (
        [[{"role": "user", "content": "p"}]],
        [[{"role": "assistant", "content": "a"}]],
    )


def test_builtins_keep_plain_text_under_a_chat_template():
    for name in ("exact_match", "gsm8k_accuracy"):
        reward = load_reward(RewardConfig(function=name), data=CHAT)
        assert reward.completion_format == "text"
    out = load_reward(RewardConfig(function="exact_match"), data=CHAT)(
        ["1+1="], [" 2 "], {"answer": ["2"]}
    )
    assert out.tolist() == [1.0]


def test_a_text_reward_given_messages_says_how_to_get_text(seen):
    reward = load_reward(RewardConfig(function="spy_rewards:strip_text"), data=CHAT)
    with pytest.raises(RewardError, match=r'set reward\.completion_format = "text"'):
        reward(["p"], ["a"], {})


def test_a_chat_run_trains_with_trl_accuracy_reward(tmp_path, tiny_model_dir):
    pytest.importorskip("math_verify")
    data = tmp_path / "math.jsonl"
    with open(data, "w") as f:
        for a in range(8):
            f.write(json.dumps({"question": f"{a}+1=", "solution": f"${a + 1}$"}) + "\n")
    raw = tiny_recipe_dict(
        tiny_model_dir,
        data,
        data={"chat_template": True, "max_prompt_tokens": 48},
        reward={"function": "trl.rewards:accuracy_reward"},
        train={"iterations": 1},
    )
    recipe = write_recipe(tmp_path / "recipe.toml", raw)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(recipe), "--output-dir", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1
    # a random model never writes a boxed answer: reward 0, a number (not a failure)
    assert all(m["llm1/task_reward"] == 0.0 for m in metrics)
