"""Diversity of sampled answers (run/collapse.py) against values worked out by hand."""

from __future__ import annotations

import pytest

from cory_lora.run.collapse import distinct_n, mean_pairwise_overlap, tokens


def test_tokens_are_lower_cased_words_and_punctuation():
    assert tokens("The answer is 12.") == ["the", "answer", "is", "12", "."]


def test_distinct_n_counts_n_grams_within_each_answer():
    # unigrams a b a | a c: 5, distinct a b c: 3
    assert distinct_n(["a b a", "A c"], 1) == pytest.approx(3 / 5)
    # bigrams (a b) (b a) | (a c): none repeated, none across the two answers
    assert distinct_n(["a b a", "a c"], 2) == 1.0
    # the same answer twice: half the bigrams repeat
    assert distinct_n(["x y z", "x y z"], 2) == pytest.approx(2 / 4)
    assert distinct_n(["one", ""], 2) is None


def test_mean_pairwise_overlap_is_the_mean_jaccard_of_every_pair():
    # {a,b}-{a,c}: 1/3; {a,b}-{a,b}: 1; {a,c}-{a,b}: 1/3; mean 5/9
    assert mean_pairwise_overlap(["a b", "a c", "b a"]) == pytest.approx(5 / 9)
    assert mean_pairwise_overlap(["same", "same"]) == 1.0
    assert mean_pairwise_overlap(["alone"]) is None
