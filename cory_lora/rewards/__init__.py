"""Task rewards: built-ins, and loading `module:function` rewards that follow TRL's convention.

A reward is `fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]`,
called with keyword arguments (`prompts=`, `completions=` and one list per dataset column), so
TRL reward functions drop in. `prompts` are the pioneer prompts, for the observer's completions
too: the reward judges an answer to the query, and the observer's own prompt contains the
pioneer's answer, which is not part of the question.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cory_lora.errors import UserError
from cory_lora.rewards.builtin import exact_match

BUILTIN: dict[str, Callable] = {"exact_match": exact_match}

__all__ = ["BUILTIN", "Reward", "exact_match", "load_reward"]


class RewardError(UserError):
    """The reward raised, or returned something that is not one finite number per completion."""


@dataclass(frozen=True)
class Reward:
    """A loaded reward function and the name the recipe gave it (for error messages)."""

    name: str
    fn: Callable

    def check_signature(self, columns: Sequence[str]) -> None:
        """Fail early, before any model is loaded, if the function cannot take our arguments."""
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return  # builtins and C functions: nothing to inspect
        names = {"prompts": [], "completions": [], **{c: [] for c in columns}}
        try:
            signature.bind(**names)
        except TypeError as e:
            raise UserError(
                f"reward.function = {self.name!r} cannot be called as "
                f"fn(prompts=..., completions=..., {', '.join(f'{c}=...' for c in columns)}): {e}. "
                "Add **kwargs to accept dataset columns it does not use."
            ) from None

    def __call__(
        self, prompts: list[str], completions: list[str], columns: dict[str, list]
    ) -> torch.Tensor:
        """Score completions; returns float32 [B]. Raises RewardError naming the bad sample."""
        try:
            with torch.no_grad():
                values = self.fn(prompts=prompts, completions=completions, **columns)
        except Exception as e:
            raise RewardError(f"reward {self.name!r} raised {type(e).__name__}: {e}") from e
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().flatten().tolist()
        try:
            values = list(values)
        except TypeError:
            raise RewardError(
                f"reward {self.name!r} returned {type(values).__name__}, expected a list of floats"
            ) from None
        if len(values) != len(completions):
            raise RewardError(
                f"reward {self.name!r} returned {len(values)} values "
                f"for {len(completions)} completions"
            )
        scores = []
        for i, v in enumerate(values):
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise RewardError(
                    f"reward {self.name!r} returned {v!r} for sample {i} "
                    f"(completion {completions[i]!r}); expected a number"
                ) from None
            if not math.isfinite(x):
                raise RewardError(
                    f"reward {self.name!r} returned {x} for sample {i} "
                    f"(completion {completions[i]!r})"
                )
            scores.append(x)
        return torch.tensor(scores, dtype=torch.float32)


def load_reward(spec: str) -> Reward:
    """`spec` is a built-in name or `module:function` (the module is imported from the current
    directory first, so a local `my_rewards.py` works)."""
    if spec in BUILTIN:
        return Reward(spec, BUILTIN[spec])
    if ":" not in spec:
        known = ", ".join(BUILTIN)
        raise UserError(f"reward.function = {spec!r}: not a built-in ({known}) nor module:function")
    module_name, function_name = spec.split(":", 1)
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"reward.function = {spec!r}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise UserError(
            f"reward.function = {spec!r}: {module_name} has no function {function_name!r}"
        )
    return Reward(spec, fn)
