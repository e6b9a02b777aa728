"""Heterogeneous agents ([[agents]] tables): per-agent LoRA shape, learning rate and initial KL
coefficient on the one shared base; recipe errors name the agent and the key; the run, its
outputs, resume and plan follow each agent's own settings."""

from __future__ import annotations

import json

import pytest

from cory_lora.algorithm.state import new_agent_state
from cory_lora.config import ConfigError, recipe_from_dict, recipe_toml
from cory_lora.engine.model import load_agents
from cory_lora.engine.plan import estimate
from cory_lora.run.resume import resume_differences

from .conftest import tiny_recipe_dict
from .helpers import invoke, write_recipe

LLM2 = {
    "name": "llm2",
    "lora": {"r": 2, "target_modules": ["q_proj"]},
    "ppo": {"learning_rate": 5e-4, "init_kl_coef": 0.05},
}


def _raw(tiny_model_dir, arith_file, *agents, **sections):
    raw = tiny_recipe_dict(tiny_model_dir, arith_file, **sections)
    raw["agents"] = [dict(a) for a in agents]
    return raw


def test_each_agent_gets_its_own_settings_and_the_rest_is_shared(tiny_model_dir, arith_file):
    recipe = recipe_from_dict(_raw(tiny_model_dir, arith_file, LLM2))
    assert recipe.lora_of("llm1") == recipe.lora
    assert recipe.lora_of("llm2").r == 2 and recipe.lora_of("llm2").target_modules == ("q_proj",)
    assert recipe.lora_of("llm2").alpha == recipe.lora.alpha
    assert (
        recipe.ppo_of("llm2").learning_rate == 5e-4 and recipe.ppo_of("llm1").learning_rate == 1e-3
    )
    assert recipe.ppo_of("llm2").epochs == recipe.ppo.epochs
    # the resolved recipe (config.toml) reads back to the same recipe
    import tomllib

    assert recipe_from_dict(tomllib.loads(recipe_toml(recipe))) == recipe
    # a change of an agent's settings makes another run: a resume refuses it
    other = recipe_from_dict(_raw(tiny_model_dir, arith_file, {**LLM2, "lora": {"r": 3}}))
    assert "agents" in resume_differences(recipe, other)[0]


def test_recipe_errors_name_the_agent_and_the_key(tiny_model_dir, arith_file):
    raw = _raw(
        tiny_model_dir,
        arith_file,
        {"name": "llm2", "lora": {"r": 0}},
        {"name": "llm1", "ppo": {"epochs": 2}},
        {"lora": {"r": 4}},
        {"name": "llm2", "lora": {"r": 4}},
    )
    with pytest.raises(ConfigError) as e:
        recipe_from_dict(raw)
    text = str(e.value)
    assert "[[agents]] llm2: lora.r = 0: must be > 0" in text
    assert "[[agents]] llm1: ppo.epochs is shared by every agent" in text
    assert '[[agents]] #3: needs name = "llmK"' in text
    assert "[[agents]] llm2: a second table for the same agent" in text
    with pytest.raises(ConfigError, match=r"\[\[agents\]\] llm3: the recipe trains llm1, llm2"):
        recipe_from_dict(_raw(tiny_model_dir, arith_file, {"name": "llm3", "lora": {"r": 2}}))
    with pytest.raises(ConfigError, match=r"\[\[agents\]\] llm2: model: not settable per agent"):
        recipe_from_dict(_raw(tiny_model_dir, arith_file, {"name": "llm2", "model": {}}))


def test_agents_of_other_shapes_share_the_base(tiny_model_dir, arith_file):
    recipe = recipe_from_dict(_raw(tiny_model_dir, arith_file, LLM2, cory={"agents": 3}))
    agents = load_agents(recipe)
    shapes = {
        name: sorted(
            (n.split(".lora_")[0].split(".")[-1], tuple(p.shape))
            for n, p in agents.model.named_parameters()
            if f".{name}." in n and "lora_A" in n
        )
        for name in recipe.agent_names
    }
    assert {module for module, _ in shapes["llm1"]} == {"q_proj", "v_proj"}
    assert {module for module, _ in shapes["llm2"]} == {"q_proj"}
    assert all(shape[0] == 2 for _, shape in shapes["llm2"])  # r = 2
    assert shapes["llm3"] == shapes["llm1"]  # llm3 has the recipe's shape: a copy of llm1
    llm1, llm3 = (dict(agents.model.named_parameters()) for _ in range(2))
    for n, p in llm1.items():
        if ".llm1." in n:
            assert p.equal(llm3[n.replace(".llm1.", ".llm3.")])
    state = new_agent_state(agents, "llm2", recipe)
    assert state.optimizer.param_groups[0]["lr"] == 5e-4 and state.kl_ctl.value == 0.05
    assert new_agent_state(agents, "llm1", recipe).kl_ctl.value == recipe.ppo.init_kl_coef
    # the plan counts each agent's own adapter
    same = recipe_from_dict(_raw(tiny_model_dir, arith_file, cory={"agents": 3}))
    part = "adapters + optimizer (3 agents)"
    assert estimate(recipe).parts[part] < estimate(same).parts[part]


def test_a_heterogeneous_run_end_to_end(tmp_path, tiny_model_dir, arith_file):
    recipe = tmp_path / "recipe.toml"
    write_recipe(recipe, tiny_recipe_dict(tiny_model_dir, arith_file, data={"eval_holdout": 4}))
    recipe.write_text(
        '[[agents]]\nname = "llm2"\nlora = { r = 2, target_modules = ["q_proj"] }\n'
        "ppo = { learning_rate = 5e-4 }\n\n" + recipe.read_text()
    )
    out = tmp_path / "run"
    result = invoke("run", recipe, "--output-dir", out, "--quiet")
    assert result.exit_code == 0, result.output
    config = json.loads((out / "final" / "llm2" / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["target_modules"] == ["q_proj"]
    assert json.loads((out / "final" / "llm1" / "adapter_config.json").read_text())["r"] == 4
    assert "[[agents]]" in (out / "config.toml").read_text()
    assert invoke("eval", out, "--limit", 4).exit_code == 0  # loads each agent's own shape
    resumed = invoke("resume", out, "--quiet", "--set", "train.iterations=3")
    assert resumed.exit_code == 0, resumed.output
