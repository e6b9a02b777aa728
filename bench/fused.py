"""Seconds per training iteration on the real model: CORY and PPO, fused and separate passes,
2 and 3 agents, and the same against an older checkout of cory-lora.

    git worktree add /tmp/cory-base b76fa65          # the code before the Learner / fused work
    python bench/fused.py --baseline /tmp/cory-base  # both SmolLM2 recipes, 3 iterations each
    python bench/fused.py --quick                    # word problems only, 2 iterations, no baseline
    python bench/fused.py --device cuda --model DIR  # a GPU, another model

Each configuration runs in a fresh process, one after another, on the recipe's own settings
(bf16 on CPU, `fetched:smollm2`; held-out evaluation off): `train.prepare`, then --iterations
iterations through `train.train_iteration`, the figure being the median over all but the first
(it warms the allocator and creates the optimizers' moments). A baseline configuration runs the
same in a process whose `cory_lora` is imported from --baseline (PYTHONPATH), so the older code
meets the same model, recipe and driver; with a baseline, every configuration runs the
baseline checkout's recipes and data, so both codes do the same work. Per configuration:

* s / iteration, and its generation part (`cory.play_episode`: sampling and rewards) and the
  rest (scoring, PPO update, logging: `learn` and what surrounds it);
* tokens: the rows x width (prompt + response, padding included) of every agent's sequences in
  an iteration, which scoring and the update must process (CORY's observer reads the pioneer's
  answer: its rows are wider);
* ratios: CORY / PPO time beside CORY / PPO tokens, each configuration against the baseline's
  (the issue's goal: CORY <= 0.6x the baseline's), fused / separate, 3 agents / 2.

The load average is printed with each line: on a shared machine the ratios move by tens of
percent (docs/measured.md).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {
    "word problems": ("recipes/smollm2_arith.toml", "recipes/smollm2_arith_ppo.toml"),
    "reviews": ("recipes/smollm2_sentiment.toml", "recipes/smollm2_sentiment_ppo.toml"),
}


@dataclass(frozen=True)
class Configuration:
    name: str
    algorithm: str  # "cory" (the task's CORY recipe) or "ppo" (its PPO recipe)
    baseline: bool  # run on the --baseline checkout
    overrides: tuple[str, ...] = ()


CONFIGURATIONS = (
    Configuration("baseline ppo", "ppo", True),
    Configuration("baseline cory", "cory", True),
    Configuration("ppo", "ppo", False, ("train.fused=false",)),
    Configuration("cory separate", "cory", False, ("train.fused=false",)),
    Configuration("cory fused", "cory", False, ("train.fused=true",)),
    Configuration("cory n=3 separate", "cory", False, ("cory.agents=3", "train.fused=false")),
    Configuration("cory n=3 fused", "cory", False, ("cory.agents=3", "train.fused=true")),
)


def worker(args) -> None:
    """One configuration in this process (its cory_lora from PYTHONPATH); figures as JSON."""
    import torch
    from rich.console import Console

    import cory_lora
    from cory_lora.cli.console import Display
    from cory_lora.config import load_recipe
    from cory_lora.run import train
    from cory_lora.run.rundir import RunDir

    recipe = load_recipe(args.recipe, json.loads(args.overrides))
    generation = {"seconds": 0.0, "tokens": 0}
    original = train.play_episode

    def play_episode(*a, **k):
        started = time.perf_counter()
        episode = original(*a, **k)
        generation["seconds"] += time.perf_counter() - started
        generation["tokens"] += sum(
            g.prompt_ids.shape[0] * (g.prompt_ids.shape[1] + g.response_ids.shape[1])
            for g in episode.generations
        )
        return episode

    train.play_episode = play_episode
    workdir = Path(tempfile.mkdtemp(prefix="cory-fused-"))
    quiet = Display(Console(file=io.StringIO()), quiet=True)
    setup, state = train.prepare(recipe, RunDir(workdir / "run"), quiet, False, None)
    rows = []
    for _ in range(args.iterations):
        generation.update(seconds=0.0, tokens=0)
        started = time.perf_counter()
        train.train_iteration(setup, state)
        rows.append((time.perf_counter() - started, generation["seconds"], generation["tokens"]))
        if recipe.model.device == "cuda":
            torch.cuda.synchronize()
    shutil.rmtree(workdir, ignore_errors=True)
    timed = rows[1:] or rows
    figures = {
        "seconds": statistics.median(r[0] for r in timed),
        "generation": statistics.median(r[1] for r in timed),
        "tokens": statistics.median(r[2] for r in timed),
        "code": str(Path(cory_lora.__file__).parent.parent),
        "load": os.getloadavg()[0],
    }
    Path(args.out).write_text(json.dumps(figures))


def run_configuration(args, task: str, config: Configuration) -> dict | None:
    cory_recipe, ppo_recipe = RECIPES[task]
    # With a baseline, both codes run the baseline checkout's recipes and data (from its
    # directory): the same work, whatever changed in them since.
    work = Path(args.baseline) if args.baseline else ROOT
    recipe = work / (cory_recipe if config.algorithm == "cory" else ppo_recipe)
    overrides = ["train.eval_every=0", "log.report_to=[]", *args.set]
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    if args.device:
        overrides.append(f"model.device={args.device}")
    overrides += config.overrides
    code = Path(args.baseline) if config.baseline else ROOT
    env = {**os.environ, "PYTHONPATH": str(code)}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable,
            __file__,
            "--worker",
            "--recipe",
            str(recipe),
            "--overrides",
            json.dumps(overrides),
            "--iterations",
            str(args.iterations),
            "--out",
            out.name,
        ]
        result = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"  {config.name}: failed\n{result.stderr[-2000:]}")
            return None
        figures = json.loads(Path(out.name).read_text())
    if Path(figures["code"]).resolve() != code.resolve():
        raise SystemExit(f"{config.name} imported cory_lora from {figures['code']}, not {code}")
    return figures


def ratio(a: dict | None, b: dict | None, key: str = "seconds") -> str:
    return f"{a[key] / b[key]:.2f}x" if a and b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a checkout of older cory-lora code to compare with")
    parser.add_argument("--task", choices=list(RECIPES), action="append")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="word problems, 2 iterations")
    parser.add_argument("--set", action="append", default=[], help="recipe override for all")
    parser.add_argument("--model")
    parser.add_argument("--device")
    parser.add_argument("--only", action="append", help="configuration names to run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.iterations, args.task = 2, args.task or ["word problems"]
    for task in args.task or list(RECIPES):
        print(f"\n{task} ({args.iterations} iterations, median of all but the first):")
        print(f"  {'configuration':<20}{'s/iter':>8}{'gen s':>7}{'tokens':>8}{'load':>6}")
        figures = {}
        for config in CONFIGURATIONS:
            if config.baseline and not args.baseline:
                continue
            if args.only and config.name not in args.only:
                continue
            f = figures[config.name] = run_configuration(args, task, config)
            if f:
                print(
                    f"  {config.name:<20}{f['seconds']:>8.2f}{f['generation']:>7.2f}"
                    f"{f['tokens']:>8.0f}{f['load']:>6.2f}",
                    flush=True,
                )
        summary(figures)


# (label, numerator, denominator, with the token ratio beside the time ratio)
RATIOS = (
    ("CORY / PPO time, tokens (now, fused)", "cory fused", "ppo", True),
    ("CORY / PPO time, tokens (now, separate)", "cory separate", "ppo", True),
    ("CORY / PPO time, tokens (baseline)", "baseline cory", "baseline ppo", True),
    ("CORY fused / baseline CORY (goal <= 0.6x)", "cory fused", "baseline cory", False),
    ("CORY separate / baseline CORY", "cory separate", "baseline cory", False),
    ("PPO / baseline PPO", "ppo", "baseline ppo", False),
    ("fused / separate, 2 agents", "cory fused", "cory separate", False),
    ("fused / separate, 3 agents", "cory n=3 fused", "cory n=3 separate", False),
    ("3 agents / 2 (separate)", "cory n=3 separate", "cory separate", False),
    ("3 agents / 2 (fused)", "cory n=3 fused", "cory fused", False),
)


def summary(figures: dict) -> None:
    for label, a, b, tokens in RATIOS:
        if figures.get(a) and figures.get(b):
            at = f" at {ratio(figures[a], figures[b], 'tokens')}" if tokens else ""
            print(f"  {label}: {ratio(figures[a], figures[b])}{at}")


if __name__ == "__main__":
    main()
