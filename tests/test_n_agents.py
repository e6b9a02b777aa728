"""N-agent chains (cory.agents = N): rotation of positions, the chain's prompts, scores with the
others' rewards summed or averaged, and a 3-agent run end to end (metrics, final adapters,
resume, eval rows, plot)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cory_lora.algorithm.cory import Episode, Roles, roles_at
from cory_lora.config import ConfigError
from cory_lora.engine.data import PromptSet
from cory_lora.engine.model import load_agents

from .conftest import tiny_recipe_dict
from .helpers import episode_of, invoke, read_jsonl, write_recipe

THREE = ("llm1", "llm2", "llm3")


def test_positions_rotate_so_every_agent_plays_every_position():
    orders = [roles_at(i, 2, THREE).order for i in range(7)]
    assert orders == [
        THREE,
        THREE,
        ("llm2", "llm3", "llm1"),
        ("llm2", "llm3", "llm1"),
        ("llm3", "llm1", "llm2"),
        ("llm3", "llm1", "llm2"),
        THREE,
    ]
    assert {roles_at(i, 0, THREE) for i in range(9)} == {Roles(*THREE)}
    # two agents: rotating by one is the paper's role exchange
    assert roles_at(1, 1, ("llm1", "llm2")) == Roles("llm2", "llm1")


def _episode(rewards: list[list[float]]) -> Episode:
    n = len(rewards)
    return Episode(
        Roles(*THREE[:n]),
        PromptSet(["q"] * len(rewards[0]), {}),
        [[]] * n,
        [None] * n,
        [torch.tensor(r) for r in rewards],
        0,
    )


def test_scores_by_hand():
    episode = _episode([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # positions 1, 2, 3
    total = episode.scores(1.0, 1.0, "sum")
    assert [total[n].tolist() for n in THREE] == [[2.0, 2.0]] * 3  # the team's total, for all
    mean = episode.scores(1.0, 1.0, "mean")
    assert mean["llm1"].tolist() == [1.5, 1.0]  # own + (0 + 1) / 2, own + (1 + 1) / 2
    assert mean["llm3"].tolist() == [1.5, 1.5]
    selfish = episode.scores(1.0, 0.0, "sum")
    assert selfish["llm2"].tolist() == [0.0, 1.0]
    pair = _episode([[1.0, 0.0], [0.25, 1.0]])
    assert (
        pair.scores(1.0, 1.0, "sum")["llm1"].tolist()
        == pair.scores(1.0, 1.0, "mean")["llm1"].tolist()
    )  # the same for two agents


def test_each_position_reads_the_earlier_answers(tiny_recipe):
    recipe = tiny_recipe(
        cory={
            "agents": 3,
            "observer_template": "{query}[{answers}][{pioneer}];{query}",
            "answer_separator": "|",
        },
        generation={"temperature": 0.0},
    )
    agents = load_agents(recipe)
    episode = episode_of(agents, recipe, Roles(*THREE), 4)
    queries = episode.prompts.queries
    first, second = (g.texts for g in episode.generations[:2])
    assert episode.chain_prompts[0] == list(queries)
    assert episode.chain_prompts[1] == [
        f"{q}[{a}][{a}];{q}" for q, a in zip(queries, first, strict=True)
    ]
    assert episode.chain_prompts[2] == [
        f"{q}[{a}|{b}][{b}];{q}" for q, a, b in zip(queries, first, second, strict=True)
    ]
    assert episode.observer_generation is episode.generations[2]


def test_recipe_checks(tiny_recipe):
    assert tiny_recipe(cory={"agents": 3}).agent_names == THREE
    assert tiny_recipe(cory={"agents": 3}, train={"algorithm": "ppo"}).agent_names == ("llm1",)
    with pytest.raises(ConfigError, match=r"cory.agents = 1: must be >= 2"):
        tiny_recipe(cory={"agents": 1})
    with pytest.raises(ConfigError, match=r"must contain \{pioneer\} or \{answers\}"):
        tiny_recipe(cory={"observer_template": "{query};"})
    tiny_recipe(cory={"observer_template": "{answers};{query}"})  # {answers} alone will do


def _run(tmp_path, tiny_model_dir, arith_file, name, iterations, *extra):
    recipe = write_recipe(
        tmp_path / f"{name}.toml",
        tiny_recipe_dict(
            tiny_model_dir,
            arith_file,
            cory={"agents": 3, "swap_every": 1, "observer_template": "{query}{answers};{query}"},
            data={"eval_holdout": 4},
            train={"iterations": iterations, "checkpoint_every": 2},
        ),
    )
    out = tmp_path / name
    result = invoke("run", recipe, "--output-dir", out, "--quiet", *extra)
    assert result.exit_code == 0, result.output
    return out


def test_three_agents_end_to_end(tmp_path, tiny_model_dir, arith_file):
    whole = _run(tmp_path, tiny_model_dir, arith_file, "whole", 4)
    metrics = read_jsonl(whole / "metrics.jsonl")
    assert [[m[f"{n}/position"] for n in THREE] for m in metrics] == [
        [1, 2, 3],
        [3, 1, 2],
        [2, 3, 1],
        [1, 2, 3],
    ]
    assert metrics[0]["llm3/role"] == "observer" and metrics[1]["llm2/role"] == "pioneer"
    assert "middle" in read_jsonl(whole / "samples.jsonl")[0]
    assert sorted(p.name for p in (whole / "final").iterdir() if p.is_dir()) == list(THREE)
    # resumed half-way, the same agents
    half = _run(tmp_path, tiny_model_dir, arith_file, "half", 2)
    assert invoke("resume", half, "--quiet", "--set", "train.iterations=4").exit_code == 0
    for name in THREE:
        a = load_file(whole / "final" / name / "adapter_model.safetensors")
        b = load_file(half / "final" / name / "adapter_model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a)
    # eval: each agent alone, the chain in its three orders, and the base
    assert invoke("eval", whole, "--limit", 4).exit_code == 0
    rows = [row["name"] for row in json.loads((whole / "eval.json").read_text())["rows"]]
    assert rows == [
        *THREE,
        "llm1→llm2→llm3",
        "llm2→llm3→llm1",
        "llm3→llm1→llm2",
        "base",
    ]
    assert invoke("plot", whole, "-o", tmp_path / "three.png").exit_code == 0
