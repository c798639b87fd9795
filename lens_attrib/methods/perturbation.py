"""The seeded random baseline (value zeroing lives in :mod:`lens_attrib.methods.value_zeroing`).

- ``random``: ``R_j ~ U[0, 1)`` on real tokens, seeded by ``seed`` and the item's token ids (so an
  item gets the same scores alone or in any batch).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from lens_attrib.forward import run
from lens_attrib.inputs import Batch
from lens_attrib.methods.registry import MethodOutput, Option, integer, register
from lens_attrib.target import Target


def item_seed(seed: int, ids: list[int]) -> int:
    """A seed from the option and the item's real token ids (batch-independent)."""
    return (seed * 1_000_003 + zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes())) % (2**63)


@register(
    "random",
    label="Random",
    target_free=True,
    needs_head=False,
    options={"seed": Option(0, check=integer)},
)
def random(model: Any, batch: Batch, target: Target, *, seed: int) -> MethodOutput:
    """Uniform random relevances on real tokens (a chance baseline for evaluations)."""
    clean = run(model, batch, target, position_only_ok=True)
    scores = torch.zeros(batch.size, batch.length, dtype=torch.float32)
    for b in range(batch.size):
        m = batch.mask[b].cpu()
        ids = batch.tokens[b].cpu()[m].tolist()
        gen = torch.Generator().manual_seed(item_seed(seed, ids))
        scores[b, m] = torch.rand(len(ids), generator=gen)
    return MethodOutput(scores, clean.resolved)
