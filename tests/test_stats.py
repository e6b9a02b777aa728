"""The report's statistics against values worked out by hand (science/stats.py)."""

from __future__ import annotations

import pytest

from cory_lora.science import stats


def test_t_interval_of_four_values():
    # mean 2.5; s = sqrt(((1.5)² + (0.5)² + (0.5)² + (1.5)²) / 3) = sqrt(5/3) = 1.290994;
    # sem = s / 2 = 0.645497; t(3 df, 0.975) = 3.182446; half-width 2.054260
    low, high = stats.t_interval([1.0, 2.0, 3.0, 4.0])
    assert low == pytest.approx(2.5 - 2.054260, abs=1e-6)
    assert high == pytest.approx(2.5 + 2.054260, abs=1e-6)


def test_t_interval_of_two_values_uses_one_degree_of_freedom():
    # mean 1; s = sqrt(2); sem = 1; t(1 df, 0.975) = 12.706205
    assert stats.t_interval([0.0, 2.0]) == pytest.approx((1 - 12.706205, 1 + 12.706205))


def test_t_interval_needs_two_values_and_is_a_point_without_spread():
    assert stats.t_interval([1.0]) is None
    assert stats.t_interval([0.5, 0.5, 0.5]) == (0.5, 0.5)


def test_a_cell_of_three_seeds_is_a_range_not_an_interval():
    cell = stats.summarise([0.2, 0.5, 0.3])
    assert cell["n"] == 3 and cell["ci95"] is None
    assert cell["range"] == [0.2, 0.5]
    assert cell["mean"] == pytest.approx(1.0 / 3)
    # s² = ((-0.1333)² + (0.1667)² + (-0.0333)²) / 2 = 0.046667 / 2
    assert cell["std"] == pytest.approx((0.046667 / 2) ** 0.5, abs=1e-5)


def test_a_cell_of_five_seeds_has_a_t_interval():
    # mean 3; s = sqrt(10 / 4) = 1.581139; sem = 0.707107; t(4 df, 0.975) = 2.776445
    cell = stats.summarise([1.0, 2.0, 3.0, 4.0, 5.0])
    assert cell["ci95"] == pytest.approx((3 - 1.963243, 3 + 1.963243), abs=1e-6)


def test_sign_flip_p_enumerates_every_sign_pattern():
    # five positive differences: only the observed pattern and its mirror are as extreme:
    # 2 / 32, the floor with five seeds
    assert stats.sign_flip_p([0.1, 0.2, 0.3, 0.4, 0.5]) == pytest.approx(2 / 32)
    # [1, -2, 3]: the 8 sums ±1 ±2 ±3 are 6, 4, 2, 0, 0, -2, -4, -6; |sum| >= |2| in 6 of 8
    assert stats.sign_flip_p([1.0, -2.0, 3.0]) == pytest.approx(6 / 8)
    # [0.1, 0.2, -0.05, 0.3]: observed sum 0.55; sums >= 0.55: 0.65 (all +) and 0.55 (the
    # observed); the mirror patterns give the other tail: 4 of 16
    assert stats.sign_flip_p([0.1, 0.2, -0.05, 0.3]) == pytest.approx(4 / 16)
    assert stats.sign_flip_p([0.0, 0.0]) == 1.0
    assert stats.sign_flip_p([0.3]) == 1.0  # one seed: +0.3 and -0.3 are as far from 0


def test_paired_difference_over_shared_seeds():
    a = {0: 1.0, 1: 2.0, 2: 3.0, 3: 5.0, 9: 7.0}  # seed 9: arm b has none, so it is left out
    b = {0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0}
    result = stats.paired(a, b)
    assert result["seeds"] == [0, 1, 2, 3] and result["differences"] == [1.0, 2.0, 3.0, 4.0]
    assert result["mean"] == 2.5
    assert result["ci95"] == pytest.approx((0.445740, 4.554260), abs=1e-6)
    # t = 2.5 / 0.645497 = 3.872983, 3 df: two-sided p = 0.030466
    assert result["p_t"] == pytest.approx(0.030466, abs=1e-6)
    assert result["p_sign_flip"] == pytest.approx(2 / 16) == result["p_floor"]
    assert result["clear"]


def test_a_gap_is_clear_only_when_the_paired_interval_excludes_zero_with_four_seeds():
    # the seeds disagree in sign: the interval holds 0
    assert not stats.paired({0: 1.0, 1: -1.0, 2: 2.0, 3: 0.5}, {s: 0.0 for s in range(4)})["clear"]
    # three seeds all one way, even far apart: a range of 3 seeds is never called clear
    assert not stats.paired({0: 5.0, 1: 5.1, 2: 5.2}, {0: 0.0, 1: 0.0, 2: 0.0})["clear"]
    assert stats.paired({0: 1.0}, {1: 1.0}) is None
