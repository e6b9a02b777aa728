"""The 7B claim where no GPU is: one CORY iteration of a randomly initialised Llama-2-7B-shaped
model in 4-bit, on the CPU, its peak live tensors beside `cory-lora plan`'s estimate for the same
settings.

    python bench/cpu_7b.py                       # ~25 GB of disk, ~6 GB of RAM, ~10-20 min
    python bench/cpu_7b.py --workdir DIR --keep  # keep the model for another run

The model (hidden 4096, 32 layers, MLP 11008, vocabulary 32000: Llama-2-7B's shapes) is written
shard by shard with random bfloat16 weights, never whole in memory (13.5 GB in bf16), then
loaded by the same code a run uses (`load_agents`: bitsandbytes NF4 with double quantisation,
LoRA r 16 on the attention projections, gradient checkpointing: recipes/llama2_7b_gsm8k.toml)
with a tiny batch and short lengths (2 queries of 32 tokens, 8 new tokens, one PPO epoch), so
the iteration is slow but finishes. Peak live tensors are measured as bench/memory.py does:
the tensors alive when the iteration starts plus the highest running sum of the allocations and
frees torch.profiler records during it. The plan (engine/plan.py) counts the same parts for a
GPU; its CUDA reserve (context + fragmentation) is left out of the comparison, since the CPU has
none.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "llama2_7b_gsm8k.toml"
SHAPE = dict(hidden_size=4096, layers=32, heads=32, max_positions=4096)


def build_model(path: Path) -> None:
    """Random weights in Llama-2-7B's shape, written shard by shard (2 GB each)."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from cory_lora.engine.tiny import char_tokenizer, tiny_llama_config

    config = tiny_llama_config(**SHAPE)
    config.intermediate_size, config.num_key_value_heads, config.vocab_size = 11008, 32, 32000
    config.torch_dtype = torch.bfloat16
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(config).state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shard, shard_bytes, index, k = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes, k
        name = f"model-{k:05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shard, shard_bytes, k = {}, 0, k + 1

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name], shard_bytes = tensor, shard_bytes + tensor.nbytes
        if shard_bytes > 2 * 1024**3:
            flush()
    if shard:
        flush()
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index})
    )
    config.save_pretrained(path)
    char_tokenizer().save_pretrained(path)


def write_prompts(path: Path, n: int, chars: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            question = (f"{i}+{i}=? " * chars)[: chars - 2]
            f.write(json.dumps({"question": question, "answer": str(2 * i)}) + "\n")


def peak_of_iteration(recipe) -> tuple[int, float, int]:
    """(peak live tensor bytes during one iteration, its seconds, live bytes at its start)."""
    from rich.console import Console

    sys.path.insert(0, str(ROOT / "bench"))
    from memory import live_tensor_bytes

    from cory_lora.cli.console import Display
    from cory_lora.run import train
    from cory_lora.run.rundir import RunDir

    workdir = Path(recipe.data.dataset).parent
    activities = [torch.profiler.ProfilerActivity.CPU]
    profiler = torch.profiler.profile(activities=activities, profile_memory=True)
    profiler.start()  # before loading: every free has its allocation
    quiet = Display(Console(file=io.StringIO()), quiet=True)
    setup, state = train.prepare(recipe, RunDir(workdir / "run"), quiet, False, None)
    at_start = live_tensor_bytes()
    with torch.profiler.record_function("iteration"):
        started = time.perf_counter()
        train.train_iteration(setup, state)
        seconds = time.perf_counter() - started
    profiler.stop()
    events = list(profiler.profiler.kineto_results.events())
    span = next(e for e in events if e.name() == "iteration")
    begin, end = span.start_ns(), span.start_ns() + span.duration_ns()
    memory = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    )
    running = list(itertools.accumulate(n for _, n in memory))
    pairs = list(zip(memory, running, strict=True))
    before = next((r for (t, _), r in reversed(pairs) if t < begin), 0)
    inside = [r for (t, _), r in pairs if begin <= t <= end]
    return at_start + max(inside, default=before) - before, seconds, at_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/cory-7b-cpu")
    parser.add_argument("--keep", action="store_true", help="keep the model directory")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    args = parser.parse_args()
    from cory_lora.config import load_recipe
    from cory_lora.engine.plan import GB, estimate

    work = Path(args.workdir)
    model_dir, data = work / "model", work / "prompts.jsonl"
    started = time.perf_counter()
    if not (model_dir / "config.json").exists():
        build_model(model_dir)
    print(f"model ready in {time.perf_counter() - started:.0f} s: {model_dir}", flush=True)
    write_prompts(data, 8, args.prompt_tokens)
    overrides = [
        f"model.name_or_path={model_dir}",
        "model.device=cpu",
        f"data.dataset={data}",
        "data.chat_template=false",
        'data.prompt_template="{query}"',
        f"data.max_prompt_tokens={args.prompt_tokens}",
        "data.eval_split=''",
        "reward.function=exact_match",
        "train.iterations=1",
        "ppo.batch_size=2",
        "ppo.minibatch_size=2",
        "ppo.micro_batch_size=2",
        "ppo.epochs=1",
        "generation.batch_size=2",
        f"generation.max_new_tokens={args.new_tokens}",
        f"generation.min_new_tokens={args.new_tokens}",
    ]
    recipe = load_recipe(RECIPE, overrides)
    plan = estimate(recipe)
    reserve = next(v for k, v in plan.parts.items() if k.startswith("CUDA"))
    peak, seconds, at_start = peak_of_iteration(recipe)
    load = os.getloadavg()[0]
    print(f"one CORY iteration on the CPU: {seconds:.0f} s (load average {load:.2f})")
    print(f"live tensors when it starts: {at_start / GB:.2f} GiB (model, adapters, heads)")
    print(f"peak live tensors during it: {peak / GB:.2f} GiB")
    print("cory-lora plan, same settings:")
    for part, size in plan.parts.items():
        print(f"  {part:<48}{size / GB:>7.2f} GiB")
    planned = plan.peak - reserve
    print(f"plan without the CUDA reserve: {planned / GB:.2f} GiB; measured / plan: ", end="")
    print(f"{peak / planned:.2f}x")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
