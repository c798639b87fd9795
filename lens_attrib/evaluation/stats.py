"""Uncertainty of a statistic over items: the percentile bootstrap.

Every table cell the reports show is a statistic over items (sentences, minimal pairs): most
are means, some are not (the Pearson drop ``r(full, gold) − r(perturbed, gold)`` over a
dataset). Its 95% interval comes from resampling the items with replacement (Efron &
Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13, the percentile interval):

    t*_b = t(x[i_b1], …, x[i_bn]),   i_bj ~ Uniform{1..n},   b = 1..B
    CI = [quantile(t*, (1 − level)/2), quantile(t*, (1 + level)/2)]

``t`` is the mean by default, or any ``statistic`` over the resampled arrays. Seeded, so that a
report is reproducible. Pure numpy; no model, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

_MAX_DRAWS_PER_CHUNK = 2_000_000
"""Resampled indices held at once (resamples × items): bounds memory for large n."""


class MeanCI(NamedTuple):
    """A statistic over ``n`` items (by default the mean of the finite values) and its
    bootstrap interval ``[low, high]``."""

    mean: float
    low: float
    high: float
    n: int


def bootstrap_ci(
    values: Iterable[float | None] | Sequence[Any],
    *,
    level: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
    statistic: Callable[..., float] | None = None,
) -> MeanCI:
    """A statistic of ``values`` with a percentile-bootstrap interval at ``level``.

    Default: the mean of the finite ``values``: ``None``, NaN and ±inf are left out (``n``
    counts what is kept); no values: all NaN and ``n = 0``; one value (or all equal): the
    interval collapses to the mean.

    ``statistic``: any function of resampled data, e.g. a Pearson correlation. ``values`` is
    then a tuple of arrays aligned along their first axis (one row per item) and each resample
    ``b`` calls ``statistic(*(a[i_b] for a in values))`` with its indices ``i_b`` (drawn one
    resample at a time); resamples whose statistic is not finite (e.g. a correlation of one
    repeated item) are left out of the interval; ``n`` is the number of items.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be positive, got {n_resamples}")
    tail = (1.0 - level) / 2.0
    if statistic is not None:
        return _statistic_ci(tuple(values), statistic, tail, n_resamples, seed)
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
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return MeanCI(mean, float(low), float(high), n)


def _statistic_ci(
    arrays: tuple[Any, ...],
    statistic: Callable[..., float],
    tail: float,
    n_resamples: int,
    seed: int,
) -> MeanCI:
    """:func:`bootstrap_ci` of ``statistic`` over the aligned ``arrays``."""
    if not arrays:
        raise ValueError("bootstrap_ci: a statistic needs at least one array of items.")
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError(
            f"bootstrap_ci: the arrays must have one row per item, got lengths "
            f"{[len(a) for a in arrays]}."
        )
    if n == 0:
        return MeanCI(math.nan, math.nan, math.nan, 0)
    rng = np.random.default_rng(seed)
    boot = np.asarray(
        [
            float(statistic(*(a[idx] for a in arrays)))
            for idx in (rng.integers(0, n, n) for _ in range(n_resamples))
        ],
        dtype=np.float64,
    )
    value = float(statistic(*arrays))
    finite = boot[np.isfinite(boot)]
    if not finite.size:
        return MeanCI(value, math.nan, math.nan, n)
    low, high = np.quantile(finite, [tail, 1.0 - tail])
    return MeanCI(value, float(low), float(high), n)


__all__ = ["MeanCI", "bootstrap_ci"]
