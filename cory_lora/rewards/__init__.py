"""Task rewards: built-ins, and loading `module:function` rewards that follow TRL's convention.

A reward is `fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]`,
called with keyword arguments (`prompts=`, `completions=` and one list per dataset column), so
TRL reward functions drop in. `prompts` are the pioneer prompts, for the observer's completions
too: the reward judges an answer to the query, and the observer's own prompt contains the
pioneer's answer, which is not part of the question.

TRL passes conversational datasets' completions as messages, and its own rewards
(`trl.rewards.accuracy_reward`, ...) read `completion[0]["content"]`. `reward.completion_format`
chooses: `text`, `conversational` (each completion `[{"role": "assistant", "content": text}]`,
each prompt `[{"role": "system", ...}, {"role": "user", "content": prompt}]`), or `auto`:
text for our built-ins (always), conversational for `trl.rewards` functions, and for any other
`module:function` conversational when the prompts are chat-templated (data.chat_template), as
TRL does.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import math
import numbers
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal

import torch

from cory_lora.config import DataConfig, RewardConfig
from cory_lora.errors import RewardError, UserError
from cory_lora.rewards.builtin import exact_match
from cory_lora.rewards.gsm8k import gsm8k_accuracy
from cory_lora.rewards.http import http_reward
from cory_lora.rewards.sentiment import sentiment_reward
from cory_lora.rewards.vader import vader_positivity

BUILTIN: dict[str, Callable] = {
    "exact_match": exact_match,
    "gsm8k_accuracy": gsm8k_accuracy,
    "http_reward": http_reward,
    "sentiment_reward": sentiment_reward,
    "vader_positivity": vader_positivity,
}
# Keyword parameters a reward may declare; they are filled from the recipe (see load_reward).
RECIPE_PARAMETERS = ("model_name", "device", "batch_size", "url", "timeout_s", "retries")

__all__ = [
    "BUILTIN",
    "Reward",
    "RewardError",
    "exact_match",
    "gsm8k_accuracy",
    "http_reward",
    "load_reward",
    "sentiment_reward",
    "vader_positivity",
]


TEXT, CONVERSATIONAL = "text", "conversational"


@dataclass(frozen=True)
class Reward:
    """A loaded reward function, the name the recipe gave it (for error messages) and the form
    it gets prompts and completions in (`text` or `conversational`)."""

    name: str
    fn: Callable
    completion_format: str = TEXT
    system_prompt: str = ""  # the system message of conversational prompts; empty: none

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
            _, unusable = self.score(prompts, list(prompts), columns)
        except RewardError as e:
            raise UserError(
                f"{e} (in a trial call on the first prompts, before training)"
            ) from None
        if prompts and len(unusable) == len(prompts):  # nothing a run could learn from
            raise UserError(
                f"reward {self.name!r} returned no usable score in a trial call on the first "
                f"prompts, before training ({describe_unusable(unusable)}); a run would learn "
                "nothing. Check the reward (for reward.url, its server)"
            )

    def __call__(
        self, prompts: list[str], completions: list[str], columns: dict[str, list]
    ) -> torch.Tensor:
        """Score completions: float32 [B], NaN where the reward gave no usable number."""
        return self.score(prompts, completions, columns)[0]

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, list]
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """Score completions: float32 [B], NaN where the reward gave None, NaN, inf or a number
        beyond float32; and what each such value was, by sample ("null", "nan", "1e+308: beyond
        float32"). Any real number type is taken (int of any size, float, Decimal, Fraction,
        NumPy and one-element tensors). Raises RewardError (naming the sample) for an
        exception, a wrong length or a value that is not a real number."""
        # The reward is user code: it gets copies, so an in-place clean-up
        # (`completions[i] = c.strip()`) cannot change the observer's input, the other rewards
        # or samples.jsonl; lists of short strings are cheap to copy.
        given_prompts, given_completions = self.shaped(list(prompts), list(completions))
        given_columns = {name: copy.deepcopy(values) for name, values in columns.items()}
        cwd = os.getcwd()
        try:
            with torch.no_grad():
                values = self.fn(
                    prompts=copy.deepcopy(given_prompts),
                    completions=copy.deepcopy(given_completions),
                    **given_columns,
                )
        except RewardError:
            raise  # already says what went wrong (an HTTP reward's server, say)
        except SystemExit as e:  # would end the whole run, silently, with the reward's code
            raise RewardError(
                f"reward {self.name!r} called sys.exit({e.code!r}); a reward must return its "
                "scores (raise an exception to report a problem)"
            ) from None
        except Exception as e:
            hint = ""
            if self.completion_format == CONVERSATIONAL:
                hint = (
                    " (it was given TRL's conversational form, completions as "
                    '[{"role": "assistant", "content": ...}]; set reward.completion_format = '
                    '"text" for plain strings)'
                )
            raise RewardError(
                f"reward {self.name!r} raised {type(e).__name__}: {e}{user_frame(e)}{hint}"
            ) from e
        finally:
            if _cwd_moved(cwd):  # a code-running reward's os.chdir must not move the run
                os.chdir(cwd)
        return self._checked(values, completions)

    def _checked(self, values, completions: list[str]) -> tuple[torch.Tensor, dict[int, str]]:
        """What the reward returned as float32 scores [B] (NaN where unusable) and what each
        unusable value was; RewardError for a wrong type or length."""
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
        scores, unusable = [], {}
        for i, v in enumerate(values):
            v = _as_scalar(v)
            # None (TRL: "no score for this one") and NaN/inf come back as NaN: the training
            # loop skips the update they would poison, with a warning naming the samples.
            if v is not None and not isinstance(v, (numbers.Real, Decimal)):  # "0.5" is not
                wanted = "a real number" if isinstance(v, numbers.Number) else "a number"
                raise RewardError(
                    f"reward {self.name!r} returned {_short(v)} for sample {i} "
                    f"(completion {completions[i]!r}): a {type(v).__name__}, expected {wanted}"
                )
            value, problem = _as_float(v)
            scores.append(value)
            if problem:
                unusable[i] = problem
        return torch.tensor(scores, dtype=torch.float32), unusable

    def shaped(self, prompts: list[str], completions: list[str]) -> tuple[list, list]:
        """Prompts and completions in the form this reward takes."""
        if self.completion_format == TEXT:
            return prompts, completions
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return (
            [[*system, {"role": "user", "content": p}] for p in prompts],
            [[{"role": "assistant", "content": c}] for c in completions],
        )


def _cwd_moved(cwd: str) -> bool:
    try:
        return os.getcwd() != cwd
    except OSError:  # the reward removed the directory it moved to
        return True


LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def user_frame(error: BaseException) -> str:
    """` (file, line N)`: where user code raised `error`: the innermost frame outside the
    standard library, installed packages and cory-lora (a reward that raises inside a library
    call is named at its own line), else the innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)[1:]  # [0] is our call of the reward
    if not frames:
        return ""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own = [
        f
        for f in frames
        if not os.path.abspath(f.filename).startswith((*LIBRARY_DIRS, ours))
        and not f.filename.startswith("<frozen")
    ]
    frame = (own or frames)[-1]
    return f" ({frame.filename}, line {frame.lineno})"


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _as_float(value) -> tuple[float, str | None]:
    """(the reward as a float, None) or (NaN, what it was: null, nan, inf, a number beyond
    float32)."""
    if value is None:
        return math.nan, "null"
    try:
        number = float(value)
    except OverflowError:  # an int (or Fraction) too large for any float
        if isinstance(value, int):  # repr() of a huge int can itself fail
            return math.nan, f"an integer of {value.bit_length()} bits: beyond float32"
        return math.nan, f"{type(value).__name__} beyond float32"
    except ValueError:  # Decimal('sNaN')
        return math.nan, "nan"
    if math.isnan(number):
        return math.nan, "nan"
    if math.isinf(number):
        return math.nan, "inf" if number > 0 else "-inf"
    if abs(number) > FLOAT32_MAX:  # would be inf in the float32 the loop computes in
        return math.nan, f"{number:g}: beyond float32"
    return number, None


def describe_unusable(unusable: dict[int, str], limit: int = 8) -> str:
    """`0: null, 3: inf, ...` for the first `limit` unusable samples."""
    shown = ", ".join(f"{i}: {what}" for i, what in list(unusable.items())[:limit])
    return shown + (", ..." if len(unusable) > limit else "")


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


def load_reward(
    cfg: RewardConfig | str, device: str = "cpu", data: DataConfig | None = None
) -> Reward:
    """A built-in name or `module:function` (the module is imported from the current directory
    first, so a local `my_rewards.py` works). `data` (the recipe's) tells `auto` whether prompts
    are chat-templated, and gives conversational prompts their system message.

    A reward that declares keyword parameters `model_name`, `device`, `batch_size`, `url`,
    `timeout_s` or `retries` (as `sentiment_reward` and `http_reward` do) gets them from
    `reward.model`, the run's device and the reward keys of the same names.
    """
    cfg = RewardConfig(function=cfg) if isinstance(cfg, str) else cfg
    fn = _resolve(cfg.function)
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        parameters = {}
    # An empty reward.model leaves model_name to the function's own default.
    given = {
        "model_name": cfg.model,
        "device": str(device),
        "batch_size": cfg.batch_size,
        "url": cfg.url,
        "timeout_s": cfg.timeout_s,
        "retries": cfg.retries,
    }
    bound = {k: v for k, v in given.items() if k in parameters and v != ""}
    return Reward(
        cfg.function,
        functools.partial(fn, **bound) if bound else fn,
        completion_format(cfg.completion_format, fn, data),
        data.system_prompt if data is not None and data.chat_template else "",
    )


def completion_format(choice: str, fn: Callable, data: DataConfig | None) -> str:
    """`text` or `conversational` for reward `fn` (see the module docstring for `auto`)."""
    if choice != "auto":
        return choice
    if any(fn is builtin for builtin in BUILTIN.values()):
        return TEXT
    module = getattr(fn, "__module__", None) or type(fn).__module__
    if module == "trl.rewards" or module.startswith("trl.rewards."):
        return CONVERSATIONAL  # TRL's rewards read completion[0]["content"]
    return CONVERSATIONAL if data is not None and data.chat_template else TEXT


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
