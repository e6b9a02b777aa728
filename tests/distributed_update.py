"""Run by tests/test_distributed.py, in one process or under `torchrun --nproc-per-node K`: two
iterations of llm1's update (`learner.learn`, unfused) on the same 8 episodes, each rank given its
share. Rank 0 writes the agent's trainable tensors and the updates' statistics to OUT.

    python tests/distributed_update.py MODEL_DIR DATA_FILE OUT [section.key=value ...]

With ppo.advantage = "rloo" or "grpo" and generation.samples_per_query = 2, the 8 episodes are 4
queries' pairs of answers (consecutive rows), so each rank's share holds whole groups.
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import torch

from cory_lora.algorithm.cory import Roles, play_episode
from cory_lora.algorithm.state import TrainerState, seed_everything
from cory_lora.config import recipe_from_dict
from cory_lora.engine.data import load_prompts
from cory_lora.engine.model import load_agents, load_tokenizer
from cory_lora.rewards import load_reward
from cory_lora.services import distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import tiny_recipe_dict
from tests.helpers import learn_alone


def share(generation, rows):
    """The rows `rows` of a Generation (same padded widths as the whole batch)."""
    return replace(
        generation,
        prompt_ids=generation.prompt_ids[rows],
        prompt_mask=generation.prompt_mask[rows],
        response_ids=generation.response_ids[rows],
        response_mask=generation.response_mask[rows],
        texts=[generation.texts[i] for i in rows],
    )


def main(model_dir: str, data_file: str, out: str, *overrides: str) -> None:
    sections = {
        # the ratio guard judges micro-batches, which differ with the ranks: off here
        "ppo": {"adaptive_kl": True, "kl_target": 0.5, "score_scaling": True, "ratio_threshold": 0},
        "train": {"algorithm": "ppo"},
    }
    for item in overrides:  # section.key=value, the value as TOML reads it
        key, value = item.split("=")
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = tomllib.loads(f"v = {value}")["v"]
    recipe = recipe_from_dict(tiny_recipe_dict(Path(model_dir), Path(data_file), **sections))
    distributed.start("cpu")
    seed_everything(0)
    tokenizer = load_tokenizer(recipe.model)
    prompts = load_prompts(recipe.data, tokenizer, 0)
    agents = load_agents(recipe, tokenizer)
    reward = load_reward(recipe.reward, "cpu", recipe.data)
    state = TrainerState.fresh(recipe, agents, len(prompts))
    minibatch_rng = torch.Generator().manual_seed(1)
    stats = []
    for iteration in range(2):
        # The same whole batch on every rank (same seed), then each rank keeps its share.
        group = recipe.generation.samples_per_query
        queries = range(8 // group * iteration, 8 // group * (iteration + 1))
        batch = prompts.take([q for q in queries for _ in range(group)])
        episode = play_episode(
            agents,
            Roles("llm1", None),
            batch,
            recipe,
            reward,
            agents.stopping(recipe.generation.stop),
            torch.Generator().manual_seed(iteration),
        )
        rows = distributed.my_share(list(range(8)))
        scores = episode.pioneer_rewards + 0.25 * torch.arange(8)  # varied: whitening matters
        mine = replace(episode, generations=[share(episode.pioneer_generation, rows)])
        agent = state.agent_states["llm1"]
        outcome = learn_alone(agents, "llm1", recipe, agent, mine, scores[rows], minibatch_rng)
        stats.append(outcome.metrics() | {"kl_coef_after": state.agent_states["llm1"].kl_ctl.value})
    trainable = {
        n: p.detach().clone()
        for n, p in agents.model.named_parameters()
        if p.requires_grad and ".llm1." in n
    }
    if "llm1" in agents.value_heads:  # none with a critic-free ppo.advantage
        heads = agents.value_heads["llm1"].state_dict()
        trainable |= {f"value_head.{k}": v for k, v in heads.items()}
    everyone = distributed.gather_objects(trainable)
    if distributed.is_main():
        torch.save({"trainable": trainable, "stats": stats, "ranks": everyone}, out)
    distributed.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
