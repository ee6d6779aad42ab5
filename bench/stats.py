"""Intervals for the quality report: percentile bootstrap of a mean, seeded (pure numpy).

* :func:`mean_interval`: the mean of per-sample values and its 95% percentile-bootstrap
  interval: ``RESAMPLES`` resamples of the samples with replacement, the 2.5th and 97.5th
  percentiles of the resampled means (numpy's default linear interpolation).
* :func:`stratified_interval`: the mean of the group means (RULER's average over tasks);
  each resample draws within every group with replacement (stratified), then averages the
  groups' resampled means.
* :func:`paired_interval`: the mean of ``b - a`` over pairs (evaluation windows seen by
  both methods), the pairs resampled together: :func:`mean_interval` of the differences.

Every call starts its own ``numpy.random.default_rng(seed)``: same inputs, same interval.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

LEVEL = 0.95
RESAMPLES = 10_000
SEED = 0
DESCRIPTION = f"95% percentile bootstrap over samples, {RESAMPLES:,} resamples, seed {SEED}"


@dataclass(frozen=True)
class Interval:
    """A mean, its bootstrap interval [lo, hi] and the number of samples behind it."""

    mean: float
    lo: float
    hi: float
    n: int

    def overlaps(self, other: "Interval") -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    def excludes(self, value: float) -> bool:
        return value < self.lo or value > self.hi


def _values(x: Sequence[float]) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"need a non-empty 1-d sequence of values, got shape {a.shape}")
    return a


def _resampled_means(a: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """[resamples] means of ``a`` resampled with replacement."""
    return a[rng.integers(0, a.size, (resamples, a.size))].mean(1)


def _interval(mean: float, boot: np.ndarray, n: int, level: float) -> Interval:
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(mean), float(lo), float(hi), n)


def mean_interval(x: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED,
                  level: float = LEVEL) -> Interval:
    """Mean of ``x`` [n] with its percentile-bootstrap interval."""
    a = _values(x)
    boot = _resampled_means(a, np.random.default_rng(seed), resamples)
    return _interval(a.mean(), boot, a.size, level)


def stratified_interval(groups: Sequence[Sequence[float]], resamples: int = RESAMPLES, seed: int = SEED,
                        level: float = LEVEL) -> Interval:
    """Mean over groups of each group's mean, resampled within every group; n = all samples."""
    arrays = [_values(g) for g in groups]
    if not arrays:
        raise ValueError("need at least one group")
    rng = np.random.default_rng(seed)
    boot = np.mean([_resampled_means(a, rng, resamples) for a in arrays], axis=0)
    return _interval(np.mean([a.mean() for a in arrays]), boot, sum(a.size for a in arrays), level)


def paired_interval(a: Sequence[float], b: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED,
                    level: float = LEVEL) -> Interval:
    """Mean of ``b - a`` over pairs, the pairs resampled together."""
    x, y = _values(a), _values(b)
    if x.shape != y.shape:
        raise ValueError(f"paired values need equal lengths, got {x.size} and {y.size}")
    return mean_interval(y - x, resamples, seed, level)


def text(c: dict) -> str:
    """An interval as a dict {mean, lo, hi, n} -> 'mean [lo, hi]' with one decimal (NIAH's 0-100
    scale), or 'mean (mean only)' when lo is None (a result that holds no per-sample values)."""
    if c["lo"] is None:
        return f"{c['mean']:.1f} (mean only)"
    return f"{c['mean']:.1f} [{c['lo']:.1f}, {c['hi']:.1f}]"
