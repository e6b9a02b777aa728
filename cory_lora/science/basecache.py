"""The base model's held-out row, computed once per study: every run of a study evaluates the
same base (adapters disabled) on the same prompts with the same settings, so its row is cached
in `STUDY_DIR/base-eval.json`, keyed by everything it depends on: the model, the data and
prompt settings, the generation and reward settings, eta, the seed (each evaluation's episodes
draw from a generator seeded with train.seed), the split's prompt texts and columns, the sample
sizes and the off-task prompts. Runs of different arms or KL weights share the key; runs of
another seed or split do not. A run evaluated outside a study computes its base row as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cory_lora.errors import UserError
from cory_lora.run.atomic import atomic_write_text
from cory_lora.run.records import read_json
from cory_lora.science.study import STATE_FILE

CACHE_FILE = "base-eval.json"


def study_dir_of(run_dir: Path) -> Path | None:
    """The study directory holding `run_dir` (STUDY/<arm>[/<grid point>]/seed-<s>), if any."""
    for parent in list(Path(run_dir).resolve().parents)[:3]:
        if (parent / STATE_FILE).is_file():
            return parent
    return None


def base_key(split: str, evaluator) -> str:
    """A digest of everything the base row of `evaluator` (run/heldout.py) on `split` depends on
    (see the module docstring)."""
    recipe, prompts, offtask = evaluator.recipe, evaluator.prompts, evaluator.offtask
    settings = {
        "model": recipe.model.model_dump(mode="json"),
        "data": recipe.data.model_dump(mode="json"),
        "generation": recipe.generation.model_dump(mode="json"),
        "reward": recipe.reward.model_dump(mode="json"),
        "eta": recipe.log.eta,
        "seed": recipe.train.seed,
        "split": split,
        "prompts": [prompts.queries, prompts.columns],
        "sampled": len(evaluator.sampled),
        "ks": list(evaluator.sampling.ks),
        "n": evaluator.sampling.n,
        "offtask": None if offtask is None else offtask.queries,
    }
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class BaseCache:
    """STUDY_DIR/base-eval.json: key -> {"split", "seed", "row"}. Studies evaluate one run at a
    time, so a read-modify-write (atomic) is enough."""

    def __init__(self, study_dir: Path):
        self.path = Path(study_dir) / CACHE_FILE

    def _entries(self) -> dict:
        if not self.path.is_file():
            return {}
        try:
            return read_json(self.path)
        except UserError:  # a damaged cache is only a cache: the row is computed again
            return {}

    def get(self, key: str) -> dict | None:
        entry = self._entries().get(key)
        return entry.get("row") if isinstance(entry, dict) else None

    def put(self, key: str, split: str, seed: int, row: dict) -> None:
        entries = self._entries() | {key: {"split": split, "seed": seed, "row": row}}
        atomic_write_text(self.path, json.dumps(entries, indent=2, sort_keys=True) + "\n")
