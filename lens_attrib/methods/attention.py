"""Attention baselines: raw attention and attention rollout, read from cached patterns.

- ``attention``: ``R_j = (1/H) Σ_h α^{l,h}_tj`` — the target row of one layer's pattern averaged
  over heads (default: the last layer).
- ``rollout`` (Abnar & Zuidema 2020): ``Â_l = rownorm((Ā_l + I)/2)`` with ``Ā_l`` the head-averaged
  pattern; ``R = e_t Â_{L−1} ⋯ Â_0`` (``layer_scores[l] = e_t Â_l ⋯ Â_0``). Rows sum to 1.

Padding tokens get 0 and are never attended (padding rows are identity rows).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.hooks.guard import model_guard
from lens_attrib.methods.alti_mixing import trace_rows
from lens_attrib.methods.cached_forward import forward, target_rows
from lens_attrib.methods.common import check_finite, make_attribution, prepare
from lens_attrib.methods.registry import register
from lens_attrib.target import Target


def _dtype(model: Any) -> torch.dtype:
    return torch.float64 if model.cfg.dtype == torch.float64 else torch.float32


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


@register("attention")
def attention(
    model: Any, inputs: Any, target: Target | None = None, *, layer: int = -1
) -> Attribution:
    """Raw attention of ``layer`` (default: last), averaged over heads, at the target row."""
    started = time.perf_counter()
    batch, target = prepare(model, inputs, target)
    n_layers = model.cfg.n_layers
    if not -n_layers <= layer < n_layers:
        raise ValueError(f"layer must be in [{-n_layers}, {n_layers - 1}], got {layer}")
    layer %= n_layers
    store: dict[int, Tensor] = {}
    hooks = [(f"blocks.{layer}.attn.hook_pattern", _pattern_hook(store, layer, _dtype(model)))]
    with model_guard(model):
        result = forward(model, batch, target, hooks)
    scores = target_rows(store[layer], result.resolved.positions)
    scores = scores * batch.mask.to(scores.dtype)
    check_finite("attention", scores)
    return make_attribution(
        model,
        batch,
        result.resolved,
        "attention",
        scores,
        started=started,
        options={"layer": layer},
        meta={"target_position_only": result.position_only},
    )


@register("rollout", per_layer=True)
def rollout(model: Any, inputs: Any, target: Target | None = None) -> Attribution:
    """Attention rollout (Abnar & Zuidema 2020), target row; per-layer rollouts in layer_scores."""
    started = time.perf_counter()
    batch, target = prepare(model, inputs, target)
    n_layers = model.cfg.n_layers
    store: dict[int, Tensor] = {}
    dtype = _dtype(model)
    hooks = [
        (f"blocks.{layer}.attn.hook_pattern", _pattern_hook(store, layer, dtype))
        for layer in range(n_layers)
    ]
    with model_guard(model):
        result = forward(model, batch, target, hooks)
    mats = [rollout_matrix(store[layer], batch.mask) for layer in range(n_layers)]
    rows = torch.zeros(batch.size, n_layers, batch.length, dtype=dtype)
    rows[torch.arange(batch.size), :, result.resolved.positions] = 1.0
    layer_scores = trace_rows(rows, [layer + 1 for layer in range(n_layers)], mats)
    scores = layer_scores[:, -1]
    check_finite("rollout", scores)
    return make_attribution(
        model,
        batch,
        result.resolved,
        "rollout",
        scores,
        started=started,
        layer_scores=layer_scores,
        meta={"target_position_only": result.position_only},
    )
