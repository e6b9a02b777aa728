"""The SmolLM2 tasks' held-out splits are held out by construction, checked on content, not on
strings: a word problem is its operation and its two operands (names, objects and wording
normalised away), a review opening is its text with the film title normalised away. test_id
shares no content with training but uses its templates; test_ood shares neither content nor
templates, names, objects, titles, genres, aspects or number ranges with training."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ("test_id", "test_ood")


def _generator():
    path = ROOT / "scripts" / "make_smollm2_data.py"
    spec = importlib.util.spec_from_file_location("make_smollm2_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def _rows(task: str, split: str) -> list[dict]:
    lines = (ROOT / "assets" / task / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _pattern(words: list[str]) -> re.Pattern:
    """Any of `words` as whole words, the longest first ("romantic comedy" before "comedy")."""
    alternatives = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
    return re.compile(rf"(?<![\w-])({alternatives})(?![\w-])")


NAMES = _pattern(GEN.NAMES + GEN.OOD_NAMES)
ITEMS = _pattern(GEN.ITEMS + GEN.OOD_ITEMS)
TITLES = _pattern(GEN.TITLES + GEN.OOD_TITLES)
GENRES = _pattern(GEN.GENRES + GEN.OOD_GENRES)
ASPECTS = _pattern(GEN.ASPECTS + GEN.OOD_ASPECTS)


# --------------------------------------------------------------------------- word problems


def problem_content(row: dict) -> tuple[str, frozenset]:
    """(operation, {a, b}) read from the numbers of the question and its answer."""
    a, b = map(int, re.findall(r"\d+", row["question"]))
    answer = int(row["answer"].removeprefix("#### "))
    ops = [op for op, value in (("+", a + b), ("-", a - b), ("-", b - a)) if value == answer]
    assert len(set(ops)) == 1, f"cannot tell the operation of {row}"
    return ops[0], frozenset((a, b))


def problem_frame(question: str) -> str:
    """The wording of a word problem: numbers, names and objects normalised away."""
    return ITEMS.sub("ITEM", NAMES.sub("NAME", re.sub(r"\d+", "N", question)))


def test_word_problem_splits_are_large_enough_and_each_item_is_a_new_problem():
    for split in HELD_OUT:
        contents = [problem_content(r) for r in _rows("word-arith", split)]
        assert len(contents) >= 200
        assert len(set(contents)) == len(contents), f"{split} repeats a problem"


@pytest.mark.parametrize("split", HELD_OUT)
def test_no_held_out_word_problem_is_a_training_problem(split):
    train = {problem_content(r) for r in _rows("word-arith", "train")}
    shared = [r for r in _rows("word-arith", split) if problem_content(r) in train]
    assert not shared, f"{len(shared)} {split} problems are training problems, e.g. {shared[0]}"


def test_in_distribution_word_problems_use_training_templates():
    train = {problem_frame(r["question"]) for r in _rows("word-arith", "train")}
    assert {problem_frame(r["question"]) for r in _rows("word-arith", "test_id")} <= train


def test_out_of_distribution_word_problems_share_no_template_name_object_or_range():
    train, ood = _rows("word-arith", "train"), _rows("word-arith", "test_ood")
    assert not {problem_frame(r["question"]) for r in train} & {
        problem_frame(r["question"]) for r in ood
    }
    for lexicon in (NAMES, ITEMS):
        seen = {w for r in train for w in lexicon.findall(r["question"])}
        assert not seen & {w for r in ood for w in lexicon.findall(r["question"])}
    numbers = [sorted(problem_content(r)[1]) for r in train]
    largest, largest_small = max(n[-1] for n in numbers), max(n[0] for n in numbers)
    for row in ood:  # both operands beyond any training problem's: a new range of numbers
        small, large = sorted(problem_content(row)[1])
        assert small > largest_small and large > largest, row


# --------------------------------------------------------------------------- review openings


def opening_content(query: str) -> str:
    """An opening's content: its text with the film title normalised away (stem, genre and
    aspect remain)."""
    return TITLES.sub("TITLE", query)


def opening_frame(query: str) -> str:
    """An opening's stem: title, genre (with its article) and aspect normalised away."""
    frame = ASPECTS.sub("ASPECT", GENRES.sub("GENRE", opening_content(query)))
    return re.sub(r"\ban? GENRE", "a GENRE", frame)


def test_review_splits_are_large_enough_and_each_item_is_a_new_opening():
    for split in HELD_OUT:
        contents = [opening_content(r["query"]) for r in _rows("reviews", split)]
        assert len(contents) >= 200
        assert len(set(contents)) == len(contents), f"{split} repeats an opening"


@pytest.mark.parametrize("split", HELD_OUT)
def test_no_held_out_opening_is_a_training_opening_with_another_title(split):
    train = {opening_content(r["query"]) for r in _rows("reviews", "train")}
    shared = [r for r in _rows("reviews", split) if opening_content(r["query"]) in train]
    assert not shared, f"{len(shared)} {split} openings are training openings, e.g. {shared[0]}"


def test_in_distribution_openings_use_training_stems_genres_and_aspects():
    train = _rows("reviews", "train")
    test = _rows("reviews", "test_id")
    assert {opening_frame(r["query"]) for r in test} <= {opening_frame(r["query"]) for r in train}
    for lexicon in (GENRES, ASPECTS):
        seen = {w for r in train for w in lexicon.findall(r["query"])}
        assert {w for r in test for w in lexicon.findall(r["query"])} <= seen


def test_out_of_distribution_openings_share_no_stem_title_genre_or_aspect():
    train, ood = _rows("reviews", "train"), _rows("reviews", "test_ood")
    assert not {opening_frame(r["query"]) for r in train} & {opening_frame(r["query"]) for r in ood}
    for lexicon in (TITLES, GENRES, ASPECTS):
        seen = {w for r in train for w in lexicon.findall(r["query"])}
        found = {w for r in ood for w in lexicon.findall(r["query"])}
        assert found and not seen & found


# --------------------------------------------------------------------------- the files


def test_the_files_are_what_the_seeded_generator_writes():
    for task, splits in GEN.build(0).items():
        for split, rows in splits.items():
            assert _rows(task, split) == rows, f"assets/{task}/{split}.jsonl is not generated"


@pytest.mark.parametrize("task", ["word-arith", "reviews"])
def test_each_split_loads_as_its_own_file(task):
    # datasets' inference from file names would read test_id and test_ood as one "test" split
    from cory_lora.config import DataConfig
    from cory_lora.engine.data import load_prompts

    column = "question" if task == "word-arith" else "query"
    cfg = DataConfig(dataset=str(ROOT / "assets" / task), query_column=column)
    for split in ("train", *HELD_OUT):
        assert load_prompts(cfg, split=split).queries == [r[column] for r in _rows(task, split)]
