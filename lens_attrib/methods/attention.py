"""Attention baselines: raw attention and attention rollout, read from cached patterns.

- ``attention``: ``R_j = (1/H) Σ_h α^{l,h}_tj`` — the target row of one layer's pattern averaged
  over heads (default: the last layer).
- ``rollout`` (Abnar & Zuidema 2020): ``Â_l = rownorm((Ā_l + I)/2)`` with ``Ā_l`` the head-averaged
  pattern; ``R = e_t Â_{L−1} ⋯ Â_0`` (``layer_scores[l] = e_t Â_l ⋯ Â_0``). Rows sum to 1.

Padding tokens get 0 and are never attended (padding rows are identity rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.backend import attn_hook
from lens_attrib.forward import run, target_rows
from lens_attrib.inputs import Batch
from lens_attrib.methods.propagation import rollout_target_rows
from lens_attrib.methods.registry import MethodOutput, Option, integer, register
from lens_attrib.target import Target


def _pattern_hook(store: dict[int, Tensor], layer: int, dtype: torch.dtype) -> Callable[..., None]:
    def hook(pattern: Tensor, hook: Any) -> None:
        store[layer] = pattern.detach().to(dtype).mean(1)  # [batch, q, k], head-averaged

    return hook


def rollout_matrix(
    mean_pattern: Float[Tensor, "batch pos pos"], mask: Bool[Tensor, "batch pos"]
) -> Float[Tensor, "batch pos pos"]:
    """``rownorm((Ā + I)/2)`` with padding columns zeroed and padding rows set to identity."""
    n = mean_pattern.shape[-1]
    eye = torch.eye(n, dtype=mean_pattern.dtype, device=mean_pattern.device)
    m = mask[:, None, :].to(mean_pattern.dtype)
    a = 0.5 * (mean_pattern * m + eye)
    a = a / a.sum(-1, keepdim=True)
    return torch.where(mask[:, :, None], a, eye)


@register(
    "attention",
    label="Attention",
    target_free=True,
    needs_head=False,
    options={"layer": Option(-1, check=integer, help="which layer (default: the last)")},
)
def attention(model: Any, batch: Batch, target: Target, *, layer: int) -> MethodOutput:
    """Raw attention of ``layer`` (default: last), averaged over heads, at the target row."""
    n_layers = batch.arch.n_layers
    if not -n_layers <= layer < n_layers:
        raise ValueError(f"layer must be in [{-n_layers}, {n_layers - 1}], got {layer}")
    layer %= n_layers
    store: dict[int, Tensor] = {}
    hooks = [(attn_hook("pattern", layer), _pattern_hook(store, layer, batch.arch.work_dtype))]
    result = run(model, batch, target, fwd_hooks=hooks, position_only_ok=True)
    scores = target_rows(store[layer], result.resolved.positions)
    scores = scores * batch.mask.to(scores.dtype)
    return MethodOutput(
        scores, result.resolved, meta={"target_position_only": result.position_only, "layer": layer}
    )


@register("rollout", label="Rollout", per_layer=True, target_free=True, needs_head=False)
def rollout(model: Any, batch: Batch, target: Target) -> MethodOutput:
    """Attention rollout (Abnar & Zuidema 2020), target row; per-layer rollouts in layer_scores."""
    n_layers = batch.arch.n_layers
    store: dict[int, Tensor] = {}
    dtype = batch.arch.work_dtype
    hooks = [
        (attn_hook("pattern", layer), _pattern_hook(store, layer, dtype))
        for layer in range(n_layers)
    ]
    result = run(model, batch, target, fwd_hooks=hooks, position_only_ok=True)
    mats = [rollout_matrix(store[layer], batch.mask) for layer in range(n_layers)]
    layer_scores = rollout_target_rows(mats, result.resolved.positions)
    return MethodOutput(
        layer_scores[:, -1],
        result.resolved,
        layer_scores=layer_scores,
        meta={"target_position_only": result.position_only},
    )
