"""The model-facing half of learning, for one agent or several in one pass: score episodes into
`Rollout`s (logprobs, values, reference logprobs, KL, advantages), then PPO epochs over them,
each agent with its own optimizer. `learner.Learner` holds an agent's fixed parts and calls
these; the maths itself is in ppo.py.

Fused passes (`train.fused`): every agent's rows and their reference rows go through the base
in one no-grad forward (`score`), and at each minibatch step every agent's micro-batch goes
through one forward and backward (`run_updates`), each row through its own adapter or none
(`engine.lora.row_blocks`, contiguous blocks, no gather). Each agent's loss is computed on its
own rows only and nothing in a causal LM mixes rows, so the summed loss's gradient on an
adapter is exactly that agent's own; clipping, the optimizer step and the skip decision stay per
agent. Rows of different widths (the observer reads the pioneer's answer) are left-padded to
the widest: positions come from the attention mask, so a padded row computes what it did
alone, up to float rounding. Generation stays sequential (the observer reads the pioneer).

Under torchrun each rank holds its share of the episodes (distributed.py): the score moments,
advantage whitening, token counts, KL and every statistic returned are global, the gradients are
summed across ranks, and every decision (skip or not) is taken by all ranks together, so the
agents stay identical everywhere.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from cory_lora.algorithm import ppo
from cory_lora.algorithm.state import AgentState
from cory_lora.config import PPOConfig
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
    """Per micro-batch of episodes, one forward each: (rows, agent logits [b, T+1, V], agent
    hidden [b, T+1, H], reference logits [b, T+1, V]) over the response positions."""
    input_ids, attention_mask = sequences(gen)
    T = gen.response_ids.shape[1]
    for rows in torch.arange(len(input_ids)).split(micro_batch_size):
        ids, attn = input_ids[rows], attention_mask[rows]
        with agents.use(name):
            logits, hidden = agents.forward(ids, attn, T + 1)
        with agents.reference():
            ref_logits, _ = agents.forward(ids, attn, T + 1)
        yield rows, logits, hidden, ref_logits


def padded_batch(
    parts: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[(input_ids [b_k, L_k], attention_mask [b_k, L_k]), ...] -> one batch [sum b_k, max L_k],
    each part left-padded (pad tokens masked out; positions come from the mask)."""
    width = max(ids.shape[1] for ids, _ in parts)
    ids = [torch.nn.functional.pad(i, (width - i.shape[1], 0), value=pad_id) for i, _ in parts]
    masks = [torch.nn.functional.pad(m, (width - m.shape[1], 0), value=0) for _, m in parts]
    return torch.cat(ids), torch.cat(masks)


def forward_blocks(
    agents: Agents, parts: list[tuple[str | None, torch.Tensor, torch.Tensor, int]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward for several blocks of rows, each through its own adapter (None: the
    reference). parts: [(adapter, input_ids [b, L], attention_mask [b, L], n_keep), ...] ->
    per part (logits [b, n_keep, V], hidden [b, n_keep, H])."""
    ids, mask = padded_batch([(i, m) for _, i, m, _ in parts], agents.tokenizer.pad_token_id)
    keep = max(n for *_, n in parts)
    sizes = [(adapter, len(i)) for adapter, i, _, _ in parts]
    with agents.row_blocks(sizes):
        logits, hidden = agents.forward(ids, mask, keep)
    out, start = [], 0
    for _, i, _, n in parts:
        stop = start + len(i)
        out.append((logits[start:stop, keep - n :], hidden[start:stop, keep - n :]))
        start = stop
    return out


@dataclass(frozen=True)
class ScoringJob:
    """What scoring needs of one agent's episodes."""

    name: str
    generation: Generation
    temperature: float
    kl_estimator: str
    critic: bool  # has a value head


@dataclass(frozen=True)
class TokenStatistics:
    """Per response token of an agent's episodes, unmasked, each [B, T]."""

    logprobs: torch.Tensor  # under the agent
    ref_logprobs: torch.Tensor  # under the reference
    values: torch.Tensor  # the agent's value head (0: critic-free)
    kl: torch.Tensor  # the KL penalty term (the recipe's estimator)


def _statistics(agents: Agents, job: ScoringJob, resp, logits, hidden, ref_logits):
    logprobs = _logprobs(logits, resp, job.temperature)
    ref_logprobs = _logprobs(ref_logits, resp, job.temperature)
    critic_free = torch.zeros_like(logprobs)
    values = agents.values(job.name, hidden[:, :-1]) if job.critic else critic_free
    if job.kl_estimator == "full":
        t = job.temperature
        kl = ppo.full_kl(logits[:, :-1] / t, ref_logits[:, :-1] / t)
    else:
        kl = ppo.kl_per_token(logprobs, ref_logprobs, job.kl_estimator)
    return logprobs, ref_logprobs, values, kl


@torch.no_grad()
def score(
    agents: Agents, jobs: list[ScoringJob], micro_batch_size: int, fused: bool
) -> dict[str, TokenStatistics]:
    """Each job's token statistics, micro_batch_size episodes of an agent at a time: its
    forward then the reference's. Fused, every job's share of micro_batch_size episodes and
    their reference rows in one forward of micro_batch_size rows, as a separate forward holds
    (so no more memory, and as many forwards).

    micro_batch_size rows whatever ppo.micro_batch_tokens: without gradients nothing is kept
    across layers, and the logits are taken at the response positions only, so a wider prompt
    (the observer's) adds little to the peak, while fewer rows per forward cost time (on CPU a
    forward's fixed cost dominates at these sizes)."""
    parts: dict[str, list[tuple]] = {job.name: [] for job in jobs}
    if not fused:
        for job in jobs:
            for rows, logits, hidden, ref in _agent_and_reference(
                agents, job.name, job.generation, micro_batch_size
            ):
                resp = job.generation.response_ids[rows]
                parts[job.name].append(_statistics(agents, job, resp, logits, hidden, ref))
    else:
        n = max(len(job.generation.response_ids) for job in jobs)
        share = max(1, micro_batch_size // (2 * len(jobs)))
        for rows in torch.arange(n).split(share):
            blocks = []
            for job in jobs:
                ids, mask = (t[rows] for t in sequences(job.generation))
                keep = job.generation.response_ids.shape[1] + 1
                blocks += [(job.name, ids, mask, keep), (None, ids, mask, keep)]
            outputs = forward_blocks(agents, blocks)
            for k, job in enumerate(jobs):
                (logits, hidden), (ref, _) = outputs[2 * k], outputs[2 * k + 1]
                resp = job.generation.response_ids[rows]
                parts[job.name].append(_statistics(agents, job, resp, logits, hidden, ref))
    return {
        name: TokenStatistics(*(torch.cat(column) for column in zip(*chunks, strict=True)))
        for name, chunks in parts.items()
    }


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
def rollout_from(
    statistics: TokenStatistics,
    gen: Generation,
    raw_scores: torch.Tensor,
    state: AgentState,
    cfg: PPOConfig,
    group_size: int = 1,
) -> Rollout:
    """An agent's scored episodes as a Rollout: per-token KL penalty and advantages (GAE, or
    critic-free over groups of `group_size` consecutive episodes answering the same query).

    raw_scores [B]: the agent's score per episode (its collective reward in CORY)."""
    input_ids, attention_mask = sequences(gen)
    response_ids, mask = gen.response_ids, gen.response_mask.float()
    logprobs, ref_logprobs, kl = statistics.logprobs, statistics.ref_logprobs, statistics.kl
    values = statistics.values * mask
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


@dataclass
class AgentUpdate:
    """One agent's PPO update in progress: its rollout, settings, the minibatches of every
    epoch (drawn up front), its running sums, and why it failed (None while it has not)."""

    name: str
    state: AgentState
    rollout: Rollout
    cfg: PPOConfig  # micro_batch_tokens already a number (`PPOConfig.with_token_cap`)
    temperature: float
    params: list[torch.nn.Parameter]
    minibatches: list[torch.Tensor]  # this rank's local rows of each optimizer step
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: int = 0
    micro_batches: int = 0
    failure: str | None = None

    @classmethod
    def start(cls, name, state, rollout, cfg, temperature, params, generator) -> AgentUpdate:
        """Under torchrun every rank draws the same permutation of the global batch and works
        on the rows of each minibatch it holds (`_my_rows`), so a minibatch holds the same
        episodes whatever the number of ranks."""
        rows_here = len(rollout.input_ids)
        minibatches = []
        for _ in range(cfg.epochs):
            order = torch.randperm(rows_here * distributed.world_size(), generator=generator)
            minibatches += [_my_rows(m, rows_here) for m in order.split(cfg.minibatch_size)]
        sums = {k: torch.zeros((), device=rollout.mask.device) for k in SUM_KEYS}
        return cls(name, state, rollout, cfg, temperature, params, minibatches, sums)

    @property
    def width(self) -> int:
        return self.rollout.input_ids.shape[1]

    def losses(self) -> dict[str, float]:
        return _mean_losses(
            self.sums, self.steps, self.micro_batches, critic=self.cfg.advantage == "gae"
        )


def run_updates(agents: Agents, updates: list[AgentUpdate], fused: bool) -> None:
    """Every update's optimizer steps (cfg.epochs passes over its rollout in minibatches), one
    agent at a time or, fused, all agents' k-th steps in one forward and backward each. An
    update whose loss or gradient turns NaN/inf stops there with `failure` set (the caller
    puts the agent back); the others go on."""
    groups = [updates] if fused else [[u] for u in updates]
    agents.model.train()  # LoRA dropout, if any, acts in updates only; base dropout is off
    try:
        for group in groups:
            with agents.training([u.name for u in group]):
                _steps(agents, group)
    finally:
        agents.model.eval()
        for u in updates:
            u.state.optimizer.zero_grad(set_to_none=True)  # frees gradients before generation


def _steps(agents: Agents, group: list[AgentUpdate]) -> None:
    """The optimizer steps of the updates in `group`, their k-th steps together. Agents may
    differ in epochs or minibatch size ([[agents]] keys): each steps while it has minibatches
    left and has not failed."""
    for k in range(max(len(u.minibatches) for u in group)):
        alive = [u for u in group if u.failure is None and k < len(u.minibatches)]
        if not alive:
            return
        _minibatch_step(agents, alive, k)
        faults.maybe_die("update")


def _minibatch_step(agents: Agents, group: list[AgentUpdate], k: int) -> None:
    """Optimizer step k of each update in `group`: gradients accumulated one micro-batch at a
    time (fused: every agent's micro-batch in one forward), summed across ranks, clipped and
    stepped per agent. A NaN/inf gradient norm sets that agent's `failure` (no step)."""
    rows = {u.name: u.minibatches[k] for u in group}
    n_tokens = {
        u.name: distributed.all_sum(u.rollout.mask[rows[u.name]].sum()).clamp(min=1) for u in group
    }
    micro = _micro_rows(group)
    splits = {u.name: rows[u.name].split(micro) for u in group}
    for u in group:
        u.state.optimizer.zero_grad(set_to_none=True)
    for m in range(max(len(s) for s in splits.values())):
        members = [(u, splits[u.name][m]) for u in group if m < len(splits[u.name])]
        total = None
        for u, micro_loss in _micro_batch_losses(agents, members, n_tokens):
            total = micro_loss.loss if total is None else total + micro_loss.loss
            u.micro_batches += 1
            _add_statistics(u.sums, micro_loss)
        total.backward()
    for u in group:
        distributed.sum_gradients(u.params)
        max_norm = u.cfg.max_grad_norm if u.cfg.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(u.params, max_norm)
        if not torch.isfinite(norm):  # one sync per optimizer step
            u.failure = "non-finite loss or gradient"
            continue
        u.sums["grad_norm"] += norm
        u.sums["tokens"] += n_tokens[u.name]
        u.state.optimizer.step()
        u.steps += 1


def _micro_rows(group: list[AgentUpdate]) -> int:
    """Rows of each agent per micro-batch: alone, as ppo.micro_batch_tokens allows at its width;
    fused, the widest member's share of that cap, so a fused micro-batch holds no more tokens
    than one agent's alone (memory as in separate passes)."""
    cfg = group[0].cfg
    if len(group) == 1:
        return cfg.micro_batch_rows(group[0].width)
    return max(1, cfg.micro_batch_rows(max(u.width for u in group)) // len(group))


def _micro_batch_losses(agents: Agents, members: list[tuple[AgentUpdate, torch.Tensor]], n_tokens):
    """Each member's micro-batch loss on its rows, from one forward (one member: through the
    active adapter, as a separate pass always ran)."""
    device = members[0][0].rollout.mask.device
    members = [(u, rows.to(device)) for u, rows in members]
    if len(members) == 1:
        u, rows = members[0]  # its adapter is the active one (`Agents.training`)
        T = u.rollout.response_ids.shape[1]
        outputs = [agents.forward(u.rollout.input_ids[rows], u.rollout.attention_mask[rows], T + 1)]
    else:
        blocks = [
            (
                u.name,
                u.rollout.input_ids[rows],
                u.rollout.attention_mask[rows],
                u.rollout.response_ids.shape[1] + 1,
            )
            for u, rows in members
        ]
        outputs = forward_blocks(agents, blocks)
    for (u, rows), (logits, hidden) in zip(members, outputs, strict=True):
        values = agents.values(u.name, hidden[:, :-1]) if u.cfg.advantage == "gae" else None
        yield u, micro_batch_loss(u, rows, logits, values, n_tokens[u.name])


def _add_statistics(sums: dict[str, torch.Tensor], micro: MicroBatchLoss) -> None:
    if micro.skipped is not None:
        sums["skips"] += micro.skipped
    with torch.no_grad():
        entropy = ppo.entropy(micro.logits[:, :-1])
        sums["entropy"] += (entropy * micro.mask).sum()
        sums["policy"] += micro.policy.detach()
        sums["value"] += micro.value.detach()
        sums["kl"] += micro.kl.detach()
        sums["clipped"] += micro.clipped_tokens
        sums["approx_kl"] += micro.approx_kl_sum


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
    u: AgentUpdate,
    rows: torch.Tensor,
    logits: torch.Tensor,
    values: torch.Tensor | None,
    n_tokens: torch.Tensor,
) -> MicroBatchLoss:
    """The PPO loss of the rollout's episodes `rows` ([b] local indices) from the agent's
    logits [b, T+1, V] and values [b, T] (None: critic-free) as it is now: the clipped policy
    loss, the value loss (GAE) and the KL term (ppo.kl_in = "loss"), each summed over tokens
    and divided by n_tokens, the minibatch's response tokens on all ranks (a scalar tensor)."""
    rollout, cfg = u.rollout, u.cfg
    beta = u.state.kl_ctl.value  # the rollout's KL coefficient (it moves after the update)
    mask = rollout.mask[rows]
    logprobs = _logprobs(logits, rollout.response_ids[rows], u.temperature)
    pg = ppo.policy_loss(
        logprobs,
        rollout.logprobs[rows],
        rollout.advantages[rows],
        mask,
        cfg.clip_range,
        n_tokens,
    )
    vf = torch.zeros((), device=mask.device)
    if values is not None:
        vf = ppo.value_loss(
            values,
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


class Snapshot:
    """An agent's parameters and optimizer state, to put it back after a failed update."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer):
        self.params, self.optimizer = params, optimizer
        self.saved_params = [p.detach().clone() for p in params]
        self.saved_optimizer = copy.deepcopy(optimizer.state_dict())

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved in zip(self.params, self.saved_params, strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(self.saved_optimizer)


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
