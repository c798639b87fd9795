"""The TransformerLens 3.x backend: ``HookedTransformer`` decoders and ``HookedEncoder`` encoders.

The functions of :data:`lens_attrib.backend.BACKEND_INTERFACE` for models built by TransformerLens
3.9 (moved here unchanged from ``backend.py``; :mod:`lens_attrib.backend` dispatches to this
module or to :mod:`lens_attrib.backend_bridge`). TransformerLens-3-only names
(``HookedEncoder``) are imported inside the functions, so that importing this module works under
TransformerLens 4 too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_attrib.arch import Arch, Head, MlmHead, arch_from_config, soft_cap
from lens_attrib.errors import ModelError, TargetError


# --------------------------------------------------------------------------- architecture facts
def is_encoder(model: Any) -> bool:
    """True for ``HookedEncoder`` (bidirectional BERT-style) models."""
    from transformer_lens import HookedEncoder

    return isinstance(model, HookedEncoder)


def arch_of(model: Any) -> Arch:
    """Read the architecture facts of a TransformerLens model."""
    return arch_from_config(model, encoder=is_encoder(model), backend="hooked")


# --------------------------------------------------------------------------- raw forwards
def forward_kwargs(
    arch: Arch, mask: Tensor, padded: bool, token_types: Tensor | None = None
) -> dict[str, Tensor]:
    """Keyword arguments for the model's forward (the attention mask, when needed, and the
    encoder's segment ids ``token_type_ids`` when given)."""
    if arch.encoder:
        kwargs = {"one_zero_attention_mask": mask.long()}
        if token_types is not None:
            kwargs["token_type_ids"] = token_types
        return kwargs
    return {"attention_mask": mask.long()} if padded else {}


def final_residual(
    model: Any,
    arch: Arch,
    tokens: Tensor,
    mask: Tensor,
    padded: bool,
    token_types: Tensor | None = None,
) -> Float[Tensor, "batch pos d_model"]:
    """The residual stream after the last block (before the head), one forward pass.

    ``token_types``: an encoder's segment ids (``None``: segment 0 everywhere)."""
    if arch.encoder:
        return cast(Tensor, model.encoder_output(tokens, token_types, mask.long()))
    return cast(
        Tensor,
        model(tokens, stop_at_layer=arch.n_layers, **forward_kwargs(arch, mask, padded)),
    )


def key_value_cache(model: Any, arch: Arch, rows: int, device: torch.device) -> Any:
    """An empty key–value cache for ``rows`` sequences: TransformerLens' own, whose entries keep
    their graph (differentiable through the cached keys and values)."""
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    return TransformerLensKeyValueCache.init_cache(model.cfg, device, rows)


def cached_final_residual(
    model: Any, arch: Arch, tokens: Tensor, cache: Any
) -> Float[Tensor, "batch pos d_model"]:
    """:func:`final_residual` of the unpadded ``tokens`` that follow the positions already in
    ``cache`` (attending to them; the new keys and values are appended to ``cache``).

    The attention mask is given (all ones): without one, a forward with a cache builds it from
    the tokenizer and hides every pad-token id (``utils.get_attention_mask``), so a sequence
    holding that id as a real token (SmolLM2's ``<|im_end|>``, id 2, ends every chat turn)
    would attend past it (its final residual thousands off the full forward's)."""
    mask = torch.ones_like(tokens)
    return cast(
        Tensor,
        model(tokens, stop_at_layer=arch.n_layers, past_kv_cache=cache, attention_mask=mask),
    )


def embedding_forward(
    model: Any,
    arch: Arch,
    tokens: Tensor,
    mask: Tensor,
    padded: bool,
    token_types: Tensor | None = None,
) -> None:
    """Run only the embedding (hooks on it fire; ``token_types``: an encoder's segment ids)."""
    if arch.encoder:
        model.hook_full_embed(model.embed(tokens, token_types))
    else:
        model(tokens, stop_at_layer=0, **forward_kwargs(arch, mask, padded))


def block_forward(
    model: Any, arch: Arch, layer: int, resid: Tensor, mask: Tensor, padded: bool
) -> Float[Tensor, "batch pos d_model"]:
    """Block ``layer`` alone on its input ``resid`` (hooks inside the block fire); returns what
    the block returns, i.e. the next block's input (``resid_hook_names(arch)[layer]``).

    ``mask``: the real positions of the rows (decoders need it only when ``padded``: left
    padding shifts rotary positions and hides padding keys, as in the full forward).
    """
    if arch.encoder:
        additive = torch.where(mask[:, None, None, :].bool(), 0.0, -torch.inf)
        return cast(Tensor, model.blocks[layer](resid, additive))
    if arch.positional == "shortformer":
        raise ModelError(
            "Running one block alone is not supported for shortformer positional embeddings "
            "(the positions enter every block); use a model with standard or rotary positions."
        )
    kwargs = {"attention_mask": mask.long()} if padded else {}
    return cast(Tensor, model(resid, start_at_layer=layer, stop_at_layer=layer + 1, **kwargs))


def _encoder_key_mask(mask: Tensor) -> Tensor | None:
    """The additive key mask TransformerLens' ``HookedEncoder`` builds (``-inf`` on padding),
    ``None`` when every position is real."""
    if bool(mask.all()):
        return None
    return torch.where(mask[:, None, None, :], 0.0, -torch.inf)


def residual_before(
    model: Any,
    arch: Arch,
    layer: int,
    tokens: Tensor,
    mask: Tensor,
    padded: bool,
    token_types: Tensor | None = None,
) -> Float[Tensor, "batch pos d_model"]:
    """The residual stream entering block ``layer`` (``0``: the embedding output; ``n_layers``:
    the final residual, as :func:`final_residual`), one forward pass through the blocks below."""
    if arch.encoder:
        resid = model.hook_full_embed(model.embed(tokens, token_types))
        key_mask = _encoder_key_mask(mask)
        for blk in model.blocks[:layer]:
            resid = blk(resid, key_mask)
        return cast(Tensor, resid)
    return cast(Tensor, model(tokens, stop_at_layer=layer, **forward_kwargs(arch, mask, padded)))


def residual_from(
    model: Any, arch: Arch, resid: Tensor, layer: int, mask: Tensor
) -> Float[Tensor, "batch pos d_model"]:
    """The final residual, running blocks ``layer … n_layers − 1`` on ``resid`` (the residual
    entering block ``layer``, :func:`residual_before`). Items are *right*-padded (checked by
    :func:`lens_attrib.backend.residual_from`), ``mask`` marks
    the real positions: encoders mask the padded keys; decoders need no mask (causal attention
    never lets a real position see the padding after it, and positions count from 0)."""
    if arch.encoder:
        key_mask = _encoder_key_mask(mask)
        for blk in model.blocks[layer:]:
            resid = blk(resid, key_mask)
        return resid
    if layer == arch.n_layers:
        return resid
    return cast(Tensor, model(resid, start_at_layer=layer, stop_at_layer=arch.n_layers))


def lm_head(model: Any, arch: Arch) -> Head:
    """``ln_final`` + ``unembed`` (decoders) or ``mlm_head`` + ``unembed`` (encoders)."""
    if arch.encoder:
        if not arch.lm_head:
            raise TargetError(
                "This encoder has no masked-LM head (e.g. all-MiniLM-L6-v2 ships only the "
                "encoder), so token logits do not exist. Pass Target(head=...) with a class head "
                "(a callable on [n, d_model] residual rows), or use a method that needs no head "
                "(alti, attention, rollout, embed_norm)."
            )

        def encoder_head(x: Tensor) -> Tensor:
            return cast(Tensor, model.unembed(model.mlm_head(x[:, None, :]))[:, 0, :])

        return encoder_head

    final = pre_unembed(model, arch)  # ln_final; the identity for models without norms
    cap = arch.logit_soft_cap

    def decoder_head(x: Tensor) -> Tensor:
        logits = cast(Tensor, model.unembed(final(x[:, None, :]))[:, 0, :])
        return cap * torch.tanh(logits / cap) if cap else logits  # Gemma 2's logit soft-cap

    return decoder_head


def pre_unembed(model: Any, arch: Arch) -> Head:
    """The part of the LM head before ``unembed`` (``ln_final`` or the MLM head's transform)."""
    if arch.encoder:
        return cast(Head, model.mlm_head)
    ln = getattr(model, "ln_final", None)
    return cast(Head, ln) if ln is not None else (lambda x: x)


def mlm_head_parts(model: Any) -> MlmHead:
    """``HookedEncoder.mlm_head``: ``W``, ``b``, its ``act_fn`` and ``ln``."""
    head = model.mlm_head
    return MlmHead(entry=head, weight=head.W, bias=head.b, act=head.act_fn, norm=head.ln)


# --------------------------------------------------------------------------- weights
def unembedding(model: Any) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, "d_vocab"]]:
    """``W_U`` and ``b_U`` of the LM head (a soft-capped head: :func:`refuse_soft_capped`)."""
    refuse_soft_capped(soft_cap(getattr(model.cfg, "output_logits_soft_cap", None)))
    return model.unembed.W_U, model.unembed.b_U


def refuse_soft_capped(cap: float) -> None:
    """A :class:`TargetError` when the logits are soft-capped (``cap > 0``): not linear in
    ``ln_final``'s output, so ``W_U``/``b_U`` do not give them."""
    if cap:
        raise TargetError(
            f"This model soft-caps its logits (logit = {cap:g}·tanh(u/{cap:g}), Gemma 2), so they "
            "are not a linear function of the final residual, which this method (ALTI-Logit, "
            "LogAt, NormXLogit) decomposes. Use a method that takes the head as it is "
            "('integrated_gradients', 'grad_x_input', 'value_zeroing'), or pass "
            "Target(head=...) with a linear head (e.g. a lens_attrib.classifiers.LinearHead of "
            "ln_final and W_U) to explain the logit before the cap."
        )


def token_embedding_matrix(model: Any, arch: Arch) -> Float[Tensor, "d_vocab d_model"]:
    embed = model.embed.embed if arch.encoder else model.embed
    return cast(Tensor, embed.W_E)


def block(model: Any, layer: int) -> Any:
    return model.blocks[layer]


def final_norm(model: Any) -> nn.Module:
    return cast(nn.Module, model.ln_final)


def value_weights(attn: nn.Module, n_v_heads: int) -> tuple[Tensor, Tensor]:
    """``W_V [n_v_heads, d_model, d_head]`` and ``b_V [n_v_heads, d_head]`` as ``hook_v`` uses them.

    Grouped-query attention stores key/value weights per KV head (``_W_V``); when ``hook_v``
    holds the query-head count (``ungroup_grouped_query_attention``) the expanded ones are used.
    """
    w_v = getattr(attn, "_W_V", None)
    if w_v is not None and w_v.shape[0] == n_v_heads:
        return cast(Tensor, w_v), cast(Tensor, attn._b_V)
    return cast(Tensor, attn.W_V), cast(Tensor, attn.b_V)


# --------------------------------------------------------------------------- new in the seam
def norm_params(module: nn.Module) -> tuple[bool, Tensor | None, Tensor | None, bool]:
    """Read the affine parameters of a TransformerLens norm (LN, LNPre, RMS, RMSPre, identity)."""
    name = type(module).__name__
    if name in ("LayerNorm", "LayerNormPre"):
        return True, getattr(module, "w", None), getattr(module, "b", None), True
    if name in ("RMSNorm", "RMSNormPre"):
        return False, getattr(module, "w", None), None, True
    if isinstance(module, nn.Identity):
        return False, None, None, False
    raise NotImplementedError(f"Unsupported normalization layer {name} for ALTI.")


def mlp_activation(model: Any, layer: int) -> Any:
    """``blocks[layer].mlp.act_fn`` (a mixture of experts: its experts' one ``act_fn``)."""
    mlp = model.blocks[layer].mlp
    experts = getattr(mlp, "experts", None)
    return experts[0].act_fn if experts is not None else mlp.act_fn


def layer_norm_activation(model: Any) -> bool:
    """``cfg.is_layer_norm_activation()`` (SoLU's ``*_ln`` activations)."""
    cfg = model.cfg
    return bool(cfg.act_fn is not None and cfg.is_layer_norm_activation())


@contextmanager
def call_context(model: Any) -> Iterator[None]:
    """Nothing to change on a TransformerLens 3.9 model for the length of a call."""
    yield


def deep_copy(model: Any, value: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy``: a HookedTransformer's hooks hold no closures over its modules."""
    return copy.deepcopy(value, memo)


def norms_folded(model: Any) -> bool:
    """``fold_ln`` shows on a HookedTransformer as its norm type (``LNPre``/``RMSPre``, read by
    :func:`lens_attrib.backend.processing_signatures` from the architecture): nothing else."""
    return False
