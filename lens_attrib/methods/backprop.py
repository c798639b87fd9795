"""Gradient machinery shared by the gradient baselines, LRPx and Grad-ELLM.

:func:`gradients_at` runs one hooked forward (:func:`lens_attrib.forward.run`) and one backward
pass of ``Σ_b f_b`` to the captured activations; :func:`grad_x_input_scores` and
:func:`head_relevances` turn activations and gradients into token and head relevances.
:data:`EMBEDDING_OPTION` and :data:`HEADS_OPTION` are the options every method that reads
gradients at the embeddings (and at ``attn.hook_z``) takes, with one meaning everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_attrib.backend import EMBEDDINGS
from lens_attrib.forward import Forward, FwdHooks, run
from lens_attrib.inputs import Batch
from lens_attrib.methods.registry import Option, is_bool
from lens_attrib.target import Target

EMBEDDING_OPTION = Option("full", choices=EMBEDDINGS, help="'full': token + positional (+ type)")
HEADS_OPTION = Option(False, check=is_bool, help="also per-head relevances at attn.hook_z")


def gradients_at(
    model: Any, batch: Batch, target: Target, names: Sequence[str], fwd_hooks: FwdHooks = ()
) -> tuple[list[Tensor], list[Tensor], Forward]:
    """(activations at ``names``, ``∂f/∂`` them, the forward) in one backward pass.

    ``fwd_hooks`` (e.g. LRP detach patches) are applied before the activations are captured, so a
    patch at a captured hook point acts upstream of the captured tensor. Must run with autograd
    on (the registry's wrapper does so for ``uses_gradient`` methods).
    """
    result = run(model, batch, target, capture=list(names), fwd_hooks=fwd_hooks)
    assert result.value is not None
    inputs = [result.captured[n] for n in names]
    grads = torch.autograd.grad(result.value.sum(), inputs, allow_unused=True)
    grads_filled = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
    return [x.detach() for x in inputs], [g.detach() for g in grads_filled], result


def _broadcast(x: Tensor, like: Tensor) -> Tensor:
    return x.expand_as(like) if x.shape != like.shape else x


def grad_x_input_scores(
    xs: Sequence[Float[Tensor, "batch pos d"]], grads: Sequence[Float[Tensor, "batch pos d"]]
) -> Float[Tensor, "batch pos"]:
    """``Σ_k Σ_d x^k ⊙ g^k`` over embedding components ``k``: ``[batch, pos]``."""
    scores = sum(((_broadcast(x, g) * g).sum(-1) for x, g in zip(xs, grads)), start=torch.zeros(()))
    assert isinstance(scores, Tensor)
    return scores


POOLINGS = ("grad_x_input", "l1", "l2")


def head_relevances(
    zs: Sequence[Tensor],
    grads: Sequence[Tensor],
    mask: Bool[Tensor, "batch pos"],
    pooling: str = "grad_x_input",
) -> dict[str, Any]:
    """Attribution fields for per-head relevances from ``z`` and ``∂f/∂z`` of every layer.

    ``pooling="grad_x_input"`` (Gradient×Input / LRP): ``r = z ⊙ ∂f/∂z`` (signed),
    ``head_token_scores = Σ_d r``, ``head_scores = Σ_pos Σ_d r``. With LRP patches and zero
    biases the head scores of one layer sum to the relevance of that attention layer's output.

    ``pooling="l1"``/``"l2"`` (saliency): ``r = |∂f/∂z|``, ``head_token_scores = ‖∂f/∂z_{p,h}‖``
    over ``d_head`` and ``head_scores = ‖∂f/∂z_h‖`` over ``(pos, d_head)`` together — the
    gradient-norm head importance of the decomposition paper (a norm, not a sum of token norms).

    Returns ``head_scores [batch, layer, head]``, ``head_token_scores [batch, layer, head, pos]``
    and ``parts["head_dim_relevance"] [batch, layer, head, pos, d_head]`` (``r``, unpooled;
    zero at padding).
    """
    z = torch.stack(list(zs), dim=1)
    g = torch.stack(list(grads), dim=1)
    keep = mask.to(g.device)[:, None, :, None, None].to(g.dtype)
    r = (z * g if pooling == "grad_x_input" else g.abs()) * keep
    r = einops.rearrange(r, "batch layer pos head d -> batch layer head pos d")
    if pooling in ("grad_x_input", "l1"):
        token = r.sum(-1)
        total = token.sum(-1)
    elif pooling == "l2":
        token = r.pow(2).sum(-1).sqrt()
        total = r.pow(2).sum((-2, -1)).sqrt()
    else:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    return {
        "head_scores": total.detach(),
        "head_token_scores": token.detach(),
        "parts": {"head_dim_relevance": r.detach()},
    }


__all__ = [
    "EMBEDDING_OPTION",
    "HEADS_OPTION",
    "POOLINGS",
    "grad_x_input_scores",
    "gradients_at",
    "head_relevances",
]
