"""GPU check at 7B scale without downloading anything: a Llama-2-7B-shaped model with random
weights, loaded in 4-bit by the same code a run uses, one CORY iteration and one single-agent PPO
iteration at the 7B recipe's batch and lengths, CORY with separate and with fused passes
(`train.fused`). Prints peak GPU memory of each (`torch.cuda.max_memory_allocated`), iteration
times, and our sampler vs `generate`.

    bash bench/gpu_check.sh              # on a GPU machine with network (pip installs us)
    bash bench/gpu_check.sh --wheels DIR # on one without: our dependencies from a wheel folder
    python bench/gpu_check.py --small    # the same code path on CPU, with a tiny model

Prompts are made as long as the recipe allows (data.max_prompt_tokens) and a random model
rarely stops early, so memory is measured near the recipe's worst case.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from cory_lora.config import load_recipe
from cory_lora.engine.tiny import char_tokenizer, tiny_llama_config

ROOT = Path(__file__).resolve().parent.parent
LLAMA2_7B = dict(hidden_size=4096, layers=32, heads=32, max_positions=4096)


def build_model(path: Path, small: bool, device: str) -> None:
    """Random weights in the 7B shape (or a tiny one), saved as a local model directory."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(**({} if small else LLAMA2_7B))
    if not small:
        config.intermediate_size, config.num_key_value_heads, config.vocab_size = 11008, 32, 32000
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)


def write_prompts(path: Path, prompt_chars: int) -> None:
    """Questions as long as the recipe's prompt limit (one character is one token here)."""
    with open(path, "w") as f:
        for i in range(256):
            question = (f"{i}+{i}=? " * prompt_chars)[: prompt_chars - 2]
            f.write(json.dumps({"question": question, "answer": str(2 * i)}) + "\n")


def one_iteration(recipe_path: Path, overrides: list[str], out: Path) -> tuple[float, float]:
    """(peak GPU memory in GiB, iteration seconds) of one training iteration."""
    from rich.console import Console

    from cory_lora.cli.console import Display
    from cory_lora.run.rundir import RunDir
    from cory_lora.run.train import run

    recipe = load_recipe(recipe_path, overrides)
    gc.collect()  # the previous run's model must be gone before measuring this one
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    history = run(recipe, RunDir(out, overwrite=True), Display(Console(), quiet=True))
    peak = (
        torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else float("nan")
    )
    return peak, history[-1]["time/iteration_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny model on CPU (checks the code)")
    parser.add_argument("--workdir", default="/tmp/cory-gpu-check")
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, data = work / "model", work / "prompts.jsonl"
    recipe = ROOT / "recipes" / "llama2_7b_gsm8k.toml"
    base = load_recipe(recipe)
    prompt_tokens = 48 if args.small else base.data.max_prompt_tokens
    started = time.perf_counter()
    if not (model_dir / "config.json").exists():
        build_model(model_dir, args.small, device)
    print(f"model ready in {time.perf_counter() - started:.0f}s: {model_dir}", flush=True)
    write_prompts(data, prompt_tokens)
    overrides = [
        f"model.name_or_path={model_dir}",
        f"model.device={device}",
        f"data.dataset={data}",
        "data.chat_template=false",
        'data.prompt_template="{query}"',
        f"data.max_prompt_tokens={prompt_tokens}",
        "reward.function=exact_match",
        "train.iterations=1",
    ]
    if args.small:
        overrides += [
            "model.dtype=float32",
            "generation.max_new_tokens=16",
            "ppo.batch_size=8",
            'lora.target_modules=["q_proj", "v_proj"]',
        ]
    results = {}
    configurations = (
        ("cory", ["train.fused=false"]),
        ("cory fused", ["train.fused=true"]),
        ("ppo", ["train.algorithm=ppo"]),
    )
    for name, extra in configurations:
        peak, seconds = one_iteration(recipe, overrides + extra, work / f"run-{name}")
        results[name] = (peak, seconds)
        print(
            f"{name:10s} one iteration: peak GPU memory {peak:.2f} GiB, {seconds:.1f} s",
            flush=True,
        )
    (cory, cory_s), (fused, fused_s), (ppo, _) = (results[n] for n, _ in configurations)
    print(f"CORY / PPO peak memory: {cory / ppo:.3f}x (fused: {fused / ppo:.3f}x)", flush=True)
    print(f"CORY fused / separate time: {fused_s / cory_s:.2f}x", flush=True)
    g = base.generation
    bench = [
        sys.executable,
        str(ROOT / "bench" / "generation.py"),
        "--model",
        str(model_dir),
        "--4bit",
        "--device",
        device,
        "--batch",
        str(8 if args.small else g.batch_size),
        "--max-new-tokens",
        str(16 if args.small else g.max_new_tokens),
        "--repeats",
        "2",
    ]
    subprocess.run(bench, check=True)


if __name__ == "__main__":
    main()
