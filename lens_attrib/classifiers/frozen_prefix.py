"""Fine-tuning's forward without waste: the frozen lower blocks once per item, no padding.

When only the last ``k`` of ``L`` blocks train, the residual entering block ``L − k`` of an item
never changes during training. :func:`build_prefix` computes it once per item, at the item's own
length (items of equal length are batched together, so no position is padding), and keeps it;
every training step then runs only blocks ``L − k … L − 1`` (:func:`final_rows`), from the kept
residuals instead of from the tokens. Per epoch this saves the ``L − k`` frozen blocks (26 of
SmolLM2's 30) and, for every epoch after the first, the embedding.

Padding. A mini-batch's items have mixed lengths (SST-2 phrases: 5 to 60 tokens, 16 on average
on MiniLM); padding them to the longest one made about 2.5 times the real positions. The step's
items are therefore run in *chunks* of similar length (:func:`length_chunks`): the items sorted by
length are cut into consecutive runs so that ``Σ (chunk size × longest length) + overhead ×
number of chunks`` is smallest (``overhead``: the cost of one more forward call, in positions).
Items are right-padded inside a chunk (:func:`lens_attrib.backend.residual_from`).

Numerics. The mini-batches (their items and order), the loss and the optimiser are those of the
padded run: the final residual of every item is the same function of the same weights, computed
in other batch shapes, so it agrees with a padded forward to float rounding (tested in float64),
and so do the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.backend import arch_of, residual_before, residual_from
from lens_attrib.classifiers.linear import feature_position, item_tokens
from lens_attrib.forward import no_grad_context
from lens_attrib.progress import progress_bar

CHUNK_OVERHEAD = 24
"""Default cost of one more forward call in :func:`length_chunks`, in token positions (measured
on MiniLM and SmolLM2 on CPU: a block call costs about as much as 20–30 more positions)."""


@dataclass
class FrozenPrefix:
    """The residual entering block ``layer`` of every item, at the item's own length.

    ``resid[i]``: ``[length_i, d_model]``; ``feature[i]``: the feature position within item ``i``
    (its last token for decoders, ``[CLS]`` = 0 for encoders).
    """

    layer: int
    resid: list[Tensor]
    feature: list[int]

    @property
    def lengths(self) -> list[int]:
        return [int(r.shape[0]) for r in self.resid]

    def __len__(self) -> int:
        return len(self.resid)


def build_prefix(
    model: Any, inputs: Sequence[Any], layer: int, *, batch_size: int = 64
) -> FrozenPrefix:
    """The residual entering block ``layer`` for every input (no gradients; items of equal
    length batched together, so no padding)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    arch = arch_of(model)
    items = item_tokens(model, inputs)
    by_length: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        by_length.setdefault(len(item.tokens), []).append(i)
    groups = [
        rows[start : start + batch_size]
        for _, rows in sorted(by_length.items())
        for start in range(0, len(rows), batch_size)
    ]
    resid: list[Tensor | None] = [None] * len(items)
    device = model.cfg.device
    bar = progress_bar(desc=f"frozen blocks 0-{layer - 1}", total=len(items), unit="item")
    with bar, no_grad_context(model):
        for rows in groups:
            tokens = torch.stack([items[i].tokens for i in rows]).to(device)
            types = (
                None
                if items[rows[0]].token_types is None
                else torch.stack([items[i].token_types for i in rows]).to(device)  # type: ignore[misc]
            )
            mask = torch.ones_like(tokens, dtype=torch.bool)
            out = residual_before(model, arch, layer, tokens, mask, False, types)
            for j, i in enumerate(rows):
                resid[i] = out[j]
            bar.update(len(rows))
    position = feature_position(model)
    feature = [len(item.tokens) - 1 if position is None else position for item in items]
    return FrozenPrefix(layer, [r for r in resid if r is not None], feature)


def length_chunks(
    lengths: Sequence[int], rows: Sequence[int], overhead: float = CHUNK_OVERHEAD
) -> list[list[int]]:
    """``rows`` cut into chunks of similar length: sorted by ``lengths[row]``, split into
    consecutive runs minimising ``Σ size × longest + overhead × chunks`` (dynamic programming)."""
    if overhead < 0:
        raise ValueError(f"overhead must be >= 0, got {overhead}")
    order = sorted(rows, key=lambda r: lengths[r])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks: list[list[int]] = []
    j = n
    while j > 0:
        chunks.append(order[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


def final_rows(
    model: Any, prefix: FrozenPrefix, rows: Sequence[int], overhead: float = CHUNK_OVERHEAD
) -> Float[Tensor, "n d_model"]:
    """The final residual at the feature position of items ``rows`` (in that order), running
    blocks ``prefix.layer …`` from the kept residuals in length chunks (:func:`length_chunks`),
    under the caller's autograd mode."""
    arch = arch_of(model)
    lengths = [prefix.lengths[r] for r in rows]
    parts: list[Tensor] = []
    placed: list[int] = []  # positions in ``rows``, in the order of ``parts``
    for chunk in length_chunks(lengths, range(len(rows)), overhead):
        longest = max(lengths[j] for j in chunk)
        first = prefix.resid[rows[chunk[0]]]
        resid = first.new_zeros(len(chunk), longest, first.shape[-1])
        mask = torch.zeros(len(chunk), longest, dtype=torch.bool, device=first.device)
        for b, j in enumerate(chunk):
            resid[b, : lengths[j]] = prefix.resid[rows[j]]
            mask[b, : lengths[j]] = True
        final = residual_from(model, arch, resid, prefix.layer, mask)
        at = torch.tensor([prefix.feature[rows[j]] for j in chunk], device=final.device)
        parts.append(final[torch.arange(len(chunk), device=final.device), at])
        placed.extend(chunk)
    out = torch.cat(parts)
    inverse = torch.empty(len(rows), dtype=torch.long, device=out.device)
    inverse[torch.tensor(placed, device=out.device)] = torch.arange(len(rows), device=out.device)
    return out[inverse]


def prefix_features(
    model: Any, prefix: FrozenPrefix, *, batch_size: int = 64, overhead: float = CHUNK_OVERHEAD
) -> Float[Tensor, "n d_model"]:
    """The final residual at the feature position of every item of ``prefix`` (no gradients),
    in item order: :func:`lens_attrib.classifiers.linear.residual_features` of the same inputs
    to float rounding, running only the blocks above ``prefix.layer``."""
    order = sorted(range(len(prefix)), key=lambda i: prefix.lengths[i])
    parts: list[Tensor] = []
    starts = range(0, len(order), batch_size)
    with no_grad_context(model):
        for start in progress_bar(starts, desc="features", unit="batch"):
            parts.append(final_rows(model, prefix, order[start : start + batch_size], overhead))
    if not parts:
        return torch.empty(0, int(model.cfg.d_model), dtype=model.cfg.dtype)
    out = torch.cat(parts).cpu()
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return out[inverse]


__all__ = [
    "CHUNK_OVERHEAD",
    "FrozenPrefix",
    "build_prefix",
    "final_rows",
    "length_chunks",
    "prefix_features",
]
