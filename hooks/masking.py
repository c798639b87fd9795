"""Masking hooks: head masks (pruning), embedding masks (soft perturbation), value zeroing.

All are TransformerLens forward hooks returning a modified activation; none modifies weights.
Use them through ``model.hooks(fwd_hooks=...)`` (or inside ``model_guard``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.backend import hook_name
from lens_attrib.hooks import HookFn


def head_mask_hooks(
    keep: Float[Tensor, "layer head"] | Bool[Tensor, "layer head"],
) -> list[tuple[str, HookFn]]:
    """Multiply each query head's output ``z`` (``attn.hook_z``) by ``keep[layer, head]``.

    ``keep`` = 0 zeroes the head (pruning). Zeroing ``z`` of head h equals zeroing the rows of
    ``W_O[h]``: the head then adds only its share of ``b_O`` (which is per layer, not per head).
    In GQA models every query head is masked on its own (key/value heads are shared).
    """
    keep = keep.to(torch.float64) if keep.dtype == torch.bool else keep
    hooks: list[tuple[str, HookFn]] = []
    for layer in range(keep.shape[0]):
        row = keep[layer]
        if bool((row == 1).all()):
            continue

        def hook(z: Tensor, hook: Any, row: Tensor = row) -> Tensor:
            return z * row.to(device=z.device, dtype=z.dtype)[:, None]

        hooks.append((hook_name("z", layer), hook))
    return hooks


def embedding_mask_hook(
    keep: Float[Tensor, "batch pos"] | Float[Tensor, "batch pos d_model"],
    name: str = "hook_embed",
) -> tuple[str, HookFn]:
    """Scale the token embedding by ``keep`` (per token, or per element): soft perturbation.

    ``keep`` = 1 leaves the embedding, 0 replaces it by the zero vector (the Soft-NC/NS
    perturbation of Zhao & Shan 2024 applied to the token embedding).
    """

    def hook(x: Tensor, hook: Any) -> Tensor:
        k = keep.to(device=x.device, dtype=x.dtype)
        return x * (k[..., None] if k.ndim == 2 else k)

    return (name, hook)


def value_zeroing_hooks(
    n_layers: int, token_mask: Bool[Tensor, "batch pos"], layers: Sequence[int] | None = None
) -> list[tuple[str, HookFn]]:
    """Zero the value vectors of the masked tokens at every layer (``attn.hook_v``), or only at
    ``layers`` when given (Mohebbi et al. 2023 zero one layer at a time).

    ``token_mask[b, j]`` True zeroes token j's values in item b. The value vector includes the
    value bias ``b_V``, as in the authors' code. Works for grouped-query attention too
    (``hook_v`` holds the key/value heads).
    """

    def hook(v: Tensor, hook: Any) -> Tensor:
        keep = (~token_mask).to(device=v.device, dtype=v.dtype)
        return v * keep[:, :, None, None]

    chosen = range(n_layers) if layers is None else layers
    return [(hook_name("v", layer), hook) for layer in chosen]


def item_head_mask_hooks(
    keep: Float[Tensor, "batch layer head"] | Bool[Tensor, "batch layer head"],
) -> list[tuple[str, HookFn]]:
    """Per-item head masks: ``z[b, :, h]`` of layer ``l`` is multiplied by ``keep[b, l, h]``.

    Like :func:`head_mask_hooks`, but every item of the batch has its own mask, so that many
    pruning masks are evaluated in one forward (the items repeated once per mask). Layers where
    every item keeps every head get no hook.
    """
    keep = keep.to(torch.float64) if keep.dtype == torch.bool else keep
    hooks: list[tuple[str, HookFn]] = []
    for layer in range(keep.shape[1]):
        rows = keep[:, layer]
        if bool((rows == 1).all()):
            continue

        def hook(z: Tensor, hook: Any, rows: Tensor = rows) -> Tensor:
            return z * rows.to(device=z.device, dtype=z.dtype)[:, None, :, None]

        hooks.append((hook_name("z", layer), hook))
    return hooks
