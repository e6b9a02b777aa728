"""Helpers shared by the tests: paths, files in our formats, the CLI in-process and as a real
subprocess, what an agent holds in memory, and one agent scored and updated on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

from cory_lora.algorithm.state import AgentState
from cory_lora.algorithm.update import (
    AgentUpdate,
    NonFiniteUpdate,
    Rollout,
    ScoringJob,
    rollout_from,
    run_updates,
    score,
)
from cory_lora.cli import app
from cory_lora.config import PPOConfig, toml_value
from cory_lora.engine.generation import Generation
from cory_lora.engine.model import Agents, is_lora_of

ROOT = Path(__file__).resolve().parent.parent


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def write_recipe(path: Path, raw: dict) -> Path:
    lines = []
    for section, table in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def invoke(*args):
    """The CLI in this process. An exception that is not a user error propagates (a bug)."""
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def cli_command(*args, env_extra: dict | None = None) -> tuple[list[str], dict]:
    """(argv, env) to run the CLI as a real process (for kills and signals)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return [sys.executable, "-m", "cory_lora.cli", *map(str, args)], env


def run_cli_process(*args, kill_at: str | None = None, timeout: int = 300):
    """The CLI as a real process; `kill_at` makes it SIGKILL itself there (services/faults.py)."""
    command, env = cli_command(*args, env_extra={"CORY_LORA_KILL_AT": kill_at} if kill_at else None)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def episode_of(agents, recipe, roles, n: int, seed: int = 0):
    """A real episode of the first n training prompts, rewarded by the recipe's reward."""
    from cory_lora.algorithm.cory import play_episode
    from cory_lora.engine.data import load_prompts
    from cory_lora.rewards import load_reward

    prompts = load_prompts(recipe.data).take(list(range(n)))
    return play_episode(
        agents,
        roles,
        prompts,
        recipe,
        load_reward(recipe.reward.function),
        agents.stopping(recipe.generation.stop),
        torch.Generator().manual_seed(seed),
    )


def adapter_state(agents, name: str) -> dict[str, torch.Tensor]:
    """Agent `name`'s LoRA weights and value head, by parameter name."""
    state = {n: p for n, p in agents.model.named_parameters() if is_lora_of(n, name)}
    if name in agents.value_heads:  # none with a critic-free ppo.advantage
        head = agents.value_heads[name].state_dict()
        state.update({f"value_head.{k}": v for k, v in head.items()})
    return state


def parameter_bytes(agents) -> int:
    """Bytes of every distinct tensor storage the agents hold (weights, quantisation state,
    adapters, value heads), each storage counted once however many modules share it."""
    seen: dict[int, int] = {}
    for t in _tensors(agents):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _tensors(agents):
    for module in (agents.model, agents.value_heads):
        yield from module.parameters()
        yield from module.buffers()
    for module in agents.model.modules():  # bitsandbytes keeps 4-bit scales beside the weight
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            yield from (t for t in vars(state).values() if isinstance(t, torch.Tensor))
            nested = getattr(state, "state2", None)
            if nested is not None:
                yield from (t for t in vars(nested).values() if isinstance(t, torch.Tensor))


def learn_alone(agents, name, recipe, agent_state, generation_episode, scores, rng):
    """Agent `name`'s whole step (score, rollout, PPO update, KL coefficient) on its episodes of
    `generation_episode`, the way the loop runs it, unfused: its outcome."""
    from cory_lora.algorithm.learner import Learner, learn

    learner = Learner(agents, name, recipe, agent_state, rng)
    return learn([learner], generation_episode, {name: scores}, "test", fused=False)[name]


# One agent scored and updated on its own; the loop does a group at once (the tests drive
# one agent at a time).
def make_rollout(
    agents: Agents,
    name: str,
    gen: Generation,
    raw_scores: torch.Tensor,
    state: AgentState,
    cfg: PPOConfig,
    temperature: float,
    group_size: int = 1,
) -> Rollout:
    """Agent `name`'s episodes scored on their own and made a Rollout (`score`, then
    `rollout_from`)."""
    job = ScoringJob(name, gen, temperature, cfg.kl_estimator, cfg.advantage == "gae")
    statistics = score(agents, [job], cfg.micro_batch_size, fused=False)[name]
    return rollout_from(statistics, gen, raw_scores, state, cfg, group_size)


def ppo_update(
    agents: Agents,
    name: str,
    state: AgentState,
    rollout: Rollout,
    cfg: PPOConfig,
    temperature: float,
    generator: torch.Generator,
) -> dict[str, float]:
    """Agent `name`'s PPO epochs over `rollout` alone. Returns the mean losses and diagnostics
    (LOSS_KEYS); raises NonFiniteUpdate on NaN/inf (the optimizer has not stepped then, but
    earlier steps stand: `Learner.update` puts the agent back)."""
    params = agents.trainable_parameters(name)
    update = AgentUpdate.start(name, state, rollout, cfg, temperature, params, generator)
    run_updates(agents, [update], fused=False)
    if update.failure is not None:
        raise NonFiniteUpdate(update.failure)
    return update.losses()
