"""The statistics of a study's report, on scipy.stats: what a few seeds can and cannot say.

* A cell (one arm at one grid point, one figure, over seeds): the mean, n, and the Student-t 95%
  interval of the mean (`scipy.stats.t`, n - 1 degrees of freedom). With n <= 3 seeds no interval
  is given, only the range of the seeds' values: a t-interval on 2 or 3 values is so wide, and
  its coverage so dependent on normality, that it says little; a percentile bootstrap of 3
  values is their [min, max] and covers ~75%, not 95%.
* Two arms at one grid point: seeds are paired (a seed gives every arm the same prompt order and
  first rollout), so the comparison is on the per-seed differences d_s = a_s - b_s: their mean,
  the paired Student-t 95% interval, and the exact two-sided sign-flip permutation p-value (under
  "no difference" each d_s is as likely to have either sign; every one of the 2^n sign patterns
  is enumerated, `scipy.stats.permutation_test` with n_resamples = inf). The smallest p a
  sign-flip test can give is 2 / 2^n: 0.25 with 3 seeds, 0.125 with 4, 0.0625 with 5, so it can
  never reach 0.05 with 5 seeds or fewer.
* `clear`: a gap is called clear when n >= 4 paired seeds and the paired t 95% interval excludes
  0 (equivalently, the paired t-test's p < 0.05). That rule is achievable with 4-5 seeds; the
  sign-flip p stands beside it, with its floor, as the assumption-free check. Nothing is
  corrected for the number of comparisons: the report says how many it made, so that a reader
  expects about 5% of them to be called clear by chance alone.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
MIN_SEEDS_FOR_INTERVAL = 4  # n <= 3: the range of the seeds, not an interval


def t_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Student-t interval of the mean: mean ± t_{n-1, (1+c)/2} · s / sqrt(n); None for n < 2.
    All values equal: the interval is the point."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return None
    mean, sem = float(x.mean()), float(stats.sem(x))
    if sem == 0:
        return mean, mean
    low, high = stats.t.interval(confidence, len(x) - 1, loc=mean, scale=sem)
    return float(low), float(high)


def summarise(values: list[float]) -> dict:
    """A cell: mean, sample std, n, range, every value, and the t 95% interval when n >= 4."""
    x = [float(v) for v in values]
    n = len(x)
    if n == 0:
        return {"mean": None, "std": None, "n": 0, "ci95": None, "range": None, "values": []}
    return {
        "mean": float(np.mean(x)),
        "std": float(np.std(x, ddof=1)) if n > 1 else 0.0,
        "n": n,
        "ci95": t_interval(x) if n >= MIN_SEEDS_FOR_INTERVAL else None,
        "range": [min(x), max(x)],
        "values": x,
    }


def sign_flip_p(differences: list[float]) -> float | None:
    """Exact two-sided sign-flip permutation p-value of the mean of paired differences: the
    share of the 2^n sign patterns whose mean is at least as far from 0 as the observed one
    (scipy's two-sided p: twice the smaller tail, at most 1). None for n = 0; 1 for n = 1 (both
    patterns are as far from 0: a study stopped after one seed of an arm pair, which scipy's
    permutation test refuses)."""
    d = np.asarray(differences, dtype=float)
    if len(d) == 0:
        return None
    if len(d) == 1 or not d.any():
        return 1.0
    result = stats.permutation_test(
        (d,),
        np.mean,
        permutation_type="samples",  # one sample: its signs are flipped
        n_resamples=math.inf,  # every one of the 2^n patterns, exactly
        alternative="two-sided",
    )
    return float(result.pvalue)


def paired_t_p(differences: list[float]) -> float | None:
    """Two-sided p of the paired t-test (one-sample t-test of the differences against 0)."""
    d = np.asarray(differences, dtype=float)
    if len(d) < 2:
        return None
    if np.ptp(d) == 0:
        return 1.0 if d[0] == 0 else 0.0
    return float(stats.ttest_1samp(d, 0.0).pvalue)


def paired(a: dict[int, float], b: dict[int, float]) -> dict | None:
    """Arm a minus arm b over the seeds both have (seed -> value): the differences, their mean,
    the paired t 95% interval, the paired t-test p, the exact sign-flip p and its floor 2 / 2^n,
    and whether the gap is `clear` (module docstring). None when no seed is shared."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    d = [float(a[s]) - float(b[s]) for s in seeds]
    interval = t_interval(d)
    clear = (
        len(d) >= MIN_SEEDS_FOR_INTERVAL
        and interval is not None
        and (interval[0] > 0 or interval[1] < 0)
    )
    return {
        "seeds": seeds,
        "n": len(d),
        "differences": d,
        "mean": float(np.mean(d)),
        "ci95": interval,
        "p_t": paired_t_p(d),
        "p_sign_flip": sign_flip_p(d),
        "p_floor": 2.0 / 2 ** len(d) if len(d) else None,
        "clear": bool(clear),
    }
