"""The seeded random baseline (value zeroing lives in :mod:`lens_attrib.methods.value_zeroing`).

- ``random``: ``R_j ~ U[0, 1)`` on real tokens, seeded by ``seed`` and the item's token ids (so an
  item gets the same scores alone or in any batch).
"""

from __future__ import annotations

from typing import Any

import torch

from lens_attrib.forward import run
from lens_attrib.inputs import Batch
from lens_attrib.methods.registry import MethodOutput, Option, integer, register
from lens_attrib.methods.seeding import item_seed
from lens_attrib.target import Target


@register(
    "random",
    label="Random",
    target_free=True,
    needs_head=False,
    options={"seed": Option(0, check=integer)},
)
def random(model: Any, batch: Batch, target: Target, *, seed: int) -> MethodOutput:
    """Uniform random relevances on real tokens (a chance baseline for evaluations).

    The draws are float32 (the same numbers for every model dtype), stored in the model's
    working dtype (float64 for a float64 model, else float32) like every method's scores.
    """
    clean = run(model, batch, target, position_only_ok=True)
    scores = torch.zeros(batch.size, batch.length, dtype=batch.arch.work_dtype)
    for b in range(batch.size):
        m = batch.mask[b].cpu()
        ids = batch.tokens[b].cpu()[m].tolist()
        gen = torch.Generator().manual_seed(item_seed(seed, ids))
        scores[b, m] = torch.rand(len(ids), generator=gen).to(scores.dtype)
    return MethodOutput(scores, clean.resolved)
