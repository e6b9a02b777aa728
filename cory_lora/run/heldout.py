"""Held-out evaluation, shared by `cory-lora eval` (evaluate.py) and evaluation during training
(`train.eval_every`): one row per agent alone, per pair, or for the base.

Per row: `accuracy` (greedy decoding) and `pass@k` (unbiased estimator over n samples per prompt,
Chen et al. 2021) when the reward is a 0/1 correctness score; and, for any task, the mean task
reward and the mean sequence KL to the reference over the sampled answers, and the combined
reward task - eta * KL. Every episode draws from its own generator seeded with train.seed, so an
evaluation never moves the training's random state and repeats exactly.

Collapse, beside reward and KL (collapse.py): the diversity of the sampled answers (distinct-1,
distinct-2, mean pairwise token overlap), their mean length in tokens, and, with
`train.eval_offtask`, the off-task KL: the mean sequence KL to the base of the agent's sampled
answers to everyday instructions unrelated to the task (0 for the base by definition).

Sizes: greedy answers on every prompt; sampled answers (n per prompt) and the chains of agents
on the first `train.eval_sampled_limit` prompts (0: all), so that an evaluation's cost can be
kept under its run's training cost while greedy accuracy is measured on many prompts.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cory_lora.algorithm.cory import Roles, play_episode
from cory_lora.algorithm.update import sequence_kl
from cory_lora.config import greedy
from cory_lora.engine.data import PromptSet
from cory_lora.engine.generation import Generation
from cory_lora.engine.model import BASE
from cory_lora.errors import UserError
from cory_lora.rewards import Reward
from cory_lora.run.collapse import distinct_n, mean_pairwise_overlap


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
    distinct_1: float | None = None  # of the sampled answers (collapse.py)
    distinct_2: float | None = None
    overlap: float | None = None  # mean pairwise token overlap of the sampled answers
    length: float | None = None  # mean sampled answer length, in tokens
    offtask_kl: float | None = None  # train.eval_offtask; None when off (and for chains)

    def figures(self) -> dict[str, float | None]:
        """Every scalar figure by name (pass@k as `pass@k`)."""
        scalars = {k: v for k, v in asdict(self).items() if k not in ("name", "pass_at")}
        return scalars | {f"pass@{k}": v for k, v in self.pass_at.items()}


NO_REWARD = Reward("none", lambda prompts, completions, **_: [0.0] * len(completions))


def offtask_prompts(path: str) -> PromptSet | None:
    """The everyday instructions of train.eval_offtask (a .jsonl file, column `prompt`)."""
    if not path:
        return None
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        queries = [json.loads(line)["prompt"] for line in lines if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"train.eval_offtask = {path!r}: not a readable .jsonl file of "
            f'{{"prompt": ...}} rows ({type(e).__name__}: {e})'
        ) from None
    if not queries:
        raise UserError(f"train.eval_offtask = {path!r}: no prompts")
    return PromptSet(queries, {})


@dataclass(frozen=True)
class Sampling:
    """n sampled answers per prompt, and the k of the pass@k figures read from them (k <= n)."""

    n: int
    ks: tuple[int, ...]


class Evaluator:
    """`offtask`: measure the off-task KL (train.eval_offtask) in this evaluation; it does not
    depend on the held-out split, so an evaluation of a second split leaves it out."""

    def __init__(
        self, recipe, agents, reward: Reward, prompts: PromptSet, sampling: Sampling, offtask=True
    ):
        self.recipe, self.agents, self.reward, self.prompts = recipe, agents, reward, prompts
        self.sampling = sampling
        self.stopping = agents.stopping(recipe.generation.stop)
        self.greedy = greedy(recipe)
        limit = recipe.train.eval_sampled_limit or len(prompts)
        self.sampled = prompts.take(list(range(min(limit, len(prompts)))))
        self.repeated = self.sampled.take(
            [i for i in range(len(self.sampled)) for _ in range(sampling.n)]
        )
        self.offtask = offtask_prompts(recipe.train.eval_offtask) if offtask else None

    def _episode(self, recipe, roles, prompts, reward=None):
        generator = torch.Generator(self.agents.device).manual_seed(recipe.train.seed)
        return play_episode(
            self.agents, roles, prompts, recipe, reward or self.reward, self.stopping, generator
        )

    def _row(self, name, greedy_rewards, sampled_rewards, kl, sampled: Generation, offtask):
        task = float(sampled_rewards.mean())
        binary = bool(((sampled_rewards == 0) | (sampled_rewards == 1)).all())
        pass_at = {}
        if binary:
            n, ks = self.sampling.n, self.sampling.ks
            correct = sampled_rewards.view(len(self.sampled), n).sum(1).long().tolist()
            pass_at = {k: sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks}
        accuracy = float(greedy_rewards.mean()) if binary else None
        return EvalRow(
            name,
            task,
            kl,
            task - self.recipe.log.eta * kl,
            accuracy,
            pass_at,
            distinct_n(sampled.texts, 1),
            distinct_n(sampled.texts, 2),
            mean_pairwise_overlap(sampled.texts),
            float(sampled.response_mask.sum(1).float().mean()),
            offtask,
        )

    def _kl(self, name: str, gen: Generation) -> float:
        temperature = self.recipe.generation.scoring_temperature
        kl = sequence_kl(self.agents, name, gen, self.recipe.ppo.micro_batch_size, temperature)
        return float(kl.mean())

    def offtask_kl(self, name: str) -> float | None:
        """Mean sequence KL to the base of `name`'s sampled answers to the everyday prompts
        (the recipe's chat template and sampling; the prompts as they are, no task template)."""
        if self.offtask is None:
            return None
        if name == BASE:
            return 0.0
        data = self.recipe.data.model_copy(update={"prompt_template": "{query}"})
        recipe = self.recipe.model_copy(update={"data": data})
        episode = self._episode(recipe, Roles(name, None), self.offtask, NO_REWARD)
        return self._kl(name, episode.pioneer_generation)

    def alone(self, name: str) -> EvalRow:
        greedy = self._episode(self.greedy, Roles(name, None), self.prompts)
        sampled = self._episode(self.recipe, Roles(name, None), self.repeated)
        generation = sampled.pioneer_generation
        kl = self._kl(name, generation)
        rewards = greedy.pioneer_rewards, sampled.pioneer_rewards
        return self._row(name, *rewards, kl, generation, self.offtask_kl(name))

    def chain(self, roles: Roles) -> EvalRow:
        """The agents in `roles.order`, each reading the earlier answers; the chain's answer
        (and KL) is the last agent's. Two agents: the pair, pioneer then observer. On the
        sampled prompts only (train.eval_sampled_limit), greedy and sampled."""
        greedy = self._episode(self.greedy, roles, self.sampled)
        sampled = self._episode(self.recipe, roles, self.repeated)
        generation = sampled.observer_generation
        kl = self._kl(roles.observer, generation)
        name = "→".join(roles.order)
        rewards = greedy.observer_rewards, sampled.observer_rewards
        return self._row(name, *rewards, kl, generation, None)

    def base(self) -> EvalRow:
        greedy = self._episode(self.greedy, Roles(BASE, None), self.prompts)
        sampled = self._episode(self.recipe, Roles(BASE, None), self.repeated)
        rewards = greedy.pioneer_rewards, sampled.pioneer_rewards
        return self._row(BASE, *rewards, 0.0, sampled.pioneer_generation, self.offtask_kl(BASE))
