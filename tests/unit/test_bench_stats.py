"""bench.stats: percentile-bootstrap intervals of a mean (plain, stratified by group, paired),
checked on hand cases and, for the stratified one, against the exact bootstrap distribution of
a small case enumerated by brute force."""
import itertools

import numpy as np
import pytest

from bench import stats


def test_interval_contains_the_mean_and_is_ordered():
    x = np.random.default_rng(1).uniform(0, 1, 40)
    c = stats.mean_interval(x)
    assert c.lo <= c.mean <= c.hi and c.n == 40
    assert c.mean == pytest.approx(x.mean())


def test_interval_shrinks_with_n():
    half = lambda n: [0.0, 1.0] * (n // 2)  # noqa: E731  same mean 0.5, more samples
    widths = [(c.hi - c.lo) for c in (stats.mean_interval(half(n)) for n in (10, 100, 1000))]
    assert widths[0] > widths[1] > widths[2] > 0
    assert widths[0] / widths[2] == pytest.approx(10, rel=0.25)  # ~ 1 / sqrt(n)


def test_all_ones_and_all_equal_are_degenerate():
    assert stats.mean_interval([1.0] * 8) == stats.Interval(1.0, 1.0, 1.0, 8)
    assert stats.stratified_interval([[1.0] * 3, [1.0] * 5]) == stats.Interval(1.0, 1.0, 1.0, 8)
    assert stats.paired_interval([0.5, 2.0, 3.0], [1.5, 3.0, 4.0]) == stats.Interval(1.0, 1.0, 1.0, 3)


def test_deterministic_under_the_seed():
    x = np.random.default_rng(2).uniform(0, 1, 30)
    assert stats.mean_interval(x) == stats.mean_interval(x)
    assert stats.stratified_interval([x, x[:7]]) == stats.stratified_interval([x, x[:7]])
    assert stats.mean_interval(x, seed=1) != stats.mean_interval(x, seed=2)  # the seed decides the resamples


def _exact_quantile(values: list, p: float) -> float:
    """Smallest value whose cumulative probability reaches p (values equally likely)."""
    v = np.sort(values)
    return float(v[int(np.ceil(p * len(v))) - 1])


def test_stratified_interval_matches_brute_force():
    """Every resample of each group enumerated (27 x 4 equally likely): the bootstrap's
    percentiles are the exact distribution's (the cumulative probabilities at the interval's
    ends, 0.009 -> 0.037 and 0.963 -> 0.991, are far from 2.5% and 97.5%)."""
    groups = [[0.0, 0.5, 1.0], [0.0, 1.0]]
    exact = [(np.mean(a) + np.mean(b)) / 2 for a in itertools.product(groups[0], repeat=3)
             for b in itertools.product(groups[1], repeat=2)]
    c = stats.stratified_interval(groups)
    assert c.mean == pytest.approx(0.5) and c.n == 5
    assert c.lo == pytest.approx(_exact_quantile(exact, 0.025)) == pytest.approx(1 / 12)
    assert c.hi == pytest.approx(_exact_quantile(exact, 0.975)) == pytest.approx(11 / 12)


def test_stratified_mean_is_the_mean_of_group_means():
    c = stats.stratified_interval([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0]])  # pooled mean would be 0.5
    assert c.mean == pytest.approx(0.375) and c.lo <= c.mean <= c.hi


def test_paired_interval_sees_a_consistent_shift():
    rng = np.random.default_rng(0)
    a = rng.normal(3.0, 1.0, 16)  # the windows differ a lot from each other ...
    shifted = stats.paired_interval(a, a + 0.1 + rng.normal(0, 0.01, 16))  # ... the pairs by 0.1 each
    assert shifted.excludes(0.0) and shifted.lo > 0.05
    noise = stats.paired_interval(a, a + np.tile([0.5, -0.5], 8))  # differences of mean 0
    assert not noise.excludes(0.0)
    assert stats.Interval(0, 0, 1, 2).overlaps(stats.Interval(1, 1, 2, 2))
    assert not stats.Interval(0, 0, 1, 2).overlaps(stats.Interval(2, 1.5, 2, 2))


def test_bad_inputs():
    with pytest.raises(ValueError, match="non-empty"):
        stats.mean_interval([])
    with pytest.raises(ValueError, match="equal lengths"):
        stats.paired_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least one group"):
        stats.stratified_interval([])


def test_text():
    assert stats.text({"mean": 42.96875, "lo": 35.5, "hi": 50.39, "n": 64}) == "43.0 [35.5, 50.4]"
    assert stats.text({"mean": 3.1, "lo": None, "hi": None, "n": 8}) == "3.1 (mean only)"
