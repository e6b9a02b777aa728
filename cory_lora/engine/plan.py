"""Peak GPU memory of a recipe, estimated from the model's config alone (nothing is loaded).

The model is built on PyTorch's `meta` device (shapes, no storage), so every architecture gets
exact parameter counts. What is counted, in bytes:

* **base weights**: 4-bit NF4 linear layers at 0.5 byte per weight plus their quantisation
  constants (double quantisation: ~1/64 byte per weight; without: 4/64); embeddings, norms and the
  LM head stay in the compute dtype (bitsandbytes does not quantise them). Full precision: every
  weight at the dtype's size.
* **each agent**: LoRA weights in float32 + their gradients + AdamW's two moments (16 bytes per
  LoRA parameter), and its float32 value head likewise.
* **generation**: the KV cache for one generation micro-batch at the longest prompt plus
  max_new_tokens, plus the prefill's widest transient activations.
* **training** (one micro-batch of prompt + response tokens): activations saved for the backward
  pass — per layer and token roughly the inputs of every linear layer, the attention output and
  the MLP's intermediate activations, plus float32 RMSNorm statistics; with gradient
  checkpointing only each layer's input is kept and one layer is recomputed at a time — and the
  response logits in float32 (our forward computes logits for response positions only).
* **reserve**: CUDA context and allocator fragmentation, 0.5 GB + 10%.

Peak = base + agents + max(generation, training) + reserve. An estimate, not a measurement: the
GPU check in bench/ measures `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cory_lora.config import Recipe
from cory_lora.engine.model import read_model_config, resolve_dtype
from cory_lora.errors import UserError

GB = 1024**3


@dataclass(frozen=True)
class MemoryPlan:
    parts: dict[str, float]  # component -> bytes
    peak: float

    def fits(self, gpu_gb: float) -> bool:
        return self.peak <= gpu_gb * GB


def _meta_model(recipe: Recipe):
    from transformers import AutoModelForCausalLM

    config = read_model_config(
        recipe.model,
        "its config (a local directory with config.json, or a hub id reachable or cached)",
    )
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, trust_remote_code=recipe.model.trust_remote_code
            )
    except (ValueError, KeyError, TypeError) as e:  # e.g. not a causal LM (a BERT config)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"model.name_or_path = {recipe.model.name_or_path!r}: not a causal language model "
            f"cory-lora can plan for: {reason}"
        ) from None
    return config.get_text_config(), model


def _is_target(name: str, targets: tuple[str, ...]) -> bool:
    if targets == ("all-linear",):
        return True
    return name.rsplit(".", 1)[-1] in targets


def estimate(recipe: Recipe) -> MemoryPlan:
    """The recipe's peak GPU memory, by part (see the module's docstring for what is counted)."""
    config, model = _meta_model(recipe)
    _check_plannable(recipe, config)
    dtype = resolve_dtype(recipe.model.dtype, torch.device("cuda"))
    if recipe.model.dtype == "auto":
        dtype = torch.bfloat16  # what `auto` gives on a recent GPU
    width = torch.finfo(dtype).bits // 8
    base, agents_bytes = _weight_bytes(recipe, model, config.hidden_size, width)
    dims = _Dims.of(config)
    kv_cache, prefill = _generation_bytes(recipe, dims, width)
    activations, logits = _training_bytes(recipe, dims, width)
    n_agents = len(recipe.agent_names)
    parts = {
        "base weights": base,
        f"adapters + optimizer ({n_agents} agent{'s' * (n_agents > 1)})": agents_bytes,
        "generation: KV cache": kv_cache,
        "generation: prefill activations": prefill,
        "training: activations"
        + (" (checkpointed)" if recipe.model.gradient_checkpointing else ""): activations,
        "training: response logits": logits,
    }
    working = base + agents_bytes + max(kv_cache + prefill, activations + logits)
    reserve = 0.5 * GB + 0.1 * working
    parts["CUDA context + fragmentation reserve"] = reserve
    return MemoryPlan(parts, working + reserve)


def _check_plannable(recipe: Recipe, config) -> None:
    missing = [
        key
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if not isinstance(getattr(config, key, None), int)
    ]
    if missing:
        raise UserError(
            f"model.name_or_path = {recipe.model.name_or_path!r}: its config has no "
            f"{', '.join(missing)}; cory-lora cannot plan for this architecture"
        )


def _weight_bytes(recipe: Recipe, model, hidden: int, width: int) -> tuple[float, int]:
    """(the base's weights, every agent's LoRA weights and value head with their gradients and
    AdamW moments), in bytes; `width`: bytes per weight in the compute dtype."""
    head = model.get_output_embeddings()
    linear = 0
    lora = dict.fromkeys(recipe.agent_names, 0)  # LoRA parameters of each agent (its own shape)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            linear += module.weight.numel()
            for agent in lora:
                shape = recipe.lora_of(agent)
                if _is_target(name, shape.target_modules):
                    lora[agent] += shape.r * (module.in_features + module.out_features)
    total = sum(p.numel() for p in model.parameters())
    other = total - linear
    if recipe.model.load_in_4bit:
        base = linear * (0.5 + 1 / 64 + 4 / (64 * 256)) + other * width
    else:
        base = total * width
    head = hidden + 1 if recipe.ppo.advantage == "gae" else 0  # critic-free: no value head
    agents_bytes = sum(16 * (n + head) for n in lora.values())  # fp32 weight, grad, 2 moments
    return base, agents_bytes


@dataclass(frozen=True)
class _Dims:
    """The sizes of a transformer that its activations and KV cache grow with."""

    hidden: int
    layers: int
    kv_dim: int  # width of a layer's keys (and of its values): KV heads x head size
    inter: int  # the MLP's intermediate width
    vocab: int

    @classmethod
    def of(cls, config) -> _Dims:
        hidden, heads = config.hidden_size, config.num_attention_heads
        inter = (
            getattr(config, "intermediate_size", None)
            or getattr(config, "n_inner", None)
            or 4 * hidden
        )
        return cls(
            hidden=hidden,
            layers=config.num_hidden_layers,
            kv_dim=getattr(config, "num_key_value_heads", heads) * (hidden // heads),
            inter=inter,
            vocab=config.vocab_size,
        )


def _generation_bytes(recipe: Recipe, dims: _Dims, width: int) -> tuple[int, int]:
    """(the KV cache, the prefill's activations) of one generation micro-batch at the longest
    prompt plus max_new_tokens."""
    g = recipe.generation
    prompt, new = recipe.data.max_prompt_tokens, g.max_new_tokens
    gen_batch = min(g.batch_size, recipe.ppo.batch_size * g.samples_per_query)
    kv_cache = 2 * dims.layers * gen_batch * (prompt + new) * dims.kv_dim * width
    prefill = gen_batch * prompt * (4 * dims.hidden + 2 * dims.inter) * width
    return kv_cache, prefill


def _training_bytes(recipe: Recipe, dims: _Dims, width: int) -> tuple[int, int]:
    """(the activations kept for the backward pass, the response logits) of one training
    micro-batch of the longest sequences."""
    prompt, new = recipe.data.max_prompt_tokens, recipe.generation.max_new_tokens
    rows = recipe.ppo.micro_batch_rows(prompt + new)
    tokens = rows * (prompt + new)
    hidden, inter = dims.hidden, dims.inter
    per_layer_token = width * (8 * hidden + 2 * dims.kv_dim + 4 * inter) + 2 * 2 * hidden * 4
    if recipe.model.gradient_checkpointing:
        activations = tokens * (dims.layers * hidden * width + per_layer_token)
    else:
        activations = tokens * dims.layers * per_layer_token
    # logits in the compute dtype, their float32 copy and log-softmax, and its gradient
    logits = rows * (new + 1) * dims.vocab * (width + 4 + 4)
    return activations, logits
