"""Held-out evaluation, shared by `cory-lora eval` (evaluate.py) and evaluation during training
(`train.eval_every`): one row per agent alone, per pair, or for the base.

Per row: `accuracy` (greedy decoding) and `pass@k` (unbiased estimator over n samples per prompt,
Chen et al. 2021) when the reward is a 0/1 correctness score; and, for any task, the mean task
reward and the mean sequence KL to the reference over the sampled answers, and the combined
reward task - eta * KL. Every episode draws from its own generator seeded with train.seed, so an
evaluation never moves the training's random state and repeats exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cory_lora.algorithm.cory import Roles, play_episode
from cory_lora.algorithm.update import sequence_kl
from cory_lora.config import greedy
from cory_lora.engine.data import PromptSet
from cory_lora.engine.generation import Generation
from cory_lora.engine.model import BASE
from cory_lora.rewards import Reward


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples, drawn without replacement from n samples of
    which c are correct, is correct: 1 - C(n - c, k) / C(n, k). Needs k <= n."""
    if not 0 <= c <= n or not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 0 < k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    # product form of the ratio of binomials: stable for large n
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class EvalRow:
    name: str
    task_reward: float
    kl: float
    combined_reward: float
    accuracy: float | None  # greedy, when the reward is 0/1
    pass_at: dict[int, float]  # k -> pass@k, when the reward is 0/1


class Evaluator:
    def __init__(self, recipe, agents, reward: Reward, prompts: PromptSet, ks, n):
        self.recipe, self.agents, self.reward, self.prompts = recipe, agents, reward, prompts
        self.ks, self.n = ks, n
        self.stopping = agents.stopping(recipe.generation.stop)
        self.greedy = greedy(recipe)
        self.repeated = prompts.take([i for i in range(len(prompts)) for _ in range(n)])

    def _episode(self, recipe, roles, prompts):
        generator = torch.Generator(self.agents.device).manual_seed(recipe.train.seed)
        return play_episode(
            self.agents, roles, prompts, recipe, self.reward, self.stopping, generator
        )

    def _row(self, name, greedy_rewards, sampled_rewards, kl) -> EvalRow:
        task = float(sampled_rewards.mean())
        binary = bool(((sampled_rewards == 0) | (sampled_rewards == 1)).all())
        pass_at = {}
        if binary:
            correct = sampled_rewards.view(len(self.prompts), self.n).sum(1).long().tolist()
            pass_at = {
                k: sum(pass_at_k(self.n, c, k) for c in correct) / len(correct) for k in self.ks
            }
        accuracy = float(greedy_rewards.mean()) if binary else None
        return EvalRow(name, task, kl, task - self.recipe.log.eta * kl, accuracy, pass_at)

    def _kl(self, name: str, gen: Generation) -> float:
        temperature = self.recipe.generation.scoring_temperature
        kl = sequence_kl(self.agents, name, gen, self.recipe.ppo.micro_batch_size, temperature)
        return float(kl.mean())

    def alone(self, name: str) -> EvalRow:
        greedy = self._episode(self.greedy, Roles(name, None), self.prompts)
        sampled = self._episode(self.recipe, Roles(name, None), self.repeated)
        kl = self._kl(name, sampled.pioneer_generation)
        return self._row(name, greedy.pioneer_rewards, sampled.pioneer_rewards, kl)

    def chain(self, roles: Roles) -> EvalRow:
        """The agents in `roles.order`, each reading the earlier answers; the chain's answer
        (and KL) is the last agent's. Two agents: the pair, pioneer then observer."""
        greedy = self._episode(self.greedy, roles, self.prompts)
        sampled = self._episode(self.recipe, roles, self.repeated)
        kl = self._kl(roles.observer, sampled.observer_generation)
        name = "→".join(roles.order)
        return self._row(name, greedy.observer_rewards, sampled.observer_rewards, kl)

    def base(self) -> EvalRow:
        greedy = self._episode(self.greedy, Roles(BASE, None), self.prompts)
        sampled = self._episode(self.recipe, Roles(BASE, None), self.repeated)
        return self._row(BASE, greedy.pioneer_rewards, sampled.pioneer_rewards, 0.0)
