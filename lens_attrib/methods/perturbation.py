"""Perturbation baselines: value zeroing and a seeded random baseline.

- ``value_zeroing`` (Mohebbi et al. 2023): zero the value vectors of token j at every layer
  (``attn.hook_v``, via :func:`lens_attrib.hooks.masking.value_zeroing_hooks`) and measure the
  cosine distance of the output representation at the target position (the final residual):
  ``R_j = 1 − cos(h_t, h_t^{¬j})``. One forward per token, batched (``batch_size`` perturbed copies
  per forward). In causal models tokens after the target cannot change it: they get exactly 0
  without a forward.
- ``random``: ``R_j ~ U[0, 1)`` on real tokens, seeded by ``seed`` and the item's token ids (so an
  item gets the same scores alone or in any batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lens_attrib.forward import resid_of, run, target_rows
from lens_attrib.hooks.masking import value_zeroing_hooks
from lens_attrib.inputs import Batch
from lens_attrib.methods.registry import MethodOutput, Option, integer, positive_int, register
from lens_attrib.methods.seeding import item_seed
from lens_attrib.progress import progress_bar
from lens_attrib.target import Target


@register(
    "value_zeroing",
    parametrization=True,
    label="Value Zeroing",
    target_free=True,
    needs_head=False,
    options={"batch_size": Option(32, check=positive_int, help="perturbed copies per forward")},
)
def value_zeroing(model: Any, batch: Batch, target: Target, *, batch_size: int) -> MethodOutput:
    """Value zeroing: cosine distance of the target's final residual when token j's values are 0."""
    causal = batch.arch.causal
    clean = run(model, batch, target, position_only_ok=True)
    positions = clean.resolved.positions
    clean_rows = target_rows(clean.resid, positions)
    pairs = [
        (b, j)
        for b in range(batch.size)
        for j in range(batch.length)
        if bool(batch.mask[b, j]) and (not causal or j <= int(positions[b]))
    ]
    scores = torch.zeros(batch.size, batch.length, dtype=clean_rows.dtype)
    starts = range(0, len(pairs), batch_size)
    for start in progress_bar(starts, desc="value_zeroing", unit="forward"):
        chunk = pairs[start : start + batch_size]
        items = torch.tensor([b for b, _ in chunk])
        sub = batch.select(items)
        zero = torch.zeros(len(chunk), batch.length, dtype=torch.bool)
        zero[torch.arange(len(chunk)), torch.tensor([j for _, j in chunk])] = True
        hooks = value_zeroing_hooks(batch.arch.n_layers, zero.to(batch.tokens.device))
        with model.hooks(fwd_hooks=hooks):
            resid = resid_of(model, sub)
        rows = target_rows(resid, positions[items.to(positions.device)])
        dist = 1.0 - F.cosine_similarity(rows, clean_rows[items.to(rows.device)], dim=-1)
        for (b, j), d in zip(chunk, dist.cpu()):
            scores[b, j] = d
    return MethodOutput(scores, clean.resolved, meta={"target_position_only": clean.position_only})


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
