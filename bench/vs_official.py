"""The paper's official CORY code against cory-lora, side by side on the same real model, prompts,
reward, batch and lengths: peak memory, seconds per iteration, and reward and KL per iteration.

    python bench/vs_official.py --official PATH --official-python PY           # 10 iterations
    python bench/vs_official.py --official PATH --official-python PY --quick   # 3 iterations

PATH is a checkout of https://github.com/Harry67Hu/CORY (its IMDB experiment
`imdb_train/cory.py`, on the TRL 0.7 it vendors); PY a Python whose environment has what that
code imports: torch, transformers 4.43 (the version of its environment file; 4.40+ loads
Llama/SmolLM2), accelerate 0.31, datasets 2.20 (with pyarrow < 17, pandas < 3, numpy < 2), peft
0.12, tyro, wandb, openai, rouge_score, matplotlib, vaderSentiment. For example:

    python3 -m venv /work/official/venv
    /work/official/venv/bin/pip install torch transformers==4.43.3 tokenizers==0.19.1 \
        accelerate==0.31.0 datasets==2.20.0 pyarrow==16.1.0 pandas==2.2.2 numpy==1.26.4 \
        peft==0.12.0 safetensors==0.4.3 tyro openai rouge_score matplotlib==3.9.2 \
        vaderSentiment wandb==0.17.3

The cory-lora side is `python -m cory_lora run recipes/smollm2_sentiment.toml` with only
`train.iterations` set (and `--output-dir`, a temporary directory); it is timed from its
metrics.jsonl (`time/iteration_s`, `llmK/task_reward`, `llmK/kl` by role).

The official side runs their script itself (`runpy`, as `__main__`), from a temporary copy of
PATH, with the recipe's values on its own command line (tyro): `--model_name` and
`--ppo_config.model_name` (the recipe's model), `--ppo_config.batch_size` 16,
`--ppo_config.mini_batch_size` 8, `--ppo_config.ppo_epochs` 2, `--ppo_config.init_kl_coef` 0.1,
`--ppo_config.no_adap_kl_ctrl` (fixed), `--swap_freq` 5 and `--ppo_config.seed` 0 (all read from
the recipe). What cannot work offline, or at our data, is replaced at run time and printed:

* source edits in the copy of imdb_train/cory.py (3, each checked to apply exactly once):
  `base_name` (where it saves both models at each role swap: /home/trl/...) -> the temporary
  directory; the `len(review) > 100` filter (meant for whole IMDB reviews: it would drop every
  one of our openings) removed; the cut of each prompt to its first 2-7 tokens removed, so the
  prompts are our openings whole, as on our side;
* `nvidia-smi`, which it runs at import to pick a GPU: a stub on PATH that answers one GPU with
  0 MiB used (so CUDA_VISIBLE_DEVICES=0; the torch is a CPU build and TRL falls back to CPU);
* `datasets.load_dataset` (IMDB from the hub) -> iterations x batch prompts of
  assets/reviews/train.jsonl (column "query", a seeded sample), put in its "text" column, so its
  dataloader (shuffled, drop_last) gives exactly --iterations batches;
* `transformers.pipeline` (the hub classifier lvwerra/distilbert-imdb, whose POSITIVE logit is
  their reward) -> VADER's compound score of the same text (query + response), in the POSITIVE
  slot: the reward of recipes/smollm2_sentiment.toml (cory_lora.rewards:vader_positivity);
* wandb: WANDB_MODE=disabled (their config logs to wandb); hub access off (HF_HUB_OFFLINE);
* the model directory: the recipe's model as transformers 4.43 reads it, in a temporary
  directory: the same weights (linked), config.json with `rope_theta` (transformers 5 writes
  `rope_parameters`, which 4.43 ignores, falling back to the wrong theta 10000), the tokenizer's
  merges as "a b" strings (tokenizers 0.19 cannot read the [a, b] pairs of newer ones) and
  class PreTrainedTokenizerFast. Token ids and greedy text were checked equal to transformers 5.

Timing and figures come from wrappers around their PPOTrainer's generate, step and log_stats
(time only; they pass everything through): an iteration ends at its `log_stats` call (the first
starts at the first `generate`), the role swap's save and reload falls in the iteration after
it; the reward per role is the mean VADER score of the pioneer's (LLM-1: answers the query) and
the observer's (LLM-2: answers their template with the pioneer's answer in it) responses; the KL
is their `objective/kl` (per sequence, summed over tokens, batch mean; their kl_penalty "full":
over the whole vocabulary) of each agent's `step`.

What still differs, by their script's own settings (kept, as they are part of their method):

* they fine-tune every weight of two full models (plus a third, frozen, as the reference), in
  float32 (their loader gives no dtype), with Adam at lr 1.41e-5 (--official-lr); cory-lora
  trains a LoRA adapter per agent (r 16, lr 5e-4) on one shared bfloat16 base, the reference
  being the base with adapters off;
* a role swap: they save both models and load them back crossed (new optimizers, so Adam's
  state starts over); cory-lora swaps which adapter plays which role;
* both train each agent on the sum of both agents' task rewards (the paper's); theirs with
  score scaling and normalisation on and kl_penalty "full" (the KL over the whole vocabulary),
  a value head on the full model;
* lengths: they draw the most new tokens once per iteration from 4-15 (LengthSampler(4, 16),
  no minimum); the recipe generates at least 4 and at most 16 new tokens every iteration (it
  sets no generation.length_range), so our side decodes more tokens per iteration;
* their sampling adds repetition_penalty 1.1, generates in chunks of 4 prompts (TRL's default)
  and also generates a reference response each iteration (for their logs); cory-lora generates
  the batch of 16 at once;
* their observer prompt is the same template; neither uses a chat template.

Peak RSS: the ru_maxrss of each side's process (os.wait4; loading included). Weights: the
bytes of the distinct parameter and buffer tensors of the models each side holds at the end
(theirs: both agents and the reference; ours: base, both adapters, both value heads, loaded by
cory-lora's own `load_agents` in a separate short process), and the trainable parameter count.
The sides run one after the other, each in its own process; the first iteration of each is a
warm-up, not counted in the median.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "smollm2_sentiment.toml"
SCRIPT = "imdb_train/cory.py"

# (why, text in their script, replacement); {tmp} is the temporary directory.
EDITS = [
    (
        "role-swap saves go to the temporary directory, not /home/trl/trl/hf_hub/models",
        "base_name = '/home/trl/trl/hf_hub/models/gpt2-'",
        "base_name = '{tmp}/swap/gpt2-'",
    ),
    (
        "no `len(review) > 100` filter: our prompts are openings, not whole reviews",
        '    ds = ds.filter(lambda x: len(x["review"]) > 100, batched=False)\n',
        "",
    ),
    (
        "prompts whole, not cut to their first 2-7 tokens: the same prompts as ours",
        'tokenizer.encode(sample["review"])[: input_size()]',
        'tokenizer.encode(sample["review"])',
    ),
]

# Runs in the official side's Python: replaces what cannot work offline, wraps their trainer
# for timing, runs their script as __main__, and writes what it measured as JSON.
RUNNER = '''
import json, os, runpy, statistics, sys, time
from itertools import chain
from types import SimpleNamespace

cfg = json.load(open(sys.argv[1]))
sys.path.insert(0, cfg["code"])
os.chdir(cfg["code"])

import datasets, torch, transformers
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

datasets.load_dataset = lambda *a, **k: datasets.Dataset.from_dict({"text": cfg["queries"]})

rec = {"start": None, "ends": [], "reward": [], "kl": [], "optimizer_bytes": {}}
vader = SentimentIntensityAnalyzer()


class VaderPipe:
    """Their sentiment pipeline's shape: [[NEGATIVE, POSITIVE]] per text, score = VADER."""

    tokenizer = SimpleNamespace(pad_token_id=0)
    model = SimpleNamespace(config=SimpleNamespace(pad_token_id=0))
    calls = 0

    def __call__(self, texts, **_):
        scores = [vader.polarity_scores(t)["compound"] for t in texts]
        if VaderPipe.calls % 3 < 2:  # pioneer's, observer's (the third: reference responses)
            rec["reward"].append(statistics.fmean(scores))
        VaderPipe.calls += 1
        return [[{"label": "NEGATIVE", "score": -s}, {"label": "POSITIVE", "score": s}]
                for s in scores]


transformers.pipeline = lambda *a, **k: VaderPipe()

from trl.trainer.ppo_trainer import PPOTrainer

generate, step, log_stats = PPOTrainer.generate, PPOTrainer.step, PPOTrainer.log_stats


def timed_generate(self, *a, **k):
    if rec["start"] is None:
        rec["start"] = time.perf_counter()
    return generate(self, *a, **k)


def recorded_step(self, *a, **k):
    stats = step(self, *a, **k)
    rec["kl"].append(float(stats["objective/kl"]))
    state = self.optimizer.state.values()
    rec["optimizer_bytes"][id(self.optimizer)] = sum(
        v.numel() * v.element_size() for s in state for v in s.values() if torch.is_tensor(v))
    return stats


def timed_log_stats(self, *a, **k):
    log_stats(self, *a, **k)
    rec["ends"].append(time.perf_counter())


PPOTrainer.generate, PPOTrainer.step = timed_generate, recorded_step
PPOTrainer.log_stats = timed_log_stats

sys.argv = [cfg["script"], *cfg["argv"]]
g = runpy.run_path(cfg["script"], run_name="__main__")

models = [g["model_1"], g["model_2"], g["ref_model"]]
tensors = {t.data_ptr(): t for m in models for t in chain(m.parameters(), m.buffers())}
marks = [rec["start"], *rec["ends"]]
json.dump({
    "seconds": [b - a for a, b in zip(marks, marks[1:])],
    "pioneer_reward": rec["reward"][0::2], "observer_reward": rec["reward"][1::2],
    "pioneer_kl": rec["kl"][0::2], "observer_kl": rec["kl"][1::2],
    "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    "trainable": sum(p.numel() for m in models[:2] for p in m.parameters() if p.requires_grad),
    "optimizer_bytes": sum(list(rec["optimizer_bytes"].values())[-2:]),
    "dtype": str(next(models[0].parameters()).dtype),
    "torch": torch.__version__, "transformers": transformers.__version__,
}, open(cfg["out"], "w"))
'''


def recipe() -> dict:
    return tomllib.loads(RECIPE.read_text())


def queries(n: int, seed: int) -> list[str]:
    lines = (ROOT / "assets" / "reviews" / "train.jsonl").read_text().splitlines()
    rows = [json.loads(line)["query"] for line in lines]
    return random.Random(seed).sample(rows, n)


def model_dir(name: str) -> Path:
    from cory_lora.services.fetch import resolve

    return Path(resolve(name))


def legacy_model(src: Path, dst: Path) -> Path:
    """`src` as transformers 4.43 / tokenizers 0.19 read it (the weights linked, not copied)."""
    dst.mkdir(parents=True)
    for f in src.glob("*.safetensors"):
        (dst / f.name).symlink_to(f)
    if (src / "generation_config.json").exists():
        (dst / "generation_config.json").symlink_to(src / "generation_config.json")
    config = json.loads((src / "config.json").read_text())
    if "rope_parameters" in config:
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    if tok.get("tokenizer_class") == "TokenizersBackend":
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local", "local_files_only"):
        tok.pop(key, None)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
    spec = json.loads((src / "tokenizer.json").read_text())
    merges = spec["model"].get("merges", [])
    if merges and isinstance(merges[0], list):
        assert not any(" " in a or " " in b for a, b in merges)
        spec["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    (dst / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return dst


def official_copy(official: Path, tmp: Path) -> Path:
    """A copy of their code with EDITS applied to the script; prints each edit."""
    code = tmp / "CORY"
    shutil.copytree(official, code, ignore=shutil.ignore_patterns(".git", "img", "__pycache__"))
    script = code / SCRIPT
    text = script.read_text()
    for why, old, new in EDITS:
        if text.count(old) != 1:
            sys.exit(f"{SCRIPT}: expected one {old!r}; is this the official CORY code?")
        text = text.replace(old, new.format(tmp=tmp))
        print(f"  edit {SCRIPT}: {why}")
    script.write_text(text)
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    print("  stub nvidia-smi (their GPU pick at import): one GPU, 0 MiB used")
    print("  load_dataset -> our prompts; pipeline -> VADER; WANDB_MODE=disabled; hub offline")
    return code


def run(cmd: list[str], log: Path, env: dict | None = None, cwd: Path = ROOT) -> int:
    """Run `cmd` to completion with its output in `log`; its peak RSS in bytes (ru_maxrss)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        print(textwrap.indent("\n".join(log.read_text().splitlines()[-25:]), "    "))
        sys.exit(f"{cmd[0]} ... exited with {proc.returncode} (the end of its output above)")
    return usage.ru_maxrss * 1024


def run_official(args, cfg: dict, tmp: Path) -> dict:
    code = official_copy(Path(args.official).resolve(), tmp)
    model = legacy_model(model_dir(cfg["model"]["name_or_path"]), tmp / "model")
    ppo, seed = cfg["ppo"], cfg["train"]["seed"]
    argv = [
        *("--model_name", str(model), "--ppo_config.model_name", str(model)),
        *("--ppo_config.query_dataset", "assets/reviews", "--ppo_config.seed", str(seed)),
        *("--ppo_config.batch_size", str(ppo["batch_size"])),
        *("--ppo_config.mini_batch_size", str(ppo["minibatch_size"])),
        *("--ppo_config.ppo_epochs", str(ppo["epochs"])),
        *("--ppo_config.init_kl_coef", str(ppo["init_kl_coef"])),
        "--ppo_config.adap_kl_ctrl"
        if ppo.get("adaptive_kl", True)
        else "--ppo_config.no_adap_kl_ctrl",
        *("--ppo_config.learning_rate", str(args.official_lr)),
        *("--swap_freq", str(cfg["cory"]["swap_every"])),
    ]
    spec = {
        "code": str(code),
        "script": str(code / SCRIPT),
        "argv": argv,
        "queries": queries(args.iterations * ppo["batch_size"], seed),
        "out": str(tmp / "official.json"),
    }
    (tmp / "official_cfg.json").write_text(json.dumps(spec))
    (tmp / "run_official.py").write_text(RUNNER)
    env = os.environ | {
        "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "WANDB_MODE": "disabled",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp),
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("PYTHONPATH", None)
    cmd = [args.official_python, str(tmp / "run_official.py"), str(tmp / "official_cfg.json")]
    rss = run(cmd, tmp / "official.log", env, cwd=code)
    return json.loads((tmp / "official.json").read_text()) | {"rss": rss}


def run_ours(args, tmp: Path) -> dict:
    out = tmp / "ours"
    cmd = [sys.executable, "-m", "cory_lora", "run", str(RECIPE), "--quiet"]
    cmd += ["--set", f"train.iterations={args.iterations}", "--output-dir", str(out)]
    rss = run(cmd, tmp / "ours.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {"seconds": [r["time/iteration_s"] for r in rows], "rss": rss}
    for role in ("pioneer", "observer"):
        agents = [[k[: -len("/role")] for k, v in r.items() if v == role] for r in rows]
        result[f"{role}_reward"] = [
            r[f"{a[0]}/task_reward"] for r, a in zip(rows, agents, strict=True)
        ]
        result[f"{role}_kl"] = [r[f"{a[0]}/kl"] for r, a in zip(rows, agents, strict=True)]
    weights = subprocess.run(
        [sys.executable, __file__, "--weights-worker"], capture_output=True, text=True, check=True
    )
    return result | json.loads(weights.stdout.splitlines()[-1])


def weights_worker() -> None:
    """Bytes of the tensors cory-lora holds for the recipe (base, adapters, value heads)."""
    import torch

    from cory_lora.config import load_recipe
    from cory_lora.engine.model import load_agents

    agents = load_agents(load_recipe(RECIPE, []))
    modules = (agents.model, agents.value_heads)
    tensors = {
        t.data_ptr(): t for m in modules for t in (*m.parameters(), *m.buffers()) if t.numel()
    }
    trainable = sum(p.numel() for m in modules for p in m.parameters() if p.requires_grad)
    print(
        json.dumps(
            {
                "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "trainable": trainable,
                "dtype": str(next(agents.model.parameters()).dtype),
                "torch": torch.__version__,
            }
        )
    )


def fmt(x: float | None, spec: str = "7.3f") -> str:
    return " " * (len(format(0.0, spec)) - 1) + "-" if x is None else format(x, spec)


def report(args, cfg: dict, sides: dict[str, dict]) -> None:
    gen, ppo = cfg["generation"], cfg["ppo"]
    print(
        f"\nmodel {cfg['model']['name_or_path']}; prompts assets/reviews (query); reward "
        f"vader_positivity; batch {ppo['batch_size']}, minibatch {ppo['minibatch_size']}, "
        f"{ppo['epochs']} PPO epochs, {gen['min_new_tokens']}-{gen['max_new_tokens']} new tokens, "
        f"temperature {gen['temperature']}, top_k {gen['top_k']}, KL coef {ppo['init_kl_coef']} "
        f"fixed, swap every {cfg['cory']['swap_every']}; {args.iterations} iterations, "
        f"{os.cpu_count()} CPU cores"
    )
    print(
        f"official: full fine-tuning of 2 models (+ a frozen reference), lr {args.official_lr}, "
        "at most 4-15 new tokens (drawn per iteration), repetition_penalty 1.1; "
        f"cory-lora: LoRA r {cfg['lora']['r']}, lr {ppo['learning_rate']}, "
        f"{cfg['model']['dtype']}\n"
    )
    print(
        f"{'side':<10} {'peak RSS':>9} {'weights':>9} {'optimizer':>9} {'trainable':>11} "
        f"{'dtype':>9} {'s/it':>7}   torch"
    )
    for side, r in sides.items():
        opt = f"{r['optimizer_bytes'] / 2**20:,.0f} MiB" if "optimizer_bytes" in r else "-"
        median = statistics.median(r["seconds"][1:] or r["seconds"])
        print(
            f"{side:<10} {r['rss'] / 2**30:>5.2f} GiB {r['weight_bytes'] / 2**20:>5,.0f} MiB "
            f"{opt:>9} {r['trainable']:>11,} {r['dtype'].removeprefix('torch.'):>9} "
            f"{median:>7.1f}   {r['torch']}"
        )
    print("(s/it: median over iterations 2.., the first is a warm-up)\n")
    cols = ("seconds", "pioneer_reward", "observer_reward", "pioneer_kl", "observer_kl")
    heads = " ".join(f"{h:>7}" for h in ("s", "r pio", "r obs", "KL pio", "KL obs"))
    print("       " + "   ".join(f"{side:<{len(heads)}}" for side in sides))
    print("iter | " + " | ".join(heads for _ in sides))
    for i in range(args.iterations):
        cells = [
            " ".join(
                fmt(r[c][i] if i < len(r[c]) else None, "7.1f" if c == "seconds" else "7.3f")
                for c in cols
            )
            for r in sides.values()
        ]
        print(f"{i + 1:>4} | " + " | ".join(cells))
    print("(r: mean VADER score of the pioneer's / observer's responses; KL: per sequence)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", help="checkout of github.com/Harry67Hu/CORY")
    parser.add_argument("--official-python", help="a Python with their dependencies")
    parser.add_argument("--official-lr", type=float, default=1.41e-5, help="their script's")
    parser.add_argument("--iterations", type=int, default=10, help="per side")
    parser.add_argument("--quick", action="store_true", help="3 iterations")
    parser.add_argument("--only", choices=["official", "cory-lora"], help="run one side")
    parser.add_argument("--weights-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.weights_worker:
        return weights_worker()
    if args.quick:
        args.iterations = 3
    if args.only != "cory-lora" and not (args.official and args.official_python):
        parser.error("--official and --official-python are needed for the official side")
    cfg = recipe()
    sides = {}
    with tempfile.TemporaryDirectory(prefix="vs_official-") as tmp:
        if args.only != "cory-lora":
            print(f"official ({args.official}, run with {args.official_python}):")
            sides["official"] = run_official(args, cfg, Path(tmp))
        if args.only != "official":
            print("cory-lora (python -m cory_lora run recipes/smollm2_sentiment.toml):")
            sides["cory-lora"] = run_ours(args, Path(tmp))
    report(args, cfg, sides)


if __name__ == "__main__":
    main()
