"""GSM8K grading: the final numeric answer of a completion against the gold answer after `####`.

The rule, in order:
1. If the completion has `####`, the first number after the last `####` is the answer.
2. Else, after the last "the answer is" / "answer:" (any case), the first number that follows.
3. Else, the last number in the completion.
Numbers are read with thousands separators (`1,234`), currency (`$5`), signs (`-3`), decimals
(`72.0` equals `72`), and a trailing period or percent sign ignored. Equality is exact on
decimals (no float rounding): `0.1 + 0.2`-style errors cannot make a wrong answer right.
A completion without any number scores 0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number: optional sign, optional $, digits with optional thousands groups, optional decimals.
NUMBER = re.compile(r"[-−]?\s?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-−]?\$?\.\d+")
MARKERS = re.compile(r"the (?:final )?answer is|answer\s*:", re.IGNORECASE)


def parse_number(text: str) -> Decimal | None:
    """The value of one NUMBER match, or None."""
    cleaned = text.replace(",", "").replace("$", "").replace("−", "-").replace(" ", "")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def extract_answer(completion: str) -> Decimal | None:
    """The completion's final answer by the rule in the module docstring."""
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1]
        match = NUMBER.search(tail)
        return parse_number(match.group()) if match else None
    markers = list(MARKERS.finditer(completion))
    if markers:
        match = NUMBER.search(completion, markers[-1].end())
        if match:
            return parse_number(match.group())
    numbers = NUMBER.findall(completion)
    return parse_number(numbers[-1]) if numbers else None


def gold_answer(answer: str) -> Decimal | None:
    """GSM8K's gold: the number after `####` (or the whole field when it is just a number)."""
    return extract_answer(str(answer))


def gsm8k_accuracy(
    prompts: list[str], completions: list[str], answer: list[str], **_
) -> list[float]:
    """1.0 when the completion's final number equals the gold answer after `####`, else 0.0."""
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        predicted, expected = extract_answer(completion), gold_answer(gold)
        scores.append(
            float(predicted is not None and expected is not None and predicted == expected)
        )
    return scores
