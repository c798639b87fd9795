"""Per-item random seeds shared by the seeded methods (``random``, ReAGent): an item gets the
same random numbers whatever batch it is in, and whichever method draws them."""

from __future__ import annotations

import zlib

import numpy as np


def item_seed(seed: int, ids: list[int]) -> int:
    """A seed from the option and the item's real token ids (batch-independent)."""
    return (seed * 1_000_003 + zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes())) % (2**63)
