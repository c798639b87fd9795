"""LRP for transformers as patched Gradient×Input: CP-LRP (``lrp``) and AttnLRP (``attnlrp``).

The model is patched with the detach hooks of :mod:`lens_attrib.hooks.lrp` (forward values
unchanged), the Target ``f`` is back-propagated once, and the relevance of input token ``i`` is

    R_i = Σ_k Σ_d e^k_{i,d} · ∂̃f/∂e^k_{i,d}

over the embedding components ``k`` (token + positional/token-type with ``embeddings="full"``,
token only with ``"partial"``), where ``∂̃`` is the patched gradient.

- ``lrp``: CP-LRP of Ali et al. 2022 ("XAI for Transformers: Better Explanations through
  Conservative Propagation"): norm scales and attention patterns detached, identity rule through
  the MLP activation, gate detached in gated MLPs. With all biases zero the network is linear in
  its embeddings along the patched graph, so ``Σ_i R_i = f`` (conservation).
- ``attnlrp``: AttnLRP of Achtibat et al. 2024 ("AttnLRP: Attention-Aware Layer-Wise Relevance
  Propagation for Transformers"): norm scales detached, identity rule through activations, uniform
  rule (half to each factor) on ``q·k``, ``A·v`` and ``φ(gate)·up``, plain Gradient×Input through
  the softmax. The softmax rule is not conservative, so ``Σ_i R_i ≠ f`` in general:
  ``meta["conservation_gap"] = f − Σ_i R_i`` reports the gap (per item), never hidden.

Both store ``meta["relevance_sum"]`` (``Σ_i R_i`` over real tokens), ``meta["explained_value"]``
(``f``) and ``meta["conservation_gap"]``; with ``heads=True`` also per-head relevances from the
same backward pass (see :func:`lens_attrib.methods.gradient.head_relevances`).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from lens_attrib.attribution import Attribution
from lens_attrib.hooks.lrp import IDENTITY_EPS, lrp_hooks, mlm_head_patch
from lens_attrib.methods.common import (
    check_finite,
    embedding_hooks,
    grad_context,
    make_attribution,
    prepare,
)
from lens_attrib.methods.gradient import (
    grad_x_input_scores,
    gradients_at,
    head_hooks,
    head_relevances,
)
from lens_attrib.methods.registry import register
from lens_attrib.target import Target


def _warn_low_precision(model: Any, method: str) -> None:
    dtype = next(model.parameters()).dtype
    if dtype in (torch.bfloat16, torch.float16):
        warnings.warn(
            f"{method} in {dtype}: relevances are computed in this precision and conservation "
            "(Σ R = f) degrades to a few percent; use float32 or float64 for exact conservation.",
            stacklevel=3,
        )


def lrpx(
    model: Any,
    inputs: Any,
    target: Target | None,
    variant: str,
    *,
    embeddings: str = "full",
    heads: bool = False,
    identity_eps: float = IDENTITY_EPS,
) -> Attribution:
    """Shared body of ``lrp`` and ``attnlrp``: patched forward, one backward, grad × input.

    ``identity_eps``: stabiliser of the identity rule through activations (see
    :func:`lens_attrib.hooks.lrp.lrp_hooks`; default ``1e-10`` as in LXT 2.1).
    """
    started = time.perf_counter()
    _warn_low_precision(model, variant)
    batch, target = prepare(model, inputs, target)
    emb = embedding_hooks(model, embeddings)
    names = emb + (head_hooks(model) if heads else [])
    hooks = lrp_hooks(model, variant, identity_eps=identity_eps)
    with grad_context(model), mlm_head_patch(model, identity_eps=identity_eps):
        xs, grads, result = gradients_at(model, batch, target, names, hooks)
    n = len(emb)
    scores = grad_x_input_scores(xs[:n], grads[:n])
    check_finite(variant, scores)
    scores = scores.masked_fill(~batch.mask.to(scores.device), 0.0)
    value = result.value.detach()
    relevance_sum = scores.sum(-1)
    fields = head_relevances(xs[n:], grads[n:], batch.mask) if heads else {}
    return make_attribution(
        model,
        batch,
        result.resolved,
        variant,
        scores,
        started=started,
        options={"embeddings": embeddings, "heads": heads, "identity_eps": identity_eps},
        meta={
            "explained_value": value.cpu(),
            "relevance_sum": relevance_sum.cpu(),
            "conservation_gap": (value - relevance_sum).cpu(),
        },
        **fields,
    )


@register("lrp", uses_gradient=True)
def lrp(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    embeddings: str = "full",
    heads: bool = False,
    identity_eps: float = IDENTITY_EPS,
) -> Attribution:
    """CP-LRP (Ali et al. 2022) as patched Gradient×Input; see the module docstring.

    embeddings: ``"full"`` (token + positional [+ token-type]) or ``"partial"`` (token only).
    heads:      also per-head relevances ``z ⊙ ∂̃f/∂z`` at ``attn.hook_z``.
    identity_eps: identity-rule stabiliser ``φ(h)/(h + ε)`` (1e-10 as LXT 2.1; 0: exact rule).
    """
    return lrpx(
        model,
        inputs,
        target,
        "lrp",
        embeddings=embeddings,
        heads=heads,
        identity_eps=identity_eps,
    )


@register("attnlrp", uses_gradient=True)
def attnlrp(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    embeddings: str = "full",
    heads: bool = False,
    identity_eps: float = IDENTITY_EPS,
) -> Attribution:
    """AttnLRP (Achtibat et al. 2024) as patched Gradient×Input; see the module docstring.

    embeddings: ``"full"`` (token + positional [+ token-type]) or ``"partial"`` (token only).
    heads:      also per-head relevances ``z ⊙ ∂̃f/∂z`` at ``attn.hook_z``.
    identity_eps: identity-rule stabiliser ``φ(h)/(h + ε)`` (1e-10 as LXT 2.1; 0: exact rule).
    """
    return lrpx(
        model,
        inputs,
        target,
        "attnlrp",
        embeddings=embeddings,
        heads=heads,
        identity_eps=identity_eps,
    )
