"""Checks shared by the continuation tests: one generation step of a batched / forced
attribution against the same prefix explained alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal to 1e-10 relative to the array's largest magnitude (float64 arithmetic)."""
    scale = max(float(expected.abs().max()), 1e-300)
    err = float((actual - expected).abs().max())
    assert err <= 1e-10 * scale, f"{what}: max error {err:.3e} vs scale {scale:.3e}"


def check_step_row(
    forced: Any, row: int, single: Any, n_real: int, what: str, arrays: Sequence[str]
) -> None:
    """Row ``row`` of ``forced`` (left padded) equals item 0 of ``single`` on its ``n_real`` real
    tokens and is 0 after them, for each of ``arrays`` (per-head totals compared whole)."""
    for name in arrays:
        a, b = getattr(forced, name), getattr(single, name)
        assert (a is None) == (b is None), f"{what}: {name} present in only one"
        if a is None:
            continue
        if name == "head_scores":
            close(a[row], b[0], f"{what} {name}")
            continue
        a_row = a[row][..., forced.mask[row]]
        assert a_row.shape[-1] >= n_real, f"{what}: {name} has fewer real tokens than the step"
        close(a_row[..., :n_real], b[0][..., single.mask[0]], f"{what} {name}")
        assert (a_row[..., n_real:] == 0).all(), f"{what}: {name} after the step is not 0"
