"""model.dtype = "bfloat16" on CPU (AMX makes it ~2x faster than float32 here): the sampler still
decodes greedily as `generate` does, scoring stays within bfloat16's rounding of float32, and
an update moves the adapter the way the float32 update does."""

from __future__ import annotations

import torch

from cory_lora.algorithm.cory import Roles
from cory_lora.algorithm.state import new_agent_state
from cory_lora.algorithm.update import sequences

from .helpers import adapter_state, episode_of, make_rollout, ppo_update
from .test_generation import PROMPTS, hf_greedy, ours, same_tokens


def agents_in(tiny_recipe, dtype: str):
    from cory_lora.engine.model import load_agents

    recipe = tiny_recipe(model={"dtype": dtype})
    agents = load_agents(recipe)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the same non-zero adapter in both precisions
        for name, p in agents.model.named_parameters():
            if "lora_B.llm1" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return recipe, agents


def test_bfloat16_greedy_decoding_equals_generate_in_bfloat16(tiny_recipe):
    _, agents = agents_in(tiny_recipe, "bfloat16")
    assert next(agents.model.parameters()).dtype == torch.bfloat16
    tok = agents.tokenizer
    with agents.use("llm1"):
        expected = hf_greedy(agents.model, tok, PROMPTS, 12)
        got = ours(agents.model, tok, PROMPTS, max_new_tokens=12, temperature=0.0, batch_size=8)
    assert same_tokens(
        got.response_ids * got.response_mask,
        expected * (expected != tok.pad_token_id),
        tok.pad_token_id,
    )


def test_bfloat16_scoring_and_update_follow_float32(tiny_recipe):
    recipe, fp32 = agents_in(tiny_recipe, "float32")
    _, bf16 = agents_in(tiny_recipe, "bfloat16")
    episode = episode_of(fp32, recipe, Roles("llm1", None), recipe.ppo.batch_size, 0)
    generation = episode.pioneer_generation  # the same episodes scored in both precisions
    scores = torch.linspace(-1, 1, len(episode.pioneer_rewards))
    ids, mask = sequences(generation)
    width = generation.response_ids.shape[1] + 1
    with torch.no_grad(), fp32.use("llm1"), bf16.use("llm1"):
        full = fp32.forward(ids, mask, width)[0].float().log_softmax(-1)
        half = bf16.forward(ids, mask, width)[0].float().log_softmax(-1)
    # bfloat16 keeps 8 bits of mantissa: ~0.4% of each value, summed over 2 small layers
    assert (half - full).abs().max() < 0.05
    moved = {}
    for name, agents in (("float32", fp32), ("bfloat16", bf16)):
        before = {k: v.float().clone() for k, v in adapter_state(agents, "llm1").items()}
        state = new_agent_state(agents, "llm1", recipe)
        rollout = make_rollout(agents, "llm1", generation, scores, state, recipe.ppo, 1.0)
        assert all(torch.isfinite(t).all() for t in (rollout.logprobs, rollout.advantages))
        ppo_update(agents, "llm1", state, rollout, recipe.ppo, 1.0, torch.Generator())
        after = adapter_state(agents, "llm1")
        moved[name] = torch.cat([(after[k].float() - before[k]).flatten() for k in before])
    assert moved["bfloat16"].abs().sum() > 0
    cosine = torch.nn.functional.cosine_similarity(moved["float32"], moved["bfloat16"], dim=0)
    assert cosine > 0.95, float(cosine)
