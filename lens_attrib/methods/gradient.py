"""Gradient baselines: saliency (ℓ1/ℓ2 gradient norms) and Gradient×Input.

For input embeddings ``e_i = Σ_k e_i^k`` (token + positional + token-type, or token only with
``embeddings="partial"``) and the explained scalar ``f``:

- ``gradient``:      ``R_i = ‖∂f/∂e_i‖_p``  (Simonyan et al. 2014; p = 1 or 2)
- ``grad_x_input``:  ``R_i = Σ_k Σ_d e_{i,d}^k · ∂f/∂e_{i,d}^k``  (Shrikumar et al. 2016)

One forward and one backward pass for the whole batch; parameters stay frozen.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.methods.common import (
    check_finite,
    embedding_hooks,
    grad_context,
    hooked_forward,
    make_attribution,
    prepare,
)
from lens_attrib.methods.registry import register
from lens_attrib.target import Target


def embedding_gradients(
    model: Any, batch: Any, target: Target, embeddings: str = "full"
) -> tuple[list[Tensor], list[Tensor], Any]:
    """(embedding activations, their gradients, forward result) in one backward pass."""
    names = embedding_hooks(model, embeddings)
    result = hooked_forward(model, batch, target, capture=names)
    inputs = [result.captured[n] for n in names]
    grads = torch.autograd.grad(result.value.sum(), inputs, allow_unused=True)
    grads_filled = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
    return [x.detach() for x in inputs], [g.detach() for g in grads_filled], result


def _broadcast(x: Tensor, like: Tensor) -> Tensor:
    return x.expand_as(like) if x.shape != like.shape else x


@register("gradient", uses_gradient=True)
def gradient(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    norm: str = "l2",
    embeddings: str = "full",
) -> Attribution:
    """Saliency: ``R_i = ‖∂f/∂e_i‖_p`` over ``d_model`` (``norm="l1"`` or ``"l2"``).

    The gradient of the summed embedding: with ``embeddings="full"`` the gradients at the
    token and positional embeddings are equal, so one of them is read.
    """
    if norm not in ("l1", "l2"):
        raise ValueError(f"norm must be 'l1' or 'l2', got {norm!r}")
    started = time.perf_counter()
    batch, target = prepare(model, inputs, target)
    with grad_context(model):
        _, grads, result = embedding_gradients(model, batch, target, "partial")
    g: Float[Tensor, "batch pos d"] = grads[0]
    scores = g.abs().sum(-1) if norm == "l1" else g.norm(dim=-1)
    check_finite("gradient", scores)
    return make_attribution(
        model,
        batch,
        result.resolved,
        "gradient",
        scores,
        started=started,
        options={"norm": norm, "embeddings": embeddings},
    )


@register("grad_x_input", uses_gradient=True)
def grad_x_input(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    embeddings: str = "full",
) -> Attribution:
    """Gradient×Input: ``R_i = Σ_k Σ_d e^k_{i,d} ∂f/∂e^k_{i,d}`` (signed)."""
    started = time.perf_counter()
    batch, target = prepare(model, inputs, target)
    with grad_context(model):
        xs, grads, result = embedding_gradients(model, batch, target, embeddings)
    scores = sum(((_broadcast(x, g) * g).sum(-1) for x, g in zip(xs, grads)), start=torch.zeros(()))
    assert isinstance(scores, Tensor)
    check_finite("grad_x_input", scores)
    return make_attribution(
        model,
        batch,
        result.resolved,
        "grad_x_input",
        scores,
        started=started,
        options={"embeddings": embeddings},
        meta={"explained_value": result.value.detach().cpu()},
    )
