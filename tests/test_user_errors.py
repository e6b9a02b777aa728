"""The README's table of user errors, row by row: one clear message, the documented exit code,
no traceback, and nothing that existed before overwritten or left half-written."""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import tiny_recipe_dict
from .helpers import invoke, write_recipe


@pytest.fixture
def workspace(tmp_path, tiny_model_dir, arith_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards_here.py").write_text(
        "def two_args(prompts, completions):\n    return [0.0] * len(completions)\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
    )
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "other.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")

    def recipe(**sections):
        return write_recipe(
            tmp_path / "recipe.toml", tiny_recipe_dict(tiny_model_dir, arith_file, **sections)
        )

    return tmp_path, recipe


# (row of the README table, recipe sections or raw TOML, expected message, exit code)
RUN_CASES = [
    ("malformed TOML", "[model\nname_or_path = 1", "is not valid TOML", 2),
    ("unknown key", {"ppo": {"learning_rat": 1e-5}}, "ppo.learning_rat: unknown key", 2),
    (
        "wrong type",
        {"train": {"iterations": "ten"}},
        'train.iterations = "ten": expected an integer',
        2,
    ),
    (
        "impossible batch split",
        {"ppo": {"batch_size": 8, "minibatch_size": 3, "micro_batch_size": 3}},
        "ppo.minibatch_size = 3 must divide ppo.batch_size = 8",
        2,
    ),
    (
        "prompt + response longer than the model's context",
        {"data": {"max_prompt_tokens": 254}},
        "exceeds the model's context of 256 tokens",
        2,
    ),
    (
        "LoRA targets missing from the model",
        {"lora": {"target_modules": ["nope_proj"]}},
        "lora.target_modules = ['nope_proj']",
        1,
    ),
    (
        "missing model path",
        {"model": {"name_or_path": "./models/nope"}},
        "model.name_or_path = './models/nope': no such local directory",
        1,
    ),
    (
        "missing dataset column",
        {"data": {"dataset": "other.jsonl"}},
        "data.query_column = 'question': no such column",
        1,
    ),
    (
        "empty dataset",
        {"data": {"dataset": "empty.jsonl"}},
        "data.dataset = 'empty.jsonl': the file is empty",
        1,
    ),
    (
        "reward not importable",
        {"reward": {"function": "no_such_module:score"}},
        "cannot import 'no_such_module'",
        1,
    ),
    (
        "reward with wrong signature",
        {"reward": {"function": "rewards_here:two_args"}},
        "cannot be called as fn(prompts=..., completions=..., question=..., answer=...)",
        1,
    ),
    (
        "reward returning the wrong length",
        {"reward": {"function": "rewards_here:short"}},
        "returned 1 values for 2 completions (in a trial call",
        1,
    ),
]


@pytest.mark.parametrize("row, sections, message, code", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_run_errors(workspace, row, sections, message, code):
    root, recipe = workspace
    if isinstance(sections, str):
        path = root / "recipe.toml"
        path.write_text(sections)
    else:
        path = recipe(**sections)
    out = root / "run"
    result = invoke("run", path, "--output-dir", out, "--quiet")
    assert result.exit_code == code, result.output
    assert message in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    assert not out.exists()


def test_output_dir_exists(workspace):
    root, recipe = workspace
    out = root / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"iteration": 1}\n')
    result = invoke("run", recipe(), "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    assert "is not empty (metrics.jsonl); choose another --output-dir" in " ".join(
        result.output.split()
    )
    assert (out / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    foreign = root / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    result = invoke("run", recipe(), "--output-dir", foreign, "--overwrite", "--quiet")
    assert result.exit_code == 1 and "does not look like a run directory" in result.output
    assert (foreign / "thesis.tex").read_text() == "years of work"


def test_out_of_gpu_memory_names_the_keys_to_lower(workspace, monkeypatch):
    import cory_lora.train

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cory_lora.train, "play_episode", oom)
    root, recipe = workspace
    out = root / "run"
    result = invoke("run", recipe(), "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    for key in ("generation.batch_size", "ppo.micro_batch_size", "model.gradient_checkpointing"):
        assert key in text
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not out.exists()
