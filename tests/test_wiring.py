"""Issue 11 features that the training loop calls (trackers; the recipe's data section for the
reward's completion format), end to end through the CLI.

cory_lora/run/train.py makes those calls (see cory_lora/integrations/trackers.py and
cory_lora/rewards/__init__.py for the interface)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cory_lora.cli import app

from .conftest import tiny_recipe_dict
from .helpers import write_recipe


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_a_run_and_its_resume_feed_tensorboard_each_iteration_once(
    tmp_path, tiny_model_dir, arith_file
):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    raw = tiny_recipe_dict(
        tiny_model_dir,
        arith_file,
        train={"iterations": 1},
        log={"report_to": ["tensorboard"]},
    )
    out = tmp_path / "run"
    result = invoke("run", write_recipe(tmp_path / "r.toml", raw), "--output-dir", out, "--quiet")
    assert result.exit_code == 0, result.output
    result = invoke("resume", out, "--set", "train.iterations=2", "--quiet")
    assert result.exit_code == 0, result.output
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("llm1/task_reward")]
    assert points == [(m["iteration"], pytest.approx(m["llm1/task_reward"])) for m in metrics]
    assert "samples/text_summary" in events.Tags()["tensors"]


def test_with_a_chat_template_a_module_reward_gets_trl_s_messages(
    tmp_path, tiny_model_dir, arith_file, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat_rewards.py").write_text(
        "def messages_only(prompts, completions, **columns):\n"
        "    assert all(c[0]['role'] == 'assistant' for c in completions), completions[:1]\n"
        "    assert all(p[-1]['role'] == 'user' for p in prompts), prompts[:1]\n"
        "    return [float(c[0]['content'].strip() == a) for c, a in "
        "zip(completions, columns['answer'])]\n"
    )
    raw = tiny_recipe_dict(
        tiny_model_dir,
        arith_file,
        data={"chat_template": True, "max_prompt_tokens": 48},
        reward={"function": "chat_rewards:messages_only"},
        train={"iterations": 1},
    )
    out = tmp_path / "run"
    result = invoke("run", write_recipe(tmp_path / "r.toml", raw), "--output-dir", out, "--quiet")
    assert result.exit_code == 0, result.output
