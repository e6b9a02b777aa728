"""Rewards (TRL convention, clear errors) and prompts (local files, columns, truncation)."""

from __future__ import annotations

import math
import sys

import pytest

from cory_lora.config import DataConfig
from cory_lora.engine.data import PromptOrder, encode_prompts, load_prompts
from cory_lora.engine.tiny import char_tokenizer
from cory_lora.errors import UserError
from cory_lora.rewards import RewardError, load_reward

from .helpers import write_jsonl


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import math\n"
        "def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n"
        "def nan_at_1(prompts, completions, **kw):\n    return [0.0, math.nan][: len(completions)]"
        "\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def boom(prompts, completions, **kw):\n    raise KeyError('label')\n"
        "def nothing(prompts, completions, **kw):\n    return [None] * len(completions)\n"
        "def two_args(prompts, completions):\n    return [0.0] * len(completions)\n"
        "def text(prompts, completions, **kw):\n    return ['good'] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    yield
    sys.modules.pop("my_rewards", None)


def test_builtin_exact_match():
    reward = load_reward("exact_match")
    out = reward(["1+1="] * 3, [" 2 ", "3", ""], {"answer": ["2", "2", "0"]})
    assert out.tolist() == [1.0, 0.0, 0.0]


def test_module_function_reward_receives_columns(reward_module):
    reward = load_reward("my_rewards:length")
    reward.check_signature(["question", "answer"])
    assert reward(["q", "q"], ["ab", "abcd"], {"answer": ["x", "y"]}).tolist() == [2.0, 4.0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope_module:f", "cannot import 'nope_module'"),
        ("my_rewards:missing", "has no function 'missing'"),
        ("not_a_builtin", "not a built-in"),
    ],
)
def test_reward_loading_errors(reward_module, spec, message):
    with pytest.raises(UserError, match=message):
        load_reward(spec)


def test_reward_signature_checked_before_running(reward_module):
    with pytest.raises(UserError, match="cannot be called as"):
        load_reward("my_rewards:two_args").check_signature(["question", "answer"])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("my_rewards:short", "returned 1 values for 2 completions"),
        ("my_rewards:boom", "raised KeyError"),
        ("my_rewards:text", "returned 'good' for sample 0"),
    ],
)
def test_bad_reward_values_name_the_reward_and_sample(reward_module, spec, message):
    with pytest.raises(RewardError, match=message) as info:
        load_reward(spec)(["p", "p"], ["a", "b"], {})
    assert spec in str(info.value)
    with pytest.raises(UserError, match="trial call"):
        load_reward(spec).probe(["p", "p"], {})


def test_nan_and_none_become_nan_for_the_loop_to_skip(reward_module):
    nan = load_reward("my_rewards:nan_at_1")(["p", "p"], ["a", "b"], {})
    assert nan[0] == 0.0 and math.isnan(nan[1])
    assert load_reward("my_rewards:nothing")(["p"], ["a"], {}).isnan().all()
    load_reward("my_rewards:nan_at_1").probe(["p", "p"], {})  # allowed before training


def test_local_jsonl_and_directory(tmp_path):
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    f = write_jsonl(tmp_path / "a.jsonl", rows)
    prompts = load_prompts(DataConfig(dataset=str(f)))
    assert prompts.queries[:2] == ["0+1=", "1+1="]
    assert prompts.columns["answer"][4] == "5"
    d = tmp_path / "dir"
    d.mkdir()
    write_jsonl(d / "train.jsonl", rows)
    write_jsonl(d / "test.jsonl", rows[:2])
    assert len(load_prompts(DataConfig(dataset=str(d)), split="test")) == 2
    sub = prompts.take([3, 1])
    assert sub.queries == ["3+1=", "1+1="] and sub.columns["answer"] == ["4", "2"]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"query_column": "prompt"}, "data.query_column = 'prompt': no such column"),
        ({"prompt_template": "Q: {query} ({topic})"}, "uses topic, which is not a column"),
    ],
)
def test_missing_columns_are_named(tmp_path, config, message):
    f = write_jsonl(tmp_path / "a.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(UserError, match=message):
        load_prompts(DataConfig(dataset=str(f), **config))


def test_missing_or_empty_dataset(tmp_path):
    with pytest.raises(UserError, match=r"data\.dataset = .*: no such file or directory"):
        load_prompts(DataConfig(dataset=str(tmp_path / "nowhere" / "x")))
    d = tmp_path / "d"
    d.mkdir()
    write_jsonl(d / "train.jsonl", [{"question": "1", "answer": "1"}])
    with pytest.raises(UserError, match="split 'test'"):
        load_prompts(DataConfig(dataset=str(d)), split="test")


def test_long_prompts_keep_bos_and_their_end():
    tok = char_tokenizer()
    (short, long), cut = encode_prompts(tok, ["1+1=", "the question is long: 1+1="], 5)
    assert cut == 1
    assert short == tok("1+1=").input_ids
    assert long[0] == tok.bos_token_id and tok.decode(long[1:]) == "1+1="


def test_prompt_order_covers_everything_each_pass_and_resumes():
    order = PromptOrder(10, seed=3)
    first = order.next(4) + order.next(4) + order.next(2)
    assert sorted(first) == list(range(10))
    state = order.state_dict()
    expected = order.next(7)
    resumed = PromptOrder(10, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next(7) == expected
