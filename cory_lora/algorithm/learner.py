"""One `Learner` per agent: what an agent learns with, built once, and the two things the loop
asks of it — turn its episodes into a rollout, and learn from it.

A learner owns its adapter name on the shared model, its value head (on the model, by name),
its state (optimizer, KL controller, score statistics: `state.AgentState`, which checkpoints
save), its own resolved settings (`recipe.ppo_of(name)`: [ppo] with its [[agents]] keys, so a
per-agent key reaches the update too) and the minibatch generator. Role exchange moves nothing:
everything stays with the adapter name.

`learn` is step 4 of an iteration for every learner: score (every agent and the reference in
one forward when fused), build each rollout, run the PPO updates (fused: every agent's
minibatch in one forward and backward), then move each KL coefficient. The model-facing work
is in update.py, the maths in ppo.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cory_lora.algorithm.cory import Episode
from cory_lora.algorithm.state import AgentState
from cory_lora.algorithm.update import (
    AgentUpdate,
    Rollout,
    ScoringJob,
    Skipped,
    Snapshot,
    TokenStatistics,
    UpdateStats,
    first_non_finite,
    rollout_from,
    run_updates,
    score,
)
from cory_lora.config import Recipe
from cory_lora.engine.generation import Generation
from cory_lora.engine.model import Agents
from cory_lora.services import distributed


@dataclass(frozen=True)
class Prepared:
    """A rollout ready to learn from, with the KL figures of the rollout."""

    rollout: Rollout
    kl: float  # mean sequence KL (k1), what we report
    kl_penalty: float  # mean summed per-token KL of the penalty's estimator


class Learner:
    """Agent `name`: its adapter and value head on the shared model, its state and settings."""

    def __init__(
        self,
        model: Agents,
        name: str,
        recipe: Recipe,
        state: AgentState,
        minibatch_rng: torch.Generator,
    ):
        self.model, self.name, self.state = model, name, state
        self.settings = recipe.ppo_of(name)
        self.temperature = recipe.generation.scoring_temperature
        self.group_size = recipe.generation.samples_per_query
        self.minibatch_rng = minibatch_rng

    def restart(self) -> None:
        """Optimizer, KL coefficient and score statistics afresh (cory.reset_on_swap)."""
        self.state.restart(self.settings)

    def scoring_job(self, generation: Generation) -> ScoringJob:
        critic = self.settings.advantage == "gae"
        return ScoringJob(
            self.name, generation, self.temperature, self.settings.kl_estimator, critic
        )

    def rollout(
        self, generation: Generation, scores: torch.Tensor, statistics: TokenStatistics
    ) -> Prepared | Skipped:
        """The scored episodes as a rollout; Skipped when any of it is NaN/inf.
        scores [B]: the agent's score per episode (its collective reward in CORY)."""
        rollout = rollout_from(
            statistics, generation, scores, self.state, self.settings, self.group_size
        )
        kl = distributed.global_mean(rollout.sequence_kl)
        # The controller follows the KL the penalty uses (k1, k3 or full), summed per episode,
        # as TRL 0.x's does; `kl` (always k1) is what we report, so runs compare whatever the
        # penalty.
        kl_penalty = distributed.global_mean(rollout.kl.sum(1))
        problem = first_non_finite(rollout)
        if distributed.any_rank(problem is not None):
            where = problem or "rollout on another process"
            return Skipped(f"non-finite {where}", kl, kl_penalty, self.state.kl_ctl.value)
        return Prepared(rollout, kl, kl_penalty)

    def start_update(self, prepared: Prepared, pioneer_width: int) -> AgentUpdate:
        """The PPO update of `prepared`, its minibatches drawn; micro-batches capped by the
        pioneer's width (ppo.micro_batch_tokens = "auto")."""
        return AgentUpdate.start(
            self.name,
            self.state,
            prepared.rollout,
            self.settings.with_token_cap(pioneer_width),
            self.temperature,
            self.model.trainable_parameters(self.name),
            self.minibatch_rng,
        )

    def finish(self, prepared: Prepared, update: AgentUpdate) -> UpdateStats | Skipped:
        """After the update: the KL coefficient moves with the rollout's KL (beta changes after
        the iteration that used it) and Elastic Reset's EMA follows; a failed update was put
        back by the caller and is reported as Skipped."""
        kl_coef = self.state.kl_ctl.value
        if update.failure is not None:
            return Skipped(update.failure, prepared.kl, prepared.kl_penalty, kl_coef)
        n = len(prepared.rollout.scores) * distributed.world_size()
        self.state.kl_ctl.update(prepared.kl_penalty, n)
        if self.state.ema is not None:
            self.state.ema.update()
        return UpdateStats(prepared.kl, prepared.kl_penalty, kl_coef, **update.losses())

    def count(self, outcome: UpdateStats | Skipped) -> UpdateStats | Skipped:
        """Count a skipped update (train.max_bad_updates reads the streak)."""
        skipped = isinstance(outcome, Skipped)
        self.state.bad_streak = self.state.bad_streak + 1 if skipped else 0
        self.state.skipped += skipped
        return outcome


def learn(
    learners: list[Learner],
    episode: Episode,
    scores: dict[str, torch.Tensor],
    reward_name: str,
    fused: bool,
) -> dict[str, UpdateStats | Skipped]:
    """Every learner's step: score its episodes (with the reference), make its rollout, update
    it with PPO, move its KL coefficient. NaN/inf anywhere (rewards, rollout, loss or gradient)
    skips that agent's update instead, leaving it exactly as it was."""
    outcomes: dict[str, UpdateStats | Skipped] = {}
    ready = []
    for learner in learners:
        problem = episode.reward_problem(scores[learner.name], reward_name)
        if distributed.any_rank(problem is not None):
            reason = problem or "NaN/inf rewards on another process"
            outcomes[learner.name] = Skipped(reason, None, None, learner.state.kl_ctl.value)
        else:
            ready.append(learner)
    micro_batch_size = learners[0].settings.micro_batch_size
    jobs = [learner.scoring_job(episode.generation_of(learner.name)) for learner in ready]
    statistics = score(learners[0].model, jobs, micro_batch_size, fused) if jobs else {}
    prepared = {}
    for learner in ready:
        generation = episode.generation_of(learner.name)
        result = learner.rollout(generation, scores[learner.name], statistics[learner.name])
        if isinstance(result, Skipped):
            outcomes[learner.name] = result
        else:
            prepared[learner.name] = result
    updating = [learner for learner in ready if learner.name in prepared]
    updates = [lr.start_update(prepared[lr.name], episode.pioneer_width) for lr in updating]
    snapshots = [Snapshot(u.params, u.state.optimizer) for u in updates]
    if updates:
        run_updates(learners[0].model, updates, fused)
    for learner, update, snapshot in zip(updating, updates, snapshots, strict=True):
        if update.failure is not None:
            snapshot.restore()  # put the agent back exactly as it was before the update
        outcomes[learner.name] = learner.finish(prepared[learner.name], update)
    return {lr.name: lr.count(outcomes[lr.name]) for lr in learners}
