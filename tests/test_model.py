"""Invariants of the shared-base design: one copy of the base, a frozen reference, updates that
touch only their own agent, role exchange that moves nothing, adapters that load in plain PEFT."""

from __future__ import annotations

import pytest
import torch

from cory_lora.algorithm.cory import Roles, play_episode, roles_at
from cory_lora.algorithm.state import new_agent_state
from cory_lora.config import greedy
from cory_lora.engine.data import encode_prompts, format_prompt, load_prompts
from cory_lora.engine.model import load_agents
from cory_lora.rewards import load_reward

from .helpers import adapter_state, episode_of, make_rollout, parameter_bytes, ppo_update


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
    return {k: v.detach().clone() for k, v in adapter_state(agents, name).items()}


def one_update(agents, recipe, name, seed=0):
    """A real rollout and PPO update of agent `name` (as pioneer, alone)."""
    episode = episode_of(agents, recipe, Roles(name, None), recipe.ppo.batch_size, seed)
    # a non-zero score so the policy gradient is not zero
    scores = episode.pioneer_rewards + torch.linspace(-1, 1, len(episode.pioneer_rewards))
    state = new_agent_state(agents, name, recipe)
    rollout = make_rollout(agents, name, episode.pioneer_generation, scores, state, recipe.ppo, 1.0)
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


def base_weights_used(agents, context) -> list[int]:
    """Storage addresses of the frozen base weights that a forward pass under `context` reads,
    recorded by hooks on every module that holds a base weight."""
    used, hooks = [], []
    for name, module in agents.model.named_modules():
        weight = getattr(module, "weight", None)
        own = module._parameters.get("weight") is not None
        if own and "lora_" not in name and isinstance(weight, torch.Tensor):
            hooks.append(
                module.register_forward_pre_hook(
                    lambda m, _: used.append(m.weight.untyped_storage().data_ptr())
                )
            )
    ids, mask = probe(agents)
    try:
        with torch.no_grad(), context:
            agents.forward(ids, mask, 1)
    finally:
        for hook in hooks:
            hook.remove()
    return used


@pytest.mark.parametrize("four_bit", [False, True], ids=["fp32", "4bit"])
def test_no_second_copy_of_the_base(tiny_recipe, four_bit):
    cory = load_agents(tiny_recipe(model={"load_in_4bit": four_bit}))
    single = load_agents(tiny_recipe(model={"load_in_4bit": four_bit}, train={"algorithm": "ppo"}))
    # Every agent and the reference read the very same base weights, in the same order.
    as_llm1 = base_weights_used(cory, cory.use("llm1"))
    assert len(as_llm1) == len(set(as_llm1)) > 0
    assert base_weights_used(cory, cory.use("llm2")) == as_llm1
    assert base_weights_used(cory, cory.reference()) == as_llm1
    # The only memory CORY adds over single-agent PPO is one adapter and one value head.
    one_agent = sum(t.numel() * t.element_size() for t in adapter_state(cory, "llm2").values())
    assert parameter_bytes(cory) - parameter_bytes(single) == one_agent


@pytest.mark.parametrize("advantage", ["gae", "rloo"])
def test_each_extra_agent_adds_one_adapter_and_nothing_else(tiny_recipe, advantage):
    """To the byte: agent k + 1 adds its adapter, and its value head only when the advantage
    needs one (N = 1 -> 2 -> 3, 4-bit)."""
    keys = {"ppo": {"advantage": advantage}, "generation": {"samples_per_query": 2}}
    one = load_agents(tiny_recipe(model={"load_in_4bit": True}, train={"algorithm": "ppo"}, **keys))
    two = load_agents(tiny_recipe(model={"load_in_4bit": True}, **keys))
    three = load_agents(tiny_recipe(model={"load_in_4bit": True}, cory={"agents": 3}, **keys))

    def agent_bytes(agents, name):
        return sum(t.numel() * t.element_size() for t in adapter_state(agents, name).values())

    head = sum(p.numel() * p.element_size() for p in two.value_heads.parameters()) // 2
    assert (head > 0) == (advantage == "gae")
    adapter = agent_bytes(two, "llm2") - head
    assert adapter > 0
    assert parameter_bytes(two) - parameter_bytes(one) == adapter + head
    assert parameter_bytes(three) - parameter_bytes(two) == adapter + head


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
    assert roles.rotated(1) == Roles("llm2", "llm1")
    assert roles.rotated(1).rotated(1) == roles
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


def greedy_answers(agents, name, texts, recipe) -> list[str]:
    """`transformers` greedy `generate` with adapter `name` set directly in PEFT: a path
    independent of play_episode and our sampler."""
    tokenizer = agents.tokenizer
    ids, _ = encode_prompts(tokenizer, texts, recipe.data.max_prompt_tokens)
    answers = []
    agents.model.set_adapter(name)
    for row in ids:
        with torch.no_grad():
            out = agents.model.generate(
                input_ids=torch.tensor([row]),
                attention_mask=torch.ones(1, len(row), dtype=torch.long),
                max_new_tokens=recipe.generation.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                stop_strings=list(recipe.generation.stop),
                tokenizer=tokenizer,
            )
        text = tokenizer.decode(out[0, len(row) :], skip_special_tokens=True)
        answers.append(text.split(recipe.generation.stop[0])[0])
    agents.model.set_adapter("llm1")
    return answers


def test_after_a_swap_each_role_is_played_by_the_other_adapter(agents):
    recipe, a = agents
    one_update(a, recipe, "llm2")  # make the agents differ
    recipe = greedy(recipe)
    prompts = load_prompts(recipe.data).take(list(range(6)))
    reward, stop = load_reward("exact_match"), a.stopping(recipe.generation.stop)
    roles = Roles("llm1", "llm2")
    for pioneer, observer in (("llm1", "llm2"), ("llm2", "llm1")):
        episode = play_episode(a, roles, prompts, recipe, reward, stop, torch.Generator())
        assert (episode.roles.pioneer, episode.roles.observer) == (pioneer, observer)
        # the pioneer's answers are those of the pioneer adapter, the observer's those of the
        # observer adapter reading the pioneer's answers
        assert episode.pioneer_generation.texts == greedy_answers(
            a, pioneer, episode.pioneer_prompts, recipe
        )
        observer_prompts = [
            format_prompt(
                recipe.data.prompt_template,
                recipe.cory.observer_template.format(query=q, pioneer=answer),
                {},
            )
            for q, answer in zip(prompts.queries, episode.pioneer_generation.texts, strict=True)
        ]
        assert episode.observer_prompts == observer_prompts
        assert episode.observer_generation.texts == greedy_answers(
            a, observer, observer_prompts, recipe
        )
        roles = roles.rotated(1)
    # the agents differ, so the exchange is visible in the answers
    assert greedy_answers(a, "llm1", episode.pioneer_prompts, recipe) != greedy_answers(
        a, "llm2", episode.pioneer_prompts, recipe
    )


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


def record_forward_rows(agents) -> set[tuple[bool, int]]:
    """From now on, each `agents.forward` call adds (gradients on, rows) to the returned set."""
    seen, forward = set(), agents.forward

    def recording(ids, *args, **kwargs):
        seen.add((torch.is_grad_enabled(), len(ids)))
        return forward(ids, *args, **kwargs)

    agents.forward = recording
    return seen


def test_micro_batch_tokens_cuts_long_sequences_into_fewer_rows_and_changes_no_update(tiny_recipe):
    from cory_lora.config import PPOConfig

    def rows(tokens, width):
        return PPOConfig(micro_batch_size=8, micro_batch_tokens=tokens).micro_batch_rows(width)

    assert rows(0, 62) == 8  # off: micro_batch_size rows
    assert rows(248, 31) == 8  # the pioneer's width: the cap is not reached
    assert rows(248, 62) == 4  # twice as wide (the observer's): half the rows
    assert rows(10, 62) == 1  # never fewer than one row
    auto = PPOConfig(micro_batch_size=8)  # the default: the pioneer's micro-batch is the cap
    assert auto.micro_batch_tokens == "auto" and auto.micro_batch_rows(62) == 8
    assert auto.with_token_cap(31).micro_batch_tokens == 248
    assert auto.with_token_cap(31).micro_batch_rows(31) == 8
    assert auto.with_token_cap(31).micro_batch_rows(62) == 4
    assert PPOConfig(micro_batch_tokens=0).with_token_cap(31).micro_batch_rows(62) == 8
    after, rows_seen = {}, {}
    for tokens in (0, 1):  # 1: one row per micro-batch, 2 x the micro-batches of the recipe's
        recipe = tiny_recipe(ppo={"micro_batch_tokens": tokens})
        a = load_agents(recipe)
        seen = record_forward_rows(a)
        one_update(a, recipe, "llm1")
        after[tokens], rows_seen[tokens] = snapshot(a, "llm1"), seen
    # the cap binds the update (with gradients) only: scoring runs micro_batch_size rows always
    assert rows_seen == {0: {(False, 2), (True, 2)}, 1: {(False, 2), (True, 1)}}
    assert any(
        not torch.equal(v, torch.zeros_like(v)) for k, v in after[0].items() if "lora_B" in k
    )
    for key, value in after[0].items():
        assert torch.allclose(after[1][key], value, atol=1e-6), key


def test_the_lm_head_gets_a_contiguous_input_where_few_positions_are_kept(agents):
    """Scoring and the sampler's prompt pass keep the last few positions (`logits_to_keep`): a
    strided view, for which CPU linear copies the head weight once per row (52x slower in bf16 on
    SmolLM2). The head must see a contiguous input, and the kept logits must be the full pass's."""
    from cory_lora.config import GenerationConfig
    from cory_lora.engine.generation import Stopping, generate

    _, agents = agents
    seen: list[bool] = []
    hook = agents.model.get_output_embeddings().register_forward_hook(
        lambda _, args, __: seen.append(args[0].is_contiguous())
    )
    ids, mask = probe(agents)
    try:
        with torch.no_grad(), agents.use("llm1"):
            kept, _ = agents.forward(ids, mask, 3)
            full, _ = agents.forward(ids, mask, ids.shape[1])
            prompts = [ids[0].tolist(), ids[1][mask[1].bool()].tolist()]
            cfg = GenerationConfig(max_new_tokens=1, temperature=0.0)
            generate(agents.model, agents.tokenizer, prompts, cfg, Stopping((0,)), None)
    finally:
        hook.remove()
    assert seen == [True, True, True]
    assert torch.allclose(kept, full[:, -3:], atol=1e-6)
