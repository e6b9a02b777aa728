"""`run(recipe)`: the CORY training loop, top to bottom.

Each iteration: (1) rollout: pioneer then observer answer a batch of queries; (2) score: task
rewards, each agent's collective score, logprobs, values and reference logprobs, per-token KL;
(3) advantages (GAE, whitened); (4) PPO epochs per agent with its own optimizer, skipped for an
agent whose numbers went NaN/inf; (5) roles are exchanged every cory.swap_every iterations (a
function of the iteration, see cory.roles_at); (6) log metrics and samples, checkpoint when due.
The maths lives in ppo.py, one agent's scoring and update in update.py, checkpoints in
checkpoint.py.

Nothing is lost: checkpoints are atomic and hold every state the future depends on, so a run
killed at any moment resumes (`--resume`) to bit-identical adapters on CPU; the first Ctrl-C
finishes the iteration and checkpoints, the second stops at once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch

from cory_lora.checkpoint import TrainerState, list_checkpoints, load_checkpoint, save_checkpoint
from cory_lora.config import Recipe, load_recipe, resume_differences, to_toml
from cory_lora.console import Display
from cory_lora.cory import Episode, play_episode, roles_at
from cory_lora.data import PromptOrder, load_prompts
from cory_lora.errors import ConfigError, UserError
from cory_lora.generation import Stopping
from cory_lora.model import Agents, load_agents, load_tokenizer, resolve_device
from cory_lora.outputs import RunDir
from cory_lora.plots import plot_runs
from cory_lora.rewards import load_reward
from cory_lora.update import Rollout, UpdateStats, guarded_update, new_agent_state, score_rollout


class Interrupted(UserError):
    """The user pressed Ctrl-C; a checkpoint was written."""

    exit_code = 130


class TrainingStopped(UserError):
    """An agent's updates kept failing on non-finite numbers."""


def run(recipe: Recipe, run_dir: RunDir, display: Display, resume: bool = False) -> list[dict]:
    """Train as the recipe says; write everything under run_dir. Returns the metrics history."""
    # 0. Everything that can fail on user input fails here, before any output is touched.
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
    state = TrainerState(
        iteration=0,
        order=PromptOrder(len(prompts), recipe.train.seed),
        agents={name: new_agent_state(agents, name, recipe.ppo) for name in names},
        sampling_rng=torch.Generator(agents.device).manual_seed(recipe.train.seed),
        minibatch_rng=torch.Generator().manual_seed(recipe.train.seed + 1),
        bad_streak=dict.fromkeys(names, 0),
        skipped=dict.fromkeys(names, 0),
    )
    if resume:
        restore(run_dir, recipe, agents, state, display)
    else:
        run_dir.open()
    run_dir.write_config(to_toml(recipe))
    stopping = stopping_for(agents, recipe)
    temperature = recipe.generation.temperature or 1.0  # greedy rollouts score at temperature 1

    if state.iteration >= recipe.train.iterations:
        display.message(
            f"the run already has its {state.iteration} iterations; raise train.iterations "
            "(--set train.iterations=N) to extend it"
        )
    display.start(recipe.train.iterations, done=state.iteration)
    try:
        with GracefulStop(display) as stop:
            for iteration in range(state.iteration, recipe.train.iterations):
                started = time.perf_counter()
                roles = roles_at(iteration, recipe.cory.swap_every, names)  # (5) exchange when due
                # 1. Rollout: the pioneer answers, then the observer answers after reading it.
                batch = prompts.take(state.order.next(recipe.ppo.batch_size))
                episode = play_episode(
                    agents, roles, batch, recipe, reward, stopping, state.sampling_rng
                )
                generated = time.perf_counter()
                # 2-4. Per agent: collective score, KL, advantages, independent PPO update.
                scores = episode.scores(recipe.cory.self_coef, recipe.cory.other_coef)
                rollouts: dict[str, Rollout] = {}
                outcomes: dict[str, UpdateStats | str] = {}
                for name in names:
                    problem = reward_problem(episode, scores[name], reward.name)
                    if problem is None:
                        rollouts[name] = score_rollout(
                            agents,
                            name,
                            episode.generation_of(name),
                            scores[name],
                            state.agents[name],
                            recipe.ppo,
                            temperature,
                        )
                        problem = guarded_update(
                            agents,
                            name,
                            state.agents[name],
                            rollouts[name],
                            recipe.ppo,
                            temperature,
                            state.minibatch_rng,
                        )
                    outcomes[name] = problem
                count_skips(outcomes, state)
                metrics = iteration_metrics(
                    iteration, episode, scores, rollouts, outcomes, state, recipe
                )
                for name, outcome in outcomes.items():
                    if isinstance(
                        outcome, UpdateStats
                    ):  # beta moves after the iteration that used it
                        state.agents[name].kl_ctl.update(
                            metrics[f"{name}/kl"], recipe.ppo.batch_size
                        )
                # 6. Log, then checkpoint when due (or when Ctrl-C asked to stop).
                state.iteration = iteration + 1
                metrics["time/generation_s"] = generated - started
                metrics["time/iteration_s"] = time.perf_counter() - started
                run_dir.append("metrics.jsonl", [metrics])
                run_dir.append(
                    "samples.jsonl", samples(iteration, episode, recipe.log.samples_per_iteration)
                )
                display.update(metrics, names, recipe.train.iterations)
                warn(display, recipe, episode, outcomes, state.iteration)
                stop_if_failing(outcomes, state, recipe, run_dir)
                due = state.iteration % recipe.train.checkpoint_every == 0
                if due or state.iteration == recipe.train.iterations or stop.requested:
                    checkpoint = save_checkpoint(
                        run_dir.path, agents, state, recipe.train.keep_checkpoints
                    )
                if stop.requested:
                    raise Interrupted(
                        f"stopped after iteration {state.iteration}; checkpoint {checkpoint}. "
                        f"Resume with: cory-lora resume {run_dir.path}"
                    )
        display.stop()
        run_dir.save_final(agents)
        plot_runs([run_dir.path], run_dir.path / "curves.png")
    except BaseException as e:
        display.stop()
        run_dir.discard_if_empty_run()
        if isinstance(e, torch.OutOfMemoryError):
            raise UserError(out_of_memory_message(run_dir)) from None
        raise
    history = read_history(run_dir)
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


def restore(run_dir: RunDir, recipe: Recipe, agents: Agents, state: TrainerState, display) -> None:
    """Continue from the newest complete checkpoint, if the recipe still describes the same run."""
    checkpoints = list_checkpoints(run_dir.path)
    if not checkpoints:
        raise UserError(f"nothing to resume in {run_dir.path}: it has no checkpoint")
    refused, noted = resume_differences(load_recipe(run_dir.path / "config.toml"), recipe)
    if refused:
        raise UserError(
            f"cannot resume {run_dir.path} with a recipe that changed {', '.join(refused)}: "
            "that would be a different run (start a new one, or undo those changes)"
        )
    if noted:
        display.message(f"resuming with changed settings: {', '.join(noted)}")
    run_dir.remove_partial_writes()
    load_checkpoint(checkpoints[-1], agents, state)
    for agent in state.agents.values():  # the recipe, not the checkpoint, sets the learning rate
        for group in agent.optimizer.param_groups:
            group["lr"] = recipe.ppo.learning_rate
    run_dir.truncate_logs(state.iteration)
    display.message(f"resuming from {checkpoints[-1].name} ({state.iteration} iterations done)")


class GracefulStop:
    """First Ctrl-C: finish the iteration, checkpoint, exit 130. The second: exit 130 at once.

    The second press does not unwind (an exception could land anywhere, even in interpreter
    shutdown): it exits the process there and then. Every file is written atomically, so the
    last complete checkpoint is intact whatever was being written at that moment.
    """

    def __init__(self, display: Display):
        self.display, self.requested, self._previous = display, False, None

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            self.display.console.show_cursor(True)
            print(
                "\nstopped at once: the last complete checkpoint is intact; resume with "
                "`cory-lora resume RUN_DIR`",
                file=sys.stderr,
                flush=True,
            )
            os._exit(130)
        self.requested = True
        self.display.message(
            "Ctrl-C: finishing this iteration, then a checkpoint (Ctrl-C again to stop now)"
        )

    def __exit__(self, *exc) -> None:
        # After a first Ctrl-C the process is on its way out: keep the handler, so a second
        # press during shutdown still exits at once and quietly.
        if self._previous is not None and not self.requested:
            signal.signal(signal.SIGINT, self._previous)


def reward_problem(episode: Episode, scores: torch.Tensor, reward_name: str) -> str | None:
    """Why an agent's scores cannot be used (NaN/inf from the reward), naming the samples."""
    if torch.isfinite(scores).all():
        return None
    parts = []
    for role, rewards in (
        ("pioneer", episode.pioneer_rewards),
        ("observer", episode.observer_rewards),
    ):
        if rewards is not None and not torch.isfinite(rewards).all():
            bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
            parts.append(f"the {role}'s answers {bad[:8]}")
    return f"reward {reward_name!r} returned NaN/inf for {' and '.join(parts)}"


def count_skips(outcomes: dict, state: TrainerState) -> None:
    """Skipped updates, in a row and in total, per agent."""
    for name, outcome in outcomes.items():
        skipped = not isinstance(outcome, UpdateStats)
        state.bad_streak[name] = state.bad_streak[name] + 1 if skipped else 0
        state.skipped[name] += skipped


def stop_if_failing(outcomes: dict, state: TrainerState, recipe: Recipe, run_dir: RunDir) -> None:
    for name, outcome in outcomes.items():
        if state.bad_streak[name] >= recipe.train.max_bad_updates:
            last = list_checkpoints(run_dir.path)
            where = (
                f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written"
            )
            raise TrainingStopped(
                f"{name}'s update was skipped {state.bad_streak[name]} iterations in a row "
                f"(train.max_bad_updates = {recipe.train.max_bad_updates}); last: {outcome}. "
                f"Stopped; {where}."
            )


def warn(
    display: Display, recipe: Recipe, episode: Episode, outcomes: dict, iteration: int
) -> None:
    for name, outcome in outcomes.items():
        if not isinstance(outcome, UpdateStats):
            display.message(f"warning: iteration {iteration}: {name}'s update skipped: {outcome}")
    if episode.truncated_prompts:
        display.warn_once(
            "truncation",
            f"warning: {episode.truncated_prompts} prompt(s) longer than data.max_prompt_tokens = "
            f"{recipe.data.max_prompt_tokens} were cut (their last tokens kept); metrics.jsonl "
            "counts them in data/truncated_prompts",
        )


def out_of_memory_message(run_dir: RunDir) -> str:
    resume = (
        f" The last checkpoint is kept: fix the recipe, then cory-lora run RECIPE --output-dir "
        f"{run_dir.path} --resume."
        if list_checkpoints(run_dir.path)
        else ""
    )
    return (
        "out of GPU memory. Lower generation.batch_size (KV cache), ppo.micro_batch_size "
        "(activations), generation.max_new_tokens or data.max_prompt_tokens, or set "
        "model.gradient_checkpointing = true / model.load_in_4bit = true; `cory-lora plan RECIPE` "
        "estimates the peak." + resume
    )


def _finite_or_none(x: float) -> float | None:
    return x if np.isfinite(x) else None


def iteration_metrics(
    iteration: int,
    episode: Episode,
    scores: dict[str, torch.Tensor],
    rollouts: dict[str, Rollout],
    outcomes: dict[str, UpdateStats | str],
    state: TrainerState,
    recipe: Recipe,
) -> dict:
    """One JSON object: the keys DESIGN.md promises per agent, plus diagnostics. Values that are
    not finite, or do not exist because an update was skipped, are null."""
    metrics: dict = {"iteration": iteration + 1}
    for name, outcome in outcomes.items():
        rewards = episode.task_reward_of(name)
        finite = rewards[torch.isfinite(rewards)]
        task = float(finite.mean()) if len(finite) else None
        kl = float(rollouts[name].sequence_kl.mean()) if name in rollouts else None
        combined = task - recipe.log.eta * kl if task is not None and kl is not None else None
        stats = outcome if isinstance(outcome, UpdateStats) else None
        generation = episode.generation_of(name)
        metrics |= {
            f"{name}/role": episode.roles.role_of(name),
            f"{name}/task_reward": task,
            f"{name}/kl": _finite_or_none(kl) if kl is not None else None,
            f"{name}/combined_reward": combined,
            f"{name}/score": _finite_or_none(float(scores[name].mean())),
            f"{name}/kl_coef": state.agents[name].kl_ctl.value,
            f"{name}/response_length": float(generation.response_mask.sum(1).float().mean()),
            f"{name}/update_skipped": int(stats is None),
            f"{name}/skipped_updates": state.skipped[name],
        }
        for key in ("policy_loss", "value_loss", "clipfrac", "approx_kl", "entropy", "grad_norm"):
            metrics[f"{name}/{key}"] = getattr(stats, key) if stats else None
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
            "pioneer_reward": _finite_or_none(float(episode.pioneer_rewards[i])),
        }
        if episode.observer is not None:
            record |= {
                "observer_agent": episode.roles.observer,
                "observer": episode.observer.texts[i],
                "observer_reward": _finite_or_none(float(episode.observer_rewards[i])),
            }
        out.append(record)
    return out


def read_history(run_dir: RunDir) -> list[dict]:
    path = run_dir.path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
