"""Timing verdicts as distributions: repeats, their spread, and a verdict that can say undecided.

A claims row that reads a clock on a shared 2-core machine is decided by repeats, not one run:

    a, b = interleaved(run_a, run_b, repeats=7)        # A B B A A B ... : drift hits both alike
    row = timed_claim("A is faster than B", "source", below(a, b), {"A": a, "B": b})

The rule (`decided_spread`): a side's spread is its middle half, the interquartile range from
the first to the third quartile. A verdict is yes or no only when the spreads do not overlap in
the decisive direction, and only with at least MIN_REPEATS repeats; otherwise it is None,
rendered "undecided on this machine". Why the quartiles and not min..max: on a shared machine
one repeat in several is slowed by another process; that outlier widens min..max, and min..max
only widens as repeats are added, so more repeats would push every verdict to undecided. The
middle half ignores one outlier in four, and its edges settle as repeats grow (on the quartiles
of what is being timed, not on zero: more repeats cannot decide a bar that sits inside them).
The figure still shows min, median and max, so a reader sees the outliers the verdict set aside.

A claim about the typical figure of many widely spread samples (a share of each step, over 20
steps and more) is decided on the median's 95% interval instead (`median_within`): the order
statistics that hold the median with 95% confidence whatever the distribution (Conover,
Practical Nonparametric Statistics, 1999, section 3.2). That interval does narrow as repeats
grow, so a bar outside the middle half's reach can still be decided. A claim about the time
lost over a run (a share of the step, summed over steps) is about the mean, not the typical
step: `mean_within` decides it on the mean's 95% bootstrap percentile interval (Efron &
Tibshirani, An Introduction to the Bootstrap, 1993, chapter 13), which a skewed spread of
shares (many small, a few large) leaves narrower than the median's.

`samples` are seconds (or any figure, e.g. an MFU per repeat); nothing here reads a clock except
`repeat` and `interleaved`, so the verdict rules are tested on synthetic samples.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

from distlab.lab.common import claim

MIN_REPEATS = 3  # fewer repeats than this never decide: quick mode's rows read undecided


# -- taking the repeats -------------------------------------------------------------------------
def repeat(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of `fn`, `repeats` times, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved(a: Callable[[], object], b: Callable[[], object], repeats: int,
                warmup: int = 1) -> tuple[list[float], list[float]]:
    """Seconds per call of `a` and of `b`, taken in the order A B, B A, A B, ... so that a load
    that rises or falls during the comparison falls on both sides alike."""
    for _ in range(warmup):
        a()
        b()
    ta, tb = [], []
    for i in range(repeats):
        for name in ("ab" if i % 2 == 0 else "ba"):
            t0 = time.perf_counter()
            (a if name == "a" else b)()
            (ta if name == "a" else tb).append(time.perf_counter() - t0)
    return ta, tb


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a[i] / b[i] for paired (interleaved) repeats: a ratio within one pair cancels the load the
    pair shared."""
    return [x / y for x, y in zip(a, b, strict=True)]


# -- the spread and the rules -------------------------------------------------------------------
def spread(samples: Sequence[float]) -> dict:
    """min, quartiles, median and max of the samples."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("no samples")
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return {"n": len(xs), "min": xs[0], "q1": q1, "median": statistics.median(xs), "q3": q3,
            "max": xs[-1]}


def decided_spread(samples: Sequence[float]) -> tuple[float, float] | None:
    """The range a verdict is decided on (the interquartile range), or None with too few
    repeats to decide."""
    if len(samples) < MIN_REPEATS:
        return None
    s = spread(samples)
    return s["q1"], s["q3"]


def below(a: Sequence[float], b: Sequence[float], factor: float = 1.0) -> bool | None:
    """"a is below factor·b": yes when a's spread lies wholly under factor·b's, no when wholly
    above, else None (also with too few repeats)."""
    ra, rb = decided_spread(a), decided_spread(b)
    if ra is None or rb is None:
        return None
    if ra[1] < factor * rb[0]:
        return True
    if ra[0] > factor * rb[1]:
        return False
    return None


def within(samples: Sequence[float], lo: float | None = None,
           hi: float | None = None) -> bool | None:
    """"the figure lies in [lo, hi]" (either bound may be open): yes when the spread lies wholly
    inside, no when wholly outside (below lo or above hi), else None."""
    return _in_band(decided_spread(samples), lo, hi)


def median_interval(samples: Sequence[float],
                    confidence: float = 0.95) -> tuple[float, float] | None:
    """The order statistics (x_(k), x_(n+1-k)) that hold the median with at least `confidence`,
    whatever the distribution: the largest k with P(Binomial(n, 1/2) < k) <= (1 - confidence)/2.
    None when n is too small for any such k (n < 6 at 95%)."""
    xs, n = sorted(samples), len(samples)
    tail, below_k, k = (1 - confidence) / 2, 0.0, 0
    while True:  # below_k = P(B <= k - 1) for B ~ Binomial(n, 1/2)
        nxt = below_k + math.comb(n, k) / 2**n
        if nxt > tail:
            break
        below_k, k = nxt, k + 1
    return None if k == 0 or k > n - k + 1 else (xs[k - 1], xs[n - k])


def median_within(samples: Sequence[float], lo: float | None = None,
                  hi: float | None = None) -> bool | None:
    """"the typical figure lies in [lo, hi]": `within`'s rule on the median's 95% interval
    instead of the middle half (too few samples: None)."""
    return _in_band(median_interval(samples), lo, hi)


def mean_interval(samples: Sequence[float], confidence: float = 0.95,
                  resamples: int = 2000) -> tuple[float, float] | None:
    """The bootstrap percentile interval of the mean: the (1-confidence)/2 and (1+confidence)/2
    quantiles of the means of `resamples` resamples drawn with replacement (a fixed seed, so
    the same samples always give the same interval). None with fewer than 6 samples, where
    the median's interval has none either."""
    import random
    xs, n = list(samples), len(samples)
    if n < 6:
        return None
    rng = random.Random(0)
    means = sorted(sum(rng.choices(xs, k=n)) / n for _ in range(resamples))
    tail = int((1 - confidence) / 2 * resamples)
    return means[tail], means[resamples - 1 - tail]


def mean_within(samples: Sequence[float], lo: float | None = None,
                hi: float | None = None) -> bool | None:
    """"the mean lies in [lo, hi]": `within`'s rule on the mean's 95% bootstrap interval."""
    return _in_band(mean_interval(samples), lo, hi)


def median_note(samples: Sequence[float], scale: float = 1e3, unit: str = "ms",
                digits: int = 3) -> str:
    """What `median_within` decided on, for the row's figure."""
    return _interval_note(median_interval(samples), "median", len(samples), scale, unit, digits)


def mean_note(samples: Sequence[float], scale: float = 1e3, unit: str = "ms",
              digits: int = 3) -> str:
    """What `mean_within` decided on, for the row's figure: the mean and its interval."""
    mean = _num(statistics.mean(samples) * scale, digits) if samples else "none"
    return (f"mean {mean}{' ' + unit if unit not in ('%', '') else unit}, "
            + _interval_note(mean_interval(samples), "mean", len(samples), scale, unit, digits))


def _interval_note(r, what: str, n: int, scale: float, unit: str, digits: int) -> str:
    if r is None:
        return f"too few repeats ({n}) for the {what}'s 95% interval"
    return (f"decided on the {what}'s 95% interval, {_num(r[0] * scale, digits)}–"
            f"{_num(r[1] * scale, digits)}{' ' + unit if unit not in ('%', '') else unit}")


def _in_band(r: tuple[float, float] | None, lo: float | None, hi: float | None) -> bool | None:
    """A range against [lo, hi]: yes wholly inside, no wholly outside, else (or no range)
    None."""
    if r is None:
        return None
    lo_ = -float("inf") if lo is None else lo
    hi_ = float("inf") if hi is None else hi
    if lo_ <= r[0] and r[1] <= hi_:
        return True
    if r[1] < lo_ or r[0] > hi_:
        return False
    return None


def in_order(samples: dict[str, Sequence[float]], order: Sequence[str]) -> bool | None:
    """"the sides run from smallest to largest in `order`": yes when each neighbouring pair is
    decided `below`, no when any pair is decided the other way round, else None."""
    return all_of(*(below(samples[a], samples[b]) for a, b in zip(order, order[1:])))


def all_of(*verdicts: bool | None) -> bool | None:
    """Several verdicts that must all hold: no if any is no, yes if all are yes, else
    undecided."""
    if any(v is False for v in verdicts):
        return False
    return True if all(v is True for v in verdicts) else None


# -- the row ------------------------------------------------------------------------------------
def _num(x: float, digits: int) -> str:
    """x to `digits` significant digits, never in exponent form (1020, 98.2, 0.0123)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    return f"{x:.{max(0, digits - 1 - math.floor(math.log10(abs(x))))}f}"


def fmt_spread(samples: Sequence[float], scale: float = 1e3, unit: str = "ms",
               digits: int = 3) -> str:
    """'min / median / max unit', each scaled (seconds to ms by default)."""
    s = spread(samples)
    return " / ".join(_num(s[k] * scale, digits) for k in ("min", "median", "max")) + \
        (f" {unit}" if unit else "")


def timed_figure(sides: dict[str, Sequence[float]], scale: float = 1e3, unit: str = "ms",
                 note: str = "", digits: int = 3, interleaved_: bool | None = None) -> str:
    """'A 1.2 / 1.3 / 1.9 ms, B ... (min / median / max of n repeats, interleaved)'."""
    n = sorted({len(v) for v in sides.values()})
    paired = len(sides) > 1 if interleaved_ is None else interleaved_
    body = ", ".join(f"{name} {fmt_spread(v, scale, unit, digits)}" for name, v in sides.items())
    counts = "/".join(map(str, n))
    plural = "" if n == [1] else "s"
    tail = f"(min / median / max of {counts} repeat{plural}{', interleaved' if paired else ''})"
    return f"{body} {tail}" + (f"; {note}" if note else "")


def timed_claim(text: str, source: str, holds: bool | None, sides: dict[str, Sequence[float]],
                scale: float = 1e3, unit: str = "ms", note: str = "", digits: int = 3,
                interleaved_: bool | None = None) -> dict:
    """A claims row with basis "timed": the figure shows each side's min / median / max and the
    repeat count, `holds` comes from `below` / `within` (None reads "undecided on this
    machine")."""
    return claim(text, source, timed_figure(sides, scale, unit, note, digits, interleaved_),
                 holds, basis="timed")
