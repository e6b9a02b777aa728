"""Where a training iteration's time goes, on the real model: by phase and by op class.

    python bench/profile_iteration.py                         # both SmolLM2 recipes, CORY, CPU
    python bench/profile_iteration.py --recipe recipes/smollm2_arith.toml --set train.fused=true
    python bench/profile_iteration.py --quick                           # batch 8, 16 new tokens
    python bench/profile_iteration.py --model DIR --device cuda         # another model, a GPU

Each recipe runs as it is (bf16 on CPU for the SmolLM2 ones, `fetched:smollm2`): one iteration
to warm up, one timed with the wall clock by phase, then one under torch.profiler. The phases:

* generation: the episode (`cory.play_episode`: every agent's sampling and the rewards);
* scoring: every agent's rollout scoring, with the reference (`update.score`);
* update: the PPO epochs (`update.run_updates`);
* rest: what the iteration does besides (metrics, samples, KL controller, rollout maths).

Within each phase, the profiled self CPU time by op class: matmul (`mm`, `addmm`, `bmm`),
attention (`scaled_dot_product_attention` and its kernels), casts and copies (`copy_`, `to`,
`contiguous`, `clone`: a float32 LoRA on a bfloat16 base casts every activation twice, per
layer), elementwise (`mul`, `add`, `silu`, norms' `pow`/`rsqrt`/`mean`, ...), softmax and
logprobs (`log_softmax`, `softmax`, `gather`, `logsumexp`), and the rest (indexing, cat,
allocation, Python-side overhead the profiler sees as op time). The profiler adds a fixed cost
per op (several microseconds), so op classes are shares of the profiled time, and the phases'
seconds come from the unprofiled iteration. Then the ten ops with the most self time.

(Not bench/profile.py: a script of that name in bench/ would shadow the standard library's
`profile`, which torch imports, for every script run from bench/.)
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

RECIPES = ("recipes/smollm2_arith.toml", "recipes/smollm2_sentiment.toml")
PHASES = ("generation", "scoring", "update")
CLASSES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::_int_mm", "aten::baddbmm"),
    "attention": ("attention", "flash", "efficient"),
    "casts and copies": ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous"),
    "softmax and logprobs": ("softmax", "gather", "logsumexp", "aten::topk", "aten::sort"),
    "elementwise": (
        "aten::mul",
        "aten::add",
        "aten::sub",
        "aten::div",
        "aten::silu",
        "aten::neg",
        "aten::pow",
        "aten::rsqrt",
        "aten::mean",
        "aten::exp",
        "aten::where",
        "aten::cos",
        "aten::sin",
        "aten::clone",
        "aten::sum",
        "aten::gelu",
        "aten::tanh",
        "backward",
    ),
}


def op_class(name: str) -> str:
    for label, needles in CLASSES.items():
        if any(n in name.lower() if not n.startswith("aten::") else name == n for n in needles):
            return label
    return "rest"


class Phases:
    """Wraps the phase functions where the loop calls them: wall-clock seconds per phase and,
    when profiling, a record_function span named after the phase."""

    def __init__(self):
        from cory_lora.algorithm import learner
        from cory_lora.run import train

        self.seconds: dict[str, float] = defaultdict(float)
        self._wrap(train, "play_episode", "generation")
        self._wrap(learner, "score", "scoring")
        self._wrap(learner, "run_updates", "update")

    def _wrap(self, module, attribute: str, phase: str) -> None:
        original = getattr(module, attribute)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            with torch.profiler.record_function(f"phase:{phase}"):
                out = original(*args, **kwargs)
            self.seconds[phase] += time.perf_counter() - started
            return out

        setattr(module, attribute, timed)


def phase_of(event) -> str:
    while event is not None:
        if event.name.startswith("phase:"):
            return event.name.removeprefix("phase:")
        event = event.cpu_parent
    return "rest"


def self_time_by_class(profiler) -> tuple[dict, dict]:
    """{phase: {class: self CPU seconds}} and {op name: self CPU seconds} over all events."""
    by_phase: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_op: dict[str, float] = defaultdict(float)
    for event in profiler.events():
        if event.name.startswith("phase:"):
            continue
        seconds = event.self_cpu_time_total / 1e6
        by_phase[phase_of(event)][op_class(event.name)] += seconds
        by_op[event.name] += seconds
    return by_phase, by_op


def profile_recipe(path: str, args) -> None:
    from rich.console import Console

    from cory_lora.cli.console import Display
    from cory_lora.config import load_recipe
    from cory_lora.run import train
    from cory_lora.run.rundir import RunDir

    overrides = list(args.set)
    if args.quick:
        overrides += ["ppo.batch_size=8", "generation.max_new_tokens=16"]
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    if args.device:
        overrides.append(f"model.device={args.device}")
    recipe = load_recipe(path, [*overrides, "train.eval_every=0", "log.report_to=[]"])
    workdir = Path(tempfile.mkdtemp(prefix="cory-profile-"))
    try:
        phases = Phases()
        quiet = Display(Console(file=io.StringIO()), quiet=True)
        setup, state = train.prepare(recipe, RunDir(workdir / "run"), quiet, False, None)
        train.train_iteration(setup, state)  # warm-up: allocator, kernels, optimizer moments
        phases.seconds.clear()
        started = time.perf_counter()
        train.train_iteration(setup, state)
        total = time.perf_counter() - started
        wall = dict(phases.seconds) | {"rest": total - sum(phases.seconds.values())}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train.train_iteration(setup, state)
        by_phase, by_op = self_time_by_class(prof)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(path, recipe, total, wall, by_phase, by_op)


def report(path, recipe, total, wall, by_phase, by_op) -> None:
    load = os.getloadavg()[0]
    print(f"\n{path}: {recipe.train.algorithm}, {recipe.model.dtype}, fused={recipe.train.fused}")
    print(f"one iteration {total:.2f} s (wall clock, unprofiled; load average {load:.2f})")
    classes = [*CLASSES, "rest"]
    print(f"{'phase':<11}{'s':>7}{'share':>7}  " + "".join(f"{c[:16]:>17}" for c in classes))
    for phase in (*PHASES, "rest"):
        profiled = by_phase.get(phase, {})
        seconds = sum(profiled.values()) or 1.0
        shares = "".join(f"{profiled.get(c, 0.0) / seconds:>17.0%}" for c in classes)
        seconds_wall = wall.get(phase, 0.0)
        print(f"{phase:<11}{seconds_wall:>7.2f}{seconds_wall / total:>7.0%}  {shares}")
    print("(op-class columns: share of the phase's profiled self CPU time)")
    profiled_total = sum(by_op.values())
    print("top ops by self CPU time (profiled):")
    for name, seconds in sorted(by_op.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {name:<44}{seconds:>8.2f} s{seconds / profiled_total:>7.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", action="append", help="recipe(s); default both SmolLM2 ones")
    parser.add_argument("--set", action="append", default=[], help="recipe override")
    parser.add_argument("--quick", action="store_true", help="batch 8, 16 new tokens")
    parser.add_argument("--model", help="a local model directory instead of the recipe's")
    parser.add_argument("--device", help="cpu or cuda")
    args = parser.parse_args()
    for path in args.recipe or RECIPES:
        profile_recipe(path, args)


if __name__ == "__main__":
    main()
