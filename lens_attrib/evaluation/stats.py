"""Uncertainty of a mean over items: the percentile bootstrap.

Every table cell the reports show is a mean over items (sentences, minimal pairs); its 95%
interval comes from resampling the items with replacement (Efron & Tibshirani 1993, "An
Introduction to the Bootstrap", ch. 13, the percentile interval):

    mean*_b = mean(x[i_b1], …, x[i_bn]),   i_bj ~ Uniform{1..n},   b = 1..B
    CI = [quantile(mean*, (1 − level)/2), quantile(mean*, (1 + level)/2)]

Seeded, so that a report is reproducible. Pure numpy; no model, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

_MAX_DRAWS_PER_CHUNK = 2_000_000
"""Resampled indices held at once (resamples × items): bounds memory for large n."""


class MeanCI(NamedTuple):
    """A mean over ``n`` finite values and its bootstrap interval ``[low, high]``."""

    mean: float
    low: float
    high: float
    n: int


def bootstrap_ci(
    values: Iterable[float | None],
    *,
    level: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
) -> MeanCI:
    """Mean of the finite ``values`` with a percentile-bootstrap interval at ``level``.

    ``None``, NaN and ±inf are left out (``n`` counts what is kept). No values: all NaN and
    ``n = 0``. One value (or all equal): the interval collapses to the mean.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be positive, got {n_resamples}")
    kept = np.asarray(
        [float(v) for v in values if v is not None and math.isfinite(float(v))], dtype=np.float64
    )
    n = int(kept.size)
    if n == 0:
        return MeanCI(math.nan, math.nan, math.nan, 0)
    mean = float(kept.mean())
    rng = np.random.default_rng(seed)
    per_chunk = max(1, _MAX_DRAWS_PER_CHUNK // n)
    means = np.empty(n_resamples, dtype=np.float64)
    for start in range(0, n_resamples, per_chunk):
        size = min(per_chunk, n_resamples - start)
        means[start : start + size] = kept[rng.integers(0, n, size=(size, n))].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return MeanCI(mean, float(low), float(high), n)


__all__ = ["MeanCI", "bootstrap_ci"]
