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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.hooks.guard import model_guard
from lens_attrib.inputs import Batch
from lens_attrib.methods.common import (
    check_finite,
    embedding_hooks,
    make_attribution,
    prepare,
)
from lens_attrib.methods.registry import register
from lens_attrib.models import is_encoder
from lens_attrib.target import ResolvedTarget, Target, TargetError, token_ids_of

Rows = Callable[[Tensor], Tensor]


def resid_hook_names(model: Any) -> list[str]:
    """The residual stream after every block (what the next block, or the head, reads)."""
    leaf = "hook_normalized_resid_post" if is_encoder(model) else "hook_resid_post"
    return [f"blocks.{layer}.{leaf}" for layer in range(model.cfg.n_layers)]


def embed_norm_hooks(model: Any, embeddings: str = "full") -> list[str]:
    """Hooks whose sum is ``x⁰`` for :func:`embed_norm` (encoders: after the embedding LN)."""
    if embeddings not in ("full", "partial"):
        raise ValueError(f"embeddings must be 'full' or 'partial', got {embeddings!r}")
    if is_encoder(model):
        return ["hook_full_embed"] if embeddings == "full" else ["embed.hook_embed"]
    return embedding_hooks(model, embeddings)


def _pre_unembed(model: Any) -> Rows:
    """The part of the default head before ``unembed`` (``ln_final`` or the MLM head)."""
    if is_encoder(model):
        return model.mlm_head  # type: ignore[no-any-return]
    ln = getattr(model, "ln_final", None)
    return ln if ln is not None else (lambda x: x)


def _embedding_forward(model: Any, batch: Batch) -> None:
    """Run only the embedding (hooks on it fire)."""
    if is_encoder(model):
        model.hook_full_embed(model.embed(batch.tokens))
    else:
        model(batch.tokens, stop_at_layer=0, **batch.model_kwargs())


def _full_forward(model: Any, batch: Batch) -> Tensor:
    if is_encoder(model):
        return model.encoder_output(batch.tokens, None, batch.mask.long())  # type: ignore[no-any-return]
    return model(batch.tokens, stop_at_layer=model.cfg.n_layers, **batch.model_kwargs())  # type: ignore[no-any-return]


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
            self.pre = _pre_unembed(model)
            w_u, b_u = model.unembed.W_U, model.unembed.b_U
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


def read_layers(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    embeddings: str | None = None,
    full_logits: bool = False,
) -> LensReading:
    """One forward pass: the label reading of every layer and position, and ``‖x⁰_i‖``.

    Must run inside ``model_guard``; builds no autograd graph.
    """
    reader = _LabelReader(model, batch, target, full_logits)
    emb_names = embed_norm_hooks(model, embeddings) if embeddings is not None else []
    emb: list[Tensor] = []
    hooks: list[tuple[str, Any]] = [(n, lambda x, hook: emb.append(x)) for n in emb_names]
    hooks += [(n, reader.hook) for n in resid_hook_names(model)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        final = _full_forward(model, batch)
        positions = target.positions(batch)
        items = torch.arange(batch.size, device=final.device)
        head_out = reader.head(final[items, positions])
        resolved = target.resolve(model, batch, head_out)
        logits = None
        if reader.mode == "columns":
            layers = torch.stack(reader.out, dim=1)
        else:
            if reader.mode == "store":
                pre = _pre_unembed(model)
                w_u, b_u = model.unembed.W_U, model.unembed.b_U
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
                    idx = resolved.token_ids[:, None, None, None].expand(-1, *stacked.shape[1:3], 1)
                    layers = stacked.gather(-1, idx)[..., 0]
                    if resolved.foil_ids is not None:
                        fidx = resolved.foil_ids[:, None, None, None].expand_as(idx)
                        layers = layers - stacked.gather(-1, fidx)[..., 0]
        norm = None
        if emb_names:
            total = emb[0]
            for e in emb[1:]:
                total = total + e
            norm = total.norm(dim=-1)
    return LensReading(layers, resolved, norm, logits)


def _embedding_norm_only(model: Any, batch: Batch, embeddings: str) -> Tensor:
    names = embed_norm_hooks(model, embeddings)
    store: list[Tensor] = []
    with (
        torch.no_grad(),
        model.hooks(fwd_hooks=[(n, lambda x, hook: store.append(x)) for n in names]),
    ):
        _embedding_forward(model, batch)
    total = store[0]
    for e in store[1:]:
        total = total + e
    return total.norm(dim=-1)


def _mask_layers(layers: Tensor, batch: Batch) -> Tensor:
    return layers.masked_fill(~batch.mask[:, None, :].to(layers.device), 0.0)


@register("embed_norm")
def embed_norm(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    embeddings: str = "full",
) -> Attribution:
    """``R_i = ‖x⁰_i‖₂`` (token + positional embedding; ``"partial"``: token only).

    Encoders: the embedding after its LayerNorm (``hook_full_embed``) for ``"full"``. The scores
    need no head; the target is still resolved so that evaluations know what is explained (one
    forward to the target rows when it is the prediction). A model without any head gets a
    label-less record (``meta["no_label"]``).
    """
    started = time.perf_counter()
    batch, target = prepare(model, inputs, target)
    with model_guard(model):
        norms = _embedding_norm_only(model, batch, embeddings)
        resolved, labelled = _label_only(model, batch, target)
    check_finite("embed_norm", norms)
    return make_attribution(
        model,
        batch,
        resolved,
        "embed_norm",
        norms,
        started=started,
        options={"embeddings": embeddings},
        meta={} if labelled else {"target_tokens": None, "no_label": True},
    )


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
        n_out = int(model.unembed.W_U.shape[-1])
        head_out = torch.zeros(batch.size, n_out, device=batch.tokens.device)
        return target.resolve(model, batch, head_out), True
    with torch.no_grad():
        final = _full_forward(model, batch)
        rows = final[torch.arange(batch.size, device=final.device), target.positions(batch)]
        return target.resolve(model, batch, head(rows)), True


def _lens(
    model: Any,
    inputs: Any,
    target: Target | None,
    method: str,
    embeddings: str | None,
    full_logits: bool,
) -> Attribution:
    started = time.perf_counter()
    batch, target = prepare(model, inputs, target)
    with model_guard(model):
        reading = read_layers(model, batch, target, embeddings=embeddings, full_logits=full_logits)
    layers = reading.layers
    if reading.embed_norm is not None:
        layers = layers * reading.embed_norm[:, None, :]
    layers = _mask_layers(layers, batch)
    check_finite(method, layers)
    parts: dict[str, Tensor] = {}
    if reading.embed_norm is not None:
        parts["embed_norm"] = reading.embed_norm.masked_fill(~batch.mask, 0.0)
        parts["logat"] = _mask_layers(reading.layers, batch)[:, -1]
    if reading.full_logits is not None:
        parts["layer_logits"] = reading.full_logits
    options: dict[str, Any] = {"full_logits": full_logits}
    if embeddings is not None:
        options["embeddings"] = embeddings
    return make_attribution(
        model,
        batch,
        reading.resolved,
        method,
        layers[:, -1],
        started=started,
        options=options,
        layer_scores=layers,
        parts=parts,
        meta={"layers": list(range(model.cfg.n_layers)), "hooks": resid_hook_names(model)},
    )


@register("logat", per_layer=True)
def logat(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    full_logits: bool = False,
) -> Attribution:
    """LogAt: the head-on-top at every position and layer, read at the label (module docstring).

    ``full_logits=True`` also returns the head's full output at every layer and position in
    ``parts["layer_logits"]`` ``[batch, layer, pos, n_out]`` (memory ``∝ d_vocab``).
    """
    return _lens(model, inputs, target, "logat", None, full_logits)


@register("normxlogit", per_layer=True)
def normxlogit(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    embeddings: str = "full",
    full_logits: bool = False,
) -> Attribution:
    """NormXLogit: ``R^l_i = ‖x⁰_i‖₂ · LogAt^l_i`` (``parts``: ``embed_norm``, final ``logat``)."""
    return _lens(model, inputs, target, "normxlogit", embeddings, full_logits)


__all__ = ["LensReading", "embed_norm", "logat", "normxlogit", "read_layers", "resid_hook_names"]
