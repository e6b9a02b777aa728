"""PPO maths as small pure functions (TRL 1.x no longer ships PPO).

Shapes: B = episodes, T = response tokens (right-padded; `mask` is 1 on real tokens).
Formulas follow the PPO used by the CORY paper's code (TRL 0.x `PPOTrainer`): per-token KL
penalty, the task score on the last response token, GAE, whitened advantages, clipped policy
and value losses, and the adaptive KL controller of Ziegler et al. (2019).

Losses are token sums divided by a caller-given token count (`n_tokens`, the count of the whole
minibatch), so summing the losses of micro-batches gives exactly the loss of the minibatch:
gradient accumulation 1x8 equals 8x1.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# --------------------------------------------------------------------------- log-probabilities
# Our own, in plain PyTorch: TRL's versions dispatch to a Triton kernel on CUDA whenever triton is
# importable, which needs a C compiler at run time and breaks the no-Triton promise.


def selective_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, rows_per_chunk: int = 1
) -> torch.Tensor:
    """log softmax(logits / temperature) at `tokens`, in float32. [B, T, V], [B, T] -> [B, T].

    Computed as logit - logsumexp(logits) a few rows at a time, so the float32 copy of the
    logits and the softmax never exist for the whole batch at once (memory), and in float32
    whatever the logits' dtype (bf16 logsumexp is unstable).
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    out = []
    for rows, ids in zip(logits.split(rows_per_chunk), tokens.split(rows_per_chunk), strict=True):
        rows = rows.float()
        if temperature != 1.0:
            rows = rows / temperature
        picked = torch.gather(rows, -1, ids.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(out)


def entropy(logits: torch.Tensor, rows_per_chunk: int = 128) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(logits) along the last axis, in float32.
    [..., V] -> [...], a chunk of rows at a time (memory)."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(rows_per_chunk):
        logp = chunk.float().log_softmax(-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


# --------------------------------------------------------------------------- masked statistics


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1. x, mask: same shape. Returns a scalar."""
    return (x * mask).sum() / mask.sum()


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over positions where mask is 1 (Bessel-corrected by default)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError("unbiased variance needs at least two masked-in values")
        var = var * n / (n - 1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, all_sum=lambda t: t
) -> torch.Tensor:
    """(x - mean) / std over masked positions (std Bessel-corrected, as masked_var); with
    shift_mean=False the mean is added back. Masked-out positions are returned as 0. `all_sum`
    (a sum over processes) makes the mean and variance those of every process's x together."""
    n = all_sum(mask.sum())
    if n < 2:
        raise ValueError("unbiased variance needs at least two masked-in values")
    mean = all_sum((x * mask).sum()) / n
    var = all_sum(((x - mean) ** 2 * mask).sum()) / n
    var = var * n / (n - 1)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


# --------------------------------------------------------------------------- KL and rewards


def kl_per_token(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token KL estimate from the sampled tokens' logprobs. [B, T] -> [B, T].

    k1 = log p - log p_ref (unbiased, can be negative);
    k3 = (r - 1) - log r with r = p_ref / p (unbiased, never negative; Schulman 2020).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k3; `full` uses full_kl)")


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || p_ref) over the vocabulary at each position. [B, T, V] x2 -> [B, T]."""
    logp = logits.float().log_softmax(-1)
    ref_logp = ref_logits.float().log_softmax(-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token rewards: -kl_coef * kl everywhere, plus the score on the last real token.

    scores [B], kl [B, T], mask [B, T] -> [B, T] (0 on padding). Every row needs a token.
    """
    rewards = -kl_coef * kl * mask
    last = mask.sum(1).long() - 1
    rows = torch.arange(len(scores), device=scores.device)
    rewards[rows, last] += scores
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over right-padded rows.

    rewards, values, mask: [B, T]. The value after the last real token is 0 (the episode ends).
    Returns (advantages [B, T], returns [B, T]) with returns = advantages + values.
    """
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


# --------------------------------------------------------------------------- critic-free


def group_advantages(scores: torch.Tensor, group_size: int, kind: str) -> torch.Tensor:
    """Per-episode advantages without a value head, from the scores [N] of N / G queries' G
    answers each (a query's answers consecutive). [N] -> [N].

    rloo (Ahmadian et al. 2024): score minus the mean of the other G - 1 scores of its group;
    grpo (Shao et al. 2024): (score - group mean) / (group std + 1e-4), std Bessel-corrected.
    As TRL's RLOOTrainer and GRPOTrainer (scale_rewards="group") compute them.
    """
    if group_size < 2 or len(scores) % group_size:
        raise ValueError(f"{len(scores)} scores do not form groups of {group_size} >= 2")
    groups = scores.view(-1, group_size)
    if kind == "rloo":
        baseline = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)
        return (groups - baseline).reshape(-1)
    if kind == "grpo":
        mean = groups.mean(1, keepdim=True)
        std = groups.std(1, keepdim=True)  # unbiased, as TRL's nanstd
        return ((groups - mean) / (std + 1e-4)).reshape(-1)
    raise ValueError(f"unknown critic-free advantage {kind!r} (rloo, grpo)")


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask, n_tokens) -> torch.Tensor:
    """GRPO's KL term: sum over tokens of the k3 estimate exp(ref - logp) - (ref - logp) - 1
    (>= 0) of the current policy against the reference, / n_tokens. [B, T] -> scalar."""
    delta = ref_logprobs - logprobs
    return ((torch.exp(delta) - delta - 1) * mask).sum() / n_tokens


# --------------------------------------------------------------------------- losses


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable
    clipped_tokens: torch.Tensor  # scalar count of tokens where the clipped term was active
    approx_kl_sum: torch.Tensor  # scalar, sum over tokens of 0.5 * (log ratio)^2
    ratio_sum: torch.Tensor  # scalar, sum over tokens of the ratio (for its mean)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    n_tokens: float,
) -> PolicyLoss:
    """Clipped surrogate: sum over tokens of max(-A r, -A clip(r, 1-e, 1+e)) / n_tokens.

    All tensors [B, T]; r = exp(logprobs - old_logprobs).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = (torch.max(unclipped, clipped) * mask).sum() / n_tokens
    with torch.no_grad():
        clipped_tokens = ((clipped > unclipped).float() * mask).sum()
        approx_kl_sum = (0.5 * log_ratio**2 * mask).sum()
        ratio_sum = (ratio * mask).sum()
    return PolicyLoss(loss, clipped_tokens, approx_kl_sum, ratio_sum)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    n_tokens: float,
) -> torch.Tensor:
    """Clipped value loss: sum of 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2) / n_tokens.

    All tensors [B, T]. Returns a differentiable scalar.
    """
    clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    losses = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * (losses * mask).sum() / n_tokens


# --------------------------------------------------------------------------- controllers


class KLController:
    """The KL coefficient beta: fixed, or adaptive (Ziegler et al. 2019, as in TRL 0.x).

    Adaptive: err = clip(KL / target - 1, -0.2, 0.2); beta *= 1 + err * n_episodes / horizon.
    """

    def __init__(self, init: float, adaptive: bool, target: float, horizon: int):
        self.value, self.adaptive, self.target, self.horizon = init, adaptive, target, horizon

    def update(self, current_kl: float, n_episodes: int) -> None:
        if not self.adaptive:
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_episodes / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class RunningMoments:
    """Running mean and standard deviation of all scores seen (Chan et al. parallel update)."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        xs = xs.double()
        n = xs.numel()
        batch_mean = xs.mean().item()
        batch_var = xs.var(unbiased=False).item()
        delta = batch_mean - self.mean
        total = self.count + n
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        """Sample standard deviation (Bessel-corrected)."""
        return math.sqrt(self.var * self.count / max(self.count - 1, 1e-24))

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = (float(state[k]) for k in ("mean", "var", "count"))


def normalise_scores(
    scores: torch.Tensor,
    moments: RunningMoments | None,
    subtract_mean: bool,
    clip: float,
    batch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Score scaling as in TRL 0.x: update the running moments, divide by the running std (and
    subtract the running mean when subtract_mean), then clip to [-clip, clip] when clip > 0.
    scores [B] -> [B]. moments=None skips scaling. `batch`: the scores the moments learn from
    when they are more than `scores` (every process's, under data parallelism)."""
    if moments is not None:
        moments.update(scores if batch is None else batch)
        scale = moments.std + torch.finfo(scores.dtype).eps
        scores = (scores - moments.mean) / scale if subtract_mean else scores / scale
    if clip > 0:
        scores = scores.clamp(-clip, clip)
    return scores
