"""What an iteration writes: one metrics record (metrics.jsonl) and a few sample texts
(samples.jsonl). Metric keys per agent `llmK/` are a contract (the README lists them)."""

from __future__ import annotations

import math

import torch

from cory_lora.algorithm.cory import Episode
from cory_lora.algorithm.state import AgentState
from cory_lora.algorithm.update import LOSS_KEYS, Skipped, UpdateStats
from cory_lora.services import distributed


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _finite(x: float | None) -> float | None:
    return None if x is None else finite_or_none(x)


def iteration_metrics(
    iteration: int,
    episode: Episode,
    scores: dict[str, torch.Tensor],
    outcomes: dict[str, UpdateStats | Skipped],
    agent_states: dict[str, AgentState],
    eta: float,
) -> dict:
    """One JSON object for iteration `iteration` (1-based). Values that are not finite, or do
    not exist because an update was skipped, are null. Under torchrun: over every rank's
    episodes."""
    metrics: dict = {"iteration": iteration}
    for name, outcome in outcomes.items():
        rewards = episode.task_reward_of(name)
        task = finite_or_none(distributed.global_mean(rewards[torch.isfinite(rewards)]))
        update = outcome.metrics()
        kl = update["kl"]
        combined = task - eta * kl if task is not None and kl is not None else None
        generation = episode.generation_of(name)
        metrics |= {
            f"{name}/role": episode.roles.role_of(name),
            f"{name}/position": episode.roles.position_of(name),
            f"{name}/task_reward": task,
            f"{name}/kl": _finite(kl),
            f"{name}/kl_penalty": _finite(update["kl_penalty"]),
            f"{name}/combined_reward": combined,
            f"{name}/score": finite_or_none(distributed.global_mean(scores[name])),
            f"{name}/kl_coef": update["kl_coef"],
            f"{name}/response_length": distributed.global_mean(generation.response_mask.sum(1)),
            f"{name}/update_skipped": update["update_skipped"],
            f"{name}/skipped_updates": agent_states[name].skipped,
        }
        metrics |= {f"{name}/{key}": update[key] for key in LOSS_KEYS}
    metrics["data/truncated_prompts"] = distributed.sum_int(episode.truncated_prompts)
    return metrics


def samples(iteration: int, episode: Episode, k: int) -> list[dict]:
    """The first k episodes' texts and rewards, for samples.jsonl: the pioneer's and the last
    observer's, and with more than 2 agents the answers between them (`middle`, in order)."""
    out = []
    for i in range(min(k, len(episode.pioneer_prompts))):
        record = {
            "iteration": iteration,
            "query": episode.prompts.queries[i],
            "pioneer_agent": episode.roles.pioneer,
            "pioneer": episode.pioneer_generation.texts[i],
            "pioneer_reward": finite_or_none(float(episode.pioneer_rewards[i])),
        }
        if episode.observer_generation is not None:
            record |= {
                "observer_agent": episode.roles.observer,
                "observer": episode.observer_generation.texts[i],
                "observer_reward": finite_or_none(float(episode.observer_rewards[i])),
            }
        if len(episode.generations) > 2:
            record["middle"] = [
                {
                    "agent": name,
                    "answer": episode.generations[k].texts[i],
                    "reward": finite_or_none(float(episode.rewards[k][i])),
                }
                for k, name in enumerate(episode.roles.order[1:-1], start=1)
            ]
        out.append(record)
    return out
