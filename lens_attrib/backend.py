"""The model backend: architecture facts, hook names, weight access and the raw forwards.

Methods, evaluation, pruning and ``hooks/`` ask this module and :mod:`lens_attrib.forward`,
never the model classes. Two backends answer the same questions:

- :mod:`lens_attrib.backend_hooked`: TransformerLens 3.9's ``HookedTransformer`` (decoders) and
  ``HookedEncoder`` (BERT-style encoders);
- :mod:`lens_attrib.backend_bridge`: TransformerLens 4's ``TransformerBridge`` (the Hugging Face
  module wrapped with hook points; decoders and BERT encoders).

Each function of :data:`BACKEND_INTERFACE` below dispatches on the model (or on
``Arch.backend``) to the backend module's function of the same name. Hook names are
TransformerLens 3.9's (``blocks.L.attn.hook_z``); the bridge resolves them as aliases, and
:mod:`lens_attrib.backend_bridge` documents where an alias means something else and how that is
mapped. Shared facts (:class:`Arch`, the hook-name helpers, the head lookup, weight-processing
signatures) live here.

Architecture facts are read once per call into an :class:`Arch` and carried on the
:class:`~lens_attrib.inputs.Batch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_attrib.arch import CLASS_HEAD, Arch, Head, MlmHead, attached_head
from lens_attrib.errors import ModelError
from lens_attrib.module_hooks import has_hooks

EMBEDDINGS = ("full", "partial")


# --------------------------------------------------------------------------- dispatch
BACKEND_INTERFACE = (
    "is_encoder",
    "arch_of",
    "forward_kwargs",
    "final_residual",
    "key_value_cache",
    "cached_final_residual",
    "embedding_forward",
    "block_forward",
    "residual_before",
    "residual_from",
    "lm_head",
    "pre_unembed",
    "mlm_head_parts",
    "unembedding",
    "token_embedding_matrix",
    "block",
    "final_norm",
    "value_weights",
    "norm_params",
    "mlp_activation",
    "layer_norm_activation",
    "call_context",
    "deep_copy",
    "norms_folded",
)
"""The functions every backend module defines (same names, same signatures, same meaning):

- ``is_encoder(model)``, ``arch_of(model) -> Arch``: architecture facts;
- ``forward_kwargs(arch, mask, padded, token_types)``: the attention-mask keywords of a forward;
- ``final_residual(model, arch, tokens, mask, padded, token_types)``: the residual stream after
  the last block (the caller's hooks fire), ``embedding_forward(...)``: only the embedding;
- ``key_value_cache(model, arch, rows, device)``: an empty key–value cache whose entries keep
  their graph; ``cached_final_residual(model, arch, tokens, cache)``: the final residual of
  unpadded decoder ``tokens`` that follow the positions in ``cache`` (appended to it);
- ``block_forward(model, arch, layer, resid, mask, padded)``: one block alone;
  ``residual_before(model, arch, layer, tokens, mask, padded, token_types)``: the residual
  entering a block; ``residual_from(model, arch, resid, layer, mask)``: the blocks from ``layer``
  on (bounds and padding checked by :mod:`lens_attrib.backend` before dispatch);
- ``lm_head(model, arch)``, ``pre_unembed(model, arch)``, ``final_norm(model)``: the head-on-top;
  ``mlm_head_parts(model)``: an encoder's MLM transform as its parts (:class:`MlmHead`);
- ``unembedding(model)``, ``token_embedding_matrix(model, arch)``, ``block(model, layer)``,
  ``value_weights(attn, n_v_heads)``, ``norm_params(module)``: weights, in TransformerLens 3.9's
  layout and with zero tensors for absent biases;
- ``mlp_activation(model, layer)``: the MLP's element-wise activation function;
- ``layer_norm_activation(model)``: whether the MLP activation is a LayerNorm one (SoLU);
- ``call_context(model)``: a context the model guard enters for the length of one call;
- ``deep_copy(model, value, memo)``: ``copy.deepcopy(value, memo)`` (``value``: the model or a
  structure holding it) whose copy of the model runs on its own modules only;
- ``norms_folded(model)``: whether ``fold_ln`` processed the model where its norm type does not
  say so (a bridge keeps its norms' types).
"""


def is_bridge(model: Any) -> bool:
    """True for a TransformerLens 4 ``TransformerBridge`` (told by class, nothing imported)."""
    return any(
        cls.__name__ == "TransformerBridge" and cls.__module__.startswith("transformer_lens")
        for cls in type(model).__mro__
    )


def backend_module(model: Any) -> Any:
    """The backend module that answers for ``model`` (a model, or an :class:`Arch`)."""
    kind = model.backend if isinstance(model, Arch) else ("bridge" if is_bridge(model) else "")
    if kind == "bridge":
        from lens_attrib import backend_bridge

        return backend_bridge
    from lens_attrib import backend_hooked

    return backend_hooked


def is_encoder(model: Any) -> bool:
    """True for bidirectional BERT-style encoders (``HookedEncoder``, a BERT bridge)."""
    return bool(backend_module(model).is_encoder(model))


def arch_of(model: Any) -> Arch:
    """Read the architecture facts of a TransformerLens model."""
    return cast(Arch, backend_module(model).arch_of(model))


def has_lm_head(model: Any) -> bool:
    """Whether token logits exist: False for encoders loaded without their MLM head (a
    ``BertModel`` checkpoint, a classifier), on either backend (a bridge builds a
    ``*ForMaskedLM`` with a freshly initialised head from such a checkpoint: ``Arch.lm_head``
    reads which)."""
    return bool(arch_of(model).lm_head)


def layer_norm_activation(model: Any) -> bool:
    """Whether the MLP activation is a LayerNorm activation (SoLU), which is not element-wise."""
    return bool(backend_module(model).layer_norm_activation(model))


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
    from transformer_lens.utilities import get_act_name  # the same function in 3.9 and 4.x

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
    return cast(
        "dict[str, Tensor]", backend_module(arch).forward_kwargs(arch, mask, padded, token_types)
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
    impl = backend_module(arch)
    return cast(Tensor, impl.final_residual(model, arch, tokens, mask, padded, token_types))


def key_value_cache(model: Any, arch: Arch, rows: int, device: torch.device) -> Any:
    """An empty key–value cache of a decoder for ``rows`` sequences, differentiable through its
    entries (for :func:`cached_final_residual`)."""
    return backend_module(arch).key_value_cache(model, arch, rows, device)


def cached_final_residual(
    model: Any, arch: Arch, tokens: Tensor, cache: Any
) -> Float[Tensor, "batch pos d_model"]:
    """The residual after the last block of unpadded decoder ``tokens`` that continue the
    positions already in ``cache`` (they attend to the cached keys and values, and theirs are
    appended): a sequence run chunk by chunk gives the residual of the whole forward."""
    impl = backend_module(arch)
    return cast(Tensor, impl.cached_final_residual(model, arch, tokens, cache))


def block_forward(
    model: Any, arch: Arch, layer: int, resid: Tensor, mask: Tensor, padded: bool
) -> Float[Tensor, "batch pos d_model"]:
    """Block ``layer`` alone on its input ``resid`` (hooks inside the block fire); returns what
    the block returns, i.e. the next block's input (``resid_hook_names(arch)[layer]``).

    ``mask``: the real positions of the rows (decoders need it only when ``padded``: left
    padding shifts rotary positions and hides padding keys, as in the full forward).
    """
    impl = backend_module(arch)
    return cast(Tensor, impl.block_forward(model, arch, layer, resid, mask, padded))


def embedding_forward(
    model: Any,
    arch: Arch,
    tokens: Tensor,
    mask: Tensor,
    padded: bool,
    token_types: Tensor | None = None,
) -> None:
    """Run only the embedding (hooks on it fire; ``token_types``: an encoder's segment ids)."""
    backend_module(arch).embedding_forward(model, arch, tokens, mask, padded, token_types)


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
    impl = backend_module(arch)
    return cast(Tensor, impl.residual_before(model, arch, layer, tokens, mask, padded, token_types))


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
    return cast(Tensor, backend_module(arch).residual_from(model, arch, resid, layer, mask))


def lm_head(model: Any, arch: Arch) -> Head:
    """``ln_final`` + ``unembed`` (decoders) or ``mlm_head`` + ``unembed`` (encoders)."""
    return cast(Head, backend_module(arch).lm_head(model, arch))


def pre_unembed(model: Any, arch: Arch) -> Head:
    """The part of the LM head before ``unembed`` (``ln_final`` or the MLM head's transform)."""
    return cast(Head, backend_module(arch).pre_unembed(model, arch))


def mlm_head_parts(model: Any) -> MlmHead:
    """An encoder's masked-LM transform ``LN(φ(x W + b))`` as its parts (:class:`MlmHead`)."""
    return cast(MlmHead, backend_module(model).mlm_head_parts(model))


def default_head(model: Any, arch: Arch) -> Head:
    """The head explained by default: the model's own class head, else its LM head."""
    head = attached_head(model)
    return head if head is not None else lm_head(model, arch)


# --------------------------------------------------------------------------- weights
def unembedding(model: Any) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, "d_vocab"]]:
    """``W_U`` and ``b_U`` of the LM head, the linear map from ``ln_final``'s output to logits.

    A soft-capped head (Gemma 2: ``logit = c·tanh(u/c)``) is not linear: methods that read the
    logit as ``ln_final(x)·W_U + b_U`` get a :class:`TargetError` that says what applies.
    """
    return cast("tuple[Tensor, Tensor]", backend_module(model).unembedding(model))


def vocab_size(model: Any) -> int:
    """Number of token logits of the LM head (soft-capped or not)."""
    return int(model.unembed.W_U.shape[-1])


def token_embedding_matrix(model: Any, arch: Arch) -> Float[Tensor, "d_vocab d_model"]:
    return cast(Tensor, backend_module(arch).token_embedding_matrix(model, arch))


def block(model: Any, layer: int) -> Any:
    return backend_module(model).block(model, layer)


def final_norm(model: Any) -> nn.Module:
    return cast(nn.Module, backend_module(model).final_norm(model))


def value_weights(attn: nn.Module, n_v_heads: int) -> tuple[Tensor, Tensor]:
    """``W_V [n_v_heads, d_model, d_head]`` and ``b_V [n_v_heads, d_head]`` as ``hook_v`` uses them
    (zeros where the model has no value bias)."""
    impl = _component_backend(attn)
    return cast("tuple[Tensor, Tensor]", impl.value_weights(attn, n_v_heads))


def output_weights(attn: nn.Module) -> tuple[Tensor, Tensor]:
    """``W_O [head, d_head, d_model]`` and ``b_O [d_model]`` (zeros where there is no bias)."""
    w_o, b_o = cast(Tensor, cast(Any, attn).W_O), cast(Any, attn).b_O
    return w_o, (w_o.new_zeros(w_o.shape[-1]) if b_o is None else cast(Tensor, b_o))


def norm_params(module: nn.Module) -> tuple[bool, Tensor | None, Tensor | None, bool]:
    """A norm module as ``(center, weight, bias, active)``: ``x ↦ c(x)/σ ⊙ weight + bias``
    (``c`` centres when ``center``; ``active=False``: the identity)."""
    return cast(
        "tuple[bool, Tensor | None, Tensor | None, bool]",
        _component_backend(module).norm_params(module),
    )


def mlp_activation(model: Any, layer: int) -> Callable[[Tensor], Tensor]:
    """The element-wise activation ``φ`` of block ``layer``'s MLP (of the gate, when gated)."""
    return cast("Callable[[Tensor], Tensor]", backend_module(model).mlp_activation(model, layer))


@contextmanager
def call_context(model: Any) -> Iterator[None]:
    """What a backend changes for the length of one call on the user's model (entered by the
    model guard): nothing for TransformerLens 3.9; see
    :func:`lens_attrib.backend_bridge.call_context`."""
    with backend_module(model).call_context(model):
        yield


def deep_copy(model: Any, value: Any = None, memo: dict[int, Any] | None = None) -> Any:
    """``copy.deepcopy(value, memo)`` (``value`` defaults to ``model``; a structure holding the
    model, such as ``(model, head)``, is copied together) whose copy of ``model`` computes with
    its own modules and leaves the original untouched: plain ``deepcopy`` for TransformerLens
    3.9; see :func:`lens_attrib.backend_bridge.deep_copy`."""
    return backend_module(model).deep_copy(
        model, model if value is None else value, {} if memo is None else memo
    )


def _component_backend(module: Any) -> Any:
    """The backend of a model *component* (bridge components live in ``model_bridge``)."""
    if type(module).__module__.startswith("transformer_lens.model_bridge"):
        from lens_attrib import backend_bridge

        return backend_bridge
    from lens_attrib import backend_hooked

    return backend_hooked


def processing_signatures(model: Any, arch: Arch) -> list[str]:
    """TransformerLens weight processing this model shows (``from_pretrained``'s defaults).

    Read from the weights: ``LNPre``/``RMSPre`` norms, or a bridge's norms of weight 1 and bias 0
    after its ``process_weights`` (``fold_ln``), a vocabulary-centred
    unembedding (``center_unembed``), embeddings centred over ``d_model``
    (``center_writing_weights``), zero value biases with a non-zero output bias
    (``fold_value_biases``). Each is returned as a phrase naming the processing.
    """
    found: list[str] = []
    if arch.normalization in ("LNPre", "RMSPre") or backend_module(arch).norms_folded(model):
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
    "BACKEND_INTERFACE",
    "CLASS_HEAD",
    "EMBEDDINGS",
    "Arch",
    "Head",
    "MlmHead",
    "arch_of",
    "architecture_limit",
    "attached_head",
    "attn_hook",
    "backend_module",
    "block",
    "block_forward",
    "cached_final_residual",
    "call_context",
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
    "is_bridge",
    "is_encoder",
    "key_value_cache",
    "layer_norm_activation",
    "lm_head",
    "mlm_head_parts",
    "mlp_activation",
    "norm_params",
    "output_weights",
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
