"""Our forward for PEFT's LoRA linear layers: in the base's dtype, and by blocks of rows.

PEFT keeps LoRA weights in float32 on a bfloat16 base and casts each layer's *activations* to
float32 and the sum back (`_cast_input_dtype`): on our profile of a SmolLM2 update that was 29% of
CPU time (`aten::copy_`, 2,472 calls a step). Here the small *weights* are cast to the
activations' dtype instead (`A.to(x.dtype)`: r x in elements, not rows x tokens x in), so the
float32 weights stay the masters the optimizer steps, their gradients flow back through the
cast, and a float32 base computes exactly as PEFT does. The scale is applied inside the add
(`torch.add(result, delta, alpha=scaling)`), one op fewer per layer; with a power-of-two
scaling (alpha / r = 2 in our recipes) that is bit for bit PEFT's `result + delta * scaling`.

Blocks: inside `row_blocks(...)` each block of rows of the batch goes through its own adapter,
or through none (the reference), whatever adapter is active: every agent's rows and the
reference rows in one forward. A block's rows are a slice (a view), never a gather; each
adapter's output (and so its gradient) comes from its own rows only, because nothing in a
causal LM mixes rows. PEFT's own mixed batches (`adapter_names=`) refuse training mode and
gather rows by index; ours trains.

Anything else PEFT supports (DoRA and other variants, merged or disabled adapters, its
`adapter_names=`) goes through PEFT's own forward unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MethodType

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Block:
    """Rows [start, stop) of a batch, through adapter `adapter` (None: the base alone)."""

    adapter: str | None
    start: int
    stop: int


def blocks_of(sizes: Sequence[tuple[str | None, int]]) -> tuple[Block, ...]:
    """[(adapter, rows), ...] in batch order -> contiguous Blocks."""
    out, start = [], 0
    for adapter, rows in sizes:
        out.append(Block(adapter, start, start + rows))
        start += rows
    return tuple(out)


_BLOCKS: ContextVar[tuple[Block, ...] | None] = ContextVar("lora_row_blocks", default=None)


@contextmanager
def row_blocks(blocks: tuple[Block, ...]) -> Iterator[None]:
    """Forwards inside the block send each block of rows through its own adapter (or none)."""
    token = _BLOCKS.set(blocks)
    try:
        yield
    finally:
        _BLOCKS.reset(token)


def _weights(layer, adapter: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter's A and B weights in `dtype`. Where gradients flow, cast in the graph (the
    float32 masters get the gradient). Without (generation, scoring), the cast copies are kept
    until a master changes (its version counter moves with every in-place write: optimizer
    steps, loads, restores): a decode step's activations are a few rows, so casting both
    weights of every layer at every step would cost more than the cast it replaces."""
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    if a.dtype == dtype and b.dtype == dtype:
        return a, b
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return a.to(dtype), b.to(dtype)
    cache = layer.__dict__.setdefault("_cory_cast_weights", {})
    stamp = (a._version, b._version, a.data_ptr(), b.data_ptr())
    hit = cache.get((adapter, dtype))
    if hit is None or hit[0] != stamp:
        hit = cache[adapter, dtype] = (stamp, a.detach().to(dtype), b.detach().to(dtype))
    return hit[1], hit[2]


def _delta(layer, adapter: str, x: torch.Tensor) -> torch.Tensor:
    """The adapter's low-rank update B(A(dropout(x))) in x's dtype, unscaled."""
    a, b = _weights(layer, adapter, x.dtype)
    h = F.linear(layer.lora_dropout[adapter](x), a)
    bias = layer.lora_B[adapter].bias
    return F.linear(h, b, None if bias is None else bias.to(x.dtype))


def _forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if layer.disable_adapters or layer.merged or layer.lora_variant or "adapter_names" in kwargs:
        return layer._peft_forward(x, *args, **kwargs)
    result = layer.base_layer(x, *args, **kwargs)
    blocks = _BLOCKS.get()
    if blocks is None:
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                delta = _delta(layer, adapter, x).to(result.dtype)
                result = torch.add(result, delta, alpha=layer.scaling[adapter])
        return result
    parts = []
    for block in blocks:
        part = result[block.start : block.stop]
        if block.adapter is not None and block.adapter in layer.lora_A:
            delta = _delta(layer, block.adapter, x[block.start : block.stop]).to(result.dtype)
            part = torch.add(part, delta, alpha=layer.scaling[block.adapter])
        parts.append(part)
    return torch.cat(parts)


def _is_lora_linear(module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer) and isinstance(
        getattr(module, "base_layer", None), torch.nn.Linear
    )


def install(model: torch.nn.Module) -> int:
    """Give every LoRA linear layer of `model` our forward (PEFT's stays reachable as
    `_peft_forward` for what ours leaves to it). Returns the number of layers changed."""
    count = 0
    for module in model.modules():
        if _is_lora_linear(module) and not hasattr(module, "_peft_forward"):
            module._peft_forward = module.forward
            module.forward = MethodType(_forward, module)
            count += 1
    return count
