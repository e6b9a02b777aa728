"""Data parallelism over processes started by `torchrun`: every helper here is a no-op in a single
process, so the training code reads the same either way.

Each rank holds the whole shared base and every agent (they are small: adapters and value heads),
generates and scores its share of the global batch, and takes part in the same optimizer steps:
the gradients of the trainable parameters are summed across ranks, and every statistic that
shapes an update (token counts, score moments, advantage whitening, the KL controller) or is
logged is global. So K ranks x B/K episodes take the same update as 1 rank x B episodes, and the
agents stay identical on every rank. Rank 0 alone writes.

Not sharded, on purpose: the frozen 4-bit base is loaded by every rank (ZeRO/FSDP would shard
weights that take no gradient and do not mix with bitsandbytes' 4-bit tensors); what is
replicated and synchronised is only the adapters, value heads and their AdamW moments.
"""

from __future__ import annotations

import math
import os
import shlex
from datetime import timedelta

import torch
import torch.distributed as dist

from cory_lora.errors import UserError


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher) for several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start(device: str) -> None:
    """Join the process group torchrun describes (its environment variables): NCCL when the
    recipe's device is a GPU, gloo on CPU. Each rank takes the GPU of its LOCAL_RANK."""
    if not launched() or dist.is_initialized():
        return
    on_gpu = device != "cpu" and torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local_rank())
    # A lost peer should end the run, not hang it (torchrun restarts nothing by default).
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(minutes=30))


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def check_batch_split(batch_size: int, processes: int | None = None) -> None:
    """ppo.batch_size is the global batch: it must split evenly across the ranks."""
    k = processes or world_size()
    if batch_size % k:
        raise UserError(
            f"ppo.batch_size = {batch_size} does not split across {k} processes "
            f"(--nproc-per-node {k}): each process takes batch_size / {k} queries; choose a "
            f"multiple of {k}"
        )


def my_share(items: list) -> list:
    """This rank's contiguous share of a global batch (equal shares: check_batch_split)."""
    share = len(items) // world_size()
    return items[rank() * share : (rank() + 1) * share]


LAUNCH_FLAGS = "CORY_LORA_LAUNCH_FLAGS"  # set by `--nproc-per-node`/`--nnodes`: the ranks' flags


def cli(*args) -> str:
    """The command line, quoted for a POSIX shell (a path with a space pastes whole), that runs
    `cory-lora ARGS` as this run was launched: with the launch flags it was given (every one of
    --nproc-per-node, --nnodes, --node-rank, --rdzv-endpoint), or under plain torchrun with
    --nproc-per-node of its world size."""
    words = ["cory-lora", *(str(a) for a in args)]
    if world_size() > 1 or os.environ.get(LAUNCH_FLAGS):
        launched = os.environ.get(LAUNCH_FLAGS)
        words += shlex.split(launched) if launched else ["--nproc-per-node", str(world_size())]
    return shlex.join(words)


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over ranks (a new tensor; the same tensor in one process)."""
    if world_size() == 1:
        return tensor
    out = tensor.clone()
    dist.all_reduce(out)
    return out


def global_mean(values: torch.Tensor) -> float:
    """The mean of every rank's values together (NaN if any is; nan for no values)."""
    if world_size() == 1:
        return float(values.float().mean()) if values.numel() else math.nan
    local = torch.stack([values.double().sum(), torch.tensor(values.numel(), dtype=torch.float64)])
    total, count = all_sum(local.to(_device())).tolist()
    return total / count if count else math.nan


def sum_int(value: int) -> int:
    if world_size() == 1:
        return value
    return int(all_sum(torch.tensor(value, dtype=torch.int64, device=_device())))


def any_rank(flag: bool) -> bool:
    return sum_int(int(flag)) > 0


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, rank 0's first (the global batch, in order). Equal shapes."""
    if world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def gather_objects(obj) -> list:
    """Every rank's (picklable) object, by rank."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def from_main(value: int) -> int:
    """Rank 0's value of an integer, on every rank (e.g. a length drawn once per iteration)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor(value, dtype=torch.int64, device=_device())
    dist.broadcast(tensor, src=0)
    return int(tensor)


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of `params` over ranks, in one flat buffer (a rank that had no rows in
    this minibatch contributes zeros). The losses are divided by the global token count, so the
    sum is the gradient of the global minibatch's loss."""
    if world_size() == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
        offset += n


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def _device() -> torch.device:
    """Where collectives' small tensors live: the rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
