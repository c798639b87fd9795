"""LRP for transformers as patched Gradient×Input: CP-LRP (``lrp``) and AttnLRP (``attnlrp``).

The model is patched with the detach hooks of :mod:`lens_attrib.hooks.lrp` (forward values
unchanged), the Target ``f`` is back-propagated once, and the relevance of input token ``i`` is

    R_i = Σ_k Σ_d e^k_{i,d} · ∂̃f/∂e^k_{i,d}

over the embedding components ``k`` (token + positional/token-type with ``embeddings="full"``,
token only with ``"partial"``), where ``∂̃`` is the patched gradient.

- ``lrp``: CP-LRP of Ali et al. 2022 ("XAI for Transformers: Better Explanations through
  Conservative Propagation"): norm scales and attention patterns detached, identity rule through
  the MLP activation, gate detached in gated MLPs. With all biases zero the network is linear in
  its embeddings along the patched graph, so ``Σ_i R_i = f`` (conservation; exactly with
  ``identity_eps=0``, up to the identity rule's stabiliser ``φ(h)/(h + 1e-10)`` by default,
  which is LXT 2.1's and makes the default equal LXT to ~1e-14 on float64 SmolLM2).
- ``attnlrp``: AttnLRP of Achtibat et al. 2024 ("AttnLRP: Attention-Aware Layer-Wise Relevance
  Propagation for Transformers"): norm scales detached, identity rule through activations, uniform
  rule (half to each factor) on ``q·k``, ``A·v`` and ``φ(gate)·up``, plain Gradient×Input through
  the softmax. The softmax rule is not conservative, so ``Σ_i R_i ≠ f`` in general:
  ``meta["completeness_gap"] = f − Σ_i R_i`` reports the gap (per item), never hidden.

Both store ``meta["relevance_sum"]`` (``Σ_i R_i`` over real tokens), ``meta["explained_value"]``
(``f``) and ``meta["completeness_gap"]`` (the same key as the sum-rule gap of Integrated Gradients
and DeepLIFT, whose reference is ``f(b)``; LRP's reference is 0); with ``heads=True`` also
per-head relevances from the same backward pass (see
:func:`lens_attrib.methods.backprop.head_relevances`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lens_attrib.backend import embedding_hooks, head_output_hooks
from lens_attrib.hooks.lrp import IDENTITY_EPS, lrp_hooks, mlm_head_patch
from lens_attrib.inputs import Batch
from lens_attrib.methods.backprop import (
    EMBEDDING_OPTION,
    HEADS_OPTION,
    grad_x_input_scores,
    gradients_at,
    head_relevances,
)
from lens_attrib.methods.registry import MethodOutput, Option, register
from lens_attrib.target import Target


def _warn_low_precision(batch: Batch, method: str) -> None:
    if batch.arch.dtype in (torch.bfloat16, torch.float16):
        warnings.warn(
            f"{method} in {batch.arch.dtype}: relevances are computed in this precision and "
            "conservation (Σ R = f) degrades to a few percent; use float32 or float64 for exact "
            "conservation.",
            stacklevel=4,
        )


def lrpx(
    model: Any,
    batch: Batch,
    target: Target,
    variant: str,
    *,
    embeddings: str,
    heads: bool,
    identity_eps: float,
) -> MethodOutput:
    """Shared body of ``lrp`` and ``attnlrp``: patched forward, one backward, grad × input.

    ``identity_eps``: stabiliser of the identity rule through activations (see
    :func:`lens_attrib.hooks.lrp.lrp_hooks`; default ``1e-10`` as in LXT 2.1).
    """
    _warn_low_precision(batch, variant)
    emb = embedding_hooks(batch.arch, embeddings)
    names = emb + (head_output_hooks(batch.arch) if heads else [])
    hooks = lrp_hooks(model, variant, identity_eps=identity_eps)
    with mlm_head_patch(model, identity_eps=identity_eps):
        xs, grads, result = gradients_at(model, batch, target, names, hooks)
    n = len(emb)
    scores = grad_x_input_scores(xs[:n], grads[:n])
    scores = scores.masked_fill(~batch.mask.to(scores.device), 0.0)
    assert result.value is not None
    value = result.value.detach()
    relevance_sum = scores.sum(-1)
    fields = head_relevances(xs[n:], grads[n:], batch.mask) if heads else {}
    return MethodOutput(
        scores,
        result.resolved,
        meta={
            "explained_value": value.cpu(),
            "relevance_sum": relevance_sum.cpu(),
            "completeness_gap": (value - relevance_sum).cpu(),
        },
        **fields,
    )


def _nonnegative(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e300
    return None if ok else "a finite number >= 0"


LRPX_OPTIONS = {
    "embeddings": EMBEDDING_OPTION,
    "heads": HEADS_OPTION,
    "identity_eps": Option(
        IDENTITY_EPS,
        check=_nonnegative,
        help="identity-rule stabiliser φ(h)/(h + ε): 1e-10 as LXT 2.1; 0 for the exact ratio",
    ),
}


@register("lrp", label="LRP", uses_gradient=True, head_relevances=True, options=LRPX_OPTIONS)
def lrp(
    model: Any, batch: Batch, target: Target, *, embeddings: str, heads: bool, identity_eps: float
) -> MethodOutput:
    """CP-LRP (Ali et al. 2022) as patched Gradient×Input; see the module docstring.

    embeddings: ``"full"`` (token + positional [+ token-type]) or ``"partial"`` (token only).
    heads:      also per-head relevances ``z ⊙ ∂̃f/∂z`` at ``attn.hook_z``.
    identity_eps: identity-rule stabiliser ``φ(h)/(h + ε)`` (1e-10 as LXT 2.1; 0: exact rule).
    """
    return lrpx(
        model, batch, target, "lrp", embeddings=embeddings, heads=heads, identity_eps=identity_eps
    )


@register(
    "attnlrp", label="AttnLRP", uses_gradient=True, head_relevances=True, options=LRPX_OPTIONS
)
def attnlrp(
    model: Any, batch: Batch, target: Target, *, embeddings: str, heads: bool, identity_eps: float
) -> MethodOutput:
    """AttnLRP (Achtibat et al. 2024) as patched Gradient×Input; see the module docstring.

    embeddings: ``"full"`` (token + positional [+ token-type]) or ``"partial"`` (token only).
    heads:      also per-head relevances ``z ⊙ ∂̃f/∂z`` at ``attn.hook_z``.
    identity_eps: identity-rule stabiliser ``φ(h)/(h + ε)`` (1e-10 as LXT 2.1; 0: exact rule).
    """
    return lrpx(
        model,
        batch,
        target,
        "attnlrp",
        embeddings=embeddings,
        heads=heads,
        identity_eps=identity_eps,
    )
