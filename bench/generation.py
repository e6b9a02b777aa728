"""Our batched sampler vs `transformers` `generate`, same model, prompts and settings, side by side.

    python bench/generation.py                                   # the demo model, on CPU
    python bench/generation.py --quick                           # batch 16, 16 tokens, 1 repeat
    python bench/generation.py --model fetched:smollm2 --batch 16 # the real model (SmolLM2-135M)
    python bench/generation.py --model meta-llama/Llama-2-7b-chat-hf --4bit --device cuda \
        --batch 16 --max-new-tokens 256

Two workloads: `fixed` (no stopping: every row runs max_new_tokens, so only per-step overhead
differs) and `ragged` (rows stop at a stop string at different steps, as in RL rollouts: our
sampler drops finished rows from the batch, `generate` keeps computing them). Prints tokens/s of
each (sampled tokens that count, i.e. up to each row's stop) and the ratio ours / generate.
The demo model gets addition prompts and stops at ";"; any other model gets the movie-review
openings of assets/reviews and stops at the end of a sentence (".").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from cory_lora.config import GenerationConfig
from cory_lora.engine.generation import Stopping, generate
from cory_lora.engine.model import resolve_device, resolve_dtype
from cory_lora.services import fetch

ROOT = Path(__file__).resolve().parent.parent


def load(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cory_lora.engine.model import keep_4bit_differentiable_on_cpu, nf4_config

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    quant = nf4_config(dtype) if args.four_bit else None
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, quantization_config=quant, device_map={"": device}
    ).eval()
    if args.four_bit and device.type == "cpu":
        keep_4bit_differentiable_on_cpu(model)  # the training configuration, as in a real run
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, device


def prompts_for(model_name: str, n: int) -> tuple[list[str], str]:
    """(prompts, the ragged workload's stop string) for the demo model or a real one."""
    if model_name == "assets/tiny-arith":
        return [f"{(7 * i) % 50}+{(13 * i) % 50}=" for i in range(n)], ";"
    lines = (ROOT / "assets" / "reviews" / "train.jsonl").read_text().splitlines()
    return [json.loads(line)["query"] for line in lines[:n]], "."


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ours(model, tokenizer, texts, cfg, stopping, device) -> tuple[float, int]:
    ids = [tokenizer(t).input_ids for t in texts]
    sync(device)
    start = time.perf_counter()
    out = generate(model, tokenizer, ids, cfg, stopping, torch.Generator(device).manual_seed(0))
    sync(device)
    return time.perf_counter() - start, int(out.response_mask.sum())


def time_generate(model, tokenizer, texts, cfg, stop_strings, device) -> tuple[float, int]:
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
    kwargs = {"stop_strings": list(stop_strings), "tokenizer": tokenizer} if stop_strings else {}
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        **batch,
        do_sample=True,
        temperature=cfg.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.min_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    sync(device)
    elapsed = time.perf_counter() - start
    new = out[:, batch.input_ids.shape[1] :]
    # count each row's tokens up to its end (generate pads finished rows with pad_token_id)
    return elapsed, int((new != tokenizer.pad_token_id).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="assets/tiny-arith")
    parser.add_argument("--4bit", dest="four_bit", action="store_true")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="batch 16, 16 new tokens, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.max_new_tokens, args.repeats = 16, 16, 1
    torch.manual_seed(0)
    name = args.model
    args.model = fetch.resolve(args.model)  # fetched:smollm2 -> its directory (fetched once)
    model, tokenizer, device = load(args)
    texts, ragged_stop = prompts_for(name, args.batch)
    print(
        f"model {name} ({'4-bit' if args.four_bit else next(model.parameters()).dtype}) on "
        f"{device}, load average {os.getloadavg()[0]:.2f}, "
        f"batch {args.batch}, max_new_tokens {args.max_new_tokens}, {args.repeats} repeats (median)"
    )
    print(f"{'workload':10s} {'ours tok/s':>12s} {'generate tok/s':>15s} {'ratio':>7s}")
    for workload, stops in (("fixed", ()), ("ragged", (ragged_stop,))):
        cfg = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=1.0,
            stop=stops,
            batch_size=args.batch,
            min_new_tokens=0 if stops else args.max_new_tokens,
        )
        stopping = Stopping((tokenizer.eos_token_id,), stops)
        with torch.no_grad():
            time_ours(model, tokenizer, texts[:4], cfg, stopping, device)  # warm-up
            time_generate(model, tokenizer, texts[:4], cfg, stops, device)
            ours = [
                time_ours(model, tokenizer, texts, cfg, stopping, device)
                for _ in range(args.repeats)
            ]
            theirs = [
                time_generate(model, tokenizer, texts, cfg, stops, device)
                for _ in range(args.repeats)
            ]
        ours_tps = statistics.median(n / t for t, n in ours)
        theirs_tps = statistics.median(n / t for t, n in theirs)
        print(f"{workload:10s} {ours_tps:12.0f} {theirs_tps:15.0f} {ours_tps / theirs_tps:6.2f}x")


if __name__ == "__main__":
    main()
