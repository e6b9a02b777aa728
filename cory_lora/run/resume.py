"""Resuming a run: which recipe changes a resume allows, and restoring from the newest checkpoint.

A resume continues from the newest complete checkpoint and drops the log lines written after it,
so metrics.jsonl holds every iteration exactly once. A recipe that would make it a different run
(other weights, data or objective) is refused; changes that cannot alter what is learned pass
silently; anything else (PPO settings, say) is allowed and listed.
"""

from __future__ import annotations

from dataclasses import dataclass

from cory_lora.algorithm.state import TrainerState
from cory_lora.config import Recipe, load_recipe, to_dict, toml_value
from cory_lora.engine.model import Agents
from cory_lora.errors import UserError
from cory_lora.run.checkpoint import completed, list_checkpoints, load_checkpoint
from cory_lora.run.rundir import RunDir, nothing_to_resume
from cory_lora.services import distributed

RESUME_REFUSED = (
    "agents",
    "model.name_or_path",
    "model.load_in_4bit",
    "model.dtype",
    "model.trust_remote_code",
    "lora",
    "data",
    "reward.function",
    "reward.model",
    "train.algorithm",
    "train.seed",
    # what a checkpoint holds: one state per agent, value heads (gae) or none, adapter EMAs
    "cory.agents",
    "ppo.advantage",
    "reset.every",
)
ALLOWED = (
    "a resume keeps the run's model, agents, LoRA shapes, data, reward, algorithm, seed, "
    "advantage and Elastic Reset; it may change the other PPO, sampling and CORY settings, "
    "train.iterations and logging"
)
# Changing these cannot change what is learned: allowed without a word.
RESUME_FREE = (
    "log",
    "train.iterations",
    "train.output_dir",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.max_bad_updates",
    "reward.batch_size",
    "reward.timeout_s",
    "reward.retries",
)


def resume_differences(old: Recipe, new: Recipe) -> tuple[list[str], list[str]]:
    """(refused, noted): dotted keys whose values differ, split by what a resume allows.
    Keys in neither list above (PPO and sampling settings, say) are allowed but noted."""
    before, after = to_dict(old), to_dict(new)
    # per-agent LoRA shapes and learning settings ([[agents]]): another run if they change
    agents_changed = ["agents"] if before.pop("agents", []) != after.pop("agents", []) else []
    changed = agents_changed + [
        f"{section}.{key}"
        for section, table in after.items()
        for key, value in table.items()
        if before[section][key] != value
    ]
    matches = lambda key, prefixes: any(key == p or key.startswith(p + ".") for p in prefixes)  # noqa: E731
    refused = [k for k in changed if matches(k, RESUME_REFUSED)]
    noted = [k for k in changed if not matches(k, RESUME_REFUSED) and not matches(k, RESUME_FREE)]
    return refused, noted


def _refuse_another_run(run_dir: RunDir, recipe: Recipe) -> list[str]:
    """UserError naming each refused key with its old and new value (and what a resume allows);
    else the allowed keys that changed, to be noted."""
    saved = load_recipe(run_dir.path / "config.toml")
    refused, noted = resume_differences(saved, recipe)
    if refused:
        old, new = to_dict(saved), to_dict(recipe)
        changes = "; ".join(_change(k, old, new) for k in refused)
        raise UserError(
            f"cannot resume {run_dir.path}: the recipe changed {changes}. That would be a "
            f"different run: undo those changes, or start a new run ({ALLOWED})"
        )
    return noted


def _change(key: str, old: dict, new: dict) -> str:
    if "." not in key:  # [[agents]] tables
        return key
    section, name = key.split(".", 1)
    return f"{key} ({toml_value(old[section][name])} -> {toml_value(new[section][name])})"


@dataclass(frozen=True)
class ResumeCheck:
    """What a resume will find, checked before anything is loaded or written."""

    done: int  # iterations completed at the newest checkpoint
    complete: bool  # the run already has its iterations and final/: nothing to do, touch nothing
    warning: str | None  # damage in the live logs that the resume mends from the checkpoint
    fresh: bool = False  # no checkpoint of this run yet: nothing to lose, start it afresh


def check_resume(run_dir: RunDir, recipe: Recipe) -> ResumeCheck:
    """Check a resume with `recipe` before it loads anything. Raises UserError when the recipe
    describes another run, when the newest one is past
    train.iterations (a resume cannot undo iterations, and training nothing while recording the
    lower count would falsify the record of what ran), or when the logs are damaged beyond what
    the checkpoint can mend."""
    _refuse_another_run(run_dir, recipe)
    iterations = recipe.train.iterations
    checkpoints = list_checkpoints(run_dir.path)
    if not checkpoints and (run_dir.path / "final").is_dir():
        raise UserError(
            f"nothing to resume in {run_dir.path}: its checkpoints were deleted (final/ holds its "
            "adapters, but a resume needs a checkpoint's optimizer and random states); to train "
            "longer, start a new run"
        )
    if not checkpoints:  # stopped before its first checkpoint (a requeued job, say)
        return ResumeCheck(0, False, None, fresh=True)
    done = completed(checkpoints[-1])
    if done > iterations:
        raise UserError(
            f"{run_dir.path} already has {done} iterations ({checkpoints[-1].name}); "
            f"train.iterations = {iterations} is fewer, and a resume cannot undo iterations. "
            "Nothing was changed: raise train.iterations to extend the run, or start a new one"
        )
    complete = done == iterations and (run_dir.path / "final").is_dir()
    return ResumeCheck(done, complete, None if complete else run_dir.check_logs(done))


def restore(run_dir: RunDir, recipe: Recipe, agents: Agents, state: TrainerState, say) -> None:
    """Continue from the newest complete checkpoint, if the recipe still describes the same run.
    `say` prints a line for the user."""
    checkpoints = list_checkpoints(run_dir.path)
    if not checkpoints:
        raise nothing_to_resume(run_dir.path, "it has no checkpoint")
    noted = _refuse_another_run(run_dir, recipe)
    if noted:
        say(f"resuming with changed settings: {', '.join(noted)}")
    run_dir.remove_partial_writes()
    own_sampling = load_checkpoint(checkpoints[-1], agents, state)
    if distributed.any_rank(not own_sampling):
        say(
            f"note: {checkpoints[-1].name} was written by fewer processes than now; the new "
            "ones sample from fresh (seed, rank) generators (the run goes on, but differs from "
            "one resumed with the same number of processes)"
        )
    for name, agent in state.agent_states.items():  # the recipe, not the checkpoint, sets the rate
        for group in agent.optimizer.param_groups:
            group["lr"] = recipe.ppo_of(name).learning_rate
    run_dir.truncate_logs(state.iteration)
    say(f"resuming from {checkpoints[-1].name} ({state.iteration} iterations done)")
