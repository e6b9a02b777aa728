"""The cooperative episode of CORY (Ma et al., NeurIPS 2024) and its role exchange.

An episode: the pioneer answers the query; the observer answers after reading the query and the
pioneer's answer (`cory.observer_template`); each answer is scored by the task reward; each agent
is paid `self_coef * r_own + other_coef * r_other` (1 and 1 by default: the paper's collective
reward) and, later, its own KL penalty. Roles are exchanged every `cory.swap_every` iterations.

Where we depart from the paper's code:
* The two agents are LoRA adapters on one shared base, and the reference is that base with
  adapters disabled; the paper keeps three full models.
* Role exchange swaps which adapter plays which role (`roles_at`); nothing is saved, reloaded or
  copied, so optimizer states are kept (the paper's code reloads models and loses them). The
  roles are a pure function of the iteration, so they need no state of their own.
* With `train.algorithm = "ppo"` the same episode has no observer: single-agent PPO on the same
  engine, so the baseline differs from CORY only by the algorithm.

Ablations (recipe keys): `cory.transfer = false` (the observer does not see the pioneer's
answer), `cory.swap_every = 0` (roles never exchanged), `cory.other_coef` 0 (self-only) or -1
(competitive), and both of the first with other_coef 0: two independent agents.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cory_lora import distributed
from cory_lora.config import Recipe
from cory_lora.data import PromptSet, encode_prompts, format_prompt, render
from cory_lora.generation import Generation, Stopping, generate
from cory_lora.model import Agents
from cory_lora.rewards import Reward


@dataclass(frozen=True)
class Roles:
    """Which adapter plays which role. observer is None for single-agent PPO."""

    pioneer: str
    observer: str | None

    def swapped(self) -> Roles:
        if self.observer is None:
            return self
        return Roles(pioneer=self.observer, observer=self.pioneer)

    def role_of(self, name: str) -> str:
        return "pioneer" if name == self.pioneer else "observer"


def roles_at(iteration: int, swap_every: int, names: tuple[str, ...]) -> Roles:
    """Roles during `iteration` (0-based): llm1 pioneers first, then every swap_every iterations
    the roles are exchanged (swap_every = 0: never)."""
    roles = Roles(names[0], names[1] if len(names) > 1 else None)
    return roles.swapped() if swap_every and (iteration // swap_every) % 2 else roles


def exchanges_roles_at(iteration: int, swap_every: int) -> bool:
    """Whether the roles of `iteration` (0-based) differ from those of the iteration before."""
    return swap_every > 0 and iteration > 0 and iteration % swap_every == 0


def draw_response_length(recipe: Recipe, generator: torch.Generator) -> Recipe:
    """The recipe for one iteration: with generation.length_range = [lo, hi], at most n new
    tokens, n drawn from [lo, hi) once for the whole batch and both roles (the paper's IMDB
    code); otherwise the recipe itself (nothing is drawn, the generator is untouched). Under
    torchrun every rank draws (keeping the generators in step) and rank 0's draw holds."""
    if not recipe.generation.length_range:
        return recipe
    lo, hi = recipe.generation.length_range
    n = int(torch.randint(lo, hi, (1,), generator=generator, device=generator.device))
    n = distributed.from_main(n)
    return replace(recipe, generation=replace(recipe.generation, max_new_tokens=n))


@dataclass(frozen=True)
class Episode:
    """One batch of cooperative episodes (B queries)."""

    roles: Roles
    prompts: PromptSet  # the queries and their dataset columns
    pioneer_prompts: list[str]  # B prompt texts (before any chat template; rewards see these)
    pioneer_generation: Generation  # the pioneer's answers
    pioneer_rewards: torch.Tensor  # [B] task reward of the pioneer's answers
    observer_prompts: list[str] | None
    observer_generation: Generation | None
    observer_rewards: torch.Tensor | None  # [B]
    truncated_prompts: int  # prompts cut to data.max_prompt_tokens in this episode

    def generation_of(self, name: str) -> Generation:
        return self.pioneer_generation if name == self.roles.pioneer else self.observer_generation

    def task_reward_of(self, name: str) -> torch.Tensor:
        return self.pioneer_rewards if name == self.roles.pioneer else self.observer_rewards

    def scores(self, self_coef: float, other_coef: float) -> dict[str, torch.Tensor]:
        """Each agent's PPO score [B]: its own task reward plus, in CORY, the other's."""
        if self.roles.observer is None:
            return {self.roles.pioneer: self.pioneer_rewards}
        p, o = self.pioneer_rewards, self.observer_rewards
        return {
            self.roles.pioneer: self_coef * p + other_coef * o,
            self.roles.observer: self_coef * o + other_coef * p,
        }

    def reward_problem(self, scores: torch.Tensor, reward_name: str) -> str | None:
        """Why `scores` [B] cannot be learned from (NaN/inf from the reward), naming the
        samples; None when they can."""
        if torch.isfinite(scores).all():
            return None
        parts = []
        for role, rewards in (
            ("pioneer", self.pioneer_rewards),
            ("observer", self.observer_rewards),
        ):
            if rewards is not None and not torch.isfinite(rewards).all():
                bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
                parts.append(f"the {role}'s answers {bad[:8]}")
        return f"reward {reward_name!r} returned NaN/inf for {' and '.join(parts)}"


def play_episode(
    agents: Agents,
    roles: Roles,
    prompts: PromptSet,
    recipe: Recipe,
    reward: Reward,
    stopping: Stopping,
    generator: torch.Generator,
) -> Episode:
    """Pioneer answers, observer answers after reading it, both answers are scored."""
    data = recipe.data
    rows = prompts.rows()
    pioneer_prompts = [
        format_prompt(data.prompt_template, q, row)
        for q, row in zip(prompts.queries, rows, strict=True)
    ]
    pioneer, truncated_pioneer = _answer(
        agents, roles.pioneer, pioneer_prompts, recipe, stopping, generator
    )
    pioneer_rewards = reward(pioneer_prompts, pioneer.texts, prompts.columns)
    if roles.observer is None:
        return Episode(
            roles,
            prompts,
            pioneer_prompts,
            pioneer,
            pioneer_rewards,
            None,
            None,
            None,
            truncated_pioneer,
        )
    if recipe.cory.transfer:
        observer_prompts = [
            format_prompt(
                data.prompt_template,
                recipe.cory.observer_template.format(query=q, pioneer=answer),
                row,
            )
            for q, answer, row in zip(prompts.queries, pioneer.texts, rows, strict=True)
        ]
    else:  # the no-transfer ablation: the observer answers the query as the pioneer does
        observer_prompts = list(pioneer_prompts)
    observer, truncated_observer = _answer(
        agents, roles.observer, observer_prompts, recipe, stopping, generator
    )
    observer_rewards = reward(pioneer_prompts, observer.texts, prompts.columns)
    return Episode(
        roles,
        prompts,
        pioneer_prompts,
        pioneer,
        pioneer_rewards,
        observer_prompts,
        observer,
        observer_rewards,
        truncated_pioneer + truncated_observer,
    )


def _answer(agents, name, texts, recipe, stopping, generator) -> tuple[Generation, int]:
    """Agent `name` answers each prompt text (chat-templated here when the recipe says so);
    also returns how many prompts were cut to data.max_prompt_tokens."""
    data = recipe.data
    rendered = [render(agents.tokenizer, data, text) for text in texts]
    ids, truncated = encode_prompts(
        agents.tokenizer, rendered, data.max_prompt_tokens, data.chat_template
    )
    with agents.use(name):
        generation = generate(
            agents.model, agents.tokenizer, ids, recipe.generation, stopping, generator
        )
    return generation, truncated
