"""The offline demo learns: mean task reward of the last 10 iterations clearly above the first 10.

Slow (about 2 minutes on 2 cores): `python -m pytest -m slow`.
"""

from __future__ import annotations

import pytest

from .helpers import ROOT, invoke, read_jsonl


@pytest.mark.slow
def test_demo_recipe_visibly_learns(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe's paths are relative to the repository
    out = tmp_path / "demo"
    result = invoke("run", "recipes/tiny_cpu.toml", "--output-dir", out, "--quiet")
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(out / "metrics.jsonl")

    def mean_reward(rows):
        return sum(m[f"{a}/task_reward"] for m in rows for a in ("llm1", "llm2")) / (2 * len(rows))

    first, last = mean_reward(metrics[:10]), mean_reward(metrics[-10:])
    assert last > first + 0.1, (first, last)
