"""A comparison is a claim about a distribution, not a run: the statistics of ``mlx-llm compare`` and of every
experiment that compares arms over seeds.

For each group of runs: n, the mean, the standard deviation (ddof 1) and the 95 % t-interval of the mean
(mean ± t₀.₉₇₅,ₙ₋₁·s/√n). For the difference of means (first group minus second): its 95 % interval and the
two-sided p-value of Welch's t-test (unequal variances, Welch–Satterthwaite degrees of freedom), or, paired (one
run of each group per seed), of the paired t-test on the per-seed differences. SciPy computes them
(``scipy.stats.ttest_ind(equal_var=False)``, ``ttest_rel``, ``t.interval``); tests/test_compare.py checks them
against the formulas written out by hand.

No spread (every value of a group equal, or, paired, every difference equal, to within float rounding: a range
of at most ``ROUNDING`` times the largest magnitude) leaves the t statistic infinite, or 0/0 when the difference is
zero too, so one rule decides, the same for a group, Welch's test and the paired test: the standard deviation is 0,
the interval is the point, and p is 0 when the difference is not zero and 1 when it is (``zero_variance`` says so,
and so does ``verdict``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import numpy as np

from mlx_llm.errors import InputError

CONFIDENCE = 0.95
SIGNIFICANCE = 0.05  # a difference with p ≥ this is reported as not significant
ROUNDING = 4 * np.finfo(np.float64).eps  # values this close, relative to their magnitude, are equal


def _values(values, what: str) -> np.ndarray:
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or v.size < 2:
        raise InputError(f"{what} has {v.size} value(s): a mean's interval needs at least two runs (seeds)")
    if not np.all(np.isfinite(v)):
        raise InputError(f"{what} holds a value that is not finite: {v.tolist()}")
    return v


@contextlib.contextmanager
def _overflow_quietly():
    """Values near the float range overflow the sums: the statistics are then inf or nan, which callers report
    (``mlx-llm compare --json`` as null), not a warning per operation."""
    with np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _no_spread(v: np.ndarray, scale: np.ndarray) -> bool:
    """Every value of ``v`` equal to within float rounding of the magnitudes ``scale`` they were computed from."""
    return bool(np.ptp(v) <= ROUNDING * np.max(np.abs(scale)))


def _zero_variance(mean: float, scale: np.ndarray, test: str) -> "Difference":
    """The difference of samples with no spread: the interval is the point; p is 1 for no difference, else 0."""
    zero = abs(mean) <= ROUNDING * float(np.max(np.abs(scale)))
    return Difference(mean, (mean, mean), 1.0 if zero else 0.0, test, zero_variance=True)


@dataclasses.dataclass(frozen=True)
class Summary:
    """One group: n, mean, standard deviation (ddof 1) and the 95 % t-interval of the mean."""

    n: int
    mean: float
    std: float
    ci95: tuple[float, float]

    def as_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "std": self.std, "ci95": list(self.ci95)}


@_overflow_quietly()
def summarize(values, what: str = "the group") -> Summary:
    from scipy import stats

    v = _values(values, what)
    mean, std = float(v.mean()), float(v.std(ddof=1))
    if _no_spread(v, v):
        return Summary(v.size, mean, 0.0, (mean, mean))
    lo, hi = stats.t.interval(CONFIDENCE, v.size - 1, loc=mean, scale=std / math.sqrt(v.size))
    return Summary(v.size, mean, std, (float(lo), float(hi)))


@dataclasses.dataclass(frozen=True)
class Difference:
    """The difference of two means (a − b): its 95 % interval, the p-value and the test that gave them."""

    mean: float
    ci95: tuple[float, float]
    p_value: float
    test: str  # "welch" | "paired"
    zero_variance: bool = False  # no spread: the interval is the point, p is 0 or 1 by the module's rule

    @property
    def significant(self) -> bool:
        return self.p_value < SIGNIFICANCE

    def as_dict(self) -> dict:
        """The JSON of the difference; ``zero_variance: true`` only where the no-spread rule decided (absent
        otherwise, so results files written before the rule existed read the same)."""
        out = {"mean": self.mean, "ci95": list(self.ci95), "p_value": self.p_value, "test": self.test}
        return {**out, "zero_variance": True} if self.zero_variance else out


@_overflow_quietly()
def welch(a, b) -> Difference:
    """Welch's two-sided t-test of mean(a) − mean(b) and its 95 % interval (unequal variances)."""
    from scipy import stats

    a, b = _values(a, "the first group"), _values(b, "the second group")
    diff = float(a.mean() - b.mean())
    if _no_spread(a, a) and _no_spread(b, b):
        return _zero_variance(diff, np.concatenate([a, b]), "welch")
    res = stats.ttest_ind(a, b, equal_var=False)
    lo, hi = res.confidence_interval(CONFIDENCE)
    return Difference(diff, (float(lo), float(hi)), float(res.pvalue), "welch")


@_overflow_quietly()
def paired(a, b) -> Difference:
    """The paired two-sided t-test of a − b (a[i] and b[i] from the same seed) and its 95 % interval."""
    from scipy import stats

    a, b = _values(a, "the first group"), _values(b, "the second group")
    if a.size != b.size:
        raise InputError(f"a paired test needs one run of each group per seed: {a.size} against {b.size} runs")
    d = a - b
    if _no_spread(d, np.concatenate([a, b])):
        return _zero_variance(float(d.mean()), np.concatenate([a, b]), "paired")
    res = stats.ttest_rel(a, b)
    lo, hi = res.confidence_interval(CONFIDENCE)
    return Difference(float(d.mean()), (float(lo), float(hi)), float(res.pvalue), "paired")


def describe(s: Summary, digits: int = 4) -> str:
    """``mean ± half-width (n = k)`` of a group's 95 % interval."""
    half = (s.ci95[1] - s.ci95[0]) / 2
    return f"{s.mean:.{digits}f} ± {half:.{digits}f} (n = {s.n})"


def verdict(d: Difference, digits: int = 4) -> str:
    """The difference in words: its interval and p-value, and whether it is significant at p < 0.05."""
    word = "significant" if d.significant else "not significant"
    spread = f", no spread between {'pairs' if d.test == 'paired' else 'runs'}: p is {d.p_value:g} by convention" \
        if d.zero_variance else ""
    return (f"{d.mean:+.{digits}f} [{d.ci95[0]:+.{digits}f}, {d.ci95[1]:+.{digits}f}], p = {d.p_value:.3g} "
            f"({d.test}{spread}; {word} at p < {SIGNIFICANCE:g})")
