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

Beyond the paper: `cory.agents = N` chains N agents: position 1 answers the query, position k
after reading the earlier answers (`{answers}`, or `{pioneer}` for the one just before); each is
paid `self_coef * r_own + other_coef * (sum or mean of the others')`; the order rotates by one
every `cory.swap_every` iterations. N = 2 is the paper's pair, exactly.

Ablations (recipe keys): `cory.transfer = false` (the observer does not see the pioneer's
answer), `cory.swap_every = 0` (roles never exchanged), `cory.other_coef` 0 (self-only) or -1
(competitive), and both of the first with other_coef 0: two independent agents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cory_lora.config import GenerationConfig, Recipe
from cory_lora.engine.data import PromptSet, encode_prompts, format_prompt, render
from cory_lora.engine.generation import Generation, Stopping, generate
from cory_lora.engine.model import Agents
from cory_lora.rewards import Reward, describe_unusable
from cory_lora.services import distributed


@dataclass(frozen=True, init=False)
class Roles:
    """Which adapter answers at which position: `Roles("llm1", "llm2")` — llm1 pioneers, llm2
    observes; `Roles("llm1")` (or `Roles("llm1", None)`) — single-agent PPO; N names: a chain."""

    order: tuple[str, ...]

    def __init__(self, *names: str | None):
        object.__setattr__(self, "order", tuple(n for n in names if n is not None))

    @property
    def pioneer(self) -> str:
        return self.order[0]

    @property
    def observer(self) -> str | None:
        """The last to answer (the observer of a pair); None alone."""
        return self.order[-1] if len(self.order) > 1 else None

    def rotated(self, k: int) -> Roles:
        k %= len(self.order)
        return Roles(*self.order[k:], *self.order[:k])

    def position_of(self, name: str) -> int:
        """1-based: 1 is the pioneer."""
        return self.order.index(name) + 1

    def role_of(self, name: str) -> str:
        return "pioneer" if name == self.pioneer else "observer"


def roles_at(iteration: int, swap_every: int, names: tuple[str, ...]) -> Roles:
    """Roles during `iteration` (0-based): llm1, llm2, ... in that order first, then every
    swap_every iterations the order rotates by one (swap_every = 0: never); with 2 agents the
    roles are exchanged: the paper's role exchange (Ma et al. 2024, method section, "Role
    Exchange"; its code flips `swap` every `swap_freq` epochs, imdb_train/cory.py)."""
    roles = Roles(*names)
    return roles.rotated(iteration // swap_every) if swap_every else roles


def exchanges_roles_at(iteration: int, swap_every: int) -> bool:
    """Whether the roles of `iteration` (0-based) differ from those of the iteration before."""
    return swap_every > 0 and iteration > 0 and iteration % swap_every == 0


def draw_response_length(generation: GenerationConfig, generator: torch.Generator) -> int | None:
    """This iteration's cap on new tokens: with generation.length_range = [lo, hi], n drawn from
    [lo, hi) once for the whole batch and both roles (the paper's IMDB code); otherwise None
    (nothing is drawn, the generator is untouched: generation.max_new_tokens holds). Under
    torchrun every rank draws (keeping the generators in step) and rank 0's draw holds."""
    if not generation.length_range:
        return None
    lo, hi = generation.length_range
    n = int(torch.randint(lo, hi, (1,), generator=generator, device=generator.device))
    return distributed.from_main(n)


@dataclass(frozen=True)
class Episode:
    """One batch of cooperative episodes (B queries), position by position (roles.order)."""

    roles: Roles
    prompts: PromptSet  # the queries and their dataset columns
    chain_prompts: list[list[str]]  # per position: B prompt texts (before any chat template)
    generations: list[Generation]  # per position: the answers
    rewards: list[torch.Tensor]  # per position: [B] task reward of the answers
    truncated_prompts: int  # prompts cut to data.max_prompt_tokens in this episode
    # per position: what the reward gave for each unusable score (sample -> "null", "inf", ...)
    unusable: tuple[dict[int, str], ...] = ()

    # The pair's names for positions 1 and N (None for the observer when alone).
    @property
    def pioneer_prompts(self) -> list[str]:
        return self.chain_prompts[0]

    @property
    def pioneer_generation(self) -> Generation:
        return self.generations[0]

    @property
    def pioneer_width(self) -> int:
        """Prompt + response width of the pioneer's sequences: its micro-batches set the memory
        peak that ppo.micro_batch_tokens = "auto" holds the others to."""
        return self.generations[0].prompt_ids.shape[1] + self.generations[0].response_ids.shape[1]

    @property
    def pioneer_rewards(self) -> torch.Tensor:
        return self.rewards[0]

    @property
    def observer_prompts(self) -> list[str] | None:
        return self.chain_prompts[-1] if len(self.chain_prompts) > 1 else None

    @property
    def observer_generation(self) -> Generation | None:
        return self.generations[-1] if len(self.generations) > 1 else None

    @property
    def observer_rewards(self) -> torch.Tensor | None:
        return self.rewards[-1] if len(self.rewards) > 1 else None

    def generation_of(self, name: str) -> Generation:
        return self.generations[self.roles.position_of(name) - 1]

    def task_reward_of(self, name: str) -> torch.Tensor:
        return self.rewards[self.roles.position_of(name) - 1]

    def scores(
        self, self_coef: float, other_coef: float, others: str = "sum"
    ) -> dict[str, torch.Tensor]:
        """Each agent's PPO score [B]: its own task reward plus, in CORY, the others' (their sum
        or mean, weighted by other_coef). With 1 and 1, both agents of a pair are paid
        r(pioneer's answer) + r(observer's answer): the paper's collective reward (Ma et al.
        2024, method section, "Knowledge Transfer": both agents optimise the same collective
        return; its code: `game_reward_1 = game_reward_2 = r1 + r2`, imdb_train/cory.py)."""
        if len(self.rewards) == 1:
            return {self.roles.pioneer: self.rewards[0]}
        out = {}
        for k, name in enumerate(self.roles.order):
            other = sum(r for j, r in enumerate(self.rewards) if j != k)
            if others == "mean":
                other = other / (len(self.rewards) - 1)
            out[name] = self_coef * self.rewards[k] + other_coef * other
        return out

    def reward_problem(self, scores: torch.Tensor, reward_name: str) -> str | None:
        """Why `scores` [B] cannot be learned from (NaN/inf from the reward), naming the
        samples; None when they can."""
        if torch.isfinite(scores).all():
            return None
        parts = []
        for k, rewards in enumerate(self.rewards):
            if not torch.isfinite(rewards).all():
                bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
                what = self.unusable[k] if k < len(self.unusable) else {}
                told = f" ({describe_unusable(what)})" if what else ""
                parts.append(f"the {self._label(k)}'s answers {bad[:8]}{told}")
        return f"reward {reward_name!r} returned NaN/inf for {' and '.join(parts)}"

    def _label(self, position: int) -> str:
        if position == 0:
            return "pioneer"
        return "observer" if len(self.rewards) == 2 else f"observer at position {position + 1}"


def play_episode(
    agents: Agents,
    roles: Roles,
    prompts: PromptSet,
    recipe: Recipe,
    reward: Reward,
    stopping: Stopping,
    generator: torch.Generator,
) -> Episode:
    """Position 1 answers the query; each next position answers after reading the earlier
    answers (with cory.transfer); every answer is scored against the query."""
    data, cory = recipe.data, recipe.cory
    rows = prompts.rows()
    pioneer_prompts = [
        format_prompt(data.prompt_template, q, row)
        for q, row in zip(prompts.queries, rows, strict=True)
    ]
    chain_prompts, generations, rewards, unusable, truncated = [], [], [], [], 0
    for position, name in enumerate(roles.order):
        if position == 0 or not cory.transfer:  # no transfer: the plain query, as the pioneer
            texts = pioneer_prompts
        else:
            answers = [generation.texts for generation in generations]
            texts = [
                format_prompt(
                    data.prompt_template,
                    cory.observer_template.format(
                        query=q,
                        pioneer=answers[-1][i],
                        answers=cory.answer_separator.join(a[i] for a in answers),
                    ),
                    row,
                )
                for i, (q, row) in enumerate(zip(prompts.queries, rows, strict=True))
            ]
        generation, cut = _answer(agents, name, texts, recipe, stopping, generator)
        chain_prompts.append(list(texts))
        generations.append(generation)
        scores, unusable_here = reward.score(pioneer_prompts, generation.texts, prompts.columns)
        rewards.append(scores)
        unusable.append(unusable_here)
        truncated += cut
    return Episode(roles, prompts, chain_prompts, generations, rewards, truncated, tuple(unusable))


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
