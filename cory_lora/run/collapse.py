"""What distribution collapse looks like in a set of sampled answers, as pure functions of texts:
how varied the answers are (distinct-n, mean pairwise overlap). The held-out evaluator
(heldout.py) reports them beside the answers' length and the off-task KL.

Answers are compared as lower-cased word and punctuation tokens (`tokens`), not as the model's
subword tokens, so that the figures mean the same for every tokenizer.

* distinct-n (Li et al. 2016, "A Diversity-Promoting Objective Function"): the distinct n-grams
  of all answers over all their n-grams. 1 when no n-gram repeats; near 0 when every answer says
  the same thing.
* mean pairwise overlap: the Jaccard overlap |A ∩ B| / |A ∪ B| of two answers' token sets, the
  mean over every pair of answers. 0 when no two answers share a word; 1 when all are the same.
"""

from __future__ import annotations

import itertools
import re

TOKEN = re.compile(r"\w+|[^\w\s]")


def tokens(text: str) -> list[str]:
    """'The answer is 12.' -> ['the', 'answer', 'is', '12', '.']"""
    return TOKEN.findall(text.lower())


def distinct_n(texts: list[str], n: int) -> float | None:
    """Distinct n-grams over all n-grams of `texts` (each text's n-grams, none across texts);
    None when the texts hold no n-gram."""
    grams = [
        tuple(words[i : i + n]) for words in map(tokens, texts) for i in range(len(words) - n + 1)
    ]
    return len(set(grams)) / len(grams) if grams else None


def jaccard(a: set, b: set) -> float:
    """|a ∩ b| / |a ∪ b|; two empty sets are the same (1)."""
    return len(a & b) / len(a | b) if a | b else 1.0


def mean_pairwise_overlap(texts: list[str]) -> float | None:
    """Mean Jaccard overlap of the token sets of every pair of `texts`; None with fewer than 2."""
    sets = [set(tokens(t)) for t in texts]
    pairs = list(itertools.combinations(sets, 2))
    return sum(jaccard(a, b) for a, b in pairs) / len(pairs) if pairs else None
