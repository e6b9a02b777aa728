"""One agent's side of an iteration: turn its episodes into a scored `Rollout` (logprobs,
values, reference logprobs, KL, advantages), then run PPO epochs over it with that agent's own
optimizer, and move its KL coefficient. `train_agent` is the whole step, behind one call.

Everything an agent learns with stays with its adapter name (`state.AgentState`), so a role
exchange moves nothing: the optimizer moments, KL coefficient and score statistics follow the
adapter.

Under torchrun each rank holds its share of the episodes (distributed.py): the score moments,
advantage whitening, token counts, KL and every statistic returned are global, the gradients are
summed across ranks, and every decision (skip or not) is taken by all ranks together, so the
agents stay identical everywhere.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from cory_lora.algorithm import ppo
from cory_lora.algorithm.state import AgentState
from cory_lora.config import PPOConfig, Recipe
from cory_lora.engine.generation import Generation
from cory_lora.engine.model import Agents
from cory_lora.services import distributed, faults


@dataclass(frozen=True)
class Rollout:
    """One agent's scored episodes. B episodes, L = prompt + response width, T = response width."""

    input_ids: torch.Tensor  # [B, L] prompt (left-padded) then response (right-padded)
    attention_mask: torch.Tensor  # [B, L]
    response_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] float, 1 on response tokens
    logprobs: torch.Tensor  # [B, T] of the sampled tokens under the agent at rollout time
    ref_logprobs: torch.Tensor  # [B, T] under the reference (adapters disabled)
    values: torch.Tensor  # [B, T] the agent's value head at rollout time (0: critic-free)
    kl: torch.Tensor  # [B, T] per-token KL penalty term (estimator from the recipe)
    scores: torch.Tensor  # [B] score after scaling/clipping (added on the last token)
    advantages: torch.Tensor  # [B, T]
    returns: torch.Tensor  # [B, T] (0: critic-free)

    @property
    def sequence_kl(self) -> torch.Tensor:
        """[B] sum over response tokens of logp - logp_ref (the k1 sequence KL we report)."""
        return ((self.logprobs - self.ref_logprobs) * self.mask).sum(1)


LOSS_KEYS = (
    "policy_loss",
    "value_loss",
    "kl_loss",
    "clipfrac",
    "approx_kl",
    "entropy",
    "grad_norm",
    "ratio_skipped",
)


@dataclass(frozen=True)
class UpdateStats:
    """An agent's update happened. kl and kl_coef describe the rollout it learned from."""

    kl: float  # mean sequence KL (k1) of the rollout
    kl_penalty: float  # mean over episodes of the summed per-token KL the penalty used
    kl_coef: float  # the beta the rollout's rewards were penalised with
    policy_loss: float
    value_loss: float | None  # None without a value head (critic-free)
    kl_loss: float  # beta x the KL term of the loss (ppo.kl_in = "loss"), else 0
    clipfrac: float
    approx_kl: float
    entropy: float
    grad_norm: float
    ratio_skipped: float  # share of micro-batches zeroed by ppo.ratio_threshold

    def metrics(self) -> dict:
        return dataclasses.asdict(self) | {"update_skipped": 0}


@dataclass(frozen=True)
class Skipped:
    """An agent's update was skipped this iteration, and why; the agent is as it was."""

    reason: str
    kl: float | None  # of the rollout, when one could be scored
    kl_penalty: float | None
    kl_coef: float

    def metrics(self) -> dict:
        known = {"kl": self.kl, "kl_penalty": self.kl_penalty, "kl_coef": self.kl_coef}
        return known | {"update_skipped": 1} | dict.fromkeys(LOSS_KEYS)


def train_agent(
    agents: Agents,
    name: str,
    state: AgentState,
    generation: Generation,
    scores: torch.Tensor,
    reward_problem: str | None,
    recipe: Recipe,
    generator: torch.Generator,
    pioneer_width: int | None = None,
) -> UpdateStats | Skipped:
    """Agent `name`'s whole step: score its episodes into a rollout, update it with PPO, then
    move its KL coefficient with the rollout's KL (beta changes after the iteration that used
    it). NaN/inf anywhere (rewards, rollout, loss or gradient) skips the update instead,
    leaving the agent exactly as it was; `state` counts the skips. With Elastic Reset the
    adapter's EMA follows each update.

    generation: the agent's episodes; scores [B]: its score per episode (collective reward);
    reward_problem: why the scores cannot be learned from (Episode.reward_problem), or None;
    pioneer_width: the width (prompt + response) of this iteration's pioneer sequences, which
    sets ppo.micro_batch_tokens = "auto" (default: this agent's own).
    """
    width = generation.prompt_ids.shape[1] + generation.response_ids.shape[1]
    cfg = recipe.ppo.with_token_cap(pioneer_width or width)
    temperature = recipe.generation.scoring_temperature
    group_size = recipe.generation.samples_per_query
    outcome = _update_or_skip(
        agents,
        name,
        state,
        generation,
        scores,
        reward_problem,
        cfg,
        temperature,
        generator,
        group_size,
    )
    skipped = isinstance(outcome, Skipped)
    state.bad_streak = state.bad_streak + 1 if skipped else 0
    state.skipped += skipped
    return outcome


def _update_or_skip(
    agents, name, state, generation, scores, reward_problem, cfg, temperature, generator, group_size
):
    kl_coef = state.kl_ctl.value
    if distributed.any_rank(reward_problem is not None):
        return Skipped(reward_problem or "NaN/inf rewards on another process", None, None, kl_coef)
    rollout = make_rollout(agents, name, generation, scores, state, cfg, temperature, group_size)
    kl = distributed.global_mean(rollout.sequence_kl)
    # The controller follows the KL the penalty uses (k1, k3 or full), summed per episode, as
    # TRL 0.x's does; `kl` (always k1) is what we report, so runs compare whatever the penalty.
    kl_penalty = distributed.global_mean(rollout.kl.sum(1))
    problem = first_non_finite(rollout)
    if distributed.any_rank(problem is not None):
        where = problem or "rollout on another process"
        return Skipped(f"non-finite {where}", kl, kl_penalty, kl_coef)
    params = agents.trainable_parameters(name)
    saved_params = [p.detach().clone() for p in params]
    saved_optimizer = copy.deepcopy(state.optimizer.state_dict())
    try:
        losses = ppo_update(agents, name, state, rollout, cfg, temperature, generator)
    except NonFiniteUpdate as e:  # put the agent back exactly as it was before the update
        with torch.no_grad():
            for p, saved in zip(params, saved_params, strict=True):
                p.copy_(saved)
        state.optimizer.load_state_dict(saved_optimizer)
        return Skipped(str(e), kl, kl_penalty, kl_coef)
    state.kl_ctl.update(kl_penalty, len(scores) * distributed.world_size())
    if state.ema is not None:
        state.ema.update()
    return UpdateStats(kl, kl_penalty, kl_coef, **losses)


def _my_rows(global_rows: torch.Tensor, rows_here: int) -> torch.Tensor:
    """The rows of a minibatch (global indices) that this rank holds, as its local indices;
    rank r holds global rows [r * rows_here, (r + 1) * rows_here)."""
    local = global_rows - distributed.rank() * rows_here
    return local[(local >= 0) & (local < rows_here)]


class NonFiniteUpdate(Exception):
    """A loss or gradient turned NaN/inf during an update."""


def first_non_finite(rollout: Rollout) -> str | None:
    """Name of the first rollout tensor holding NaN/inf, or None."""
    for name in ("scores", "logprobs", "ref_logprobs", "values", "advantages", "returns"):
        if not torch.isfinite(getattr(rollout, name)).all():
            return name
    return None


def _logprobs(logits: torch.Tensor, response_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [B, T+1, V] (last position unused) -> logprobs of response_ids [B, T] (float32)."""
    return ppo.selective_logprobs(logits[:, :-1], response_ids, temperature)


def sequences(gen: Generation) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt then response: (input_ids [B, P+T], attention_mask [B, P+T])."""
    return (
        torch.cat([gen.prompt_ids, gen.response_ids], dim=1),
        torch.cat([gen.prompt_mask, gen.response_mask], dim=1),
    )


def _agent_and_reference(agents: Agents, name: str, gen: Generation, micro_batch_size: int):
    """Per micro-batch of episodes: (rows, agent logits [b, T+1, V], agent hidden [b, T+1, H],
    reference logits [b, T+1, V]) over the response positions (T = response width)."""
    input_ids, attention_mask = sequences(gen)
    T = gen.response_ids.shape[1]
    for rows in torch.arange(len(input_ids)).split(micro_batch_size):
        ids, attn = input_ids[rows], attention_mask[rows]
        with agents.use(name):
            logits, hidden = agents.forward(ids, attn, T + 1)
        with agents.reference():
            ref_logits, _ = agents.forward(ids, attn, T + 1)
        yield rows, logits, hidden, ref_logits


@torch.no_grad()
def sequence_kl(
    agents: Agents, name: str, gen: Generation, micro_batch_size: int, temperature: float
):
    """[B] sum over response tokens of logp - logp_ref of agent `name` (the reported KL)."""
    out = []
    for rows, logits, _, ref_logits in _agent_and_reference(agents, name, gen, micro_batch_size):
        resp = gen.response_ids[rows]
        log_ratio = _logprobs(logits, resp, temperature) - _logprobs(ref_logits, resp, temperature)
        out.append((log_ratio * gen.response_mask[rows]).sum(1))
    return torch.cat(out)


@torch.no_grad()
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
    """Agent `name`'s episodes as a Rollout: logprobs, values, reference logprobs, per-token
    KL penalty and advantages (GAE, or critic-free over groups of `group_size` consecutive
    episodes answering the same query).

    raw_scores [B]: the agent's score per episode (its collective reward in CORY).
    """
    input_ids, attention_mask = sequences(gen)
    response_ids, mask = gen.response_ids, gen.response_mask.float()
    logprobs, ref_logprobs, values, kl = _token_statistics(agents, name, gen, cfg, temperature)
    values = values * mask
    moments = state.score_moments if cfg.score_scaling else None
    raw_scores = raw_scores.to(mask.device)
    scores = ppo.normalise_scores(
        raw_scores, moments, cfg.score_norm, cfg.score_clip, batch=distributed.gather(raw_scores)
    )
    if cfg.advantage == "gae":
        rewards = ppo.token_rewards(scores, kl, state.kl_ctl.value, mask)
        advantages, returns = ppo.gae(rewards, values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = ppo.masked_whiten(advantages, mask, all_sum=distributed.all_sum)
    else:
        advantages = _critic_free_advantages(scores, kl, mask, state.kl_ctl.value, cfg, group_size)
        returns = torch.zeros_like(advantages)
    return Rollout(
        input_ids,
        attention_mask,
        response_ids,
        mask,
        logprobs * mask,
        ref_logprobs * mask,
        values,
        kl * mask,
        scores,
        advantages,
        returns,
    )


def _token_statistics(
    agents: Agents, name: str, gen: Generation, cfg: PPOConfig, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per response token of agent `name`'s episodes, unmasked, each [B, T]: its logprobs, the
    reference's logprobs, its values (0: critic-free) and the KL penalty term (the recipe's
    estimator), scored one micro-batch of episodes at a time.

    Always micro_batch_size rows, whatever ppo.micro_batch_tokens: without gradients nothing is
    kept across layers, and the logits are taken at the response positions only, so a wider
    prompt (the observer's) adds little to the peak, while fewer rows per forward cost time
    (on CPU a forward's fixed cost dominates at these sizes)."""
    critic = cfg.advantage == "gae"
    parts: dict[str, list[torch.Tensor]] = {"logprobs": [], "ref": [], "values": [], "kl": []}
    for rows, logits, hidden, ref_logits in _agent_and_reference(
        agents, name, gen, cfg.micro_batch_size
    ):
        resp = gen.response_ids[rows]
        logprobs = _logprobs(logits, resp, temperature)
        ref_logprobs = _logprobs(ref_logits, resp, temperature)
        parts["logprobs"].append(logprobs)
        parts["ref"].append(ref_logprobs)
        if critic:
            parts["values"].append(agents.values(name, hidden[:, :-1]))
        else:
            parts["values"].append(torch.zeros_like(logprobs))
        if cfg.kl_estimator == "full":
            kl = ppo.full_kl(logits[:, :-1] / temperature, ref_logits[:, :-1] / temperature)
        else:
            kl = ppo.kl_per_token(logprobs, ref_logprobs, cfg.kl_estimator)
        parts["kl"].append(kl)
    logprobs, ref_logprobs, values, kl = (
        torch.cat(parts[k]) for k in ("logprobs", "ref", "values", "kl")
    )
    return logprobs, ref_logprobs, values, kl


def _critic_free_advantages(scores, kl, mask, kl_coef: float, cfg: PPOConfig, group_size: int):
    """Each episode's advantage from its group (ppo.group_advantages), on every response token.
    With the KL in the reward (RLOO), beta x the episode's summed per-token KL is subtracted
    from its score first; in the loss (GRPO), the scores are used as they are."""
    if cfg.kl_in == "reward":
        scores = scores - kl_coef * (kl * mask).sum(1)
    per_episode = ppo.group_advantages(scores, group_size, cfg.advantage)
    return per_episode.unsqueeze(1) * mask


# What an update sums over its micro-batches (scalars on the device): the losses, clipped
# tokens, approx. KL and entropy summed over tokens, the gradient norm of each step, the tokens
# of each step and the micro-batches the ratio guard skipped.
SUM_KEYS = (
    "policy",
    "value",
    "kl",
    "clipped",
    "approx_kl",
    "entropy",
    "grad_norm",
    "tokens",
    "skips",
)


def ppo_update(
    agents: Agents,
    name: str,
    state: AgentState,
    rollout: Rollout,
    cfg: PPOConfig,
    temperature: float,
    generator: torch.Generator,
) -> dict[str, float]:
    """cfg.epochs passes over the rollout in shuffled minibatches; one optimizer step each.
    Returns the mean losses and diagnostics (LOSS_KEYS); raises NonFiniteUpdate on NaN/inf.

    Under torchrun every rank draws the same permutation of the global batch, and each rank
    works on the rows of each minibatch it holds (`_my_rows`), so a minibatch holds the same
    episodes whatever the number of ranks."""
    params = agents.trainable_parameters(name)
    rows_here = len(rollout.input_ids)
    # Statistics stay on the device until the end: no CPU-GPU sync per micro-batch.
    sums = {k: torch.zeros((), device=rollout.mask.device) for k in SUM_KEYS}
    steps = micro_batches = 0
    agents.model.train()  # LoRA dropout, if any, acts in updates only; base dropout is off
    try:
        with agents.use(name):
            for _ in range(cfg.epochs):
                order = torch.randperm(rows_here * distributed.world_size(), generator=generator)
                for minibatch in order.split(cfg.minibatch_size):
                    minibatch = _my_rows(minibatch, rows_here)
                    micro_batches += _minibatch_step(
                        agents, name, state, rollout, minibatch, params, cfg, temperature, sums
                    )
                    steps += 1
                    faults.maybe_die("update")
    finally:
        agents.model.eval()
        state.optimizer.zero_grad(set_to_none=True)  # frees gradient memory before generation
    return _mean_losses(sums, steps, micro_batches, critic=cfg.advantage == "gae")


def _minibatch_step(
    agents: Agents,
    name: str,
    state: AgentState,
    rollout: Rollout,
    minibatch: torch.Tensor,
    params: list[torch.nn.Parameter],
    cfg: PPOConfig,
    temperature: float,
    sums: dict[str, torch.Tensor],
) -> int:
    """One optimizer step on the rollout rows `minibatch` (this rank's local indices), their
    gradients accumulated one micro-batch at a time and summed across ranks; adds its
    statistics to `sums`. Returns the number of micro-batches it ran; raises NonFiniteUpdate
    when the gradient norm is NaN/inf (the optimizer has not stepped then)."""
    n_tokens = distributed.all_sum(rollout.mask[minibatch].sum()).clamp(min=1)
    state.optimizer.zero_grad(set_to_none=True)
    micro_batches = 0
    for rows in minibatch.split(cfg.micro_batch_rows(rollout.input_ids.shape[1])):
        rows = rows.to(rollout.mask.device)
        micro = micro_batch_loss(
            agents, name, rollout, rows, n_tokens, cfg, temperature, state.kl_ctl.value
        )
        if micro.skipped is not None:
            sums["skips"] += micro.skipped
        micro.loss.backward()
        micro_batches += 1
        with torch.no_grad():
            entropy = ppo.entropy(micro.logits[:, :-1])
            sums["entropy"] += (entropy * micro.mask).sum()
            sums["policy"] += micro.policy.detach()
            sums["value"] += micro.value.detach()
            sums["kl"] += micro.kl.detach()
            sums["clipped"] += micro.clipped_tokens
            sums["approx_kl"] += micro.approx_kl_sum
    distributed.sum_gradients(params)
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if not torch.isfinite(norm):  # one sync per optimizer step
        raise NonFiniteUpdate("non-finite loss or gradient")
    sums["grad_norm"] += norm
    sums["tokens"] += n_tokens
    state.optimizer.step()
    return micro_batches


@dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's PPO loss and its parts, each a scalar tensor already divided by the
    minibatch's token count (and zeroed when the ratio guard drops the micro-batch)."""

    loss: torch.Tensor  # what backward() runs on: policy + vf_coef x value + kl
    policy: torch.Tensor  # the clipped policy-gradient loss
    value: torch.Tensor  # the clipped value loss, before vf_coef (0: critic-free)
    kl: torch.Tensor  # beta x the KL-to-reference term (0 unless ppo.kl_in = "loss")
    skipped: torch.Tensor | None  # 1.0 when the ratio guard dropped it, else 0.0; None: no guard
    clipped_tokens: torch.Tensor  # tokens whose ratio was clipped
    approx_kl_sum: torch.Tensor  # sum over tokens of the approximate KL to the rollout policy
    logits: torch.Tensor  # [b, T+1, V] the agent's logits (for the entropy statistic)
    mask: torch.Tensor  # [b, T] float, 1 on response tokens


def micro_batch_loss(
    agents: Agents,
    name: str,
    rollout: Rollout,
    rows: torch.Tensor,
    n_tokens: torch.Tensor,
    cfg: PPOConfig,
    temperature: float,
    beta: float,
) -> MicroBatchLoss:
    """The PPO loss of the rollout's episodes `rows` ([b] local indices) under agent `name` as
    it is now (the active adapter): a forward pass, then the clipped policy loss, the value
    loss (GAE) and the KL term (ppo.kl_in = "loss"), each summed over tokens and divided by
    n_tokens, the minibatch's response tokens on all ranks (a scalar tensor). beta: the
    rollout's KL coefficient."""
    T = rollout.response_ids.shape[1]
    logits, hidden = agents.forward(rollout.input_ids[rows], rollout.attention_mask[rows], T + 1)
    mask = rollout.mask[rows]
    logprobs = _logprobs(logits, rollout.response_ids[rows], temperature)
    pg = ppo.policy_loss(
        logprobs,
        rollout.logprobs[rows],
        rollout.advantages[rows],
        mask,
        cfg.clip_range,
        n_tokens,
    )
    vf = torch.zeros((), device=mask.device)
    if cfg.advantage == "gae":
        vf = ppo.value_loss(
            agents.values(name, hidden[:, :-1]),
            rollout.values[rows],
            rollout.returns[rows],
            mask,
            cfg.value_clip_range,
            n_tokens,
        )
    kl_term = torch.zeros((), device=mask.device)
    if cfg.kl_in == "loss":  # GRPO: the KL to the reference as a loss term
        kl_term = beta * ppo.kl_loss(logprobs, rollout.ref_logprobs[rows], mask, n_tokens)
    loss = pg.loss + cfg.vf_coef * vf + kl_term
    pg_loss, skipped = pg.loss, None
    if cfg.ratio_threshold:
        # TRL 0.x's guard: a micro-batch whose mean ratio explodes teaches nothing; multiplying
        # by a 0/1 tensor avoids a CPU-GPU sync.
        mean_ratio = pg.ratio_sum / mask.sum().clamp(min=1)
        keep = (mean_ratio <= cfg.ratio_threshold).float()
        loss, pg_loss, vf, kl_term = loss * keep, pg.loss * keep, vf * keep, kl_term * keep
        skipped = 1 - keep
    return MicroBatchLoss(
        loss, pg_loss, vf, kl_term, skipped, pg.clipped_tokens, pg.approx_kl_sum, logits, mask
    )


def _mean_losses(
    sums: dict[str, torch.Tensor], steps: int, micro_batches: int, critic: bool
) -> dict[str, float]:
    """The update's statistics (LOSS_KEYS) from its sums: losses and gradient norm per
    optimizer step, token statistics per token, skips per micro-batch, over all ranks."""
    # Global totals: the token count and the gradient norm are the same on every rank already.
    local = ("policy", "value", "kl", "clipped", "approx_kl", "entropy", "skips")
    sums |= {k: distributed.all_sum(sums[k]) for k in local}
    micro_batches = distributed.sum_int(micro_batches)
    totals = {k: float(v) for k, v in sums.items()}
    return {
        "policy_loss": totals["policy"] / steps,
        "value_loss": totals["value"] / steps if critic else None,
        "kl_loss": totals["kl"] / steps,
        "clipfrac": totals["clipped"] / totals["tokens"],
        "approx_kl": totals["approx_kl"] / totals["tokens"],
        "entropy": totals["entropy"] / totals["tokens"],
        "grad_norm": totals["grad_norm"] / steps,
        "ratio_skipped": totals["skips"] / micro_batches,
    }
