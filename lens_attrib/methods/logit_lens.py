"""NormXLogit, LogAt, embedding norm (Abbasi et al., "NormXLogit: The head-on-top never lies").

For item ``b`` with label ``y`` (the target token/class, default the model's prediction; optionally
minus a foil ``y'``), the model's head-on-top ``h`` (``ln_final`` + ``unembed`` for decoders, the
MLM head + ``unembed`` for encoders, or any ``Target.head``) and the residual stream ``x^l_i`` of
position ``i`` after layer ``l`` (``blocks.l.hook_resid_post``; for post-LN encoders the block
output ``hook_normalized_resid_post``):

- ``embed_norm``:  ``E_i = ‖x^0_i‖₂``, the norm of the input embedding (token + positional by
  default, token only with ``embeddings="partial"``; for encoders the embedding after the
  embedding LayerNorm, ``hook_full_embed``, as in the authors' code).
- ``logat``:       ``LogAt^l_i = h(x^l_i)[y] − h(x^l_i)[y']`` at every layer ``l`` and position
  ``i``: the head applied to every position as if it were the prediction position (a logit
  lens read at the explained label). Regression heads (one output):
  ``LogAt^l_i = |h(x^l_i) − h(x^l_p)|`` with ``p`` the target position of the same layer.
- ``normxlogit``:  ``R^l_i = E_i · LogAt^l_i``.

``layer_scores`` holds ``[batch, layer, pos]`` (one row per block), ``scores`` the last layer
(whose residual is the one the model's own head reads). The cost is one forward pass: forward
hooks reduce every layer's residual at once to the explained label's column(s) (the norm uses each
row's own scale, then the dot with ``W_U[:, y] − W_U[:, y']`` and the bias), so neither
``[layer, pos, d_vocab]`` logits nor, when the label is given, ``[layer, batch, pos, d_model]``
residuals are kept. With the default target (the prediction, unknown until the last layer) the
residuals are kept until the label is known. No backward pass: everything runs under
``torch.no_grad`` (and works under ``torch.inference_mode``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.backend import (
    EMBEDDINGS,
    embedded_input_hooks,
    embedding_forward,
    pre_unembed,
    resid_hook_names,
    unembedding,
    vocab_size,
)
from lens_attrib.errors import TargetError
from lens_attrib.forward import resid_of, target_rows
from lens_attrib.inputs import Batch
from lens_attrib.methods.registry import MethodOutput, Option, is_bool, register
from lens_attrib.target import ResolvedTarget, Target, token_ids_of

Rows = Callable[[Tensor], Tensor]


@dataclass
class LensReading:
    """Per-layer label readings of one batch (see the module docstring)."""

    layers: Float[Tensor, "batch layer pos"]
    resolved: ResolvedTarget
    embed_norm: Float[Tensor, "batch pos"] | None = None
    full_logits: Float[Tensor, "batch layer pos n_out"] | None = None


class _LabelReader:
    """Reduces each layer's residual ``[batch, pos, d]`` as soon as its hook fires.

    ``columns``: default head with a known label → ``pre(x) · (W_U[:, y] − W_U[:, y']) + b``.
    ``store``:   default head, label = prediction (unknown yet) or full logits asked → keep ``x``.
    ``head``:    a custom head → keep ``head(x)`` ``[batch, pos, n_out]`` (small for class heads).
    """

    def __init__(self, model: Any, batch: Batch, target: Target, full_logits: bool) -> None:
        self.model = model
        self.head = target.head_fn(model)  # raises a clear error for encoders without MLM head
        self.out: list[Tensor] = []
        if target.head is not None:
            self.mode = "head"
        elif full_logits or target.token is None or target.regression:
            self.mode = "store"
        else:
            self.mode = "columns"
            self.pre = pre_unembed(model, batch.arch)
            w_u, b_u = unembedding(model)
            n_out = int(w_u.shape[-1])
            ids = token_ids_of(model, target.token, batch.size, n_out, "token").to(w_u.device)
            self.direction = w_u[:, ids].T  # [batch, d]
            self.bias = b_u[ids]
            if target.foil is not None:
                foil = token_ids_of(model, target.foil, batch.size, n_out, "foil").to(w_u.device)
                self.direction = self.direction - w_u[:, foil].T
                self.bias = self.bias - b_u[foil]

    def hook(self, x: Tensor, hook: Any) -> None:
        if self.mode == "columns":
            self.out.append(
                torch.einsum("btd,bd->bt", self.pre(x), self.direction) + self.bias[:, None]
            )
        elif self.mode == "head":
            b, t, d = x.shape
            self.out.append(self.head(x.reshape(b * t, d)).reshape(b, t, -1))
        else:
            self.out.append(x)


def _sum_norm(parts: list[Tensor]) -> Tensor:
    total = parts[0]
    for e in parts[1:]:
        total = total + e
    return total.norm(dim=-1)


def read_layers(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    embeddings: str | None = None,
    full_logits: bool = False,
) -> LensReading:
    """One forward pass: the label reading of every layer and position, and ``‖x⁰_i‖``.

    Must run inside the model guard without autograd (the registry's wrapper does so).
    """
    reader = _LabelReader(model, batch, target, full_logits)
    emb_names = embedded_input_hooks(batch.arch, embeddings) if embeddings is not None else []
    emb: list[Tensor] = []
    hooks: list[tuple[str, Any]] = [(n, lambda x, hook: emb.append(x)) for n in emb_names]
    hooks += [(n, reader.hook) for n in resid_hook_names(batch.arch)]
    with model.hooks(fwd_hooks=hooks):
        final = resid_of(model, batch)
    positions = target.positions(batch)
    items = torch.arange(batch.size, device=final.device)
    head_out = reader.head(final[items, positions])
    resolved = target.resolve(model, batch, head_out)
    logits = None
    if reader.mode == "columns":
        layers = torch.stack(reader.out, dim=1)
    else:
        if reader.mode == "store":
            pre = pre_unembed(model, batch.arch)
            w_u, b_u = unembedding(model)
            if full_logits:
                outs = [pre(x) @ w_u + b_u for x in reader.out]
                logits = torch.stack(outs, dim=1)
                reader.out = outs
            else:
                direction = resolved.direction(w_u)
                bias = b_u[resolved.token_ids]
                if resolved.foil_ids is not None:
                    bias = bias - b_u[resolved.foil_ids]
                layers = torch.stack(
                    [
                        torch.einsum("btd,bd->bt", pre(x), direction) + bias[:, None]
                        for x in reader.out
                    ],
                    dim=1,
                )
        if reader.mode == "head" or full_logits:
            stacked = torch.stack(reader.out, dim=1)  # [batch, layer, pos, n_out]
            if reader.mode == "head" and full_logits:
                logits = stacked
            if resolved.regression:
                own = stacked[items, :, resolved.positions, 0]  # [batch, layer]
                layers = (stacked[..., 0] - own[:, :, None]).abs()
            else:
                layers = resolved.select_grid(stacked)
    norm = _sum_norm(emb) if emb_names else None
    return LensReading(layers, resolved, norm, logits)


def _embedding_norm_only(model: Any, batch: Batch, embeddings: str) -> Tensor:
    names = embedded_input_hooks(batch.arch, embeddings)
    store: list[Tensor] = []
    with model.hooks(fwd_hooks=[(n, lambda x, hook: store.append(x)) for n in names]):
        embedding_forward(
            model, batch.arch, batch.tokens, batch.mask, batch.padded, batch.token_types
        )
    return _sum_norm(store)


def _mask_layers(layers: Tensor, batch: Batch) -> Tensor:
    return layers.masked_fill(~batch.mask[:, None, :].to(layers.device), 0.0)


def _label_only(model: Any, batch: Batch, target: Target) -> tuple[ResolvedTarget, bool]:
    """The explained target for a method that does not depend on it (embed_norm).

    An explicit token with the default head needs no forward pass; the prediction or a custom
    head costs one forward (to the target rows only). A model without a head (MiniLM) and no
    ``Target.head`` has no label: a label-less record is returned (``False``).
    """
    try:
        head = target.head_fn(model)
    except TargetError:
        positions = target.positions(batch)
        zeros = torch.zeros(batch.size, dtype=torch.long, device=positions.device)
        return ResolvedTarget(positions, zeros, None, True), False
    if target.token is not None and target.head is None and not target.regression:
        n_out = vocab_size(model)
        head_out = torch.zeros(batch.size, n_out, device=batch.tokens.device)
        return target.resolve(model, batch, head_out), True
    final = resid_of(model, batch)
    return target.resolve(model, batch, head(target_rows(final, target.positions(batch)))), True


EMBEDDING_OPTION = Option("full", choices=EMBEDDINGS, help="'full': token + positional")
FULL_LOGITS_OPTION = Option(False, check=is_bool, help="also every layer's full head output")


@register(
    "embed_norm",
    parametrization=True,
    label="Embedding ℓ2",
    target_free=True,
    needs_head=False,
    options={"embeddings": EMBEDDING_OPTION},
)
def embed_norm(model: Any, batch: Batch, target: Target, *, embeddings: str) -> MethodOutput:
    """``R_i = ‖x⁰_i‖₂`` (token + positional embedding; ``"partial"``: token only).

    Encoders: the embedding after its LayerNorm (``hook_full_embed``) for ``"full"``. The scores
    need no head; the target is still resolved so that evaluations know what is explained (one
    forward to the target rows when it is the prediction). A model without any head gets a
    label-less record (``meta["no_label"]``).
    """
    norms = _embedding_norm_only(model, batch, embeddings)
    resolved, labelled = _label_only(model, batch, target)
    meta: dict[str, Any] = {} if labelled else {"target_tokens": None, "no_label": True}
    return MethodOutput(norms, resolved, meta=meta)


def _lens(
    model: Any, batch: Batch, target: Target, embeddings: str | None, full_logits: bool
) -> MethodOutput:
    reading = read_layers(model, batch, target, embeddings=embeddings, full_logits=full_logits)
    layers = reading.layers
    if reading.embed_norm is not None:
        layers = layers * reading.embed_norm[:, None, :]
    layers = _mask_layers(layers, batch)
    parts: dict[str, Tensor] = {}
    if reading.embed_norm is not None:
        parts["embed_norm"] = reading.embed_norm.masked_fill(~batch.mask, 0.0)
        parts["logat"] = _mask_layers(reading.layers, batch)[:, -1]
    if reading.full_logits is not None:
        parts["layer_logits"] = reading.full_logits
    return MethodOutput(
        layers[:, -1],
        reading.resolved,
        layer_scores=layers,
        parts=parts,
        meta={"hooks": resid_hook_names(batch.arch)},
    )


@register(
    "logat",
    label="LogAt",
    per_layer=True,
    parametrization=True,
    options={"full_logits": FULL_LOGITS_OPTION},
)
def logat(model: Any, batch: Batch, target: Target, *, full_logits: bool) -> MethodOutput:
    """LogAt: the head-on-top at every position and layer, read at the label (module docstring).

    ``full_logits=True`` also returns the head's full output at every layer and position in
    ``parts["layer_logits"]`` ``[batch, layer, pos, n_out]`` (memory ``∝ d_vocab``).
    """
    return _lens(model, batch, target, None, full_logits)


@register(
    "normxlogit",
    parametrization=True,
    label="NormXLogit",
    per_layer=True,
    options={"embeddings": EMBEDDING_OPTION, "full_logits": FULL_LOGITS_OPTION},
)
def normxlogit(
    model: Any, batch: Batch, target: Target, *, embeddings: str, full_logits: bool
) -> MethodOutput:
    """NormXLogit: ``R^l_i = ‖x⁰_i‖₂ · LogAt^l_i`` (``parts``: ``embed_norm``, final ``logat``)."""
    return _lens(model, batch, target, embeddings, full_logits)


__all__ = ["LensReading", "embed_norm", "logat", "normxlogit", "read_layers"]
