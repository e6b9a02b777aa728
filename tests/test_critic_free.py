"""Critic-free advantages (ppo.advantage = rloo | grpo, generation.samples_per_query = G): the
maths by hand and against TRL's trainers' formulas, no value head anywhere, KL in the reward or
in the loss, CORY with groups, resume, and 2 ranks equal 1 rank."""

from __future__ import annotations

import math

import pytest
import torch

from cory_lora.algorithm import ppo
from cory_lora.config import ConfigError
from cory_lora.engine.model import load_agents

from .conftest import tiny_recipe_dict
from .helpers import ROOT, invoke, read_jsonl, write_recipe

TRAINED = ROOT / "assets" / "tiny-arith"

CRITIC_FREE = {"advantage": "rloo"}
GROUPS = {"samples_per_query": 2}


def test_group_advantages_by_hand():
    scores = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    rloo = ppo.group_advantages(scores, 4, "rloo")
    # group 1: mean of the 3 others is 2/3 for a 0 and 1/3 for a 1
    expected = [-2 / 3, 2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0]
    assert rloo.tolist() == pytest.approx(expected)
    grpo = ppo.group_advantages(scores, 4, "grpo")
    # group 1: mean 1/2, unbiased std sqrt(1/3); group 2: mean 3/4, std 1/2
    s1, s2 = math.sqrt(1 / 3) + 1e-4, 0.5 + 1e-4
    expected = [-0.5 / s1, 0.5 / s1, -0.5 / s1, 0.5 / s1, 0.25 / s2, 0.25 / s2, 0.25 / s2]
    assert grpo.tolist()[:7] == pytest.approx(expected)
    assert grpo[7] == pytest.approx(-0.75 / s2)
    with pytest.raises(ValueError):
        ppo.group_advantages(scores, 3, "rloo")


def test_group_advantages_follow_trl_trainers_formulas():
    """The formulas of trl/trainer/rloo_trainer.py (`_generate_and_score_completions`: baseline =
    (grouped sum - reward) / (count - 1), advantage = reward - baseline) and
    trl/trainer/grpo_trainer.py (scale_rewards = "group": (reward - group mean) / (group nanstd
    + 1e-4)), TRL 1.16, written out here on random scores; nanstd is TRL's own."""
    from trl.trainer.utils import nanstd

    torch.manual_seed(0)
    scores, group = torch.randn(24), 6
    grouped = scores.view(-1, group)
    baselines = (grouped.sum(1, keepdim=True) - grouped) / (group - 1)
    trl_rloo = (grouped - baselines).reshape(-1)
    mean = grouped.mean(1).repeat_interleave(group)
    std = nanstd(grouped, dim=1).repeat_interleave(group)
    trl_grpo = (scores - mean) / (std + 1e-4)
    assert torch.allclose(ppo.group_advantages(scores, group, "rloo"), trl_rloo, atol=1e-6)
    assert torch.allclose(ppo.group_advantages(scores, group, "grpo"), trl_grpo, atol=1e-6)


def test_kl_loss_is_grpos_k3_term():
    """trl/trainer/grpo_trainer.py: per_token_kl = exp(ref - logp) - (ref - logp) - 1."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -2.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    d = torch.tensor([-0.5, 0.0])
    expected = float((torch.exp(d) - d - 1).sum() / 4)
    assert float(ppo.kl_loss(logp, ref, mask, 4)) == pytest.approx(expected)
    assert float(ppo.kl_loss(logp, logp, mask, 4)) == 0.0


def test_recipe_checks(tiny_recipe):
    with pytest.raises(ConfigError, match=r"needs generation.samples_per_query >= 2"):
        tiny_recipe(ppo=CRITIC_FREE)
    with pytest.raises(ConfigError, match=r"ppo.kl_in = 'loss' is for the critic-free"):
        tiny_recipe(ppo={"kl_in": "loss"})
    with pytest.raises(ConfigError, match=r"x generation.samples_per_query = 3 = 24 episodes"):
        tiny_recipe(ppo={**CRITIC_FREE, "minibatch_size": 16}, generation={"samples_per_query": 3})


def test_no_value_head_is_created_trained_or_saved(tiny_recipe):
    gae = load_agents(tiny_recipe())
    free = load_agents(tiny_recipe(ppo=CRITIC_FREE, generation=GROUPS))
    assert len(free.value_heads) == 0
    head = sum(p.numel() for p in gae.value_heads["llm1"].parameters())
    assert head > 0
    n = lambda agents: sum(p.numel() for p in agents.trainable_parameters("llm1"))  # noqa: E731
    assert n(gae) - n(free) == head


def _run(tmp_path, arith_file, name, ppo_keys, iterations=3, *extra):
    """A short run of the shipped tiny model that half-knows addition: its answers' rewards vary
    within a group, so critic-free advantages are not all 0."""
    recipe = write_recipe(
        tmp_path / f"{name}.toml",
        tiny_recipe_dict(
            TRAINED,
            arith_file,
            ppo=ppo_keys,
            generation=GROUPS,
            train={"iterations": iterations, "checkpoint_every": 2},
        ),
    )
    out = tmp_path / name
    result = invoke("run", recipe, "--output-dir", out, "--quiet", *extra)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize(
    "ppo_keys",
    [{"advantage": "rloo"}, {"advantage": "grpo", "kl_in": "loss"}],
    ids=["cory-rloo", "cory-grpo-kl-loss"],
)
def test_cory_critic_free_runs_end_to_end(tmp_path, arith_file, ppo_keys):
    out = _run(tmp_path, arith_file, "run", ppo_keys)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        for agent in ("llm1", "llm2"):
            assert m[f"{agent}/value_loss"] is None
            assert m[f"{agent}/update_skipped"] == 0
            kl_loss = m[f"{agent}/kl_loss"]
            assert kl_loss == 0.0 if ppo_keys.get("kl_in") != "loss" else kl_loss >= 0.0
    if ppo_keys.get("kl_in") == "loss":  # the policy has moved from the reference by then
        assert metrics[-1]["llm1/kl_loss"] > 0
    # every query answered twice by the pioneer, each answer read by the observer: 8 x 2 rows
    samples = read_jsonl(out / "samples.jsonl")
    assert samples[0]["query"] == samples[1]["query"]
    for agent in ("llm1", "llm2"):
        files = {p.name for p in (out / "final" / agent).iterdir()}
        assert "adapter_model.safetensors" in files and "value_head.safetensors" not in files
    exported = tmp_path / "export"
    assert invoke("export", out, "--agent", "llm2", "-o", exported).exit_code == 0
    assert "no value head" in (exported / "README.md").read_text()


def test_critic_free_run_resumes_to_the_same_adapters(tmp_path, arith_file):
    whole = _run(tmp_path, arith_file, "whole", CRITIC_FREE, 4)
    half = _run(tmp_path, arith_file, "half", CRITIC_FREE, 2)
    result = invoke("resume", half, "--quiet", "--set", "train.iterations=4")
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    for agent in ("llm1", "llm2"):
        a = load_file(whole / "final" / agent / "adapter_model.safetensors")
        b = load_file(half / "final" / agent / "adapter_model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a)
