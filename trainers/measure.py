"""When a timing trial has measured enough: the median step time's confidence interval.

``trainer.measure=fixed`` runs ``trainer.steps``. ``adaptive`` stops once the median of the timed
steps (those after ``trainer.warmup_steps``) is known to within ``trainer.measure_tolerance``:
the half-width of a distribution-free 95% confidence interval of the median, relative to the
median. The trial still stops at ``trainer.steps`` at the latest.

The interval is the one from order statistics (no assumption on the step-time distribution, which
on a shared machine has a long right tail): for n sorted samples, the median lies between the
j-th and (n + 1 - j)-th smallest with probability at least 1 - alpha, where j is the largest rank
with P(B <= j - 1) <= alpha / 2 for B ~ binomial(n, 1/2) (computed exactly: the normal
approximation, j = floor(n/2 - z sqrt(n)/2), gives the extremes x_1 and x_10 for n = 10, whose
coverage is 99.8%, where x_2 and x_9 hold 97.9%). Below ``MIN_TIMED`` samples it is too loose to
trust and no stop is taken.

The noise a comparison of two trials needs is another figure: :func:`median_rel_se`, the
median's standard error from the median absolute deviation, which one slow step cannot inflate
(the interval above, from 6 to 8 samples, runs from the smallest to the largest: one garbage
collection or flush among them set a single-run sweep's threshold at 7-9x).

Every rank must stop at the same step (the next step's collectives would hang otherwise): the
decision is taken on rank 0's times and shared with the others by the caller (one broadcast of a
flag per check, ``trainers/loop.py``).
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence, Tuple

MIN_TIMED = 6  # timed steps before an interval is trusted
Z95 = 1.959964  # the two-sided 95% normal quantile
MAD_SIGMA = 1.482602  # a normal sample's standard deviation per median absolute deviation
MEDIAN_SE = math.sqrt(math.pi / 2)  # the median's standard error per sigma / sqrt(n), normal samples


def median_interval(times: Sequence[float], z: float = Z95) -> Optional[Tuple[float, float, float]]:
    """(low, median, high) of the median's confidence interval, or None with too few samples."""
    n = len(times)
    if n < MIN_TIMED:
        return None
    xs = sorted(times)
    tail = 1.0 - statistics.NormalDist().cdf(z)  # alpha / 2
    j, below = 0, 0.0
    for i in range(n + 1):  # P(B <= i), B ~ binomial(n, 1/2)
        below += math.comb(n, i) / 2**n
        if below > tail:
            break
        j = i + 1
    j = max(1, j)
    mid = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    return xs[j - 1], mid, xs[n - j]


def relative_half_width(times: Sequence[float]) -> Optional[float]:
    """The median's interval half-width over the median; None while unknown."""
    got = median_interval(times)
    if got is None:
        return None
    low, mid, high = got
    return (high - low) / 2 / mid if mid > 0 else None


def enough(times: Sequence[float], tolerance: float) -> bool:
    """Whether the timed steps so far pin the median to within ``tolerance`` (relative)."""
    width = relative_half_width(times)
    return width is not None and width <= tolerance


def median_rel_se(times: Sequence[float]) -> Optional[float]:
    """The median's standard error over the median, robustly: ``sqrt(pi/2) x 1.4826 x MAD /
    sqrt(n)`` (the median absolute deviation estimates the spread of the bulk of the steps; up to
    half of them can be arbitrarily slow without moving it). None below ``MIN_TIMED`` samples."""
    n = len(times)
    if n < MIN_TIMED:
        return None
    mid = statistics.median(times)
    if mid <= 0:
        return None
    mad = statistics.median(abs(t - mid) for t in times)
    return MEDIAN_SE * MAD_SIGMA * mad / math.sqrt(n) / mid
