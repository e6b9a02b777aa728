"""The ungated small-model recipes (Qwen2.5-0.5B-Instruct on GSM8K), checked offline: a tiny
random Qwen2-shaped model (grouped-query attention, q/k/v biases, tied embeddings) goes through
our sampler exactly as through `generate`, trains one CORY iteration in 4-bit and exports;
the memory plan is computed from Qwen2.5-0.5B's real hyperparameters."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from typer.testing import CliRunner

from cory_lora.cli import app
from cory_lora.config import load_recipe, recipe_from_dict
from cory_lora.engine.model import load_agents
from cory_lora.engine.plan import GB, estimate
from cory_lora.engine.tiny import char_tokenizer

from .conftest import tiny_recipe_dict
from .helpers import ROOT, write_recipe
from .test_generation import PROMPTS, hf_greedy, ours, same_tokens

RECIPES = {
    "cory": ROOT / "recipes" / "qwen2.5_0.5b_gsm8k.toml",
    "ppo": ROOT / "recipes" / "qwen2.5_0.5b_gsm8k_ppo.toml",
}
# Qwen/Qwen2.5-0.5B-Instruct's config.json, as published (what `cory-lora plan` reads).
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def tiny_qwen2_config() -> Qwen2Config:
    """Qwen2's shape at toy size: 8 query heads sharing 2 KV heads, tied input/output
    embeddings, over the character vocabulary."""
    vocab = len(char_tokenizer())
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(2024)
    model = Qwen2ForCausalLM(tiny_qwen2_config())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def qwen_recipe(qwen_dir, data, **sections):
    """The shipped recipe's model/LoRA/prompt choices on the tiny model, at toy sizes."""
    shipped = load_recipe(RECIPES["cory"])
    raw = tiny_recipe_dict(
        qwen_dir,
        data,
        lora={"r": 4, "alpha": 4, "target_modules": list(shipped.lora.target_modules)},
        data={"chat_template": True, "max_prompt_tokens": 64},
        **sections,
    )
    return raw


@pytest.mark.parametrize("four_bit", [False, True])
def test_greedy_sampling_equals_generate_on_a_qwen2_shaped_model(qwen_dir, arith_file, four_bit):
    recipe = recipe_from_dict(qwen_recipe(qwen_dir, arith_file, model={"load_in_4bit": four_bit}))
    agents = load_agents(recipe)
    with torch.no_grad():  # an adapter that matters
        for name, p in agents.model.named_parameters():
            if "lora_B.llm1" in name:
                p.normal_(0, 0.5)
    tokenizer = agents.tokenizer
    with agents.use("llm1"):
        expected = hf_greedy(agents.model, tokenizer, PROMPTS, 12)
        got = ours(agents.model, tokenizer, PROMPTS, temperature=0.0, max_new_tokens=12)
    assert same_tokens(got.response_ids, expected, tokenizer.pad_token_id)


def test_one_cory_iteration_in_4bit_then_export_merged(qwen_dir, arith_file, tmp_path):
    raw = qwen_recipe(
        qwen_dir,
        arith_file,
        model={"load_in_4bit": True, "gradient_checkpointing": True},
        train={"iterations": 1},
    )
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        ["run", str(write_recipe(tmp_path / "r.toml", raw)), "--output-dir", str(out), "--quiet"],
    )
    assert result.exit_code == 0, result.output
    (metrics,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["llm1/update_skipped"] == 0 and metrics["llm2/update_skipped"] == 0
    assert metrics["llm1/role"] == "pioneer" and metrics["llm1/grad_norm"] > 0

    agents = load_agents(load_recipe(out / "config.toml"))
    model = agents.model.get_base_model()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    agents.load(out / "final")
    ids = torch.tensor([[1, 20, 30, 40, 50, 60]])
    with torch.no_grad(), agents.use("llm2"):
        trained = agents.model(input_ids=ids).logits

    merged_dir = tmp_path / "merged"
    result = CliRunner().invoke(
        app, ["export", str(out), "--agent", "llm2", "-o", str(merged_dir), "--merge"]
    )
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert merged.config.tie_word_embeddings
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - trained).abs().max() <= 1e-4


@pytest.fixture(scope="module")
def qwen_config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2.5-0.5b-config")
    (path / "config.json").write_text(json.dumps(QWEN2_5_0_5B))
    return path


def test_the_config_is_qwen2_5_0_5b(qwen_config_dir):
    from transformers import AutoConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(qwen_config_dir))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # the published 0.49B


@pytest.mark.parametrize(("algorithm", "gib"), [("cory", 5.1), ("ppo", 4.8)])
def test_documented_memory_plan_of_the_qwen_recipes(qwen_config_dir, algorithm, gib):
    recipe = load_recipe(RECIPES[algorithm], [f"model.name_or_path={qwen_config_dir}"])
    peak = estimate(recipe).peak / GB
    assert round(peak, 1) == gib
    readme = (ROOT / "docs" / "gpu.md").read_text()  # the memory plan table
    row = re.search(
        rf"\| `qwen2\.5_0\.5b_gsm8k{'_ppo' if algorithm == 'ppo' else ''}\.toml`.*", readme
    )
    assert row is not None and f"{gib} GiB" in row.group(0)


def test_the_recipes_are_ungated_qwen_on_gsm8k():
    cory, ppo = (load_recipe(RECIPES[k]) for k in ("cory", "ppo"))
    assert cory.model.name_or_path == ppo.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (cory.train.algorithm, ppo.train.algorithm) == ("cory", "ppo")
    assert cory.data.dataset == "openai/gsm8k" and cory.data.eval_split == "test"
    # the baseline differs from CORY only by the algorithm (and the observer it does not have)
    same = lambda r: {k: v for k, v in r.__dict__.items() if k not in ("train", "cory")}  # noqa: E731
    assert same(cory) == same(ppo)
