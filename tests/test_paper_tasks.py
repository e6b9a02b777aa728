"""The paper's recipes, run tiny: GSM8K- and IMDB-schema data written here, a tiny policy and a
tiny sentiment classifier built here, then eval, sample, plot and the memory plan."""

from __future__ import annotations

import json

import pytest
import torch

from cory_lora.config import DataConfig, load_recipe
from cory_lora.engine.data import load_eval_prompts, load_prompts, render
from cory_lora.engine.tiny import char_tokenizer
from cory_lora.rewards import load_reward

from .helpers import ROOT, invoke, write_jsonl

TINY_MODEL_OVERRIDES = [
    "model.load_in_4bit=false",
    "model.dtype=float32",
    "model.device=cpu",
    "model.gradient_checkpointing=false",
    'lora.target_modules=["q_proj", "v_proj"]',
    "lora.r=4",
    "ppo.batch_size=4",
    "ppo.minibatch_size=2",
    "ppo.micro_batch_size=2",
    "ppo.epochs=1",
    "generation.batch_size=4",
    "generation.max_new_tokens=6",
    "generation.min_new_tokens=1",
    "data.max_prompt_tokens=200",
    "train.iterations=2",
]


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gsm8k")
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a in range(3, 9)
        for b in range(2, 4)
    ]
    write_jsonl(d / "train.jsonl", rows[:8])
    write_jsonl(d / "test.jsonl", rows[8:])
    return d


@pytest.fixture(scope="module")
def imdb_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("imdb")
    good = "This movie was a wonderful surprise, the acting was great and the story moved me. "
    bad = "Terrible. "
    rows = [
        {"text": (good if i % 3 else bad) * (1 + i % 2), "label": int(i % 3 > 0)} for i in range(12)
    ]
    write_jsonl(d / "train.jsonl", rows)
    write_jsonl(d / "test.jsonl", rows[:6])
    return d


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory):
    """A random 2-layer Llama sequence classifier with NEGATIVE/POSITIVE labels."""
    from transformers import LlamaForSequenceClassification

    from cory_lora.engine.tiny import tiny_llama_config

    path = tmp_path_factory.mktemp("classifier")
    config = tiny_llama_config()
    config.num_labels = 2
    config.id2label = {0: "NEGATIVE", 1: "POSITIVE"}
    config.label2id = {"NEGATIVE": 0, "POSITIVE": 1}
    torch.manual_seed(7)
    LlamaForSequenceClassification(config).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


run = invoke


def sets(*overrides):
    return [x for o in overrides for x in ("--set", o)]


def test_sentiment_reward_is_the_positive_logit(tiny_classifier):
    from transformers import AutoModelForSequenceClassification

    reward = load_reward(
        load_recipe(ROOT / "recipes" / "gpt2_imdb.toml", [f"reward.model={tiny_classifier}"]).reward
    )
    scores = reward(["I liked", "I hated"], [" it a lot", " it"], {})
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier).eval()
    tok = char_tokenizer()
    with torch.no_grad():
        expected = [
            model(**tok(t, return_tensors="pt")).logits[0, 1].item()
            for t in ("I liked it a lot", "I hated it")
        ]
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5)


def test_imdb_queries_are_short_prefixes_of_long_reviews(imdb_dir):
    cfg = DataConfig(
        dataset=str(imdb_dir),
        query_column="text",
        min_query_chars=100,
        query_min_tokens=2,
        query_max_tokens=8,
    )
    tok = char_tokenizer()
    prompts = load_prompts(cfg, tok, seed=0)
    assert len(prompts) == 4  # the reviews of 100+ characters
    lengths = [len(tok(q, add_special_tokens=False).input_ids) for q in prompts.queries]
    assert all(2 <= n < 8 for n in lengths) and len(set(lengths)) > 1
    assert all(
        text.startswith(q) for q, text in zip(prompts.queries, prompts.columns["text"], strict=True)
    )
    assert load_prompts(cfg, tok, seed=0).queries == prompts.queries  # seeded


def test_holdout_and_chat_template(gsm8k_dir):
    cfg = DataConfig(
        dataset=str(gsm8k_dir / "train.jsonl"),
        eval_holdout=3,
        chat_template=True,
        system_prompt="Be brief.",
    )
    train, held = load_prompts(cfg, seed=1), load_eval_prompts(cfg, seed=1)
    assert len(train) == 5 and len(held) == 3
    assert not set(train.queries) & set(held.queries)
    text = render(char_tokenizer(), cfg, "2+2?")
    assert text == "<|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\n"


def test_gsm8k_recipe_runs_tiny_then_eval_sample_plot(tmp_path, tiny_model_dir, gsm8k_dir):
    out = tmp_path / "gsm8k"
    overrides = sets(
        *TINY_MODEL_OVERRIDES, f"model.name_or_path={tiny_model_dir}", f"data.dataset={gsm8k_dir}"
    )
    result = run(
        "run", ROOT / "recipes" / "llama2_7b_gsm8k.toml", *overrides, "--output-dir", out, "--quiet"
    )
    assert result.exit_code == 0, result.output
    assert (out / "curves.png").stat().st_size > 0
    result = run("eval", out, "--limit", 3, "--k", "1,2", "--n", 2)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    names = [row["name"] for row in report["rows"]]
    assert names == ["llm1", "llm2", "llm1→llm2", "llm2→llm1", "base"]
    for row in report["rows"]:
        assert 0 <= row["accuracy"] <= 1 and set(row["pass_at"]) == {"1", "2"}
        assert row["pass_at"]["2"] >= row["pass_at"]["1"]
    assert report["rows"][-1]["kl"] == 0.0
    result = run("sample", out, "Tom has 3 apples.", "--agent", "llm2", "--n", 2)
    assert result.exit_code == 0 and "llm2 #2" in result.output


def test_imdb_recipes_run_tiny_and_plot_together(
    tmp_path, tiny_model_dir, imdb_dir, tiny_classifier
):
    runs = []
    for recipe in ("gpt2_imdb.toml", "gpt2_imdb_ppo.toml"):
        out = tmp_path / recipe.removesuffix(".toml")
        overrides = sets(
            *TINY_MODEL_OVERRIDES,
            f"model.name_or_path={tiny_model_dir}",
            f"data.dataset={imdb_dir}",
            f"reward.model={tiny_classifier}",
            "reward.batch_size=4",
            "generation.min_new_tokens=2",
            "generation.length_range=[2, 5]",
        )
        result = run("run", ROOT / "recipes" / recipe, *overrides, "--output-dir", out, "--quiet")
        assert result.exit_code == 0, result.output
        runs.append(out)
    result = run("eval", runs[0], "--limit", 2)
    assert result.exit_code == 0, result.output
    row = json.loads((runs[0] / "eval.json").read_text())["rows"][0]
    assert row["accuracy"] is None and row["pass_at"] == {}  # sentiment is not 0/1
    assert row["combined_reward"] == pytest.approx(row["task_reward"] - 0.1 * row["kl"])
    png = tmp_path / "compare.png"
    result = run("plot", *runs, "-o", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_memory_plan_of_the_7b_recipes(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from cory_lora.engine.plan import GB, estimate

    cory = estimate(
        load_recipe(ROOT / "recipes" / "llama2_7b_gsm8k.toml", [f"model.name_or_path={tmp_path}"])
    )
    assert 3.3 * GB < cory.parts["base weights"] < 4.0 * GB  # 6.5B linear weights at ~4.1 bits
    assert cory.peak < 16 * GB
    full = estimate(
        load_recipe(
            ROOT / "recipes" / "llama2_7b_gsm8k.toml",
            [
                f"model.name_or_path={tmp_path}",
                "model.load_in_4bit=false",
                "model.gradient_checkpointing=false",
            ],
        )
    )
    assert full.parts["base weights"] > 12 * GB and not full.fits(24)
    result = run(
        "plan", ROOT / "recipes" / "llama2_7b_gsm8k.toml", "--set", f"model.name_or_path={tmp_path}"
    )
    assert result.exit_code == 0 and "fits in 24 GiB" in result.output
    small = run(
        "plan",
        ROOT / "recipes" / "llama2_7b_gsm8k.toml",
        "--set",
        f"model.name_or_path={tmp_path}",
        "--gpu-gb",
        "8",
    )
    assert small.exit_code == 1 and "does NOT fit" in small.output
