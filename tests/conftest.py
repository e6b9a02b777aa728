"""Fixtures: tiny random models and small datasets built offline, and recipes pointing at them."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import pytest
import torch

from cory_lora.config import recipe_from_dict
from cory_lora.engine.tiny import char_tokenizer, tiny_llama_config

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", category=FutureWarning)
# A bug keeps its traceback in the tests (the CLI, and the CLI processes the tests start, would
# otherwise report it in one line and save the traceback to a file): a user error that reaches
# that catch-all fails the test that checks for "no traceback".
os.environ["CORY_LORA_TRACEBACK"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama (hidden 64) with the character tokenizer, saved like a hub model."""
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(1234)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def arith_file(tmp_path_factory) -> Path:
    """Addition problems in the question/answer schema."""
    path = tmp_path_factory.mktemp("data") / "arith.jsonl"
    with open(path, "w") as f:
        for a in range(12):
            for b in range(6):
                f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def tiny_recipe_dict(model_dir: Path, data_file: Path, **sections) -> dict:
    """A small, fast recipe over the fixtures; keyword sections update the defaults."""
    raw = {
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "data": {"dataset": str(data_file), "max_prompt_tokens": 24},
        "generation": {"max_new_tokens": 4, "stop": [";"], "batch_size": 8},
        "reward": {"function": "exact_match"},
        "ppo": {
            "batch_size": 8,
            "minibatch_size": 4,
            "micro_batch_size": 2,
            "epochs": 1,
            "learning_rate": 1e-3,
        },
        "cory": {"swap_every": 1, "observer_template": "{query}{pioneer};{query}"},
        "train": {"iterations": 2, "seed": 0},
        "log": {"samples_per_iteration": 2},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


@pytest.fixture
def tiny_recipe(tiny_model_dir, arith_file):
    def make(**sections):
        return recipe_from_dict(tiny_recipe_dict(tiny_model_dir, arith_file, **sections))

    return make


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir, arith_file):
    """A 2-iteration CORY run (a checkpoint per iteration), copied for each test that uses it."""
    from .helpers import invoke, write_recipe

    root = tmp_path_factory.mktemp("finished")
    raw = tiny_recipe_dict(tiny_model_dir, arith_file, train={"checkpoint_every": 1})
    recipe = write_recipe(root / "recipe.toml", raw)
    result = invoke("run", recipe, "--output-dir", root / "run", "--quiet")
    assert result.exit_code == 0, result.output
    return root / "run"


@pytest.fixture
def run_copy(finished, tmp_path):
    """A copy of the `finished` run, for a test to damage."""
    import shutil

    return Path(shutil.copytree(finished, tmp_path / "run"))
