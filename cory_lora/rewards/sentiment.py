"""IMDB sentiment reward: the positive-class logit of a sequence classifier on query + completion.

As the paper's code (TRL's sentiment example): `lvwerra/distilbert-imdb`, reward = the raw logit
of the POSITIVE class (not a probability), batched, under no_grad. The classifier is loaded once
per (model, device) and kept.
"""

from __future__ import annotations

from functools import lru_cache

import torch

DEFAULT_MODEL = "lvwerra/distilbert-imdb"


@lru_cache(maxsize=4)
def load_classifier(name: str, device: str):
    """(tokenizer, model, index of the positive class), loaded once."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForSequenceClassification.from_pretrained(name).to(device).eval()
    labels = {int(i): str(label).lower() for i, label in model.config.id2label.items()}
    positive = next((i for i, label in labels.items() if label.startswith("pos")), None)
    if positive is None:  # unnamed labels (LABEL_0, LABEL_1): binary classifiers put positive last
        positive = max(labels)
    return tokenizer, model, positive


def sentiment_reward(
    prompts: list[str],
    completions: list[str],
    *,
    model_name: str = DEFAULT_MODEL,
    device: str = "cpu",
    batch_size: int = 64,
    **_,
) -> list[float]:
    """Positive-class logit of `prompt + completion` for each pair."""
    tokenizer, model, positive = load_classifier(model_name, device)
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    scores: list[float] = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size],
                padding=True,
                truncation=True,
                return_tensors="pt",
            ).to(device)
            scores += model(**batch).logits[:, positive].float().tolist()
    return scores
