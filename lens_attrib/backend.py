"""The model backend: architecture facts, hook names, weight access and the raw forwards.

Everything that depends on how TransformerLens 3.x lays out a model (``HookedTransformer`` for
decoders, ``HookedEncoder`` for BERT-style encoders) lives here: which hooks hold the input
embeddings and the residual stream, where grouped key/value weights are stored, how the final
residual and the head-on-top are computed. Methods, evaluation and pruning ask this module and
:mod:`lens_attrib.forward`, never the model classes, so that a second backend (TransformerLens
4's ``TransformerBridge``, whose hooks and ``stop_at_layer`` differ) is one more module.

Architecture facts are read once per call into an :class:`Arch` and carried on the
:class:`~lens_attrib.inputs.Batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.utilities import get_act_name

from lens_attrib.errors import ModelError, TargetError

Head = Callable[[Tensor], Tensor]
"""A head-on-top: ``[n, d_model]`` residual rows -> ``[n, n_out]`` outputs."""

EMBEDDINGS = ("full", "partial")


# --------------------------------------------------------------------------- architecture facts
def is_encoder(model: Any) -> bool:
    """True for ``HookedEncoder`` (bidirectional BERT-style) models."""
    from transformer_lens import HookedEncoder

    return isinstance(model, HookedEncoder)


def has_lm_head(model: Any) -> bool:
    """Whether token logits exist (False for encoders loaded without their MLM head)."""
    return not getattr(model, "lens_attrib_no_lm_head", False)


@dataclass(frozen=True)
class Arch:
    """The facts methods branch on, read once from the model's config."""

    encoder: bool
    lm_head: bool
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    normalization: str | None
    positional: str
    parallel: bool
    gated_mlp: bool
    dtype: torch.dtype
    n_ctx: int
    d_mlp: int = 0
    class_head: bool = False
    moe: bool = False
    logit_soft_cap: float = 0.0
    attn_soft_cap: float = 0.0
    post_norms: bool = False

    @property
    def causal(self) -> bool:
        return not self.encoder

    @property
    def rotary(self) -> bool:
        return self.positional == "rotary"

    @property
    def gqa(self) -> bool:
        return self.n_kv_heads != self.n_heads

    @property
    def learned_positions(self) -> bool:
        """A positional embedding is added to the residual stream (GPT-2, BERT)."""
        return self.encoder or self.positional in ("standard", "shortformer")

    @property
    def kind(self) -> str:
        return "encoder (HookedEncoder)" if self.encoder else "decoder (HookedTransformer)"

    @property
    def work_dtype(self) -> torch.dtype:
        """float64 for float64 models, float32 otherwise (bf16/fp16 reductions are upcast)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def as_dict(self) -> dict[str, Any]:
        return {
            "encoder": self.encoder,
            "normalization": self.normalization,
            "positional": self.positional,
            "rotary": self.rotary,
            "gqa": self.gqa,
            "n_kv_heads": self.n_kv_heads,
            "parallel": self.parallel,
            "gated_mlp": self.gated_mlp,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "moe": self.moe,
            "logit_soft_cap": self.logit_soft_cap,
            "attn_soft_cap": self.attn_soft_cap,
            "post_norms": self.post_norms,
        }


def arch_of(model: Any) -> Arch:
    """Read the architecture facts of a TransformerLens model."""
    cfg = model.cfg
    try:
        dtype = next(model.parameters()).dtype
    except StopIteration:  # pragma: no cover - a model always has parameters
        dtype = torch.float32
    return Arch(
        encoder=is_encoder(model),
        lm_head=has_lm_head(model),
        n_layers=int(cfg.n_layers),
        n_heads=int(cfg.n_heads),
        n_kv_heads=int(cfg.n_key_value_heads or cfg.n_heads),
        d_model=int(cfg.d_model),
        d_head=int(cfg.d_head),
        normalization=cfg.normalization_type,
        positional=str(cfg.positional_embedding_type),
        parallel=bool(getattr(cfg, "parallel_attn_mlp", False)),
        gated_mlp=bool(getattr(cfg, "gated_mlp", False)),
        dtype=dtype,
        n_ctx=int(cfg.n_ctx),
        d_mlp=int(cfg.d_mlp or 0),
        class_head=attached_head(model) is not None,
        moe=bool(getattr(cfg, "num_experts", None)),
        logit_soft_cap=_soft_cap(getattr(cfg, "output_logits_soft_cap", None)),
        attn_soft_cap=_soft_cap(getattr(cfg, "attn_scores_soft_cap", None)),
        post_norms=bool(getattr(cfg, "use_normalization_before_and_after", False)),
    )


def _soft_cap(cap: float | None) -> float:
    """A soft-cap ``c`` (``c·tanh(x/c)``) when active, else 0 (TransformerLens: ``-1``/``None``)."""
    return float(cap) if cap is not None and cap > 0 else 0.0


ARCHITECTURE_LIMITS: dict[str, dict[str, str]] = {
    "moe": {
        "deeplift": "DeepLIFT's Rescale multipliers compare each expert's activations with the "
        "baseline's, but the baseline routes tokens to other experts. Use "
        "'integrated_gradients' (same path-based idea, any routing) or 'attnlrp'.",
    },
    "post_norms": {
        name: "its decomposition of the attention block ignores the RMSNorm applied to the "
        "attention output before the residual (Gemma 2's post-attention norm). Use "
        "'value_zeroing' (token mixing from the forward itself) or 'integrated_gradients'."
        for name in ("alti", "alti_logit")
    },
    **{
        fact: {
            name: "it has no relevance rule for the tanh soft-capping of attention scores and "
            "logits (Gemma 2: c·tanh(x/c); LXT has none either), and the plain gradient through "
            "it does not conserve. Use 'integrated_gradients' or 'grad_x_input'."
            for name in ("lrp", "attnlrp")
        }
        for fact in ("attn_soft_cap", "logit_soft_cap")
    },
}
"""Architecture fact → method → why it does not apply and which method does."""


def backward_bytes_per_row(arch: Arch, length: int) -> int:
    """Estimated activation memory that one input row of ``length`` tokens keeps for a backward.

    Per layer and token ``≈ 14·d_model + 4·d_mlp`` values (residuals, norm inputs and outputs,
    q/k/v, z, the attention and MLP outputs, the MLP's pre- and post-activations), plus
    ``2·n_heads·length`` attention scores and probabilities, at the working dtype's size.
    Calibrated on SmolLM2-135M in float32 (estimate 118 MB at 64 tokens and 577 MB at 256,
    against 122 and 600 MB per item measured by ``benchmarks/bench_throughput.py``).
    """
    per_token = 14 * arch.d_model + 4 * arch.d_mlp + 2 * arch.n_heads * length
    size = torch.empty((), dtype=arch.work_dtype).element_size()
    return arch.n_layers * length * per_token * size


# --------------------------------------------------------------------------- hook names
def hook_name(kind: str, layer: int | None = None, sub: str | None = None) -> str:
    """TransformerLens' name of an activation (``get_act_name``), e.g. ``("v", 0)``."""
    return str(get_act_name(kind, layer, sub))


def check_embeddings(embeddings: str) -> None:
    if embeddings not in EMBEDDINGS:
        raise ValueError(f"embeddings must be 'full' or 'partial', got {embeddings!r}")


def embedding_hooks(arch: Arch, embeddings: str = "full") -> list[str]:
    """Hook names of the input embeddings whose sum enters the first block.

    ``"full"``: token + learned positional (+ token-type for encoders); ``"partial"``: token only.
    Rotary models have no positional embedding, so both are the token embedding.
    """
    check_embeddings(embeddings)
    if arch.encoder:
        names = ["embed.hook_embed"]
        if embeddings == "full":
            names += ["embed.hook_pos_embed", "embed.hook_token_type_embed"]
        return names
    names = [hook_name("embed")]
    if embeddings == "full" and arch.learned_positions:
        names.append(hook_name("pos_embed"))
    return names


def token_embedding_hook(arch: Arch) -> str:
    """The hook of the token embedding alone (what soft perturbation masks)."""
    return "embed.hook_embed" if arch.encoder else hook_name("embed")


def embedded_input_hooks(arch: Arch, embeddings: str = "full") -> list[str]:
    """Hooks whose sum is the first block's input ``x⁰`` (encoders: after the embedding LN)."""
    check_embeddings(embeddings)
    if arch.encoder:
        return [hook_name("full_embed")] if embeddings == "full" else ["embed.hook_embed"]
    return embedding_hooks(arch, embeddings)


def resid_hook_names(arch: Arch) -> list[str]:
    """The residual stream after every block (what the next block, or the head, reads)."""
    kind = "normalized_resid_post" if arch.encoder else "resid_post"
    return [hook_name(kind, layer) for layer in range(arch.n_layers)]


def attn_hook(kind: str, layer: int) -> str:
    """``blocks.L.attn.hook_<kind>`` (q, k, v, z, pattern, rot_q, rot_k, …)."""
    return hook_name(kind, layer)


def query_key_hooks(arch: Arch, layer: int) -> tuple[str, str]:
    """The query and key hooks as attention uses them (rotated for rotary models)."""
    if arch.rotary:
        return hook_name("rot_q", layer), hook_name("rot_k", layer)
    return hook_name("q", layer), hook_name("k", layer)


def head_output_hooks(arch: Arch) -> list[str]:
    """``blocks.L.attn.hook_z`` of every layer (head outputs before ``W_O``)."""
    return [hook_name("z", layer) for layer in range(arch.n_layers)]


def pattern_hooks(arch: Arch) -> list[str]:
    return [hook_name("pattern", layer) for layer in range(arch.n_layers)]


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


def has_hooks(point: nn.Module) -> bool:
    """Whether any forward, forward-pre or backward hook (own or global) is on ``point``."""
    from torch.nn.modules import module as nn_module

    return bool(
        point._forward_hooks
        or point._forward_pre_hooks
        or point._backward_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks
    )


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
    if not 0 <= layer <= arch.n_layers:
        raise ValueError(f"layer must be between 0 and {arch.n_layers}, got {layer}")
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
    entering block ``layer``, :func:`residual_before`). Items are *right*-padded, ``mask`` marks
    the real positions: encoders mask the padded keys; decoders need no mask (causal attention
    never lets a real position see the padding after it, and positions count from 0)."""
    if not 0 <= layer <= arch.n_layers:
        raise ValueError(f"layer must be between 0 and {arch.n_layers}, got {layer}")
    real = mask.long()
    if bool((real[:, 1:] > real[:, :-1]).any()):
        raise ValueError("residual_from takes right-padded items (real positions first)")
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


CLASS_HEAD = "lens_attrib_class_head"
"""Attribute (a registered submodule) holding the sequence-classification head a loaded
``*ForSequenceClassification`` checkpoint came with
(:mod:`lens_attrib.classifiers.checkpoint_head`)."""


def attached_head(model: Any) -> Head | None:
    """The model's own classification/regression head, if it was loaded with one."""
    return cast("Head | None", getattr(model, CLASS_HEAD, None))


def default_head(model: Any, arch: Arch) -> Head:
    """The head explained by default: the model's own class head, else its LM head."""
    head = attached_head(model)
    return head if head is not None else lm_head(model, arch)


def pre_unembed(model: Any, arch: Arch) -> Head:
    """The part of the LM head before ``unembed`` (``ln_final`` or the MLM head's transform)."""
    if arch.encoder:
        return cast(Head, model.mlm_head)
    ln = getattr(model, "ln_final", None)
    return cast(Head, ln) if ln is not None else (lambda x: x)


# --------------------------------------------------------------------------- weights
def unembedding(model: Any) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, "d_vocab"]]:
    """``W_U`` and ``b_U`` of the LM head, the linear map from ``ln_final``'s output to logits.

    A soft-capped head (Gemma 2: ``logit = c·tanh(u/c)``) is not linear: methods that read the
    logit as ``ln_final(x)·W_U + b_U`` get a :class:`TargetError` that says what applies.
    """
    cap = _soft_cap(getattr(model.cfg, "output_logits_soft_cap", None))
    if cap:
        raise TargetError(
            f"This model soft-caps its logits (logit = {cap:g}·tanh(u/{cap:g}), Gemma 2), so they "
            "are not a linear function of the final residual, which this method (ALTI-Logit, "
            "LogAt, NormXLogit) decomposes. Use a method that takes the head as it is "
            "('integrated_gradients', 'grad_x_input', 'value_zeroing'), or pass "
            "Target(head=...) with a linear head (e.g. a lens_attrib.classifiers.LinearHead of "
            "ln_final and W_U) to explain the logit before the cap."
        )
    return model.unembed.W_U, model.unembed.b_U


def vocab_size(model: Any) -> int:
    """Number of token logits of the LM head (soft-capped or not)."""
    return int(model.unembed.W_U.shape[-1])


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


def processing_signatures(model: Any, arch: Arch) -> list[str]:
    """TransformerLens weight processing this model shows (``from_pretrained``'s defaults).

    Read from the weights: ``LNPre``/``RMSPre`` norms (``fold_ln``), a vocabulary-centred
    unembedding (``center_unembed``), embeddings centred over ``d_model``
    (``center_writing_weights``), zero value biases with a non-zero output bias
    (``fold_value_biases``). Each is returned as a phrase naming the processing.
    """
    found: list[str] = []
    if arch.normalization in ("LNPre", "RMSPre"):
        found.append("fold_ln (the norms' weights were folded into the next layers)")
    with torch.no_grad():
        if arch.lm_head and not arch.encoder:
            w_u = model.unembed.W_U.detach()
            if w_u.shape[-1] > 1 and _centred(w_u):
                found.append("center_unembed (the unembedding was centred over the vocabulary)")
        w_e = token_embedding_matrix(model, arch).detach()
        if _centred(w_e):
            found.append("center_writing_weights (what writes to the residual was centred)")
        attn = model.blocks[0].attn
        _, b_v = value_weights(attn, arch.n_kv_heads)
        b_o = getattr(attn, "b_O", None)
        if b_o is not None and bool((b_v == 0).all()) and bool((b_o != 0).any()):
            found.append("fold_value_biases (value biases were folded into b_O)")
    return found


def _centred(weight: Tensor) -> bool:
    """Every row of ``weight`` sums to ~0 over its last axis (relative to its scale)."""
    scale = float(weight.abs().max())
    mean = weight.mean(-1, dtype=torch.float64)  # accumulates in float64 without a copy
    return scale > 0 and float(mean.abs().max()) <= 1e-6 * scale


def check_applies_to(name: str, arch: Arch, decoder: bool, encoder: bool, instead: str | None):
    """Raise a ModelError naming the right method when ``name`` does not fit the architecture."""
    if (arch.encoder and not encoder) or (not arch.encoder and not decoder):
        hint = f" Use {instead!r} instead." if instead else ""
        if instead and architecture_limit(instead, arch):
            hint = f" Nor does {instead!r} here: {architecture_limit(instead, arch)}"
        raise ModelError(f"Method {name!r} does not apply to a {arch.kind} model.{hint}")
    reason = architecture_limit(name, arch)
    if reason:
        raise ModelError(f"Method {name!r} does not apply to this model: {reason}")


def architecture_limit(name: str, arch: Arch) -> str | None:
    """Why method ``name`` does not apply to ``arch`` (:data:`ARCHITECTURE_LIMITS`), or None."""
    for fact, refused in ARCHITECTURE_LIMITS.items():
        if getattr(arch, fact) and name in refused:
            return f"({fact}={getattr(arch, fact)}) {refused[name]}"
    return None


__all__ = [
    "ARCHITECTURE_LIMITS",
    "CLASS_HEAD",
    "EMBEDDINGS",
    "Arch",
    "Head",
    "arch_of",
    "architecture_limit",
    "attached_head",
    "attn_hook",
    "block",
    "block_forward",
    "check_applies_to",
    "default_head",
    "embedded_input_hooks",
    "embedding_forward",
    "embedding_hooks",
    "final_norm",
    "final_residual",
    "forward_kwargs",
    "has_hooks",
    "has_lm_head",
    "head_output_hooks",
    "hook_name",
    "is_encoder",
    "lm_head",
    "pattern_hooks",
    "pre_unembed",
    "processing_signatures",
    "query_key_hooks",
    "resid_hook_names",
    "residual_before",
    "residual_from",
    "token_embedding_hook",
    "token_embedding_matrix",
    "unembedding",
    "value_weights",
    "vocab_size",
]
