"""Every method gives exactly the pinned arrays on tiny float64 models (refactoring guard).

The arrays were written by ``python -m tests.pinned_outputs`` before the engine refactor; a
deliberate behaviour change regenerates them in the same commit and says so.
"""

from __future__ import annotations

import numpy as np
import pytest
from pinned_outputs import PATH, compute


@pytest.fixture(scope="module")
def pinned() -> dict[str, np.ndarray]:
    with np.load(PATH) as data:
        return {k: data[k] for k in data.files}


def test_every_method_reproduces_its_pinned_outputs(pinned):
    current = compute()
    assert sorted(current) == sorted(pinned)
    different = [k for k in pinned if not np.array_equal(current[k], pinned[k])]
    worst = {
        k: float(np.abs(current[k] - pinned[k]).max())
        if current[k].shape == pinned[k].shape
        else -1
        for k in different
    }
    assert not different, f"outputs changed: {worst}"
