"""Offline sentiment reward: VADER's compound score of query + completion, in [-1, 1].

The paper's IMDB reward is a classifier's POSITIVE logit on query + response; a hub classifier
cannot be had offline, so the SmolLM2 sentiment recipe uses VADER (Hutto & Gilbert, ICWSM 2014;
the `vaderSentiment` package, MIT): a lexicon and rules, no model, deterministic, ~0.1 ms a text.
It scores the same text the paper's classifier does (query + continuation). Being a lexicon, it
rewards positive words wherever they appear: the KL penalty is what keeps the text a review.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _analyzer():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError:
        from cory_lora.errors import UserError

        raise UserError(
            "reward.function = 'vader_positivity' needs the vaderSentiment package: "
            "pip install vaderSentiment (it comes with `pip install cory-lora`)"
        ) from None
    return SentimentIntensityAnalyzer()


def vader_positivity(prompts: list[str], completions: list[str], **_) -> list[float]:
    """VADER compound score of `prompt + completion` for each pair (-1 negative .. 1 positive)."""
    analyzer = _analyzer()
    return [
        analyzer.polarity_scores(p + c)["compound"]
        for p, c in zip(prompts, completions, strict=True)
    ]
