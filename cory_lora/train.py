"""`run(recipe)`: the CORY training loop, top to bottom.

Each iteration: (1) rollout: pioneer then observer answer a batch of queries; (2) score: task
rewards, each agent's collective score, logprobs, values and reference logprobs, per-token KL;
(3) advantages (GAE, whitened); (4) PPO epochs per agent with its own optimizer; (5) roles are
exchanged every cory.swap_every iterations (a function of the iteration, see cory.roles_at);
(6) log metrics and samples. The maths lives in ppo.py, the per-agent work in update.py.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import torch

from cory_lora.config import Recipe, to_toml
from cory_lora.console import Display
from cory_lora.cory import Episode, play_episode, roles_at
from cory_lora.data import PromptOrder, load_prompts
from cory_lora.errors import ConfigError
from cory_lora.generation import Stopping
from cory_lora.model import Agents, load_agents, load_tokenizer, resolve_device
from cory_lora.outputs import RunDir
from cory_lora.plots import plot_runs
from cory_lora.rewards import load_reward
from cory_lora.update import (
    AgentState,
    Rollout,
    UpdateStats,
    new_agent_state,
    ppo_update,
    score_rollout,
)


def run(recipe: Recipe, run_dir: RunDir, display: Display) -> list[dict]:
    """Train as the recipe says; write everything under run_dir. Returns the metrics history."""
    # 0. Everything that can fail on user input fails here, before the run directory exists.
    seed_everything(recipe.train.seed)
    tokenizer = load_tokenizer(recipe.model)
    prompts = load_prompts(recipe.data, tokenizer, recipe.train.seed)
    reward = load_reward(recipe.reward, str(resolve_device(recipe.model.device)))
    reward.check_signature(list(prompts.columns))
    reward.probe(prompts.queries[:2], {k: v[:2] for k, v in prompts.columns.items()})
    display.message(f"loading {recipe.model.name_or_path} ...")
    agents = load_agents(recipe, tokenizer)
    check_lengths(recipe, agents)
    names = agents.names
    states = {name: new_agent_state(agents, name, recipe.ppo) for name in names}
    order = PromptOrder(len(prompts), recipe.train.seed)
    sampling_rng = torch.Generator(agents.device).manual_seed(recipe.train.seed)
    minibatch_rng = torch.Generator().manual_seed(recipe.train.seed + 1)
    stopping = stopping_for(agents, recipe)
    temperature = recipe.generation.temperature or 1.0  # greedy rollouts score at temperature 1

    run_dir.open()
    run_dir.write_config(to_toml(recipe))
    history: list[dict] = []
    display.start(recipe.train.iterations)
    try:
        for iteration in range(recipe.train.iterations):
            started = time.perf_counter()
            roles = roles_at(iteration, recipe.cory.swap_every, names)  # (5) exchange when due
            # 1. Rollout: the pioneer answers, then the observer answers after reading it.
            batch = prompts.take(order.next(recipe.ppo.batch_size))
            episode = play_episode(agents, roles, batch, recipe, reward, stopping, sampling_rng)
            generated = time.perf_counter()
            # 2-3. Scores (collective reward), KL to the reference, advantages, per agent.
            scores = episode.scores(recipe.cory.self_coef, recipe.cory.other_coef)
            rollouts = {
                name: score_rollout(
                    agents,
                    name,
                    episode.generation_of(name),
                    scores[name],
                    states[name],
                    recipe.ppo,
                    temperature,
                )
                for name in names
            }
            # 4. Independent PPO updates, each agent with its own optimizer and value head.
            stats = {
                name: ppo_update(
                    agents,
                    name,
                    states[name],
                    rollouts[name],
                    recipe.ppo,
                    temperature,
                    minibatch_rng,
                )
                for name in names
            }
            metrics = iteration_metrics(iteration, episode, scores, rollouts, stats, states, recipe)
            for name in names:  # the controller moves beta after the iteration that used it
                states[name].kl_ctl.update(metrics[f"{name}/kl"], recipe.ppo.batch_size)
            # 6. Log.
            metrics["time/generation_s"] = generated - started
            metrics["time/iteration_s"] = time.perf_counter() - started
            run_dir.append("metrics.jsonl", [metrics])
            run_dir.append(
                "samples.jsonl", samples(iteration, episode, recipe.log.samples_per_iteration)
            )
            history.append(metrics)
            if episode.truncated_prompts and not any(
                m["data/truncated_prompts"] for m in history[:-1]
            ):
                display.message(
                    f"warning: {episode.truncated_prompts} prompt(s) longer than "
                    f"data.max_prompt_tokens = {recipe.data.max_prompt_tokens} were cut (their "
                    "last tokens kept); metrics.jsonl counts them in data/truncated_prompts"
                )
            display.update(metrics, names, recipe.train.iterations)
        display.stop()
        run_dir.save_final(agents)
        plot_runs([run_dir.path], run_dir.path / "curves.png")
    except BaseException:
        display.stop()
        run_dir.discard_if_empty_run()
        raise
    display.summary(history, names, run_dir.path)
    return history


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stopping_for(agents: Agents, recipe: Recipe) -> Stopping:
    """EOS ids from the tokenizer and the model's generation config, plus the recipe's strings."""
    eos = {agents.tokenizer.eos_token_id}
    configured = getattr(getattr(agents.model, "generation_config", None), "eos_token_id", None)
    eos |= set(configured) if isinstance(configured, list) else {configured}
    eos.discard(None)
    return Stopping(tuple(sorted(eos)), recipe.generation.stop)


def check_lengths(recipe: Recipe, agents: Agents) -> None:
    """Prompt plus response must fit the model's context (prompts are cut to max_prompt_tokens)."""
    config = agents.model.config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    needed = recipe.data.max_prompt_tokens + recipe.generation.max_new_tokens
    if limit is not None and needed > limit:
        raise ConfigError(
            [
                f"data.max_prompt_tokens + generation.max_new_tokens = {needed} exceeds the "
                f"model's context of {limit} tokens ({recipe.model.name_or_path})"
            ]
        )


def iteration_metrics(
    iteration: int,
    episode: Episode,
    scores: dict[str, torch.Tensor],
    rollouts: dict[str, Rollout],
    stats: dict[str, UpdateStats],
    states: dict[str, AgentState],
    recipe: Recipe,
) -> dict:
    """One JSON object: the keys DESIGN.md promises per agent, plus diagnostics."""
    metrics: dict = {"iteration": iteration + 1}
    for name, rollout in rollouts.items():
        task = float(episode.task_reward_of(name).mean())
        kl = float(rollout.sequence_kl.mean())
        s = stats[name]
        metrics |= {
            f"{name}/role": episode.roles.role_of(name),
            f"{name}/task_reward": task,
            f"{name}/kl": kl,
            f"{name}/combined_reward": task - recipe.log.eta * kl,
            f"{name}/score": float(scores[name].mean()),
            f"{name}/kl_coef": states[name].kl_ctl.value,
            f"{name}/policy_loss": s.policy_loss,
            f"{name}/value_loss": s.value_loss,
            f"{name}/clipfrac": s.clipfrac,
            f"{name}/approx_kl": s.approx_kl,
            f"{name}/entropy": s.entropy,
            f"{name}/grad_norm": s.grad_norm,
            f"{name}/response_length": float(rollout.mask.sum(1).mean()),
        }
    metrics["data/truncated_prompts"] = episode.truncated_prompts
    return metrics


def samples(iteration: int, episode: Episode, k: int) -> list[dict]:
    out = []
    for i in range(min(k, len(episode.pioneer_prompts))):
        record = {
            "iteration": iteration + 1,
            "query": episode.prompts.queries[i],
            "pioneer_agent": episode.roles.pioneer,
            "pioneer": episode.pioneer.texts[i],
            "pioneer_reward": float(episode.pioneer_rewards[i]),
        }
        if episode.observer is not None:
            record |= {
                "observer_agent": episode.roles.observer,
                "observer": episode.observer.texts[i],
                "observer_reward": float(episode.observer_rewards[i]),
            }
        out.append(record)
    return out


def default_output_dir(recipe_path: Path) -> Path:
    return Path("runs") / f"{Path(recipe_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
