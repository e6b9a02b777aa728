"""Evaluation of a finished run on held-out prompts: each agent alone, the chain, and the base.

Rows:
* `llmK` — the agent alone, answering the query (the pioneer's prompt);
* `llmA→llmB` — the pair: llmA answers, llmB answers after reading it (the pair's answer is the
  observer's); its KL is the observer's. With N agents, the full chain `llmA→...→llmZ` in each of
  the N orders training rotates through (the chain's answer and KL: the last agent's);
* `base` — the model with adapters disabled (the reference; its KL is 0 by definition).

Each row's figures (heldout.py): greedy accuracy and pass@k when the reward is a 0/1 correctness
score (exact_match, gsm8k_accuracy); for any task the mean task reward, KL to the reference and
combined reward task − eta·KL over the sampled answers (eta = log.eta of the run's recipe); and
the collapse figures: diversity and length of the sampled answers, off-task KL
(train.eval_offtask). Sampled answers and chains use the first train.eval_sampled_limit prompts.

In a study, the base row is computed once per (model, split, settings, seed) and reused by the
study's other runs (basecache.py).
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict
from pathlib import Path

import torch

from cory_lora.algorithm.cory import Roles, play_episode
from cory_lora.config import Recipe, greedy, load_recipe, template_fields
from cory_lora.engine.data import PromptSet, eval_split, load_eval_prompts
from cory_lora.engine.model import BASE, Agents, load_agents
from cory_lora.errors import UserError
from cory_lora.rewards import Reward, load_reward
from cory_lora.run.atomic import atomic_write_text
from cory_lora.run.heldout import EvalRow, Evaluator, Sampling
from cory_lora.run.lock import RunLock
from cory_lora.science.basecache import BaseCache, base_key, study_dir_of
from cory_lora.science.study import eval_file_name


def load_run(run_dir: Path) -> tuple[Recipe, Agents]:
    """The run's resolved recipe and its final agents (adapters and value heads)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise UserError(f"{run_dir}: not a run directory (no config.toml)")
    if not (run_dir / "final").is_dir():
        raise UserError(f"{run_dir}: the run has not finished (no final/ adapters)")
    recipe = load_recipe(run_dir / "config.toml")
    agents = load_agents(recipe)
    try:
        agents.load(run_dir / "final")
    except UserError:
        raise
    except Exception as e:  # missing or truncated files, tensors of another shape
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{run_dir / 'final'} is damaged or does not fit the run's config.toml "
            f"({type(e).__name__}: {reason}); its checkpoints are intact: delete final/ and "
            f"`cory-lora resume {shlex.quote(str(run_dir))}` writes it again"
        ) from None
    return recipe, agents


def eval_file(run_dir: Path, split: str, default: str) -> Path:
    """eval.json for the run's own held-out split; eval-<split>.json for any other, so that an
    evaluation of one split never overwrites another's."""
    return Path(run_dir) / eval_file_name(None if split == default else split)


def evaluate(
    run_dir: Path,
    split: str | None = None,
    limit: int = 200,
    ks: tuple[int, ...] = (1,),
    n: int = 0,
) -> dict:
    """Evaluate every row on up to `limit` held-out prompts; write run_dir/eval.json (or
    eval-<split>.json, see eval_file). The run directory is locked meanwhile: a run being trained
    or overwritten is not evaluated."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise UserError(f"{run_dir}: not a run directory (no config.toml)")
    with RunLock(run_dir).acquire():
        return _evaluate(run_dir, split, limit, ks, n)


def _evaluate(run_dir: Path, split: str | None, limit: int, ks: tuple[int, ...], n: int) -> dict:
    n = n or max(ks)
    if max(ks) > n:
        raise UserError(f"--k {max(ks)} needs at least that many samples per prompt (--n {n})")
    recipe = load_recipe(run_dir / "config.toml")
    name, held_out = eval_split(recipe.data, split)  # refuses before any model is loaded
    recipe, agents = load_run(run_dir)
    prompts = load_eval_prompts(recipe.data, agents.tokenizer, recipe.train.seed, split)
    prompts = prompts.take(list(range(min(limit, len(prompts)))))
    reward = load_reward(recipe.reward, str(agents.device), recipe.data)
    started = time.perf_counter()
    path = eval_file(run_dir, name, default=_default_split(recipe))
    offtask = path.name == "eval.json"  # the run's own split: not again for each split
    evaluator = Evaluator(recipe, agents, reward, prompts, Sampling(n, ks), offtask)
    rows = [evaluator.alone(name) for name in agents.names]
    if len(agents.names) > 1:  # the chain in each of the orders training rotates through
        chain = Roles(*agents.names)
        rows += [evaluator.chain(chain.rotated(k)) for k in range(len(agents.names))]
    records = [_record(row) for row in rows]
    base, cached = _base_row(run_dir, evaluator, name)
    result = {
        "run": str(run_dir),
        "split": name,
        "held_out": held_out,
        "prompts": len(prompts),
        "sampled_prompts": len(evaluator.sampled),
        "samples_per_prompt": n,
        "k": list(ks),
        "eta": recipe.log.eta,
        "base_cached": cached,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [*records, base],
    }
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    return result | {"path": str(path)}


def _record(row: EvalRow) -> dict:
    return asdict(row) | {"pass_at": {str(k): v for k, v in row.pass_at.items()}}


def _base_row(run_dir, evaluator: Evaluator, split: str) -> tuple[dict, bool]:
    """The base's row, and whether it came from the study's cache (basecache.py)."""
    study_dir = study_dir_of(run_dir)
    if study_dir is None:
        return _record(evaluator.base()), False
    cache = BaseCache(study_dir)
    key = base_key(split, evaluator)
    if (row := cache.get(key)) is not None:
        return row, True
    row = _record(evaluator.base())
    cache.put(key, split, evaluator.recipe.train.seed, row)
    return row, False


def samples_each(n: int) -> str:
    """How an eval.json's samples_per_prompt reads in a heading (the eval table, the model card)."""
    return f"{n} sample{'' if n == 1 else 's'} each"


def _default_split(recipe: Recipe) -> str | None:
    try:
        return eval_split(recipe.data)[0]
    except UserError:  # the run has no held-out split: every evaluation names its own
        return None


def sample_answers(
    run_dir: Path, prompt: str, agent: str, n: int, greedy_decoding: bool, seed: int
) -> list[str]:
    """Agent `agent`'s (or the base's) answers to `prompt`, formatted like the recipe's prompts."""
    recipe, agents = load_run(run_dir)
    if agent not in (*agents.names, BASE):
        raise UserError(f"--agent {agent!r}: this run has {', '.join(agents.names)} (or base)")
    if greedy_decoding:
        recipe = greedy(recipe)
    if not (template_fields(recipe.data.prompt_template) or set()) <= {"query"}:
        # the template needs dataset columns we do not have here: use the query as it is
        data = recipe.data.model_copy(update={"prompt_template": "{query}"})
        recipe = recipe.model_copy(update={"data": data})
    no_reward = Reward("none", lambda prompts, completions, **_: [0.0] * len(completions))
    episode = play_episode(
        agents,
        Roles(agent, None),
        PromptSet([prompt] * n, {}),
        recipe,
        no_reward,
        agents.stopping(recipe.generation.stop),
        torch.Generator(agents.device).manual_seed(seed),
    )
    return episode.pioneer_generation.texts
