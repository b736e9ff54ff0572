"""Timing verdicts (distlab.lab.timed) on synthetic samples: no clock is read here.

A timed row says yes or no only when the two spreads (the middle halves) do not overlap, and
undecided when they do or when there are too few repeats.
"""

import statistics

from distlab.lab.common import claims_markdown
from distlab.lab.timed import (MIN_REPEATS, below, in_order, interleaved, mean_interval,
                               mean_note, mean_within, median_interval, median_within, ratios,
                               spread, timed_claim, within)

FAST = [1.0, 1.1, 1.05, 0.98, 1.02, 1.07, 1.01]
SLOW = [2.0, 2.1, 1.95, 2.2, 2.05, 1.99, 2.03]
NEAR = [1.03, 1.2, 0.9, 1.1, 1.0, 0.95, 1.15]


def test_a_clear_yes_a_clear_no_and_an_overlap():
    assert below(FAST, SLOW) is True
    assert below(SLOW, FAST) is False
    assert below(FAST, NEAR) is None and below(NEAR, FAST) is None


def test_one_outlier_does_not_decide_the_verdict():
    # one repeat in seven slowed by another process: min..max would overlap, the middle half not
    loaded = FAST[:-1] + [2.5]
    assert below(loaded, SLOW) is True
    assert spread(loaded)["max"] == 2.5


def test_a_factor_scales_the_other_side():
    # 'A within 1.5x of B': A below 1.5 B
    assert below(SLOW, FAST, factor=2.5) is True
    assert below(SLOW, FAST, factor=1.5) is False


def test_an_order_holds_only_when_every_neighbour_pair_is_decided():
    sides = {"fast": FAST, "near": NEAR, "slow": SLOW}
    assert in_order(sides, ["fast", "slow"]) is True
    assert in_order(sides, ["slow", "fast"]) is False
    # fast and near overlap: the order fast < near < slow is not decided, nor is its reverse
    # of the first pair; a pair decided the wrong way round makes it no
    assert in_order(sides, ["fast", "near", "slow"]) is None
    assert in_order(sides, ["near", "fast", "slow"]) is None
    assert in_order(sides, ["fast", "slow", "near"]) is False


def test_too_few_repeats_never_decide():
    few = MIN_REPEATS - 1
    assert below(FAST[:few], SLOW[:few]) is None
    assert within(FAST[:few], 0.5, 1.5) is None


def test_within_a_band_outside_it_and_across_its_edge():
    mfu = [0.44, 0.45, 0.46, 0.43, 0.47]
    assert within(mfu, 0.40, 0.50) is True
    assert within([x / 2 for x in mfu], 0.40, 0.50) is False      # all below the band
    assert within([x + 0.3 for x in mfu], 0.40, 0.50) is False    # all above it
    assert within([0.35, 0.38, 0.41, 0.44, 0.47], 0.40, 0.50) is None
    assert within(mfu, lo=0.4) is True and within(mfu, hi=0.4) is False


def test_the_row_is_timed_shows_min_median_max_and_the_count():
    row = timed_claim("A is faster than B", "s", below(FAST, SLOW), {"A": FAST, "B": SLOW},
                      scale=1, unit="s")
    assert row["basis"] == "timed" and row["holds"] is True
    assert "A 0.980 / 1.02 / 1.10 s, B 1.95 / 2.03 / 2.20 s" in row["figure"]
    assert "of 7 repeats, interleaved" in row["figure"]
    undecided = timed_claim("A is faster", "s", below(FAST, NEAR), {"A": FAST, "B": NEAR})
    assert "| timed | undecided on this machine |" in claims_markdown([undecided])


def test_interleaving_alternates_the_order_and_ratios_pair_them():
    order = []
    ta, tb = interleaved(lambda: order.append("a"), lambda: order.append("b"), 3, warmup=0)
    assert "".join(order) == "abbaab" and len(ta) == len(tb) == 3
    assert ratios([2.0, 4.0], [1.0, 2.0]) == [2.0, 2.0]


def test_the_median_interval_is_the_binomial_order_statistics():
    # Conover's table at 95%: n = 6 -> (1st, 6th), 9 -> (2nd, 8th), 26 -> (8th, 19th)
    assert median_interval(range(1, 6)) is None
    assert median_interval(range(1, 7)) == (1, 6)
    assert median_interval(range(1, 10)) == (2, 8)
    assert median_interval(range(1, 27)) == (8, 19)


def test_a_wide_spread_decides_on_its_median_not_its_middle_half():
    # 26 per-step shares spread from 1% to 29% around a 7% median: the middle half reaches under
    # a 3% bar, so `within` cannot decide; the median's interval lies wholly above it
    shares = [0.012, 0.015, 0.018, 0.02, 0.022, 0.024, 0.025, 0.035, 0.05, 0.055, 0.06, 0.062,
              0.065, 0.068, 0.07, 0.072, 0.075, 0.08, 0.085, 0.09, 0.12, 0.15, 0.2, 0.22, 0.25,
              0.29]
    assert within(shares, hi=0.03) is None
    assert median_within(shares, hi=0.03) is False
    assert median_within(shares, hi=0.5) is True
    assert median_within(shares, hi=0.06) is None           # the bar inside the interval
    assert median_within(shares[:5], hi=0.5) is None         # too few to hold the median at 95%


def test_the_mean_interval_holds_the_mean_and_narrows_with_repeats():
    # a skewed spread of shares: many small, a few large (ZeRO-3's waits on its gathers)
    shares = [0.01, 0.012, 0.015, 0.02, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.065, 0.07, 0.08,
              0.09, 0.1, 0.12, 0.15, 0.2, 0.23, 0.25]
    lo, hi = mean_interval(shares)
    assert lo < statistics.mean(shares) < hi
    assert mean_interval(shares) == (lo, hi)  # a fixed seed: the same samples, the same verdict
    lo4, hi4 = mean_interval(shares * 4)  # four times the repeats: about half as wide
    assert 0.35 < (hi4 - lo4) / (hi - lo) < 0.65
    assert mean_within(shares, hi=0.03) is False and mean_within(shares, hi=0.5) is True
    assert mean_within(shares, hi=statistics.mean(shares)) is None  # the bar inside it
    assert mean_interval(shares[:5]) is None and mean_within(shares[:5], hi=1) is None
    assert mean_note(shares, 100, "%", 2).startswith("mean 8.2%, decided on the mean's 95%")
