"""Propagating row vectors down a stack of token-mixing matrices (rollout-style tracing).

Shared by attention rollout (Abnar & Zuidema 2020) and ALTI (Ferrando et al. 2022): a relevance
row over layer ``l``'s input positions is traced to the input tokens by multiplying it with the
mixing matrices of the layers below, ``r A_{l−1} ⋯ A_0``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor


def trace_rows(
    rows: Float[Tensor, "batch n pos"],
    depths: Sequence[int],
    mats: Sequence[Float[Tensor, "batch pos pos"]],
) -> Float[Tensor, "batch n pos"]:
    """``out[:, r] = rows[:, r] @ mats[depth_r − 1] @ … @ mats[0]`` (top-down, row vectors).

    Row vectors are pushed down one layer at a time (O(n·T²) per layer) instead of forming full
    ``T×T`` products. ``rows`` and ``mats`` are on one device.
    """
    out = rows.clone()
    depth = torch.as_tensor(list(depths), device=rows.device)
    for k in range(int(depth.max().item()) - 1 if len(depths) else -1, -1, -1):
        sel = torch.nonzero(depth > k).flatten()
        out[:, sel] = torch.bmm(out[:, sel], mats[k].to(out.dtype))
    return out


def rollout_target_rows(
    mats: Sequence[Float[Tensor, "batch pos pos"]], positions: Int[Tensor, " batch"]
) -> Float[Tensor, "batch n_layers pos"]:
    """``out[b, l] = (A_l ⋯ A_0)[t_b]``: the target position's row rolled out to the input
    tokens after each layer (``t_b = positions[b]``), made on the matrices' device."""
    n_layers = len(mats)
    size, _, length = mats[0].shape
    rows = torch.zeros(size, n_layers, length, dtype=mats[0].dtype, device=mats[0].device)
    rows[torch.arange(size, device=rows.device), :, positions.to(rows.device)] = 1.0
    return trace_rows(rows, [layer + 1 for layer in range(n_layers)], mats)


__all__ = ["rollout_target_rows", "trace_rows"]
