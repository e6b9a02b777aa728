"""Held-out evaluation during training (train.eval_every): figures in metrics.jsonl, the same as
`cory-lora eval` gives the same adapters, training itself unchanged, a plot panel, and a recipe
without held-out prompts refused before anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import tiny_recipe_dict
from .helpers import invoke, read_jsonl, write_recipe

FIGURES = ("accuracy", "task_reward", "kl", "combined_reward")
COLLAPSE = ("distinct_1", "distinct_2", "overlap", "length", "offtask_kl")
EVERYDAY = Path(__file__).resolve().parents[1] / "assets" / "everyday" / "prompts.jsonl"


def _run(tmp_path, tiny_model_dir, arith_file, name, **train):
    recipe = write_recipe(
        tmp_path / f"{name}.toml",
        tiny_recipe_dict(
            tiny_model_dir,
            arith_file,
            data={"eval_holdout": 6},
            train={"iterations": 3, **train},
        ),
    )
    out = tmp_path / name
    result = invoke("run", recipe, "--output-dir", out, "--quiet")
    assert result.exit_code == 0, result.output
    return out, result


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, arith_file):
    tmp_path = tmp_path_factory.mktemp("eval-during-training")
    evaluated, result = _run(
        tmp_path,
        tiny_model_dir,
        arith_file,
        "evaluated",
        eval_every=2,
        eval_limit=5,
        eval_offtask=str(EVERYDAY),
    )
    plain, _ = _run(tmp_path, tiny_model_dir, arith_file, "plain")
    return evaluated, plain, result.output


def test_evaluations_land_in_metrics_at_every_nth_and_the_last_iteration(runs):
    evaluated, _, output = runs
    metrics = read_jsonl(evaluated / "metrics.jsonl")
    has_eval = [any(k.startswith("eval/") for k in m) for m in metrics]
    assert has_eval == [False, True, True]  # every 2nd, and the last
    for m in metrics[1:]:
        for agent in ("llm1", "llm2"):
            for figure in FIGURES + COLLAPSE:
                value = m[f"eval/{agent}/{figure}"]
                assert isinstance(value, float) and math.isfinite(value), (agent, figure)
            assert 0 <= m[f"eval/{agent}/accuracy"] <= 1  # exact_match is 0/1
            for figure in ("distinct_1", "distinct_2", "overlap"):
                assert 0 <= m[f"eval/{agent}/{figure}"] <= 1
        assert m["time/eval_s"] > 0
    assert "eval at iteration 2: llm1 accuracy" in output and "(5 held-out prompts)" in output


def test_the_last_evaluation_equals_cory_lora_eval_of_the_final_adapters(runs):
    evaluated, _, _ = runs
    last = read_jsonl(evaluated / "metrics.jsonl")[-1]
    result = invoke("eval", evaluated, "--limit", 5, "--n", 1)
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads((evaluated / "eval.json").read_text())["rows"]}
    for agent in ("llm1", "llm2"):
        for figure in FIGURES + COLLAPSE:
            assert last[f"eval/{agent}/{figure}"] == pytest.approx(rows[agent][figure], abs=1e-6)
    assert rows["base"]["offtask_kl"] == 0.0 and rows["llm1→llm2"]["offtask_kl"] is None


def test_evaluation_does_not_change_training(runs):
    evaluated, plain, _ = runs

    def training(run_dir):
        return [
            {k: v for k, v in m.items() if not k.startswith(("eval/", "time/"))}
            for m in read_jsonl(run_dir / "metrics.jsonl")
        ]

    assert training(evaluated) == training(plain)
    for agent in ("llm1", "llm2"):
        for file in ("adapter_model.safetensors", "value_head.safetensors"):
            a, b = (load_file(run / "final" / agent / file) for run in (evaluated, plain))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_plot_draws_the_held_out_panel(runs, tmp_path):
    evaluated, plain, _ = runs
    from matplotlib import pyplot as plt

    drawn = []
    original = plt.subplots

    def spy(*args, **kwargs):
        fig, axes = original(*args, **kwargs)
        drawn.append(axes)
        return fig, axes

    plt.subplots = spy
    try:
        assert invoke("plot", evaluated, plain, "-o", tmp_path / "both.png").exit_code == 0
        assert invoke("plot", plain, "-o", tmp_path / "plain.png").exit_code == 0
    finally:
        plt.subplots = original
    with_eval, without = drawn
    assert len(with_eval) == 5 and len(without) == 4
    lines = with_eval[4].get_lines()
    assert [list(line.get_xdata()) for line in lines] == [[2, 3], [2, 3]]  # llm1, llm2


def test_eval_every_without_held_out_prompts_is_refused_before_training(
    tmp_path, tiny_model_dir, arith_file
):
    recipe = write_recipe(
        tmp_path / "recipe.toml",
        tiny_recipe_dict(tiny_model_dir, arith_file, train={"eval_every": 1}),
    )
    out = tmp_path / "run"
    result = invoke("run", recipe, "--output-dir", out, "--quiet")
    assert result.exit_code == 1
    assert "train.eval_every = 1 needs held-out prompts" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()
