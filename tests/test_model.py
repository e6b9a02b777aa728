"""Invariants of the shared-base design: one copy of the base, a frozen reference, updates that
touch only their own agent, role exchange that moves nothing, adapters that load in plain PEFT."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cory_lora.cory import Roles, play_episode, roles_at
from cory_lora.data import load_prompts
from cory_lora.model import load_agents
from cory_lora.rewards import load_reward
from cory_lora.train import stopping_for
from cory_lora.update import new_agent_state, ppo_update, score_rollout


def probe(agents):
    ids = agents.tokenizer(["12+7=19;", "hello 3+4="], padding=True, return_tensors="pt")
    return ids.input_ids, ids.attention_mask


def reference_logits(agents):
    ids, mask = probe(agents)
    with torch.no_grad(), agents.reference():
        return agents.forward(ids, mask, ids.shape[1])[0]


def agent_logits(agents, name):
    ids, mask = probe(agents)
    with torch.no_grad(), agents.use(name):
        return agents.forward(ids, mask, ids.shape[1])[0]


def snapshot(agents, name):
    return {k: v.detach().clone() for k, v in agents.adapter_state(name).items()}


def one_update(agents, recipe, name, seed=0):
    """A real rollout and PPO update of agent `name` (as pioneer, alone)."""
    prompts = load_prompts(recipe.data).take(list(range(recipe.ppo.batch_size)))
    roles = Roles(name, None)
    episode = play_episode(
        agents,
        roles,
        prompts,
        recipe,
        load_reward(recipe.reward.function),
        stopping_for(agents, recipe),
        torch.Generator().manual_seed(seed),
    )
    # a non-zero score so the policy gradient is not zero
    scores = episode.pioneer_rewards + torch.linspace(-1, 1, len(episode.pioneer_rewards))
    state = new_agent_state(agents, name, recipe.ppo)
    rollout = score_rollout(agents, name, episode.pioneer, scores, state, recipe.ppo, 1.0)
    return ppo_update(
        agents, name, state, rollout, recipe.ppo, 1.0, torch.Generator().manual_seed(seed)
    )


@pytest.fixture
def agents(tiny_recipe):
    recipe = tiny_recipe()
    return recipe, load_agents(recipe)


def test_agents_start_as_exact_copies_of_the_base(agents):
    _, a = agents
    ref = reference_logits(a)
    assert torch.equal(agent_logits(a, "llm1"), ref)
    assert torch.equal(agent_logits(a, "llm2"), ref)
    s1, s2 = snapshot(a, "llm1"), snapshot(a, "llm2")
    assert all(torch.equal(v, s2[k.replace(".llm1.", ".llm2.")]) for k, v in s1.items())


@pytest.mark.parametrize("four_bit", [False, True], ids=["fp32", "4bit"])
def test_no_second_copy_of_the_base(tiny_recipe, four_bit):
    cory = load_agents(tiny_recipe(model={"load_in_4bit": four_bit}))
    single = load_agents(tiny_recipe(model={"load_in_4bit": four_bit}, train={"algorithm": "ppo"}))
    storages = []
    with cory.use("llm1"):
        storages.append(cory.base_storages())
    with cory.use("llm2"):
        storages.append(cory.base_storages())
    with cory.reference():
        storages.append(cory.base_storages())
    assert storages[0] == storages[1] == storages[2]
    # The only memory CORY adds over single-agent PPO is one adapter and one value head.
    one_agent = sum(t.numel() * t.element_size() for t in cory.adapter_state("llm2").values())
    assert cory.parameter_bytes() - single.parameter_bytes() == one_agent
    if not four_bit:  # a 4-bit base of hidden size 64 is too small for a meaningful ratio
        assert cory.parameter_bytes() <= 1.05 * single.parameter_bytes()


def test_4bit_base_is_quantised_and_passes_gradients_on_cpu(tiny_recipe):
    import bitsandbytes as bnb

    a = load_agents(tiny_recipe(model={"load_in_4bit": True}))
    reference_logits(a)  # an eval-mode forward first: where bitsandbytes would repack weights
    layers = [m for m in a.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers, "load_in_4bit must give bitsandbytes 4-bit linear layers"
    for layer in layers:
        weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
        x = torch.randn(3, weight.shape[1], requires_grad=True)
        layer(x).sum().backward()
        assert x.grad is not None, "gradients must flow back through frozen 4-bit layers"
        assert torch.allclose(x.grad, torch.ones(3, weight.shape[0]) @ weight, atol=1e-4)


def test_ppo_step_changes_only_the_updated_agent_and_never_the_reference(agents):
    recipe, a = agents
    ref_before = reference_logits(a)
    base_before = {n: p.detach().clone() for n, p in a.model.named_parameters() if "lora_" not in n}
    llm1_before, llm2_before = snapshot(a, "llm1"), snapshot(a, "llm2")
    llm2_logits = agent_logits(a, "llm2")
    one_update(a, recipe, "llm1")
    llm1_after, llm2_after = snapshot(a, "llm1"), snapshot(a, "llm2")
    assert any(not torch.equal(llm1_before[k], llm1_after[k]) for k in llm1_before if "lora_B" in k)
    assert any(
        not torch.equal(llm1_before[k], llm1_after[k]) for k in llm1_before if "value_head" in k
    )
    assert all(torch.equal(llm2_before[k], llm2_after[k]) for k in llm2_before)
    assert torch.equal(agent_logits(a, "llm2"), llm2_logits)
    assert not torch.equal(agent_logits(a, "llm1"), llm2_logits)
    assert torch.equal(reference_logits(a), ref_before)
    for n, p in a.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n


def test_swapping_roles_twice_is_the_identity():
    roles = Roles("llm1", "llm2")
    assert roles.swapped() == Roles("llm2", "llm1")
    assert roles.swapped().swapped() == roles
    names = ("llm1", "llm2")
    for i in range(20):
        assert roles_at(i + 2 * 3, 3, names) == roles_at(i, 3, names)
    assert [roles_at(i, 2, names).pioneer for i in range(6)] == [
        "llm1",
        "llm1",
        "llm2",
        "llm2",
        "llm1",
        "llm1",
    ]
    assert roles_at(7, 1, ("llm1",)) == Roles("llm1", None)


def test_after_a_swap_the_pioneer_answers_as_the_observer_did(agents):
    recipe, a = agents
    one_update(a, recipe, "llm2")  # make the agents differ
    greedy = replace(recipe, generation=replace(recipe.generation, temperature=0.0))
    prompts = load_prompts(recipe.data).take(list(range(6)))
    reward, stop = load_reward("exact_match"), stopping_for(a, recipe)
    before = play_episode(
        a, Roles("llm1", "llm2"), prompts, greedy, reward, stop, torch.Generator()
    )
    after = play_episode(
        a, Roles("llm1", "llm2").swapped(), prompts, greedy, reward, stop, torch.Generator()
    )
    # the observer adapter of before, answering the pioneer prompt, is the pioneer of after
    observer_alone = play_episode(
        a, Roles("llm2", None), prompts, greedy, reward, stop, torch.Generator()
    )
    assert after.pioneer.texts == observer_alone.pioneer.texts
    assert before.pioneer.texts != after.pioneer.texts


def test_saved_adapters_load_with_plain_peft(agents, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    recipe, a = agents
    one_update(a, recipe, "llm1")
    a.save(tmp_path)
    for name in ("llm1", "llm2"):
        assert (tmp_path / name / "adapter_config.json").exists()
        assert (tmp_path / name / "value_head.safetensors").exists()
        base = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path)
        loaded = PeftModel.from_pretrained(base, str(tmp_path / name)).eval()
        ids, mask = probe(a)
        with torch.no_grad():
            logits = loaded(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()  # padded positions have no meaning
        assert torch.allclose(logits[real], agent_logits(a, name)[real], atol=1e-5)
