"""Recipes and studies: every shipped one validates; every problem is reported at once, by key."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from cory_lora.cli import describe_keys
from cory_lora.config import load_recipe, recipe_from_dict, recipe_toml
from cory_lora.errors import ConfigError

from .helpers import ROOT

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))

MINIMAL = {
    "model": {"name_or_path": "m"},
    "data": {"dataset": "d.jsonl"},
    "reward": {"function": "exact_match"},
}


def problems_of(raw, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(raw, overrides)
    return [p.text for p in info.value.problems]


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_validate(path):
    recipe = load_recipe(path)
    assert recipe.model.name_or_path


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"tiny_cpu.toml", "llama2_7b_gsm8k.toml", "gpt2_imdb.toml"} <= names


def test_every_problem_reported_at_once_by_dotted_key():
    raw = {
        "model": {"name_or_path": "m", "load_in_4bits": True, "dtype": "float64"},
        "data": {"dataset": "d.jsonl"},
        "reward": {"function": "exact_match"},
        "ppo": {"learning_rate": "fast", "batch_size": 10, "minibatch_size": 4, "epochs": 0},
        "generation": {"top_p": 1.5},
        "trian": {"iterations": 3},
    }
    problems = problems_of(raw)
    joined = "\n".join(problems)
    assert "model.load_in_4bits: unknown key (did you mean load_in_4bit?)" in joined
    assert 'model.dtype = "float64": must be one of' in joined
    assert 'ppo.learning_rate = "fast": expected a number' in joined
    assert "ppo.epochs = 0: must be > 0" in joined
    assert "generation.top_p = 1.5: must be <= 1" in joined
    assert "trian: unknown section" in joined
    # consistency is checked in the same pass
    assert "ppo.minibatch_size = 4 must divide ppo.batch_size = 10" in joined
    assert "ppo.micro_batch_size = 8 must divide ppo.minibatch_size = 4" in joined
    assert len(problems) == 8


def test_inconsistent_pairs_are_reported():
    raw = {**MINIMAL, "ppo": {"batch_size": 10, "minibatch_size": 4, "micro_batch_size": 3}}
    raw["generation"] = {"min_new_tokens": 9, "max_new_tokens": 4}
    raw["cory"] = {"observer_template": "{query} and {answer}"}
    joined = "\n".join(problems_of(raw))
    assert "ppo.minibatch_size = 4 must divide ppo.batch_size = 10" in joined
    assert "ppo.micro_batch_size = 3 must divide ppo.minibatch_size = 4" in joined
    assert "generation.min_new_tokens = 9 exceeds generation.max_new_tokens = 4" in joined
    assert "cory.observer_template: unknown placeholder(s) answer" in joined


def test_observer_template_must_show_the_pioneer():
    raw = {**MINIMAL, "cory": {"observer_template": "{query}"}}
    assert any("must contain {pioneer}" in p for p in problems_of(raw))
    raw["train"] = {"algorithm": "ppo"}  # no observer: the template does not matter
    recipe_from_dict(raw)


def test_consistency_is_checked_beside_bad_values():
    raw = {**MINIMAL, "ppo": {"learning_rat": 1, "minibatch_size": 3}, "train": {"iterations": "x"}}
    joined = "\n".join(problems_of(raw))
    assert "ppo.learning_rat: unknown key" in joined
    assert 'train.iterations = "x": expected an integer' in joined
    assert "ppo.minibatch_size = 3 must divide ppo.batch_size = 64" in joined
    # a pair whose other half is itself wrong is not reported against the default
    raw = {**MINIMAL, "ppo": {"batch_size": "many", "minibatch_size": 3, "micro_batch_size": 3}}
    assert not any("must divide ppo.batch_size" in p for p in problems_of(raw))


def test_required_keys():
    joined = "\n".join(problems_of({}))
    for key in ("model.name_or_path", "data.dataset", "reward.function"):
        assert f"{key}: required" in joined


def test_bool_is_not_an_int_and_ints_widen_to_float():
    assert any(
        "expected an integer" in p for p in problems_of({**MINIMAL, "train": {"iterations": True}})
    )
    recipe = recipe_from_dict({**MINIMAL, "ppo": {"learning_rate": 1}})
    assert recipe.ppo.learning_rate == 1.0 and isinstance(recipe.ppo.learning_rate, float)


def test_overrides_are_typed():
    recipe = recipe_from_dict(
        MINIMAL,
        [
            "train.iterations=7",
            "ppo.learning_rate=2e-5",
            "model.load_in_4bit=true",
            "model.name_or_path=meta-llama/Llama-2-7b-chat-hf",
            "data.split=2024",
            'generation.stop=[";", "\\n"]',
        ],
    )
    assert recipe.train.iterations == 7
    assert recipe.ppo.learning_rate == 2e-5
    assert recipe.model.load_in_4bit is True
    assert recipe.model.name_or_path == "meta-llama/Llama-2-7b-chat-hf"
    assert recipe.data.split == "2024"
    assert recipe.generation.stop == (";", "\n")


def test_bad_overrides_are_reported():
    joined = "\n".join(problems_of(MINIMAL, ["train.iterations=many", "nokey", "train.nope=1"]))
    assert 'train.iterations = "many": expected an integer' in joined
    assert "--set 'nokey': expected section.key=value" in joined
    assert "train.nope: unknown key" in joined


def test_an_override_that_is_neither_toml_nor_a_bare_word_is_refused():
    # Two TOML strings side by side used to be taken as the bare word '"a" "b"'.
    joined = "\n".join(problems_of(MINIMAL, ['data.dataset="a" "b"', "data.split=[1"]))
    assert """--set 'data.dataset="a" "b"': not a TOML value or a bare word""" in joined
    assert "--set 'data.split=[1': not a TOML value or a bare word" in joined
    assert recipe_from_dict(MINIMAL, ["data.dataset=org/name with space"]).data.dataset == (
        "org/name with space"
    )


def test_a_misspelt_key_gets_the_close_names():
    joined = "\n".join(problems_of(MINIMAL, ["ppo.learning_rat=1e-5", "ppo.lr=1"]))
    assert "ppo.learning_rat: unknown key (did you mean learning_rate?)" in joined
    assert "ppo.lr: unknown key" in joined


def test_resolved_recipe_round_trips(tmp_path):
    for path in RECIPES:
        recipe = load_recipe(path)
        out = tmp_path / "config.toml"
        out.write_text(recipe_toml(recipe))
        assert load_recipe(out) == recipe


def test_malformed_toml_is_one_message(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model\nname_or_path = 1")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_recipe(path)


def test_a_recipe_saved_with_a_byte_order_mark_or_windows_line_ends_reads_as_written(tmp_path):
    text = '[train]\niterations = 7\n[model]\nname_or_path = "x/y"\n[data]\ndataset = "d"\n'
    text += '[reward]\nfunction = "exact_match"\n'
    for name, data in (
        ("bom.toml", b"\xef\xbb\xbf" + text.encode()),
        ("crlf.toml", text.replace("\n", "\r\n").encode()),
    ):
        (tmp_path / name).write_bytes(data)
        recipe = load_recipe(tmp_path / name)
        assert recipe.train.iterations == 7 and recipe.model.name_or_path == "x/y"


def test_recipe_docs_match_the_code():
    """docs/recipe.md is generated by `cory-lora keys`; regenerate it when a field changes."""
    assert (ROOT / "docs" / "recipe.md").read_text() == describe_keys() + "\n"


def test_validate_cli_exit_code_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nname_or_path = "m"\nload_in_4bits = true\n[ppo]\nepochs = -1\n')
    result = subprocess.run(
        [sys.executable, "-m", "cory_lora.cli", "validate", str(bad)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    assert "model.load_in_4bits: unknown key" in result.stderr
    assert "ppo.epochs = -1: must be > 0" in result.stderr
    assert "data.dataset: required" in result.stderr
    good = subprocess.run(
        [
            sys.executable,
            "-m",
            "cory_lora.cli",
            "validate",
            str(ROOT / "recipes" / "tiny_cpu.toml"),
        ],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0, good.stderr
    assert "valid recipe" in good.stdout


STUDIES = sorted((ROOT / "studies").glob("*.toml"))


@pytest.mark.parametrize("path", STUDIES, ids=[p.name for p in STUDIES])
def test_shipped_studies_validate_with_every_run(path):
    from cory_lora.science.study import load_study

    study, runs = load_study(path)
    points = math.prod(len(values) for values in study.grid.values())
    assert len(runs) == len(study.seeds) * len(study.arms) * points
