"""Gradient baselines: saliency (ℓ1/ℓ2 gradient norms) and Gradient×Input.

For input embeddings ``e_i = Σ_k e_i^k`` (token + positional + token-type, or token only with
``embeddings="partial"``) and the explained scalar ``f``:

- ``gradient``:      ``R_i = ‖∂f/∂e_i‖_p``  (Simonyan et al. 2014; p = 1 or 2)
- ``grad_x_input``:  ``R_i = Σ_k Σ_d e_{i,d}^k · ∂f/∂e_{i,d}^k``  (Shrikumar et al. 2016)

One forward and one backward pass for the whole batch; parameters stay frozen. The steps of a
generation (``Target(continuation=...)``) share one forward per sequence, run in prefix chunks
where no hook is set (:mod:`.prefix_chunks`: each step's backward stops at its chunk's end).
Integrated Gradients is in :mod:`.integrated_gradients`, its baselines in :mod:`.baselines`.

Per-head relevances (``heads=True``), read in the same backward pass at every ``attn.hook_z``
(the head outputs ``z`` ``[batch, pos, head, d_head]`` before ``W_O``):
``head_dim_relevance[b, l, h, p, d] = z · ∂f/∂z`` (Gradient×Input; for ``gradient``: ``|∂f/∂z|``),
``head_token_scores`` pools it over ``d_head``, ``head_scores`` over ``pos`` and ``d_head``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from jaxtyping import Float
from torch import Tensor

from lens_attrib.backend import EMBEDDINGS, embedding_hooks, head_output_hooks
from lens_attrib.inputs import Batch
from lens_attrib.methods.backprop import (
    EMBEDDING_OPTION,
    HEADS_OPTION,
    TOKEN_POOLING_OPTION,
    grad_x_input_scores,
    head_relevances,
)
from lens_attrib.methods.prefix_chunks import prefix_gradients_at
from lens_attrib.methods.registry import MethodOutput, Option, register
from lens_attrib.target import Target


@register(
    "gradient",
    label="Gradient (ℓ2)",
    uses_gradient=True,
    head_relevances=True,
    options={
        "norm": Option("l2", choices=("l1", "l2")),
        "embeddings": EMBEDDING_OPTION,
        "heads": HEADS_OPTION,
    },
)
def gradient(
    model: Any, batch: Batch, target: Target, *, norm: str, embeddings: str, heads: bool
) -> MethodOutput:
    """Saliency: ``R_i = ‖∂f/∂e_i‖_p`` over ``d_model`` (``norm="l1"`` or ``"l2"``).

    The gradient of the summed embedding: with ``embeddings="full"`` the gradients at the
    token and positional embeddings are equal, so one of them is read.

    ``heads=True``: per-head gradient norms at ``attn.hook_z`` with the same ``norm``
    (see :func:`~lens_attrib.methods.backprop.head_relevances`; ``head_dim_relevance = |∂f/∂z|``).
    """
    names = embedding_hooks(batch.arch, "partial")
    names += head_output_hooks(batch.arch) if heads else []
    xs, grads, result = prefix_gradients_at(model, batch, target, names)
    g: Float[Tensor, "batch pos d"] = grads[0]
    scores = g.abs().sum(-1) if norm == "l1" else g.norm(dim=-1)
    fields = head_relevances(xs[1:], grads[1:], batch.mask, norm) if heads else {}
    return MethodOutput(scores, result.resolved, **fields)


@register(
    "grad_x_input",
    label="Gradient×Input",
    uses_gradient=True,
    head_relevances=True,
    options={
        "embeddings": Option(
            None,
            choices=(None, *EMBEDDINGS),
            help="default: 'full' on decoders, 'partial' (token embedding) on encoders",
        ),
        "pooling": TOKEN_POOLING_OPTION,
        "heads": HEADS_OPTION,
    },
)
def grad_x_input(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    embeddings: str | None,
    pooling: str,
    heads: bool,
) -> MethodOutput:
    """Gradient×Input: ``R_i = Σ_k Σ_d e^k_{i,d} ∂f/∂e^k_{i,d}`` (signed; Shrikumar et al. 2016).

    ``embeddings``: decoders default to ``"full"`` (token + learned positional embedding).
    Encoders default to ``"partial"``, the token embedding before the embedding LayerNorm (what
    Captum/Inseq call ``inputs_embeds``): their full embedding ``x = e_tok + e_pos + e_type``
    enters a LayerNorm, which is scale-invariant per token, so ``x · ∂f/∂x = 0`` for every token
    (Euler's theorem; MiniLM gives |R| ~ 1e-8 for f ~ 1) and ``"full"`` would rank noise.
    The same identity makes the token-only score there the negative of the positional and
    token-type parts' (``e_tok · ∂f/∂x = −(e_pos + e_type) · ∂f/∂x``).

    ``pooling``: ``"sum"`` (default) is the signed ``Σ_d`` above, whose total is the
    first-order change of ``f``; ``"l1"``/``"l2"`` score the norm of the relevance vector
    ``Σ_k e^k_i ⊙ ∂f/∂e^k_i`` over ``d`` instead (unsigned). The NormXLogit paper (Section 4,
    "Input Attribution Methods") aggregates Gradient×Input, IG and the gradient with the ℓ1
    norm in its faithfulness tables.

    ``heads=True``: per-head ``z ⊙ ∂f/∂z`` at ``attn.hook_z`` (see
    :func:`~lens_attrib.methods.backprop.head_relevances`).
    """
    used = embeddings or ("partial" if batch.arch.encoder else "full")
    if embeddings == "full" and batch.arch.encoder:
        warnings.warn(
            "grad_x_input with embeddings='full' on an encoder: the embedding LayerNorm is "
            "scale-invariant, so x·∇x is ~0 for every token; use embeddings='partial' (default).",
            RuntimeWarning,
            stacklevel=4,
        )
    emb = embedding_hooks(batch.arch, used)
    names = emb + (head_output_hooks(batch.arch) if heads else [])
    xs, grads, result = prefix_gradients_at(model, batch, target, names)
    n = len(emb)
    scores = grad_x_input_scores(xs[:n], grads[:n], pooling)
    fields = head_relevances(xs[n:], grads[n:], batch.mask) if heads else {}
    assert result.value is not None
    return MethodOutput(
        scores,
        result.resolved,
        meta={"explained_value": result.value.detach().cpu()},
        options={"embeddings": used},
        **fields,
    )


# ---------------------------------------------------------------- names that moved (issue 30)
MOVED = {
    "integrated_gradients": "integrated_gradients",
    "quadrature": "integrated_gradients",
    "rows_per_forward": "integrated_gradients",
    "item_path": "integrated_gradients",
    "path_integral": "integrated_gradients",
    "path_node_scores": "integrated_gradients",
    "path_values": "integrated_gradients",
    "warn_unconverged": "integrated_gradients",
    "ItemPath": "integrated_gradients",
    "RULES": "integrated_gradients",
    "PANEL_POINTS": "integrated_gradients",
    "STEP_MEMORY_SHARE": "integrated_gradients",
    "BASELINES": "baselines",
    "SINK_MODES": "baselines",
    "default_baseline": "baselines",
    "embedding_baselines": "baselines",
    "sink_positions": "baselines",
    "sink_token_id": "baselines",
    "zero_start": "baselines",
}
"""Names this module held before Integrated Gradients moved out: name → module of
``lens_attrib.methods`` that holds it now (still importable from here, with a warning)."""


def __getattr__(name: str) -> Any:
    """The moved names, looked up where they live now (PEP 562), with a DeprecationWarning."""
    if name not in MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = f"lens_attrib.methods.{MOVED[name]}"
    warnings.warn(
        f"lens_attrib.methods.gradient.{name} moved to {where}.{name}; import it from there.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(where), name)
