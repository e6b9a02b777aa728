"""Elastic Reset (Noukhovitch et al., NeurIPS 2023): keep an exponential moving average of an
agent's adapter; every `reset.every` iterations reset the adapter to its EMA and the EMA to the
initial adapter (the optimizer's moments are cleared by the caller). The reward–KL baseline a
CORY reviewer named: it too claims a better frontier than PPO.

Our reading, where the paper leaves room: the EMA covers the LoRA weights (the policy), not the
value head, which keeps tracking the returns of whatever policy is in place; it is updated once
per iteration, after the agent's PPO update.
"""

from __future__ import annotations

import torch


class AdapterEMA:
    """EMA of a list of parameters (updated in place by `update`) and the values it resets to."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.initial = [p.detach().clone() for p in params]
        self.average = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        """average <- decay * average + (1 - decay) * params."""
        for average, p in zip(self.average, self.params, strict=True):
            average.lerp_(p.detach(), 1.0 - self.decay)

    @torch.no_grad()
    def reset(self) -> None:
        """params <- average; average <- initial."""
        for average, initial, p in zip(self.average, self.initial, self.params, strict=True):
            p.copy_(average)
            average.copy_(initial)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"average.{i}": t.detach().cpu().contiguous() for i, t in enumerate(self.average)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if len(state) != len(self.average):
            raise ValueError(f"EMA state has {len(state)} tensors, expected {len(self.average)}")
        with torch.no_grad():
            for i, average in enumerate(self.average):
                average.copy_(state[f"average.{i}"])
