"""GSM8K grader and pass@k, hand-checked."""

from __future__ import annotations

import math

import pytest

from cory_lora.rewards import gsm8k_accuracy
from cory_lora.rewards.gsm8k import extract_answer
from cory_lora.run.heldout import pass_at_k

GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


@pytest.mark.parametrize(
    "completion, right",
    [
        ("48 + 24 = 72\n#### 72", True),
        ("#### 72.0", True),  # decimals equal
        ("The answer is 72.", True),  # trailing period
        ("So she sold $72 in total", True),  # currency, last number
        ("the final answer is: 72", True),  # marker, then the first number after it
        ("Answer: 72 clips", True),
        ("#### 71", False),
        ("She sold 72 and then 5 more", False),  # last number is 5
        ("#### 72\nQuestion: what is 5+5? #### 10", False),  # the last #### counts
        ("no digits at all", False),
        ("", False),
    ],
)
def test_gsm8k_rules(completion, right):
    assert gsm8k_accuracy([""], [completion], answer=[GOLD]) == [float(right)]


@pytest.mark.parametrize(
    "text, value",
    [
        ("#### 1,234", "1234"),
        ("It costs $1,000,000.", "1000000"),
        ("she owes -3 dollars", "-3"),
        ("#### -0.5", "-0.5"),
        ("answer: 18%", "18"),
        ("The answer is 42\n\nQuestion: 17+3", "42"),
    ],
)
def test_number_reading(text, value):
    from decimal import Decimal

    assert extract_answer(text) == Decimal(value)


def test_gold_with_thousands_separator():
    assert gsm8k_accuracy([""], ["#### 1234"], answer=["... #### 1,234"]) == [1.0]


def test_pass_at_k_by_hand():
    # n = 5, c = 2, k = 2: 1 - C(3, 2) / C(5, 2) = 1 - 3/10
    assert math.isclose(pass_at_k(5, 2, 2), 0.7)
    # k = 1 is the fraction correct
    assert math.isclose(pass_at_k(10, 3, 1), 0.3)
    # n - c < k: some correct sample is always drawn
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 0, 3) == 0.0
    # matches the binomial form on a larger case: 1 - C(90, 10) / C(100, 10)
    assert math.isclose(pass_at_k(100, 10, 10), 1 - math.comb(90, 10) / math.comb(100, 10))
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
