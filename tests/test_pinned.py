"""Every method reproduces the pinned arrays on tiny float64 models (refactoring guard).

The arrays were written by ``python -m tests.pinned_outputs``; a deliberate behaviour change
regenerates them in the same commit and says so.

Tolerance. Each current array must agree with its pinned array to ``RTOL = 1e-12`` relative to
that pinned array's largest magnitude::

    max |current − pinned| ≤ 1e-12 · max |pinned|

Bit-identity is not portable: the pins were written on an AMD EPYC, and another CPU family's BLAS
(an Intel Xeon's, say) blocks and vectorises its sums differently, so each floating-point
operation may round differently at the ``2⁻⁵³ ≈ 1e-16`` level; through a few hundred operations
that reached 1.7e-14 of an array's scale (``bert/normxlogit//layer_scores`` on an Intel Xeon).
``1e-12`` leaves a 60× margin over that and is still 1000× below a 1e-9 relative change of a
single entry, which ``test_tolerance_catches_a_real_change`` shows is caught; a real behaviour
change (another rule, epsilon, mask or layer) moves float64 results far more than that.

The scale is per array (not per element), so that near-zero entries of a large array do not turn
rounding into a failure, and a large value in another array does not loosen the check. An all-zero
pinned array (scale 0) must be reproduced exactly: zeros there are structural (a blocked gradient,
a masked position), come out exactly 0 on every CPU, and any non-zero value is an infinite relative
change. NaN/inf must sit at the same places with the same values; shapes and dtypes must match.
"""

from __future__ import annotations

import numpy as np
import pytest
from pinned_outputs import PATH, compute

RTOL = 1e-12
"""Largest accepted ``max |current − pinned|`` relative to ``max |pinned|`` of each array."""


def pin_mismatches(
    current: dict[str, np.ndarray], pinned: dict[str, np.ndarray], rtol: float = RTOL
) -> dict[str, str]:
    """``{key: reason}`` for every array of ``current`` that does not reproduce ``pinned``.

    An array reproduces its pin when shape and dtype match, non-finite entries are identical, and
    ``max |current − pinned| ≤ rtol · max |pinned|`` over the finite entries (exact equality for
    an all-zero pin). Keys present on one side only are reported too.
    """
    bad: dict[str, str] = {}
    for key in sorted(set(current) ^ set(pinned)):
        bad[key] = "missing from the current outputs" if key in pinned else "not pinned"
    for key in sorted(set(current) & set(pinned)):
        now, pin = np.asarray(current[key]), np.asarray(pinned[key])
        if now.shape != pin.shape or now.dtype != pin.dtype:
            bad[key] = f"{now.dtype}{list(now.shape)} != pinned {pin.dtype}{list(pin.shape)}"
            continue
        finite = np.isfinite(pin)
        if not np.array_equal(finite, np.isfinite(now)) or not np.array_equal(
            now[~finite], pin[~finite]
        ):
            bad[key] = "non-finite entries differ"
            continue
        scale = float(np.abs(pin[finite]).max()) if finite.any() else 0.0
        diff = float(np.abs(now[finite] - pin[finite]).max()) if finite.any() else 0.0
        if diff > rtol * scale:
            relative = diff / scale if scale > 0 else float("inf")
            bad[key] = f"max |Δ| {diff:.3g} = {relative:.3g} of max |pinned| {scale:.3g}"
    return bad


@pytest.fixture(scope="module")
def pinned() -> dict[str, np.ndarray]:
    with np.load(PATH) as data:
        return {k: data[k] for k in data.files}


def test_every_method_reproduces_its_pinned_outputs(pinned):
    bad = pin_mismatches(compute(), pinned)
    assert not bad, f"outputs changed beyond {RTOL:g} of each array's scale: {bad}"


def test_tolerance_catches_a_real_change(pinned):
    key = "llama/attnlrp//scores"
    assert not pin_mismatches(pinned, pinned)
    scale = float(np.abs(pinned[key]).max())

    def changed(array: np.ndarray) -> dict[str, np.ndarray]:
        return {**pinned, key: array}

    one_entry = pinned[key].copy()
    one_entry.flat[0] += 1e-9 * scale
    assert list(pin_mismatches(changed(one_entry), pinned)) == [key]
    assert list(pin_mismatches(changed(pinned[key] * (1 + 1e-9)), pinned)) == [key]
    rounding = pinned[key].copy()
    rounding.flat[0] += 1e-13 * scale  # CPU-rounding size: accepted
    assert not pin_mismatches(changed(rounding), pinned)


def test_all_zero_pin_must_stay_exactly_zero():
    pin = {"a": np.zeros(3)}
    assert not pin_mismatches({"a": np.zeros(3)}, pin)
    assert pin_mismatches({"a": np.array([0.0, 1e-300, 0.0])}, pin)
    assert pin_mismatches({"a": np.zeros(4)}, pin)  # shape
    assert pin_mismatches({"a": np.array([np.nan, 0, 0])}, pin)  # NaN where a 0 was pinned
    assert pin_mismatches({"b": np.zeros(3)}, pin) == {
        "a": "missing from the current outputs",
        "b": "not pinned",
    }
