"""The percentile bootstrap of any statistic (lens_attrib.evaluation.stats.bootstrap_ci)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lens_attrib.evaluation.stats import bootstrap_ci


def test_a_statistic_resamples_items_like_the_mean_does():
    """statistic=np.mean draws the same resamples as the default mean: the same interval
    (7 items: numpy sums both ways in the same order)."""
    x = np.random.default_rng(1).normal(size=7)
    assert bootstrap_ci((x,), statistic=np.mean, seed=3, n_resamples=500) == bootstrap_ci(
        list(x), seed=3, n_resamples=500
    )


def test_pearson_statistic_equals_a_hand_written_bootstrap():
    rng = np.random.default_rng(0)
    gold = rng.normal(size=12)
    pred = gold + rng.normal(scale=0.5, size=12)

    def r(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.corrcoef(a, b)[0, 1])

    with np.errstate(invalid="ignore", divide="ignore"):
        got = bootstrap_ci((pred, gold), statistic=r, n_resamples=300, seed=5)
        draws = np.random.default_rng(5)
        boot = []
        for _ in range(300):
            i = draws.integers(0, 12, 12)
            boot.append(r(pred[i], gold[i]))
    boot_a = np.asarray(boot)
    tail = (1 - 0.95) / 2  # the module's rule (level 0.95), not the literal 0.025
    low, high = np.quantile(boot_a[np.isfinite(boot_a)], [tail, 1 - tail])
    assert got == (r(pred, gold), float(low), float(high), 12)
    assert got.low < got.mean < got.high <= 1.0


def test_statistic_over_tensors_and_bad_inputs():
    full = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64)
    gold = torch.tensor([0.0, 0.4, 1.0, 0.2], dtype=torch.float64)
    got = bootstrap_ci((full, gold), statistic=lambda a, b: float((a - b).abs().max()), seed=1)
    assert got.mean == pytest.approx(0.1, abs=1e-15) and got.n == 4
    assert got.low <= got.mean + 1e-15 and got.high <= 0.1 + 1e-15
    with pytest.raises(ValueError, match="one row per item"):
        bootstrap_ci((full, gold[:3]), statistic=lambda a, b: 0.0)
    empty = bootstrap_ci((np.zeros(0),), statistic=np.mean)
    assert empty.n == 0 and math.isnan(empty.mean)
    # every resample non-finite: the estimate, no interval
    nan = bootstrap_ci((np.ones(3),), statistic=lambda a: math.nan, n_resamples=10)
    assert math.isnan(nan.low) and math.isnan(nan.high) and nan.n == 3
