"""Task rewards: built-ins, and loading `module:function` rewards that follow TRL's convention.

A reward is `fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]`,
called with keyword arguments (`prompts=`, `completions=` and one list per dataset column), so
TRL reward functions drop in. `prompts` are the pioneer prompts, for the observer's completions
too: the reward judges an answer to the query, and the observer's own prompt contains the
pioneer's answer, which is not part of the question.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cory_lora.config import RewardConfig
from cory_lora.errors import UserError
from cory_lora.rewards.builtin import exact_match
from cory_lora.rewards.gsm8k import gsm8k_accuracy
from cory_lora.rewards.sentiment import sentiment_reward

BUILTIN: dict[str, Callable] = {
    "exact_match": exact_match,
    "gsm8k_accuracy": gsm8k_accuracy,
    "sentiment_reward": sentiment_reward,
}
# Keyword parameters a reward may declare; they are filled from the recipe (see load_reward).
RECIPE_PARAMETERS = ("model_name", "device", "batch_size")

__all__ = [
    "BUILTIN",
    "Reward",
    "RewardError",
    "exact_match",
    "gsm8k_accuracy",
    "load_reward",
    "sentiment_reward",
]


class RewardError(UserError):
    """The reward raised, or returned something that is not one number per completion."""


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

    def probe(self, prompts: list[str], columns: dict[str, list]) -> None:
        """Call the reward once on a few real prompts (their own text as dummy completions) so
        that import, download, column or return-type problems surface before training (NaN
        values are allowed here: they are judged in training)."""
        try:
            self(prompts, list(prompts), columns)
        except RewardError as e:
            raise UserError(
                f"{e} (in a trial call on the first prompts, before training)"
            ) from None

    def __call__(
        self, prompts: list[str], completions: list[str], columns: dict[str, list]
    ) -> torch.Tensor:
        """Score completions: float32 [B], NaN where the reward gave None or a non-finite value.
        Raises RewardError (naming the sample) for an exception, a wrong length or a non-number."""
        try:
            with torch.no_grad():
                values = self.fn(prompts=prompts, completions=completions, **columns)
        except SystemExit as e:  # would end the whole run, silently, with the reward's code
            raise RewardError(
                f"reward {self.name!r} called sys.exit({e.code!r}); a reward must return its "
                "scores (raise an exception to report a problem)"
            ) from None
        except Exception as e:
            raise RewardError(f"reward {self.name!r} raised {type(e).__name__}: {e}") from e
        if isinstance(values, torch.Tensor) and values.ndim >= 1:
            values = values.detach().cpu().flatten().tolist()
        elif type(values).__module__ == "numpy" and getattr(values, "ndim", 0) >= 1:
            values = values.ravel().tolist()
        if not isinstance(values, (list, tuple)):
            raise RewardError(
                f"reward {self.name!r} returned {_describe(values)}, expected a list of floats "
                "(one per completion)"
            )
        if len(values) != len(completions):
            raise RewardError(
                f"reward {self.name!r} returned {len(values)} values "
                f"for {len(completions)} completions"
            )
        scores = []
        for i, v in enumerate(values):
            v = _as_scalar(v)
            # None (TRL: "no score for this one") and NaN/inf come back as NaN: the training
            # loop skips the update they would poison, with a warning naming the samples.
            if v is not None and not isinstance(v, numbers.Real):  # "0.5" is not a number
                raise RewardError(
                    f"reward {self.name!r} returned {_short(v)} for sample {i} "
                    f"(completion {completions[i]!r}): a {type(v).__name__}, expected a number"
                )
            scores.append(math.nan if v is None else float(v))
        return torch.tensor(scores, dtype=torch.float32)


def _as_scalar(value):
    """A one-element tensor or a NumPy scalar as a Python number; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if type(value).__module__ == "numpy" and getattr(value, "size", 0) == 1:
        return value.item()
    return value


def _short(value) -> str:
    shown = repr(value)
    return shown[:80] + "..." if len(shown) > 80 else shown


def _describe(value) -> str:
    return f"{type(value).__name__} {_short(value)}"


def load_reward(cfg: RewardConfig | str, device: str = "cpu") -> Reward:
    """A built-in name or `module:function` (the module is imported from the current directory
    first, so a local `my_rewards.py` works).

    A reward that declares keyword parameters `model_name`, `device` or `batch_size` (as
    `sentiment_reward` does) gets them from `reward.model`, the run's device and
    `reward.batch_size`.
    """
    cfg = RewardConfig(function=cfg) if isinstance(cfg, str) else cfg
    fn = _resolve(cfg.function)
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        parameters = {}
    # An empty reward.model leaves model_name to the function's own default.
    given = {"model_name": cfg.model, "device": str(device), "batch_size": cfg.batch_size}
    bound = {k: v for k, v in given.items() if k in parameters and v != ""}
    return Reward(cfg.function, functools.partial(fn, **bound) if bound else fn)


def _resolve(spec: str) -> Callable:
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        known = ", ".join(BUILTIN)
        raise UserError(f"reward.function = {spec!r}: not a built-in ({known}) nor module:function")
    module_name, function_name = spec.split(":", 1)
    if not module_name or not function_name:
        raise UserError(f"reward.function = {spec!r}: expected module:function")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"reward.function = {spec!r}: cannot import {module_name!r}: {e}") from None
    except SyntaxError as e:
        raise UserError(
            f"reward.function = {spec!r}: {module_name!r} has a syntax error: {e.msg} "
            f"({e.filename}, line {e.lineno})"
        ) from None
    except (Exception, SystemExit) as e:  # the module's own code failed while being imported
        what = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else type(e).__name__
        where = ""
        frames = [f for f in inspect.trace() if f.filename.endswith(".py")]
        if frames:
            where = f" ({frames[-1].filename}, line {frames[-1].lineno})"
        raise UserError(
            f"reward.function = {spec!r}: importing {module_name!r} failed: {what}: {e}{where}"
            if not isinstance(e, SystemExit)
            else f"reward.function = {spec!r}: importing {module_name!r} called {what}{where}"
        ) from None
    if not hasattr(module, function_name):
        raise UserError(
            f"reward.function = {spec!r}: {module_name} has no function {function_name!r}"
        )
    fn = getattr(module, function_name)
    if not callable(fn):
        raise UserError(
            f"reward.function = {spec!r}: {module_name}.{function_name} is "
            f"{_describe(fn)}, not a function"
        )
    return fn
