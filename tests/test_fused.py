"""Fused passes (train.fused): every agent's rows and the reference rows in one forward, each row
through its own adapter or none, compute what separate passes compute, up to float rounding;
an agent's update reaches its own adapter and value head only; our LoRA forward computes what
PEFT's does.

Tolerances, in float32: a fused batch differs from a separate one only in which rows share a
matmul (the BLAS may block a [32, K] product differently from a [8, K] one, changing summation
order) and in left padding (a padded row's attention sums over more, exactly-zero, terms). Each
is a rounding of ~1e-7 relative per op; over two layers and a sum over a few hundred tokens that
stays below 1e-5 relative, so 1e-4 leaves room and a wrong row, adapter or mask (errors of order
1) fails by far."""

from __future__ import annotations

from types import MethodType

import pytest
import torch

from cory_lora.algorithm.cory import Roles, roles_at
from cory_lora.algorithm.learner import Learner, learn
from cory_lora.algorithm.state import TrainerState
from cory_lora.algorithm.update import (
    AgentUpdate,
    ScoringJob,
    UpdateStats,
    forward_blocks,
    rollout_from,
    run_updates,
    score,
    sequences,
)
from cory_lora.engine.model import load_agents

from .conftest import tiny_recipe_dict
from .helpers import adapter_state, episode_of, invoke, read_jsonl, write_recipe

THREE = ("llm1", "llm2", "llm3")
CHAIN_OF_THREE = {"agents": 3, "swap_every": 1, "observer_template": "{query}{answers};{query}"}


def agents_of(tiny_recipe, dtype="float32", **sections):
    """The tiny model with distinct non-zero adapters (B = 0 at initialisation would make every
    agent the reference)."""
    recipe = tiny_recipe(model={"dtype": dtype}, **sections)
    agents = load_agents(recipe)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in agents.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return recipe, agents


def peft_forward_restored(agents):
    """Undo engine.lora.install: every LoRA layer back on PEFT's own forward."""
    for module in agents.model.modules():
        if hasattr(module, "_peft_forward"):
            module.forward = module._peft_forward
            del module._peft_forward


def logits_and_grads(agents, ids, mask):
    for p in agents.model.parameters():
        p.grad = None
    with agents.use("llm1"):
        logits = agents.model(input_ids=ids, attention_mask=mask).logits
        logits.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad.clone() for n, p in agents.model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_our_lora_forward_computes_what_pefts_does(tiny_recipe, dtype):
    recipe, agents = agents_of(tiny_recipe, dtype)
    episode = episode_of(agents, recipe, Roles("llm1", None), 8)
    ids, mask = sequences(episode.pioneer_generation)
    agents.model.train()  # LoRA dropout is 0 in the recipe: train mode changes nothing else
    ours, our_grads = logits_and_grads(agents, ids, mask)
    peft_forward_restored(agents)
    theirs, their_grads = logits_and_grads(agents, ids, mask)
    assert our_grads.keys() == their_grads.keys() and len(our_grads) == 8  # A, B x 2 layers x 2
    if dtype == "float32":  # the same ops, the scale (alpha / r = 2) exact inside the add
        assert torch.equal(ours, theirs)
        for name in our_grads:
            torch.testing.assert_close(our_grads[name], their_grads[name], rtol=1e-5, atol=1e-7)
    else:  # PEFT computes the LoRA branch in float32, ours in bfloat16 (8 bits of mantissa)
        assert (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max() < 0.05
        for name in our_grads:
            a, b = our_grads[name].float(), their_grads[name].float()
            assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0) > 0.99


def test_each_block_of_rows_goes_through_its_own_adapter(tiny_recipe):
    recipe, agents = agents_of(tiny_recipe, cory=CHAIN_OF_THREE)
    episode = episode_of(agents, recipe, roles_at(0, 1, agents.names), 8)
    narrow = sequences(episode.generation_of("llm1"))  # the pioneer's
    wide = sequences(episode.generation_of("llm3"))  # the last reader's, two answers wider
    assert wide[0].shape[1] > narrow[0].shape[1]
    keep = episode.generation_of("llm1").response_ids.shape[1] + 1
    parts = [("llm2", *wide), (None, *narrow), ("llm1", *narrow), ("llm3", *wide)]
    fused = forward_blocks(agents, [(name, ids, mask, keep) for name, ids, mask in parts])
    for (name, ids, mask), (logits, hidden) in zip(parts, fused, strict=True):
        with torch.no_grad(), agents.use(name) if name else agents.reference():
            alone_logits, alone_hidden = agents.forward(ids, mask, keep)
        torch.testing.assert_close(logits, alone_logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(hidden, alone_hidden, rtol=1e-4, atol=1e-5)


def test_fused_scoring_equals_scoring_each_agent_alone(tiny_recipe):
    recipe, agents = agents_of(tiny_recipe)
    episode = episode_of(agents, recipe, Roles("llm1", "llm2"), 8)
    jobs = [
        ScoringJob(name, episode.generation_of(name), 1.0, "k1", critic=True)
        for name in ("llm1", "llm2")
    ]
    fused = score(agents, jobs, micro_batch_size=4, fused=True)
    alone = score(agents, jobs, micro_batch_size=4, fused=False)
    for name in ("llm1", "llm2"):
        for field in ("logprobs", "ref_logprobs", "values", "kl"):
            a, b = getattr(fused[name], field), getattr(alone[name], field)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name} {field}")


def updates_of(recipe, agents, episode, state):
    """Both agents' PPO updates of one episode, started as the loop starts them."""
    jobs = [ScoringJob(n, episode.generation_of(n), 1.0, "k1", True) for n in agents.names]
    statistics = score(agents, jobs, recipe.ppo.micro_batch_size, fused=False)
    updates = []
    for k, name in enumerate(agents.names):
        scores = torch.linspace(-1, 1, 8) * (1 if k == 0 else -1)  # not zero, not the same
        generation = episode.generation_of(name)
        cfg = recipe.ppo_of(name).with_token_cap(episode.pioneer_width)
        agent = state.agent_states[name]
        rollout = rollout_from(statistics[name], generation, scores, agent, cfg)
        params = agents.trainable_parameters(name)
        rng = torch.Generator().manual_seed(k)
        updates.append(AgentUpdate.start(name, agent, rollout, cfg, 1.0, params, rng))
    return updates


def gradients_at_each_step(recipe, agents, episode, fused):
    """Every optimizer step's gradients of each agent, the optimizers not stepping (so the
    fused and separate passes see the same parameters throughout)."""
    state = TrainerState.fresh(recipe, agents, 8)
    updates = updates_of(recipe, agents, episode, state)
    seen = {u.name: [] for u in updates}
    for u in updates:

        def record(optimizer, *_, name=u.name, params=u.params):
            seen[name].append([p.grad.clone() for p in params])

        u.state.optimizer.step = MethodType(record, u.state.optimizer)
    run_updates(agents, updates, fused)
    return seen


def test_each_agents_fused_gradient_equals_its_separate_one(tiny_recipe):
    recipe, agents = agents_of(tiny_recipe, ppo={"epochs": 2})
    episode = episode_of(agents, recipe, Roles("llm1", "llm2"), 8)
    fused = gradients_at_each_step(recipe, agents, episode, fused=True)
    alone = gradients_at_each_step(recipe, agents, episode, fused=False)
    for name in ("llm1", "llm2"):
        assert len(fused[name]) == len(alone[name]) == 4  # 2 epochs x 8 / 4 per minibatch
        for step_fused, step_alone in zip(fused[name], alone[name], strict=True):
            assert any(g.abs().sum() > 0 for g in step_alone)
            for a, b in zip(step_fused, step_alone, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_fused_update_changes_only_the_agents_that_learn(tiny_recipe):
    recipe, agents = agents_of(tiny_recipe, cory=CHAIN_OF_THREE)
    episode = episode_of(agents, recipe, roles_at(0, 1, agents.names), 8)
    state = TrainerState.fresh(recipe, agents, 8)
    learners = [
        Learner(agents, name, recipe, state.agent_states[name], state.minibatch_rng)
        for name in ("llm1", "llm2")  # llm3 answered, but does not learn
    ]
    before = {n: {k: v.clone() for k, v in adapter_state(agents, n).items()} for n in THREE}
    scores = {
        "llm1": torch.linspace(-1, 1, 8),
        "llm2": torch.full((8,), float("nan")),  # skipped: it must stay as it was, too
    }
    outcomes = learn(learners, episode, scores, "test", fused=True)
    assert isinstance(outcomes["llm1"], UpdateStats)
    assert "NaN" in outcomes["llm2"].reason
    after = {n: adapter_state(agents, n) for n in THREE}
    assert any(not torch.equal(before["llm1"][k], after["llm1"][k]) for k in before["llm1"])
    for name in ("llm2", "llm3"):
        for key, value in before[name].items():
            assert torch.equal(value, after[name][key]), f"{name} {key} changed"


def _run(tmp_path, tiny_model_dir, arith_file, name, iterations, fused=True, **sections):
    raw = tiny_recipe_dict(
        tiny_model_dir,
        arith_file,
        train={"iterations": iterations, "checkpoint_every": 2, "fused": fused},
        **sections,
    )
    recipe = write_recipe(tmp_path / f"{name}.toml", raw)
    out = tmp_path / name
    result = invoke("run", recipe, "--output-dir", out, "--quiet")
    assert result.exit_code == 0, result.output
    return out


def final_adapters(run_dir, names):
    from safetensors.torch import load_file

    return {n: load_file(run_dir / "final" / n / "adapter_model.safetensors") for n in names}


def test_three_agents_fused_resume_bit_exact(tmp_path, tiny_model_dir, arith_file):
    whole = _run(tmp_path, tiny_model_dir, arith_file, "whole", 4, cory=CHAIN_OF_THREE)
    half = _run(tmp_path, tiny_model_dir, arith_file, "half", 2, cory=CHAIN_OF_THREE)
    assert invoke("resume", half, "--quiet", "--set", "train.iterations=4").exit_code == 0
    a, b = final_adapters(whole, THREE), final_adapters(half, THREE)
    for name in THREE:
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name])
    metrics = read_jsonl(whole / "metrics.jsonl")
    assert all(m[f"{n}/update_skipped"] == 0 for m in metrics for n in THREE)


def test_critic_free_cory_fused_learns_what_separate_passes_learn(
    tmp_path, tiny_model_dir, arith_file, monkeypatch
):
    (tmp_path / "length_reward.py").write_text(
        "def length(prompts, completions, **kw):\n    return [len(c) / 4 for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)  # a reward that varies, so that every update has a gradient
    keys = {
        "ppo": {"advantage": "rloo"},
        "generation": {"samples_per_query": 2, "temperature": 1.0, "top_k": 0},
        "reward": {"function": "length_reward:length"},
    }
    runs = {
        fused: read_jsonl(
            _run(tmp_path, tiny_model_dir, arith_file, f"f{fused}", 3, fused, **keys)
            / "metrics.jsonl"
        )
        for fused in (True, False)
    }
    for fused, alone in zip(runs[True], runs[False], strict=True):
        for agent in ("llm1", "llm2"):
            assert fused[f"{agent}/value_loss"] is None and fused[f"{agent}/grad_norm"] > 0
            for key in ("task_reward", "kl", "policy_loss", "grad_norm", "entropy"):
                a, b = fused[f"{agent}/{key}"], alone[f"{agent}/{key}"]
                assert a == pytest.approx(b, rel=1e-3, abs=1e-6), (agent, key)


def test_cast_adapter_weights_follow_every_change_of_their_float32_masters(tiny_recipe):
    """Without gradients (generation, scoring) a bfloat16 base reuses its cast copies of the
    float32 LoRA weights; an optimizer step, a load or a restore changes the masters in place,
    and the next forward must see it."""
    recipe, agents = agents_of(tiny_recipe, "bfloat16")
    episode = episode_of(agents, recipe, Roles("llm1", None), 4)
    ids, mask = sequences(episode.pioneer_generation)

    def logits():
        with torch.no_grad(), agents.use("llm1"):
            return agents.forward(ids, mask, 4)[0]

    before = logits()
    assert torch.equal(before, logits())  # the cached copies: the same values
    b = next(p for n, p in agents.model.named_parameters() if "lora_B.llm1" in n)
    with torch.no_grad():
        b.mul_(-1)  # in place, as an optimizer step or a restore writes
    after = logits()
    assert not torch.equal(before, after)
    peft_forward_restored(agents)  # PEFT's forward: no cache at all
    torch.testing.assert_close(after.float(), logits().float(), rtol=0.05, atol=0.05)
