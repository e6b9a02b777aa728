"""The official code's settings and the paper's ablations, as recipe keys: the KL controller
follows the penalty's own KL, a per-iteration response length, restarts at a role exchange, the
ratio guard, no knowledge transfer, no role exchange, and Elastic Reset (checkpointed)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from cory_lora.algorithm import ppo
from cory_lora.algorithm.cory import Roles, draw_response_length, exchanges_roles_at, roles_at
from cory_lora.algorithm.elastic import AdapterEMA
from cory_lora.algorithm.state import new_agent_state
from cory_lora.config import recipe_from_dict
from cory_lora.engine.model import load_agents
from cory_lora.errors import ConfigError

from .conftest import tiny_recipe_dict
from .helpers import (
    episode_of,
    invoke,
    learn_alone,
    make_rollout,
    ppo_update,
    read_jsonl,
    write_recipe,
)


@pytest.mark.parametrize("estimator", ["full", "k3"])
def test_kl_controller_follows_the_kl_the_penalty_uses(tiny_recipe, estimator):
    recipe = tiny_recipe(
        ppo={"kl_estimator": estimator, "adaptive_kl": True, "kl_target": 0.01, "kl_horizon": 8},
        train={"algorithm": "ppo"},
    )
    agents = load_agents(recipe)
    with torch.no_grad():  # move llm1 away from the reference so that its KL is not zero
        for p in agents.lora_parameters("llm1"):
            p.add_(0.3 * torch.randn_like(p))
    episode = episode_of(agents, recipe, Roles("llm1", None), 8)
    state = new_agent_state(agents, "llm1", recipe)
    scores = episode.pioneer_rewards
    rollout = make_rollout(
        agents, "llm1", episode.pioneer_generation, scores, state, recipe.ppo, 1.0
    )
    penalty_kl = float((rollout.kl * rollout.mask).sum(1).mean())
    k1 = float(rollout.sequence_kl.mean())
    assert not math.isclose(penalty_kl, k1, rel_tol=1e-3)  # the two differ for this estimator
    expected = ppo.KLController(0.2, True, 0.01, 8)
    expected.update(penalty_kl, 8)
    outcome = learn_alone(
        agents, "llm1", recipe, state, episode, scores, torch.Generator().manual_seed(0)
    )
    assert math.isclose(outcome.kl_penalty, penalty_kl, rel_tol=1e-6)
    assert math.isclose(outcome.kl, k1, rel_tol=1e-6)
    assert math.isclose(state.kl_ctl.value, expected.value, rel_tol=1e-9)


def test_response_length_is_drawn_once_per_iteration_for_both_roles(tiny_recipe):
    recipe = tiny_recipe(generation={"max_new_tokens": 6, "length_range": [2, 5], "stop": []})
    drawn = [
        draw_response_length(recipe.generation, g)
        for g in [torch.Generator().manual_seed(s) for s in range(40)]
    ]
    assert set(drawn) == {2, 3, 4}  # [lo, hi): hi is exclusive
    agents = load_agents(recipe)
    generator = torch.Generator().manual_seed(3)
    n = draw_response_length(recipe.generation, generator)
    generation = recipe.generation.model_copy(update={"max_new_tokens": n})
    this_iteration = recipe.model_copy(update={"generation": generation})
    episode = episode_of(agents, this_iteration, Roles("llm1", "llm2"), 8)
    for generation in (episode.pioneer_generation, episode.observer_generation):
        assert int(generation.response_mask.sum(1).max()) <= n
    # without a range nothing is drawn: the sampling generator is untouched
    plain = tiny_recipe()
    g = torch.Generator().manual_seed(5)
    assert draw_response_length(plain.generation, g) is None
    assert torch.equal(g.get_state(), torch.Generator().manual_seed(5).get_state())


def test_length_range_must_lie_within_max_new_tokens():
    raw = tiny_recipe_dict(
        "m", "d.jsonl", generation={"max_new_tokens": 8, "length_range": [4, 16]}
    )
    with pytest.raises(ConfigError, match=r"generation.length_range = \[4, 16\]"):
        recipe_from_dict(raw)


def test_roles_never_exchange_with_swap_every_zero():
    names = ("llm1", "llm2")
    assert {roles_at(i, 0, names) for i in range(50)} == {Roles("llm1", "llm2")}
    assert not any(exchanges_roles_at(i, 0) for i in range(50))
    assert [i for i in range(12) if exchanges_roles_at(i, 5)] == [5, 10]


def test_restart_clears_optimizer_kl_coefficient_and_score_statistics(tiny_recipe):
    recipe = tiny_recipe(ppo={"score_scaling": True})
    agents = load_agents(recipe)
    state = new_agent_state(agents, "llm1", recipe)
    params = agents.trainable_parameters("llm1")
    sum(p.sum() for p in params).backward()
    state.optimizer.step()
    state.kl_ctl.value = 0.7
    state.score_moments.update(torch.tensor([1.0, 5.0]))
    assert state.optimizer.state
    state.restart(recipe.ppo)
    assert not state.optimizer.state
    assert state.kl_ctl.value == recipe.ppo.init_kl_coef
    assert state.score_moments.count < 1e-20


def test_without_transfer_the_observer_answers_the_plain_query(tiny_recipe):
    agents = load_agents(tiny_recipe())
    with_transfer = episode_of(agents, tiny_recipe(), Roles("llm1", "llm2"), 8)
    assert with_transfer.observer_prompts != with_transfer.pioneer_prompts
    without = episode_of(agents, tiny_recipe(cory={"transfer": False}), Roles("llm1", "llm2"), 8)
    assert without.observer_prompts == without.pioneer_prompts


def test_ratio_guard_zeroes_a_diverged_micro_batch(tiny_recipe):
    recipe = tiny_recipe(train={"algorithm": "ppo"}, ppo={"ratio_threshold": 10.0})
    agents = load_agents(recipe)
    episode = episode_of(agents, recipe, Roles("llm1", None), 8)
    state = new_agent_state(agents, "llm1", recipe)
    scores = episode.pioneer_rewards + torch.linspace(-1, 1, 8)
    rollout = make_rollout(
        agents, "llm1", episode.pioneer_generation, scores, state, recipe.ppo, 1.0
    )
    # old logprobs far below the current ones: every ratio is e^5 > 10
    diverged = rollout.__class__(**{**rollout.__dict__, "logprobs": rollout.logprobs - 5.0})
    before = [p.detach().clone() for p in agents.trainable_parameters("llm1")]
    stats = ppo_update(agents, "llm1", state, diverged, recipe.ppo, 1.0, torch.Generator())
    assert stats["ratio_skipped"] == 1.0
    after = agents.trainable_parameters("llm1")
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # the same rollout as it was: nothing skipped, the agent learns
    stats = ppo_update(agents, "llm1", state, rollout, recipe.ppo, 1.0, torch.Generator())
    assert stats["ratio_skipped"] == 0.0


def test_adapter_ema_update_and_reset_by_hand():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = AdapterEMA([p], decay=0.9)
    with torch.no_grad():
        p.copy_(torch.tensor([3.0, 4.0]))
    ema.update()  # 0.9 * [1, 2] + 0.1 * [3, 4] = [1.2, 2.2]
    assert torch.allclose(ema.average[0], torch.tensor([1.2, 2.2]))
    ema.reset()  # adapter <- EMA, EMA <- initial
    assert torch.allclose(p, torch.tensor([1.2, 2.2]))
    assert torch.equal(ema.average[0], torch.tensor([1.0, 2.0]))


def test_elastic_reset_is_checkpointed_and_resumes_bit_identically(
    tmp_path, tiny_model_dir, arith_file
):
    """Extending a finished run from its checkpoint equals one straight run: the EMA is saved."""
    raw = tiny_recipe_dict(
        tiny_model_dir,
        arith_file,
        reset={"every": 2, "ema_decay": 0.5},
        train={"iterations": 4, "checkpoint_every": 1, "keep_checkpoints": 10},
    )
    recipe = write_recipe(tmp_path / "recipe.toml", raw)
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    assert invoke("run", recipe, "--output-dir", straight, "--quiet").exit_code == 0
    short = ["--set", "train.iterations=3"]
    assert invoke("run", recipe, *short, "--output-dir", extended, "--quiet").exit_code == 0
    assert (extended / "checkpoints" / "iter-000003" / "ema-llm1.safetensors").is_file()
    assert invoke("resume", extended, "--set", "train.iterations=4", "--quiet").exit_code == 0
    for name in ("llm1", "llm2"):
        a = load_file(straight / "final" / name / "adapter_model.safetensors")
        b = load_file(extended / "final" / name / "adapter_model.safetensors")
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(read_jsonl(straight / "metrics.jsonl")) == strip(
        read_jsonl(extended / "metrics.jsonl")
    )
    # at iteration 2 the EMA was reset to the initial adapter, which training had left
    initial = [p.detach() for p in load_agents(recipe_from_dict(raw)).lora_parameters("llm1")]
    ema = load_file(straight / "checkpoints" / "iter-000002" / "ema-llm1.safetensors")
    assert all(ema[f"average.{i}"].equal(t) for i, t in enumerate(initial))
    trained = load_file(straight / "checkpoints" / "iter-000001" / "ema-llm1.safetensors")
    assert not all(trained[f"average.{i}"].equal(t) for i, t in enumerate(initial))
