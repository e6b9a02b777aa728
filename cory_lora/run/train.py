"""`run(recipe)`: the CORY training loop, top to bottom: setup, then `train_iteration` once per
iteration with a checkpoint when due, then the final adapters.

One iteration (the numbered steps of `train_iteration`):
1. Roles: which agent pioneers and which observes, a function of the iteration (exchanged every
   `cory.swap_every` iterations: `cory.roles_at`), so role exchange has no state; with
   `cory.reset_on_swap` both agents' optimizers, KL coefficients and score statistics restart.
2. Rollout: a batch of queries (and, with `generation.length_range`, this iteration's response
   length); the pioneer answers, the observer answers after reading the pioneer's answer, and
   the task reward scores both answers (`cory.play_episode`).
3. Scores: each agent is paid `self_coef * r_own + other_coef * r_other` (1 and 1: the paper's
   collective reward; PPO: its own reward).
4. Each agent learns on its own (`learner.learn`, one `Learner` per agent): logprobs, values,
   reference logprobs and KL penalty, GAE advantages, PPO epochs with its own optimizer, then
   its KL coefficient moves; with `train.fused`, every agent and the reference go through the
   model in one pass. NaN/inf anywhere skips that agent's update and leaves it as it was. With
   Elastic Reset (`reset.every`), every agent's adapter is reset to its EMA when due.
5. Log: metrics.jsonl, samples.jsonl and the display (with `train.eval_every`, each agent's
   held-out figures first); stop when an agent's updates keep failing.
6. (in `run`) Checkpoint when due, at the end, or when Ctrl-C asked to stop.

The maths lives in ppo.py, an agent's learning in learner.py (over update.py), the episode in
cory.py.

Under torchrun (distributed.py) every rank runs this same loop on its share of each batch;
the updates, statistics and decisions are global, and rank 0 alone writes (the other ranks' run
directory is a `rundir.FollowerRunDir`).

Nothing is lost: checkpoints are atomic and hold every state the future depends on, so a run
killed at any moment resumes (resume.py) to bit-identical adapters on CPU; the first Ctrl-C
finishes the iteration and checkpoints, the second stops at once (interrupts.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from cory_lora.algorithm.cory import (
    Episode,
    draw_response_length,
    exchanges_roles_at,
    play_episode,
    roles_at,
)
from cory_lora.algorithm.learner import Learner, learn
from cory_lora.algorithm.metrics import finite_or_none, iteration_metrics, samples
from cory_lora.algorithm.state import TrainerState, seed_everything
from cory_lora.algorithm.update import Skipped, UpdateStats
from cory_lora.config import Recipe
from cory_lora.engine.data import PromptSet, load_eval_prompts, load_prompts
from cory_lora.engine.generation import Stopping
from cory_lora.engine.model import Agents, load_agents, load_tokenizer, resolve_device
from cory_lora.errors import UserError
from cory_lora.rewards import Reward, load_reward
from cory_lora.run.checkpoint import list_checkpoints, save_checkpoint
from cory_lora.run.heldout import Evaluator, Sampling
from cory_lora.run.interrupts import GracefulStop, Interrupted
from cory_lora.run.records import read_metrics
from cory_lora.run.resume import restore
from cory_lora.run.rundir import RunDir
from cory_lora.services import distributed


class Display(Protocol):
    """What the loop reports progress to (the CLI hands in the rich `cli.console.Display`)."""

    def message(self, text: str) -> None: ...
    def warn_once(self, key: str, text: str) -> None: ...
    def start(self, total: int, done: int = 0) -> None: ...
    def update(self, metrics: dict, names: tuple[str, ...], total: int) -> None: ...
    def stop(self) -> None: ...
    def restore_terminal(self) -> None: ...
    def summary(self, history: list[dict], names: tuple[str, ...], run_dir) -> None: ...


class Sink(Protocol):
    """Where each iteration's metrics and samples also go (the CLI hands in the trackers)."""

    def log(self, metrics: dict, step: int) -> None: ...
    def log_samples(self, records: list[dict], step: int) -> None: ...
    def close(self) -> None: ...


class NoSink:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def log_samples(self, records: list[dict], step: int) -> None:
        pass

    def close(self) -> None:
        pass


OpenSink = Callable[[int], Sink]  # iterations already done -> an open sink


class TrainingStopped(UserError):
    """An agent's updates kept failing on non-finite numbers."""


@dataclass(frozen=True)
class Setup:
    """What stays fixed for the whole run."""

    recipe: Recipe
    agents: Agents
    prompts: PromptSet
    reward: Reward
    stopping: Stopping
    run_dir: RunDir
    display: Display
    trackers: Sink
    evaluator: Evaluator | None  # train.eval_every: held-out evaluation during training
    learners: list[Learner]  # one per agent, over the state's AgentStates


def run(
    recipe: Recipe,
    run_dir: RunDir,
    display: Display,
    resume: bool = False,
    open_sink: OpenSink | None = None,
) -> list[dict]:
    """Train as the recipe says; write everything under run_dir. Returns the metrics history
    (empty on ranks other than 0). `open_sink` opens the trackers, on rank 0 only."""
    setup, state = prepare(recipe, run_dir, display, resume, open_sink)
    display.start(recipe.train.iterations, done=state.iteration)
    try:
        with GracefulStop(display, run_dir.path) as stop:
            while state.iteration < recipe.train.iterations:
                train_iteration(setup, state)
                # 6. Checkpoint when due, at the end, or when Ctrl-C asked to stop.
                done = state.iteration == recipe.train.iterations
                stopping = distributed.any_rank(bool(stop.requested))  # all ranks stop together
                if done or stopping or state.iteration % recipe.train.checkpoint_every == 0:
                    checkpoint = save_checkpoint(
                        run_dir.path, setup.agents, state, recipe.train.keep_checkpoints
                    )
                if stopping:
                    raise Interrupted(
                        f"stopped after iteration {state.iteration}; checkpoint {checkpoint}. "
                        f"Resume with: {distributed.cli('resume', run_dir.path)}",
                        stop.requested or signal.SIGINT,  # another rank's signal: as Ctrl-C
                    )
        display.stop()
        run_dir.save_final(setup.agents)
        setup.trackers.close()
    except BaseException as e:
        setup.trackers.close()  # before a failed run's directory is removed
        display.stop()
        run_dir.discard_if_empty_run()
        if isinstance(e, torch.OutOfMemoryError):
            raise UserError(out_of_memory_message(run_dir)) from None
        raise
    if not distributed.is_main():
        return []
    history = read_metrics(run_dir.path / "metrics.jsonl")
    display.summary(history, setup.agents.names, run_dir.path)
    return history


def prepare(
    recipe: Recipe, run_dir: RunDir, display: Display, resume: bool, open_sink: OpenSink | None
) -> tuple[Setup, TrainerState]:
    """Load everything and restore a resumed run. Whatever can fail on user input fails here,
    before any output is touched."""
    seed_everything(recipe.train.seed)
    tokenizer = load_tokenizer(recipe.model)
    prompts = load_prompts(recipe.data, tokenizer, recipe.train.seed)
    reward = load_reward(recipe.reward, str(resolve_device(recipe.model.device)), recipe.data)
    reward.check_signature(list(prompts.columns))
    reward.probe(prompts.queries[:2], {k: v[:2] for k, v in prompts.columns.items()})
    held_out = eval_prompts(recipe, tokenizer)
    display.message(f"loading {recipe.model.name_or_path} ...")
    agents = load_agents(recipe, tokenizer)
    agents.check_context(recipe)
    state = TrainerState.fresh(recipe, agents, len(prompts))
    if resume:
        restore(run_dir, recipe, agents, state, display.message)
    else:
        run_dir.open()
    run_dir.write_config(recipe)
    if state.iteration >= recipe.train.iterations:
        display.message(
            f"the run already has its {state.iteration} iterations; raise train.iterations "
            "(--set train.iterations=N) to extend it"
        )
    stopping = agents.stopping(recipe.generation.stop)
    trackers = open_sink(state.iteration) if open_sink and distributed.is_main() else NoSink()
    evaluator = None  # rank 0 alone evaluates (and writes); the others go on to the next batch
    if held_out and distributed.is_main():
        evaluator = Evaluator(recipe, agents, reward, held_out, Sampling(n=1, ks=(1,)))
    learners = [
        Learner(agents, name, recipe, state.agent_states[name], state.minibatch_rng)
        for name in agents.names
    ]
    setup = Setup(
        recipe,
        agents,
        prompts,
        reward,
        stopping,
        run_dir,
        display,
        trackers,
        evaluator,
        learners,
    )
    return setup, state


def eval_prompts(recipe: Recipe, tokenizer) -> PromptSet | None:
    """The first train.eval_limit held-out prompts when train.eval_every asks for evaluation
    during training (a recipe without held-out prompts is refused here, before training)."""
    if not recipe.train.eval_every:
        return None
    try:
        prompts = load_eval_prompts(recipe.data, tokenizer, recipe.train.seed)
    except UserError as e:
        every = recipe.train.eval_every
        raise UserError(f"train.eval_every = {every} needs held-out prompts: {e}") from None
    return prompts.take(list(range(min(recipe.train.eval_limit, len(prompts)))))


def train_iteration(setup: Setup, state: TrainerState) -> dict:
    """One iteration, steps 1-5 of the module docstring. Returns its metrics."""
    recipe, agents = setup.recipe, setup.agents
    started = time.perf_counter()
    # 1. Roles: exchanged every cory.swap_every iterations (optionally restarting the agents).
    roles = roles_at(state.iteration, recipe.cory.swap_every, agents.names)
    if recipe.cory.reset_on_swap and exchanges_roles_at(state.iteration, recipe.cory.swap_every):
        for learner in setup.learners:
            learner.restart()
    # 2. Rollout: the pioneer answers, then the observer answers after reading it; both scored.
    # (Each query generation.samples_per_query times in a row: a critic-free advantage's group.)
    queries = distributed.my_share(state.order.next(recipe.ppo.batch_size))
    repeats = recipe.generation.samples_per_query
    batch = setup.prompts.take([i for i in queries for _ in range(repeats)])
    this_iteration = recipe
    if (n := draw_response_length(recipe.generation, state.sampling_rng)) is not None:
        generation = recipe.generation.model_copy(update={"max_new_tokens": n})
        this_iteration = recipe.model_copy(update={"generation": generation})
    episode = play_episode(
        agents, roles, batch, this_iteration, setup.reward, setup.stopping, state.sampling_rng
    )
    generated = time.perf_counter()
    # 3. Scores: own and (in CORY) the other's task reward.
    scores = episode.scores(recipe.cory.self_coef, recipe.cory.other_coef, recipe.cory.others)
    # 4. Each agent learns on its own: rollout scoring, PPO epochs, then its KL coefficient.
    outcomes = learn(setup.learners, episode, scores, setup.reward.name, recipe.train.fused)
    state.iteration += 1
    if recipe.reset.every and state.iteration % recipe.reset.every == 0:
        for agent in state.agent_states.values():
            agent.ema.reset()
            agent.optimizer.state.clear()
    # 5. Log (after a held-out evaluation when due); stop when an agent's updates keep failing.
    metrics = iteration_metrics(
        state.iteration, episode, scores, outcomes, state.agent_states, recipe.log.eta
    )
    metrics["time/generation_s"] = generated - started
    metrics["time/iteration_s"] = time.perf_counter() - started
    if setup.evaluator and eval_due(recipe, state.iteration):
        metrics |= evaluate_agents(setup, state.iteration)
    setup.run_dir.append("metrics.jsonl", [metrics])
    records = samples(state.iteration, episode, recipe.log.samples_per_iteration)
    setup.run_dir.append("samples.jsonl", records)
    setup.trackers.log(metrics, step=state.iteration)
    setup.trackers.log_samples(records, step=state.iteration)
    setup.display.update(metrics, agents.names, recipe.train.iterations)
    warn(setup, episode, outcomes, state.iteration)
    stop_if_failing(setup, state, outcomes)
    return metrics


def eval_due(recipe: Recipe, iteration: int) -> bool:
    every = recipe.train.eval_every
    return bool(every) and (iteration % every == 0 or iteration == recipe.train.iterations)


def evaluate_agents(setup: Setup, iteration: int) -> dict:
    """Each agent alone on the held-out prompts: `eval/llmK/...` metrics. Its episodes draw from
    their own seeded generator, so training is the same with evaluation on or off."""
    started = time.perf_counter()
    metrics = {}
    for name in setup.agents.names:
        row = setup.evaluator.alone(name)
        figures = row.figures()  # reward, KL, accuracy, pass@k; collapse: diversity, off-task KL
        metrics |= {
            f"eval/{name}/{key}": None if value is None else finite_or_none(value)
            for key, value in figures.items()
        }
        shown = "accuracy" if row.accuracy is not None else "task_reward"
        setup.display.message(
            f"eval at iteration {iteration}: {name} {shown} {figures[shown]:.3f}  KL {row.kl:.3f}"
            f"  ({len(setup.evaluator.prompts)} held-out prompts)"
        )
    metrics["time/eval_s"] = time.perf_counter() - started
    return metrics


def warn(
    setup: Setup, episode: Episode, outcomes: dict[str, UpdateStats | Skipped], iteration: int
) -> None:
    for name, outcome in outcomes.items():
        if isinstance(outcome, Skipped):
            setup.display.message(
                f"warning: iteration {iteration}: {name}'s update skipped: {outcome.reason}"
            )
    if episode.truncated_prompts:
        setup.display.warn_once(
            "truncation",
            f"warning: {episode.truncated_prompts} prompt(s) longer than data.max_prompt_tokens = "
            f"{setup.recipe.data.max_prompt_tokens} were cut (their last tokens kept); "
            "metrics.jsonl counts them in data/truncated_prompts",
        )


def stop_if_failing(
    setup: Setup, state: TrainerState, outcomes: dict[str, UpdateStats | Skipped]
) -> None:
    limit = setup.recipe.train.max_bad_updates
    for name, outcome in outcomes.items():
        streak = state.agent_states[name].bad_streak
        if streak >= limit:
            last = list_checkpoints(setup.run_dir.path)
            where = (
                f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written"
            )
            raise TrainingStopped(
                f"{name}'s update was skipped {streak} iterations in a row "
                f"(train.max_bad_updates = {limit}); last: {outcome.reason}. Stopped; {where}."
            )


def out_of_memory_message(run_dir: RunDir) -> str:
    resume = (
        " The last checkpoint is kept: fix the recipe, then "
        + distributed.cli("run", "RECIPE", "--output-dir", run_dir.path, "--resume")
        + "."
        if list_checkpoints(run_dir.path)
        else ""
    )
    return (
        "out of GPU memory. Lower generation.batch_size (KV cache), ppo.micro_batch_size "
        "(activations; ppo.micro_batch_tokens caps the observer's longer ones), "
        "generation.max_new_tokens or data.max_prompt_tokens, or set "
        "model.gradient_checkpointing = true / model.load_in_4bit = true; `cory-lora plan RECIPE` "
        "estimates the peak." + resume
    )
