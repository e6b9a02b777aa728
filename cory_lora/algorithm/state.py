"""What training carries from one iteration to the next, besides the weights.

Each agent's learning state (`AgentState`: optimizer, KL controller, score statistics) stays
with its adapter name, so a role exchange moves nothing. `TrainerState` adds the iteration, the
data order, every random generator and the skip counters, and turns itself into (and back from)
the JSON record and tensors that a checkpoint stores.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from cory_lora.algorithm import ppo
from cory_lora.algorithm.elastic import AdapterEMA
from cory_lora.config import PPOConfig, Recipe
from cory_lora.config.problems import first_record_problem
from cory_lora.engine.data import PromptOrder
from cory_lora.engine.model import Agents
from cory_lora.services import distributed

FORMAT = 1  # of the checkpoint record; bump when its meaning changes


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _KLRecord(_Record):
    value: float


class _MomentsRecord(_Record):
    mean: float
    var: float
    count: float


class _AgentRecord(_Record):
    kl_ctl: _KLRecord
    score_moments: _MomentsRecord | None
    bad_streak: NonNegativeInt
    skipped: NonNegativeInt


class _OrderRecord(_Record):
    epoch: NonNegativeInt
    position: NonNegativeInt


class StateRecord(_Record):
    """The shape of a checkpoint's state.json, checked before any of it is used: a file damaged
    or edited into other types is refused with the key, not half-applied."""

    format: Literal[FORMAT]
    iteration: NonNegativeInt
    order: _OrderRecord
    agents: dict[str, _AgentRecord]
    # JSON has no tuples: these arrays are checked for length and item types, not Python type
    python_random: tuple[int, list[int], float | None] = Field(strict=False)
    numpy_random: tuple[str, list[int], int, int, float] = Field(strict=False)
    files: dict[str, str] = {}  # each other file's SHA-256 (added by the checkpoint writer)


def record_problem(record) -> str | None:
    """What is wrong with a state.json's content (its first problem, by key), or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    try:
        StateRecord.model_validate(record)
    except ValidationError as e:
        return first_record_problem(e)
    return None


@dataclass
class AgentState:
    """An agent's training state (mutable: it is what training changes)."""

    optimizer: torch.optim.Optimizer
    kl_ctl: ppo.KLController
    score_moments: ppo.RunningMoments | None
    bad_streak: int = 0  # consecutive iterations whose update was skipped
    skipped: int = 0  # skipped updates in the whole run
    ema: AdapterEMA | None = None  # Elastic Reset's moving average of the adapter

    def restart(self, cfg: PPOConfig) -> None:
        """Optimizer moments, KL coefficient and score statistics start afresh (the paper's
        code rebuilds its trainers at each role exchange)."""
        self.optimizer.state.clear()
        self.kl_ctl = _kl_controller(cfg)
        self.score_moments = ppo.RunningMoments() if cfg.score_scaling else None


def _kl_controller(cfg: PPOConfig) -> ppo.KLController:
    return ppo.KLController(cfg.init_kl_coef, cfg.adaptive_kl, cfg.kl_target, cfg.kl_horizon)


def new_agent_state(agents: Agents, name: str, recipe: Recipe) -> AgentState:
    cfg = recipe.ppo_of(name)  # its own learning rate and initial KL coefficient
    optimizer = torch.optim.AdamW(
        agents.trainable_parameters(name), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    )
    moments = ppo.RunningMoments() if cfg.score_scaling else None
    ema = None
    if recipe.reset.every:
        ema = AdapterEMA(agents.lora_parameters(name), recipe.reset.ema_decay)
    return AgentState(optimizer, _kl_controller(cfg), moments, ema=ema)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainerState:
    """The loop's state: iterations completed, data order, agents' states, random generators."""

    iteration: int
    order: PromptOrder
    agent_states: dict[str, AgentState]  # by agent name
    sampling_rng: torch.Generator
    minibatch_rng: torch.Generator

    @classmethod
    def fresh(cls, recipe: Recipe, agents: Agents, n_prompts: int) -> TrainerState:
        seed = recipe.train.seed
        return cls(
            iteration=0,
            order=PromptOrder(n_prompts, seed),
            agent_states={name: new_agent_state(agents, name, recipe) for name in agents.names},
            sampling_rng=torch.Generator(agents.device).manual_seed(sampling_seed(seed)),
            minibatch_rng=torch.Generator().manual_seed(seed + 1),
        )

    def record(self) -> dict:
        """Everything but tensors, as JSON: iteration, data order, KL coefficients, score
        statistics, skip counters, Python and NumPy random states."""
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        return {
            "format": FORMAT,
            "iteration": self.iteration,
            "order": self.order.state_dict(),
            "agents": {
                name: {
                    "kl_ctl": agent.kl_ctl.state_dict(),
                    "score_moments": (
                        agent.score_moments.state_dict() if agent.score_moments else None
                    ),
                    "bad_streak": agent.bad_streak,
                    "skipped": agent.skipped,
                }
                for name, agent in self.agent_states.items()
            },
            "python_random": [version, list(internal), gauss],
            "numpy_random": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        }

    def misfit(self, record) -> str | None:
        """Why a checkpoint record cannot be loaded into this state (damaged, another format,
        other agents, a data position past the prompts), or None."""
        if isinstance(record, dict) and record.get("format") not in (None, FORMAT):
            return f"written by another version (format {record.get('format')!r})"
        problem = record_problem(record)
        if problem is not None:
            return problem
        if set(record["agents"]) != set(self.agent_states):
            return f"written for agents {', '.join(sorted(record['agents']))}"
        if record["order"]["position"] > self.order.n:
            return f"order.position {record['order']['position']} is past the prompts"
        return None

    def load_record(self, record: dict) -> None:
        for name, agent in self.agent_states.items():
            saved = record["agents"][name]
            agent.kl_ctl.load_state_dict(saved["kl_ctl"])
            if agent.score_moments is not None and saved["score_moments"] is not None:
                agent.score_moments.load_state_dict(saved["score_moments"])
            agent.bad_streak, agent.skipped = saved["bad_streak"], saved["skipped"]
        version, internal, gauss = record["python_random"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = record["numpy_random"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        self.order.load_state_dict(record["order"])
        self.iteration = record["iteration"]

    def rng_tensors(self) -> dict[str, torch.Tensor]:
        """The torch generators' states: sampling, minibatch order, global CPU (and CUDA).
        Under torchrun, every rank's (a collective: every rank calls it); rank 0's keep the
        names of a single process, rank r's end in `@r`."""
        rng = {
            "sampling": self.sampling_rng.get_state(),
            "minibatch": self.minibatch_rng.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        ranks = distributed.gather_objects(rng)
        for r, theirs in enumerate(ranks[1:], start=1):
            rng |= {f"{key}@{r}": value for key, value in theirs.items() if key != "minibatch"}
        return rng

    def load_rng_tensors(self, rng: dict[str, torch.Tensor]) -> bool:
        """Restore this rank's generators; False when the checkpoint has none for this rank
        (it was written by fewer processes: this rank keeps its fresh (seed, rank) sampling)."""
        r = distributed.rank()
        mine = {key.removesuffix(f"@{r}"): v for key, v in rng.items() if key.endswith(f"@{r}")}
        if r == 0:
            mine = {key: v for key, v in rng.items() if "@" not in key}
        self.minibatch_rng.set_state(rng["minibatch"])  # the same on every rank
        if "sampling" not in mine:
            return False
        self.sampling_rng.set_state(mine["sampling"])
        torch.set_rng_state(mine["torch"])
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(mine["cuda"]))
        return True


def sampling_seed(seed: int) -> int:
    """The sampling generator's seed: the run's seed in one process; (seed, rank) under torchrun,
    so ranks sample differently (seed < 2^32, so seed + rank * 2^32 never collides)."""
    return seed + distributed.rank() * 2**32
