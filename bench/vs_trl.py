"""cory-lora (one agent, critic-free GRPO) against TRL's GRPOTrainer: seconds per iteration and
peak memory, same model, LoRA, prompts, reward, group size, lengths and optimizer steps.

    python bench/vs_trl.py                 # SmolLM2-135M (fetched:smollm2) on CPU
    python bench/vs_trl.py --quick         # 2 measured iterations, one round
    python bench/vs_trl.py --model DIR --device cuda --queries 16 --group 8 --new-tokens 128

One iteration, both sides: Q queries (movie-review openings of assets/reviews), G sampled
answers each (temperature 1, top_k 0, exactly --new-tokens new tokens: min = max, so both do the
same decoding work), the VADER positivity reward (cory_lora.rewards:vader_positivity, which
follows TRL's reward-function convention, so both call the same function), group-normalised
advantages, the k3 KL to the reference (the base with the adapter disabled, both sides) in the
loss with beta --beta, one pass over the Q x G answers in --steps optimizer steps (AdamW, the
same learning rate), LoRA r 16 / alpha 32 on every projection, float32 (--dtype).

* cory-lora: `train.algorithm = "ppo"`, `ppo.advantage = "grpo"`, `ppo.kl_in = "loss"`,
  `generation.samples_per_query = G`, epochs 1, minibatch Q x G / steps; time per iteration
  from its metrics (`time/iteration_s`).
* TRL: `GRPOTrainer` with a PEFT LoraConfig of the same shape, per-device batch Q x G / steps,
  `steps_per_generation = steps` (so a generation batch is Q x G), `num_iterations = 1`,
  `loss_type = "grpo"`; time per iteration = the time between the ends of successive generation
  cycles (a callback).

Each side runs in its own process (peak RSS: its ru_maxrss, loading included; both load the
same fp32 weights), the sides alternate for --rounds rounds on one machine, and the first
iteration of each process is a warm-up, not counted. Prints the settings, then per side the
median seconds per iteration and the peak RSS, and the ratios cory-lora / TRL.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def queries(n: int) -> list[str]:
    lines = (ROOT / "assets" / "reviews" / "train.jsonl").read_text().splitlines()
    return [json.loads(line)["query"] for line in lines[:n]]


def run_ours(args, model_dir: str) -> tuple[list[float], int]:
    """Seconds of each iteration after the first, and the peak RSS of the `cory-lora run`
    process (a child of this one, so that this process's own imports do not count)."""
    from cory_lora.config import recipe_from_dict, recipe_toml

    episodes = args.queries * args.group
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"query": q}) + "\n" for q in queries(64)))
        recipe = recipe_from_dict(
            {
                "model": {"name_or_path": model_dir, "dtype": args.dtype, "device": args.device},
                "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": TARGETS},
                "data": {"dataset": str(data), "query_column": "query", "max_prompt_tokens": 64},
                "generation": {
                    "max_new_tokens": args.new_tokens,
                    "min_new_tokens": args.new_tokens,
                    "temperature": 1.0,
                    "top_k": 0,
                    "samples_per_query": args.group,
                    "batch_size": episodes,
                },
                "reward": {"function": "vader_positivity"},
                "ppo": {
                    "advantage": "grpo",
                    "kl_in": "loss",
                    "init_kl_coef": args.beta,
                    "adaptive_kl": False,
                    "learning_rate": args.lr,
                    "batch_size": args.queries,
                    "minibatch_size": episodes // args.steps,
                    "micro_batch_size": episodes // args.steps,
                    "epochs": 1,
                },
                "train": {"algorithm": "ppo", "iterations": args.iterations + 1},
            }
        )
        (Path(tmp) / "recipe.toml").write_text(recipe_toml(recipe))
        command = [sys.executable, "-m", "cory_lora", "run", str(Path(tmp) / "recipe.toml")]
        command += ["--output-dir", str(Path(tmp) / "run"), "--quiet"]
        # the run dies with this process (the kernel's parent-death signal), as a study's run does
        env = os.environ | {"CORY_LORA_PARENT_PID": str(os.getpid())}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            sys.exit(f"cory-lora run failed:\n{done.stderr[-3000:]}")
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return [json.loads(line)["time/iteration_s"] for line in lines[1:]], peak


def run_trl(args, model_dir: str) -> tuple[list[float], int]:
    """Seconds of each generation cycle after the first, and this process's peak RSS."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from cory_lora.rewards import vader_positivity

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    episodes = args.queries * args.group
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=args.device == "cpu",
            per_device_train_batch_size=episodes // args.steps,
            gradient_accumulation_steps=1,
            steps_per_generation=args.steps,
            num_generations=args.group,
            num_iterations=1,
            max_completion_length=args.new_tokens,
            generation_kwargs={"min_new_tokens": args.new_tokens},
            temperature=1.0,
            top_k=0,
            beta=args.beta,
            loss_type="grpo",
            learning_rate=args.lr,
            max_steps=(args.iterations + 1) * args.steps,
            logging_steps=10**6,
            save_strategy="no",
            report_to="none",
            bf16=False,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=vader_positivity,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": queries(64)}),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS),
            callbacks=[Clock()],
        )
        trainer.train()
    cycles = ends[args.steps - 1 :: args.steps]  # the end of each generation cycle
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return [b - a for a, b in itertools.pairwise(cycles)], peak


def worker(args) -> None:
    from cory_lora.services import fetch

    model_dir = fetch.resolve(args.model, say=lambda text: print(text, file=sys.stderr))
    times, peak = (run_ours if args.worker == "cory-lora" else run_trl)(args, model_dir)
    print(json.dumps({"times": times, "peak_rss": peak}))


def measure(side: str, argv: list[str]) -> dict:
    command = [sys.executable, __file__, "--worker", side, *argv]
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{side} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fetched:smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--queries", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per iteration")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--iterations", type=int, default=4, help="measured, per process")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 iterations, 1 round")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.rounds = 2, 1
    if args.worker:
        return worker(args)
    argv = [a for a in sys.argv[1:] if a != "--quick"]
    argv += ["--iterations", str(args.iterations)]
    print(
        f"model {args.model} ({args.dtype}, {args.device}); {args.queries} queries x {args.group} "
        f"answers x {args.new_tokens} new tokens; {args.steps} optimizer steps per iteration; "
        f"LoRA r 16 on {len(TARGETS)} projections; beta {args.beta}; {args.iterations} measured "
        f"iterations per process, {args.rounds} round(s); load average {os.getloadavg()[0]:.2f}"
    )
    results: dict[str, list[dict]] = {"cory-lora": [], "trl": []}
    for _ in range(args.rounds):
        for side in results:
            results[side].append(measure(side, argv))
    summary = {}
    for side, runs in results.items():
        times = [t for r in runs for t in r["times"]]
        summary[side] = (statistics.median(times), max(r["peak_rss"] for r in runs))
        print(
            f"{side:<10} {summary[side][0]:7.2f} s/iteration (median of {len(times)})   "
            f"peak RSS {summary[side][1] / 2**30:.2f} GiB"
        )
    ours, theirs = summary["cory-lora"], summary["trl"]
    print(f"cory-lora / TRL: time {ours[0] / theirs[0]:.2f}x, peak RSS {ours[1] / theirs[1]:.2f}x")


if __name__ == "__main__":
    main()
