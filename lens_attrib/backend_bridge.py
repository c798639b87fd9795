"""The TransformerLens 4 backend: ``TransformerBridge`` decoders and BERT / RoBERTa encoders (a
Hugging Face model with hooks).

The functions of :data:`lens_attrib.backend.BACKEND_INTERFACE` for a ``TransformerBridge``. The
bridge resolves TransformerLens 3.9's hook names as aliases (``blocks.L.hook_resid_pre`` is
``blocks.L.hook_in``, ``attn.hook_z`` is ``attn.o.hook_in``) and shows ``q/k/v/z`` hooks in 3.9's
``[batch, pos, head, d_head]`` shape, so methods keep their hook names. Where a name or a call
means something else on the bridge, this module maps it:

- ``stop_at_layer=n_layers`` returns logits on the bridge, not the residual: :func:`final_residual`
  reads the input of ``ln_final`` (after the user's hooks there) once the last block has run, and
  stops the forward there (a head applied inside a block's hook does not stop it).
- Norms (``ln*``, ``ln_final``) run Hugging Face's own module when no hook edits them, so a hook
  that returns ``hook_scale`` detached changes nothing it computes, no gradient reaches a
  captured ``hook_scale``, and Llama's RMSNorm computes in float32 whatever the dtype. For the
  length of every call (:func:`call_context`, entered by the model guard) every norm takes the
  bridge's own formula ``(x − μ)/sqrt(mean((x − μ)²) + ε) ⊙ w + b`` in the model's dtype,
  where ``hook_scale`` and ``hook_normalized`` are live (LRP's detach and gradients work) —
  TransformerLens 3.9's norm.
- Grouped K/V weights have the KV-head count (``W_V [n_kv, d_model, d_head]``) and absent biases
  are ``None``: :func:`value_weights` and :func:`unembedding` give zeros for absent biases.
- MLP activations live on the Hugging Face module (``act``/``act_fn``): :func:`mlp_activation`.
- Hook points report their own names (``blocks.0.mlp.in.hook_out``), not the alias a hook was
  added under: hook functions in :mod:`lens_attrib.hooks` bind the layer instead of parsing
  ``hook.name``.
- GPT-NeoX's joint-QKV rotary attention has ``hook_rot_q``/``hook_rot_k`` that never fire (Grad-ELLM
  reads the rotated queries and keys there): :func:`call_context` fires them after its rotation.
- ``hook_pos_embed`` exists on rotary models but never fires: the embedding hooks of rotary
  models are the token embedding alone (:func:`lens_attrib.backend.embedding_hooks`).
- Masked attention scores are ``finfo.min`` (−3.4e38 in float32) instead of ``−inf``, and a query
  row that sees no key (left padding) gets a uniform or, in float64 where two ``finfo.min`` sum
  to ``−inf``, a NaN pattern that poisons every later position: :func:`call_context` turns on
  the attention's compatibility masking (``−inf``, fully masked rows zeroed) for each call.
- Key–value cache (:func:`cached_final_residual`, for prefix chunks): transformers 5 hands the
  cache to attention modules as ``cache=``, TransformerLens 4's GPT-2 and Llama attention
  bridges read ``past_key_values=`` and would silently attend to the new tokens alone; for the
  call every attention bridge also gets it as ``past_key_values``, and the cache must grow by
  the new tokens (else a ModelError).
- ``hook_resid_mid`` on the bridge is the MLP's input only (an edit there does not reach the
  residual stream): no method hooks it.
- Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): transformers runs all experts as one
  batched module with no hook inside; for each call :func:`expert_hooks` runs them one by one
  through per-expert hook points with TransformerLens 3.9's names
  (``blocks.L.mlp.experts.E.hook_gate/hook_pre/hook_post``), so the MoE relevance rule of
  :mod:`lens_attrib.hooks.lrp` sees each expert's gate, up projection and product; the routing
  weights are the router bridge's ``mlp.hook_expert_weights`` (renormalised top-k weights
  scattered over the experts). Only transformers 5's fused expert layout is accepted
  (:func:`experts_module`), anything else is a ModelError.
- Gemma 2's post-norms (``ln1_post``, ``ln2_post``) are bridge components while the bridge's
  config leaves ``use_normalization_before_and_after`` unset: :func:`arch_of` reads them from
  the blocks, so that ALTI refuses them as on TransformerLens 3.9.
- Attention speed: the rotary attention bridge always builds the ``[batch, head, query, key]``
  scores and pattern (~8 passes, several kept for the backward). For each call
  :func:`fused_attention` gives plain rotary attentions TransformerLens 3.9 fast path's fused
  kernel (``scaled_dot_product_attention``) whenever nothing hooks the scores or the pattern
  and the mask is causal only (:func:`_fused_attention_forward`).
- Hooks that edit in place: a bridge hands hooks tensors autograd keeps (the softmax's output
  at ``attn.hook_pattern``, the fused kernel's at ``attn.hook_z``, a ReLU's at ``mlp.hook_post``,
  ``sqrt``'s at a norm's ``hook_scale``); these points copy their tensor for their hooks
  (:func:`lens_attrib.fastpath.saved_output_hook_points`: in every call through the model
  guard, for good on ``load_model``'s bridges).
- Deep copies (fine-tuning, ``verify``): TransformerLens 4 wires hooks as closures over the
  bridge's modules, which ``copy.deepcopy`` shares with the copy; :func:`deep_copy` rebinds them.
- Weight processing: ``process_weights`` keeps each norm's type (``fold_ln`` sets its weight to 1
  and bias to 0): :func:`norms_folded` reads that for the processed-model warning.

The logit soft-cap (Gemma 2) is applied by :func:`lm_head` as the bridge's forward applies it
after ``unembed``, and :func:`unembedding` refuses a soft-capped head as the hooked backend does.

A forward split at a block (:func:`block_forward`, :func:`residual_before`,
:func:`residual_from`: value zeroing, frozen-prefix training) calls the block modules directly
with the arguments the Hugging Face forward passes them (masks, positions, rotary tables), read
by a forward pre-hook on a short forward (:func:`block_arguments`): the bridge's own
``start_at_layer`` still runs every block below.

BERT and RoBERTa encoders (``*ForMaskedLM``, ``*Model``, ``*ForSequenceClassification`` booted as
``*ForMaskedLM`` by :func:`lens_attrib.models.load_bridge`; section "encoders" below): the bridge
names their activations otherwise than ``HookedEncoder`` (``embed.hook_out`` for
``embed.hook_embed``, ``embed_ln.hook_out`` for ``hook_full_embed``, and ``hook_attn_out``,
``hook_resid_mid``, ``hook_resid_post`` are other activations), so :func:`call_context` resolves the
3.9 names for the length of each call (:func:`encoder_hook_names`); the attention bridge runs
Hugging Face's attention and fires ``hook_pattern`` after the fact, so each call computes it with
:func:`hooked_eager_attention` (pattern edits reach the output, as CP-LRP and fixed routing need);
the MLM head is ``mlm_head`` (dense) + Hugging Face's activation + ``ln_final``
(:func:`mlm_transform`, :func:`mlm_head_parts`); a ``BertModel`` checkpoint booted as
``BertForMaskedLM`` has no token logits (:func:`has_mlm_head`); and ``boot_transformers``' tokenizer
drops ``[CLS] … [SEP]`` (:func:`use_tokenizer`); RoBERTa's MLM head calls its module's GELU and its
positions are numbered ``padding_idx + 1 + i`` for each call (:func:`roberta_positions`). Other
encoders (XLM-R, …) raise naming ``backend="hooked"``.

A float64 bridge computes exactly in float64 only where Hugging Face and the bridge do:
Llama-family rotary tables are float32 in transformers, the rotary attention bridge takes its
softmax in float32, mixture-of-experts routers their softmax, and transformers' grouped expert
matmul refuses float64. :func:`exact_float64` makes all of them float64 (``load_model(...,
backend="bridge")`` does this), as TransformerLens 3.9's loader does.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any, cast

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_attrib.arch import Arch, Head, MlmHead, arch_from_config, soft_cap
from lens_attrib.errors import ModelError
from lens_attrib.module_hooks import has_hooks

DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")


# --------------------------------------------------------------------------- architecture facts
def is_encoder(model: Any) -> bool:
    """True when the wrapped Hugging Face model is not a causal LM (e.g. BERT)."""
    name = type(model.original_model).__name__
    return not name.endswith(DECODER_SUFFIXES)


def arch_of(model: Any) -> Arch:
    """Read the architecture facts of a ``TransformerBridge`` (decoders; BERT encoders:
    :func:`encoder_arch`)."""
    if is_encoder(model):
        return encoder_arch(model)
    if getattr(model.cfg, "num_experts", None):
        for layer in moe_layers(model):
            experts_module(model, layer)  # refuses an expert layout the hooks cannot follow
    arch = arch_from_config(model, encoder=False, backend="bridge")
    # Gemma 2's post-norms (ln1_post, ln2_post) are bridge components; the bridge's config
    # leaves use_normalization_before_and_after unset
    post_norms = any(hasattr(blk, "ln1_post") or hasattr(blk, "ln2_post") for blk in model.blocks)
    return replace(arch, post_norms=arch.post_norms or post_norms)


def layer_norm_activation(model: Any) -> bool:
    """SoLU-style ``*_ln`` activations (TransformerLens' ``is_layer_norm_activation``)."""
    act_fn = getattr(model.cfg, "act_fn", None)
    return act_fn is not None and str(act_fn).endswith("_ln")


# --------------------------------------------------------------------------- raw forwards
def forward_kwargs(
    arch: Arch, mask: Tensor, padded: bool, token_types: Tensor | None = None
) -> dict[str, Tensor]:
    """``attention_mask`` when the batch is padded (encoders: always, with ``token_type_ids``
    when given)."""
    if arch.encoder:
        return encoder_forward_kwargs(mask, token_types)
    return {"attention_mask": mask.long()} if padded else {}


class _ResidualReached(Exception):
    """Raised by the hook that stops a forward once the final residual is known."""

    def __init__(self, resid: Tensor) -> None:
        super().__init__()
        self.resid = resid


def _final_residual_point(model: Any) -> nn.Module:
    """The hook point whose input is the residual after the last block (``ln_final.hook_in``)."""
    name = "ln_final.hook_in" if getattr(model, "ln_final", None) is not None else "unembed.hook_in"
    return cast(nn.Module, model.hook_dict[name])


def final_residual(
    model: Any,
    arch: Arch,
    tokens: Tensor,
    mask: Tensor,
    padded: bool,
    token_types: Tensor | None = None,
) -> Float[Tensor, "batch pos d_model"]:
    """The residual after the last block: the output of ``ln_final.hook_in`` (after the user's
    hooks there), the forward stopped before the final norm and the unembedding (encoders: the
    last block's output, :func:`encoder_final_residual`)."""
    if arch.encoder:
        return encoder_final_residual(model, arch, tokens, mask, token_types)
    return _residual_of_call(model, arch, tokens, forward_kwargs(arch, mask, padded))


def key_value_cache(model: Any, arch: Arch, rows: int, device: torch.device) -> Any:
    """An empty key–value cache: Hugging Face's ``DynamicCache`` of the wrapped model (it grows
    by concatenation, so the cached keys and values keep their graph)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.original_model.config)


def cached_final_residual(
    model: Any, arch: Arch, tokens: Tensor, cache: Any
) -> Float[Tensor, "batch pos d_model"]:
    """:func:`final_residual` of the unpadded ``tokens`` that follow the positions already in
    ``cache`` (Hugging Face places them after the cached ones and appends their keys and values
    to ``cache``).

    transformers 5 hands the cache to attention modules as ``cache=``, while the attention
    bridges of TransformerLens 4 read ``past_key_values=`` (or ``layer_past=``): GPT-2's and
    Llama's would leave the cache empty and attend to the new tokens alone (float64, tiny
    models: final residual 0.07 and 0.05 off the full forward's; GPT-NeoX's reads
    ``layer_past`` and matches). For this call every attention bridge also gets the cache as
    ``past_key_values``, and the cache must have grown by exactly ``tokens``' length (else a
    ModelError: the chunks would be silently wrong)."""
    before = int(cache.get_seq_length())

    def with_past(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if kwargs.get("cache") is cache and kwargs.get("past_key_values") is None:
            return args, {**kwargs, "past_key_values": cache}
        return None

    handles = [
        attn.register_forward_pre_hook(with_past, with_kwargs=True, prepend=True)
        for attn in _attention_bridges(model)
    ]
    try:
        resid = _residual_of_call(
            model, arch, tokens, {_cache_keyword(model): cache, "use_cache": True}
        )
    finally:
        for handle in handles:
            handle.remove()
    grown = int(cache.get_seq_length()) - before
    if grown != int(tokens.shape[1]):
        raise ModelError(
            f"The bridge's key–value cache grew by {grown} positions for {tokens.shape[1]} new "
            "tokens: its attention does not extend the cache as Hugging Face's does, so the "
            "sequence cannot run in chunks. Explain the steps under a hook (any hook keeps the "
            "one-forward path) or use backend='hooked'."
        )
    return resid


def _cache_keyword(model: Any) -> str:
    """The keyword the wrapped model's forward takes its cache by: ``cache`` (transformers ≥ 5.x,
    which warns that ``past_key_values`` is deprecated), else ``past_key_values``."""
    parameters = inspect.signature(model.original_model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _residual_of_call(
    model: Any, arch: Arch, tokens: Tensor, kwargs: dict[str, Any]
) -> Float[Tensor, "batch pos d_model"]:
    """The input of ``ln_final`` (after the user's hooks there) once the last block has run, on
    ``model(tokens, **kwargs)``; the forward stopped there."""
    point = _final_residual_point(model)
    after_blocks = {"done": False}

    def blocks_done(module: nn.Module, args: Any, output: Any) -> None:
        after_blocks["done"] = True

    def stop(module: nn.Module, args: Any, output: Tensor) -> None:
        # hooks inside the blocks may apply the head (logit lens): only the forward's own
        # final norm, after the last block, ends the run
        if after_blocks["done"]:
            raise _ResidualReached(output)

    handles = [
        model.blocks[arch.n_layers - 1].register_forward_hook(blocks_done),
        point.register_forward_hook(stop),
    ]
    try:
        model(tokens, **kwargs)
    except _ResidualReached as reached:
        return reached.resid
    finally:
        for handle in handles:
            handle.remove()
    raise RuntimeError("The bridge's forward never reached its final norm.")  # pragma: no cover


def embedding_forward(
    model: Any,
    arch: Arch,
    tokens: Tensor,
    mask: Tensor,
    padded: bool,
    token_types: Tensor | None = None,
) -> None:
    """Run only the embedding (``stop_at_layer=0``; hooks on it fire)."""
    model(tokens, stop_at_layer=0, **forward_kwargs(arch, mask, padded, token_types))


def block_forward(
    model: Any, arch: Arch, layer: int, resid: Tensor, mask: Tensor, padded: bool
) -> Float[Tensor, "batch pos d_model"]:
    """Block ``layer`` alone on ``resid`` (its hooks fire), called with the arguments the
    Hugging Face forward gives it for rows of this shape and ``mask`` (:func:`block_arguments`)."""
    calls = block_arguments(model, arch, [layer], resid, mask, padded)
    return _run_block(model, layer, resid, calls[layer])


def residual_before(
    model: Any,
    arch: Arch,
    layer: int,
    tokens: Tensor,
    mask: Tensor,
    padded: bool,
    token_types: Tensor | None = None,
) -> Float[Tensor, "batch pos d_model"]:
    """The residual entering block ``layer``: the first argument of that block's call (after
    the hooks of the blocks below, before its own ``hook_resid_pre``, as TransformerLens 3.9's
    ``stop_at_layer``), the forward stopped there; ``n_layers``: :func:`final_residual`."""
    if layer == arch.n_layers:
        return final_residual(model, arch, tokens, mask, padded, token_types)
    calls = _capture_block_calls(model, arch, [layer], tokens, mask, padded, token_types)
    return calls[layer].resid


def residual_from(
    model: Any, arch: Arch, resid: Tensor, layer: int, mask: Tensor
) -> Float[Tensor, "batch pos d_model"]:
    """Blocks ``layer … n_layers − 1`` on ``resid`` (right-padded items): encoders hide the padded
    keys, decoders run without a mask as TransformerLens 3.9 does (causal attention never lets a
    real position see the padding after it)."""
    layers = list(range(layer, arch.n_layers))
    if not layers:
        return resid
    calls = block_arguments(model, arch, layers, resid, mask, padded=arch.encoder)
    for i in layers:
        resid = _run_block(model, i, resid, calls[i])
    return resid


# --------------------------------------------------------------------------- one block alone
class _BlockCall:
    """The arguments a Hugging Face forward passed to one block (``resid``: its input)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs

    @property
    def resid(self) -> Tensor:
        return cast(Tensor, self.args[0] if self.args else self.kwargs["hidden_states"])


class _BlocksReached(Exception):
    """Raised once every block whose call is wanted has been called."""


def _layer_types(model: Any) -> list[str] | None:
    """Hugging Face's per-layer attention types (sliding / full), where the config has them:
    blocks of one type get the same arguments (mask, rotary tables) in its forward."""
    config = model.original_model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    return [str(t) for t in types] if types else None


def block_arguments(
    model: Any, arch: Arch, layers: list[int], resid: Tensor, mask: Tensor, padded: bool
) -> dict[int, _BlockCall]:
    """The call of each block of ``layers`` on rows shaped as ``resid`` with ``mask``.

    A forward of placeholder tokens (id 0; the embedding and its hooks run on them) is stopped
    at the first block whose arguments stand for each wanted layer's: block 0, or for models
    with several attention types (``layer_types``: sliding-window layers) the first block of the
    layer's type. Only the block arguments (masks, positions, rotary tables) are kept; the
    residual argument is replaced by the caller's.
    """
    types = _layer_types(model)
    first = {layer: (0 if types is None else types.index(types[layer])) for layer in layers}
    tokens = torch.zeros(resid.shape[:2], dtype=torch.long, device=resid.device)
    with torch.no_grad():
        calls = _capture_block_calls(model, arch, sorted(set(first.values())), tokens, mask, padded)
    return {layer: calls[first[layer]] for layer in layers}


def _capture_block_calls(
    model: Any,
    arch: Arch,
    layers: list[int],
    tokens: Tensor,
    mask: Tensor,
    padded: bool,
    token_types: Tensor | None = None,
) -> dict[int, _BlockCall]:
    """Run the forward until each block of ``layers`` is called; their calls (forward pre-hooks,
    ahead of anything in the block, so its own hooks do not fire)."""
    calls: dict[int, _BlockCall] = {}
    last = max(layers)

    def keep(layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[layer] = _BlockCall(args, kwargs)
            if layer == last:
                raise _BlocksReached

        return hook

    handles = [
        model.blocks[layer].register_forward_pre_hook(keep(layer), with_kwargs=True, prepend=True)
        for layer in layers
    ]
    kwargs: dict[str, Any] = dict(forward_kwargs(arch, mask, padded, token_types))
    if not arch.encoder:
        kwargs["use_cache"] = False  # a cache would keep each block's keys for the next call
    try:
        model(tokens, **kwargs)
    except _BlocksReached:
        return calls
    finally:
        for handle in handles:
            handle.remove()
    raise RuntimeError(f"The bridge's forward never called block {last}.")  # pragma: no cover


def _run_block(model: Any, layer: int, resid: Tensor, call: _BlockCall) -> Tensor:
    """Block ``layer`` on ``resid`` with the other arguments of ``call``."""
    if call.args:
        out = model.blocks[layer](resid, *call.args[1:], **call.kwargs)
    else:
        out = model.blocks[layer](**{**call.kwargs, "hidden_states": resid})
    return cast(Tensor, out[0] if isinstance(out, tuple) else out)


def lm_head(model: Any, arch: Arch) -> Head:
    """``ln_final`` + ``unembed`` (+ the logit soft-cap ``c·tanh(u/c)`` where the model has one);
    encoders: the MLM head + ``unembed`` (:func:`encoder_lm_head`)."""
    if arch.encoder:
        return encoder_lm_head(model, arch)
    final = pre_unembed(model, arch)
    cap = arch.logit_soft_cap  # the bridge applies it after ``unembed``, in its forward

    def decoder_head(x: Tensor) -> Tensor:
        logits = cast(Tensor, model.unembed(final(x[:, None, :]))[:, 0, :])
        return cap * torch.tanh(logits / cap) if cap else logits  # Gemma 2's logit soft-cap

    return decoder_head


def pre_unembed(model: Any, arch: Arch) -> Head:
    """``ln_final`` (the identity for models without a final norm); encoders: the MLM head's
    transform (:func:`mlm_transform`)."""
    if arch.encoder:
        return mlm_transform(model)
    ln = getattr(model, "ln_final", None)
    return cast(Head, ln) if ln is not None else (lambda x: x)


# --------------------------------------------------------------------------- weights
def unembedding(model: Any) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, "d_vocab"]]:
    """``W_U [d_model, d_vocab]`` and ``b_U`` (zeros where the LM head has no bias); a
    soft-capped head is refused as on TransformerLens 3.9
    (:func:`lens_attrib.backend_hooked.refuse_soft_capped`)."""
    from lens_attrib.backend_hooked import refuse_soft_capped

    refuse_soft_capped(soft_cap(getattr(model.cfg, "output_logits_soft_cap", None)))
    w_u = cast(Tensor, model.unembed.W_U)
    b_u = getattr(model.unembed, "b_U", None)
    if b_u is None:
        b_u = w_u.new_zeros(w_u.shape[-1])
    return w_u, cast(Tensor, b_u)


def token_embedding_matrix(model: Any, arch: Arch) -> Float[Tensor, "d_vocab d_model"]:
    return cast(Tensor, model.embed.W_E)


def block(model: Any, layer: int) -> Any:
    return model.blocks[layer]


def final_norm(model: Any) -> nn.Module:
    return cast(nn.Module, model.ln_final)


def value_weights(attn: nn.Module, n_v_heads: int) -> tuple[Tensor, Tensor]:
    """``W_V [n_v_heads, d_model, d_head]`` and ``b_V [n_v_heads, d_head]`` (zeros when absent).

    The bridge gives grouped-query models' ``W_V`` with the KV-head count, as ``hook_v`` has it;
    a query-head count (expanded) is made by repeating each KV head.
    """
    w_v = cast(Tensor, cast(Any, attn).W_V)
    b_v = cast(Any, attn).b_V
    if b_v is None:
        b_v = w_v.new_zeros(w_v.shape[0], w_v.shape[-1])
    if w_v.shape[0] != n_v_heads:
        group = n_v_heads // w_v.shape[0]
        w_v = torch.repeat_interleave(w_v, group, dim=0)
        b_v = torch.repeat_interleave(b_v, group, dim=0)
    return w_v, cast(Tensor, b_v)


def norm_params(module: nn.Module) -> tuple[bool, Tensor | None, Tensor | None, bool]:
    """A norm bridge as ``(center, weight, bias, active)`` (Gemma-style ``1 + w`` resolved)."""
    norm = cast(Any, module)
    if isinstance(norm, nn.Identity) or norm.original_component is None:
        return False, None, None, False
    if isinstance(norm.original_component, nn.Identity):
        return False, None, None, False
    if not hasattr(norm, "uses_rms_norm"):
        raise NotImplementedError(f"Unsupported normalization layer {type(module).__name__}.")
    center = not norm.uses_rms_norm
    weight = getattr(norm.original_component, "weight", None)
    if weight is not None and norm.uses_weight_offset:
        weight = 1.0 + weight
    bias = getattr(norm.original_component, "bias", None) if center else None
    return center, weight, bias, True


def norms_folded(model: Any) -> bool:
    """Whether ``fold_ln`` processed the bridge: TransformerLens 4's ``process_weights`` (also
    run by ``enable_compatibility_mode``) keeps each norm's type and sets its weight to 1 and its
    bias to 0, having moved them into the weights that read it; read from that, on a bridge
    whose ``_weights_processed`` flag is set."""
    if not getattr(model, "_weights_processed", False):
        return False
    norms, _ = _norm_and_attention_bridges(model)
    found = False
    with torch.no_grad():
        for norm in norms:
            _, weight, bias, active = norm_params(norm)
            if not active or weight is None:
                continue
            if not bool((weight == 1).all()) or (bias is not None and bool((bias != 0).any())):
                return False
            found = True
    return found


def mlp_activation(model: Any, layer: int) -> Callable[[Tensor], Tensor]:
    """The Hugging Face MLP's activation module (``act_fn`` or ``act``; BERT's
    ``intermediate.intermediate_act_fn``; a mixture of experts: the experts' one ``act_fn``)."""
    if getattr(model.cfg, "num_experts", None) and layer in moe_layers(model):
        return cast("Callable[[Tensor], Tensor]", experts_module(model, layer).act_fn)
    mlp = model.blocks[layer].mlp
    bert_layer = model.blocks[layer].original_component
    owners = (mlp, mlp.original_component, getattr(bert_layer, "intermediate", None))
    for owner in owners:
        if owner is None:
            continue
        for attr in ("act_fn", "act", "activation_fn", "intermediate_act_fn"):
            fn = getattr(owner, attr, None)
            if callable(fn):
                return cast("Callable[[Tensor], Tensor]", fn)
    raise ModelError(f"Cannot find the activation function of blocks.{layer}.mlp on this bridge.")


# --------------------------------------------------------------------------- per-call settings
def _norm_bridges(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if "use_native_layernorm_autograd" in vars(m)]


def _attention_bridges(model: nn.Module) -> list[Any]:
    """Modules with the bridge's attention softmax (told by class: a bridge component's
    ``__getattr__`` fallback makes ``hasattr`` on instances slow)."""
    return [m for m in model.modules() if hasattr(type(m), "_masked_softmax")]


def _norm_and_attention_bridges(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """:func:`_norm_bridges` and :func:`_attention_bridges` in one walk of the module tree."""
    norms, attns = [], []
    for module in model.modules():
        if "use_native_layernorm_autograd" in vars(module):
            norms.append(module)
        elif hasattr(type(module), "_masked_softmax"):
            attns.append(module)
    return norms, attns


def _set_if_changed(module: Any, flag: str, value: Any) -> None:
    """Set an attribute only when it differs (``nn.Module.__setattr__`` is slow on bridges)."""
    if getattr(module, flag) != value:
        setattr(module, flag, value)


@contextmanager
def call_context(model: Any) -> Iterator[None]:
    """For one call, the bridge computes as TransformerLens 3.9 does, then is set back.

    Every norm computes with live ``hook_scale``/``hook_normalized`` in the model's dtype (the
    bridge's own formula instead of Hugging Face's module), and every attention takes the
    bridge's compatibility masking: ``−inf`` for masked scores (not ``finfo.min``, which sums
    to ``−inf`` with a causal mask in float64 and turns a left-padded row into NaN) and a zero
    pattern for query rows that see no key (left padding), as ``HookedTransformer``. A joint-QKV
    rotary attention (GPT-NeoX) fires ``hook_rot_q``/``hook_rot_k``. An encoder resolves
    TransformerLens 3.9's ``HookedEncoder`` hook names (:func:`encoder_hook_names`).
    """
    encoder_names = encoder_hook_names(model) if is_encoder(model) else None
    norms, attns = _norm_and_attention_bridges(model)
    before = [n.use_native_layernorm_autograd for n in norms]
    compat = [m.compatibility_mode for m in attns]
    silent_rotary = [m for m in attns if _rotary_hooks_silent(m)]
    folding = getattr(model.cfg, "layer_norm_folding", False)
    try:
        for norm in norms:
            _set_if_changed(norm, "use_native_layernorm_autograd", False)
        for attn in attns:  # -inf masks; fully masked (left-pad) query rows give a 0 pattern
            _set_if_changed(attn, "compatibility_mode", True)
        for attn in silent_rotary:
            attn._apply_rotary_pos_emb = _rotary_firing_hooks(attn)
        if folding:  # a folding flag also routes norms to the native path
            model.cfg.layer_norm_folding = False
        if encoder_names:
            model._add_aliases_to_hooks = _aliases_with(model, encoder_names)
            with live_patterns(model), roberta_positions(model):
                yield
        else:
            with expert_hooks(model), fused_attention(model, attns):  # per-expert hooks; fused
                yield
    finally:
        if encoder_names:
            model.__dict__.pop("_add_aliases_to_hooks", None)
        for norm, value in zip(norms, before):
            _set_if_changed(norm, "use_native_layernorm_autograd", value)
        for attn, value in zip(attns, compat):
            _set_if_changed(attn, "compatibility_mode", value)
        for attn in silent_rotary:
            attn.__dict__.pop("_apply_rotary_pos_emb", None)
        if folding:
            model.cfg.layer_norm_folding = folding


def _rotary_hooks_silent(attn: Any) -> bool:
    """A joint-QKV rotary attention (GPT-NeoX) has ``hook_rot_q``/``hook_rot_k`` that never fire."""
    names = {cls.__name__ for cls in type(attn).__mro__}
    return "JointQKVPositionEmbeddingsAttentionBridge" in names and hasattr(attn, "hook_rot_q")


def _rotary_firing_hooks(attn: Any) -> Callable[..., tuple[Tensor, Tensor]]:
    """The attention's own rotation, then ``hook_rot_q``/``hook_rot_k`` on the rotated ``q``/``k``
    (``[batch, head, pos, d_head]`` there; the hook points show them as ``[batch, pos, head,
    d_head]``, as on Llama's attention bridge)."""
    rotate = type(attn)._apply_rotary_pos_emb

    def apply(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        q, k = rotate(attn, q, k, cos, sin)
        return attn.hook_rot_q(q), attn.hook_rot_k(k)

    return apply


def exact_float64(model: Any) -> Any:
    """Make a float64 bridge compute in float64 end to end, in place; returns ``model``.

    Norms take the bridge's own formula in the model's dtype (instead of Hugging Face's RMSNorm,
    which computes in float32), every rotary table is ``cos/sin(pos · base^(−2i/d))`` in
    float64 (transformers keeps ``inv_freq`` and the angles in float32: ≈ 3e-8 relative error),
    the rotary attention bridge's softmax keeps float64 (it asks for float32), and a mixture of
    experts gets transformers' eager experts and float64 routers (:func:`_float64_moe`). Other
    dtypes: norms only.
    """
    for norm in _norm_bridges(model):
        norm.use_native_layernorm_autograd = False
    if next(model.parameters()).dtype != torch.float64:
        return model
    _float64_moe(model)
    for module in model.original_model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            _float64_rotary(module)
    for attn in _attention_bridges(model):
        _softmax_in_input_dtype(attn)
    return model


def _softmax_in_input_dtype(attn: Any) -> None:
    """The attention bridge's softmax in the scores' dtype (it asks for float32) for float64.

    Set as a method bound to ``attn`` (not a closure), so that ``copy.deepcopy`` of the bridge
    (fine-tuning's copy) binds it to the copy's attention."""
    attn._masked_softmax = types.MethodType(_float64_masked_softmax, attn)


def _float64_masked_softmax(attn: Any, scores: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    keep = scores.dtype if scores.dtype == torch.float64 else dtype
    return cast(Tensor, type(attn)._masked_softmax(attn, scores, dtype=keep))


def _float64_rotary(rotary: Any) -> None:
    """Recompute ``rotary``'s ``inv_freq`` in float64 from its config, and its angles too (a
    method bound to ``rotary``, which ``copy.deepcopy`` re-binds to the copy)."""
    config = rotary.config
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ModelError(
            f"exact_float64: rotary scaling {rope_type!r} is not recomputed in float64 here."
        )
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    dim = 2 * rotary.inv_freq.numel()
    rotary.lens_attrib_inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    rotary.forward = types.MethodType(_float64_rotary_forward, rotary)


def _float64_rotary_forward(rotary: Any, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    inv_freq = rotary.lens_attrib_inv_freq.to(x.device)
    angles = position_ids[..., None].to(torch.float64) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)


# --------------------------------------------------------------------------- encoders (BERT)
ENCODER_ADAPTERS = ("BertArchitectureAdapter", "RobertaArchitectureAdapter")
"""The encoder bridges mapped here: BERT and RoBERTa (post-LN blocks, learned positions, token
types; RoBERTa's positions from ``padding_idx + 1``: :func:`roberta_positions`)."""


def encoder_arch(model: Any) -> Arch:
    """The architecture facts of a BERT bridge (``lm_head``: :func:`has_mlm_head`)."""
    adapter = type(getattr(model, "adapter", None)).__name__
    if adapter not in ENCODER_ADAPTERS:
        raise ModelError(
            f"TransformerBridge around {type(model.original_model).__name__} ({adapter}): the "
            "encoder bridges supported are BERT's. Load this encoder under TransformerLens 3.9 "
            "with load_model(folder, backend='hooked')."
        )
    arch = arch_from_config(model, encoder=True, backend="bridge")
    return dataclasses.replace(arch, lm_head=arch.lm_head and has_mlm_head(model))


def has_mlm_head(model: Any) -> bool:
    """Whether the bridge's masked-LM head holds the checkpoint's weights.

    ``boot_transformers`` builds a ``BertForMaskedLM`` also from a ``BertModel`` checkpoint
    (all-MiniLM-L6-v2), whose MLM head is then freshly initialised: only a checkpoint saved as
    ``*ForMaskedLM`` (its config's ``architectures``) has token logits.
    """
    if getattr(model, "mlm_head", None) is None or getattr(model, "unembed", None) is None:
        return False
    saved = getattr(model.original_model.config, "architectures", None)
    if not saved:
        return True  # built in memory: the module is what the user made
    return any(str(name).endswith("ForMaskedLM") for name in saved)


def encoder_hook_names(model: Any) -> dict[str, str]:
    """TransformerLens 3.9 ``HookedEncoder`` hook names → the BERT bridge's hook points.

    Where the bridge has no such name (``embed.hook_embed``, ``hook_full_embed``,
    ``hook_normalized_resid_post``) and where its alias means something else: on the bridge
    ``hook_attn_out`` is the attention module's output *after* BERT's residual and first
    LayerNorm, ``hook_resid_mid`` the input of ``ln2`` and ``hook_resid_post`` the block output
    (after ``ln2``), while ``HookedEncoder`` has ``attn_out`` (the attention's ``W_O`` output
    with ``b_O``), ``resid_mid = resid_pre + attn_out`` (``ln1``'s input), ``resid_post =
    ln1(resid_mid) + mlp_out`` (``ln2``'s input) and ``normalized_resid_post = ln2(resid_post)``.
    ``hook_embed`` of the bridge is the embedding LayerNorm's output (3.9:
    ``hook_full_embed``) and is left as it is.
    """
    names = {
        "embed.hook_embed": "embed.hook_out",
        "embed.hook_pos_embed": "pos_embed.hook_out",
        "embed.hook_token_type_embed": "token_type_embed.hook_out",
        "hook_full_embed": "embed_ln.hook_out",
    }
    for layer in range(int(model.cfg.n_layers)):
        block = f"blocks.{layer}."
        names[block + "hook_attn_out"] = block + "attn.o.hook_out"
        names[block + "hook_resid_mid"] = block + "ln1.hook_in"
        names[block + "hook_resid_post"] = block + "ln2.hook_in"
        names[block + "hook_normalized_resid_post"] = block + "hook_out"
    return names


@contextmanager
def roberta_positions(model: Any) -> Iterator[None]:
    """For one call, a RoBERTa bridge numbers positions ``padding_idx + 1 + i`` (``i`` the index
    in the row), as TransformerLens 3.9's ``HookedEncoder`` of the same folder (its position table
    starts at that row); BERT is left as it is.

    transformers' RoBERTa embedding numbers only tokens whose id is not the padding id, so a
    token equal to it inside a row (a tokenizer whose ``[UNK]`` has that id, a replacement
    token) would shift every later position there, and the methods' forwards would disagree
    with the hooked backend's; position ids given by the caller are kept.
    """
    embeddings: Any = getattr(model.original_model.base_model, "embeddings", None)
    offset = getattr(embeddings, "padding_idx", None)
    if offset is None or not hasattr(embeddings, "create_position_ids_from_input_ids"):
        yield
        return

    def numbered(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("position_ids") is not None:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = ids if ids is not None else kwargs["inputs_embeds"]
        start = int(offset) + 1
        positions = torch.arange(start, start + rows.shape[1], device=rows.device)
        return args, {**kwargs, "position_ids": positions.expand(rows.shape[0], -1)}

    handle = embeddings.register_forward_pre_hook(numbered, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _aliases_with(model: Any, names: dict[str, str]) -> Callable[[dict[str, Any]], None]:
    """The bridge's alias resolution, then ``names`` (3.9 name → the bridge's canonical name)."""
    resolve = type(model)._add_aliases_to_hooks

    def add(hooks: dict[str, Any]) -> None:
        resolve(model, hooks)
        registry = model._hook_registry
        for old, canonical in names.items():
            hooks[old] = registry[canonical]

    return add


def encoder_forward_kwargs(mask: Tensor, token_types: Tensor | None) -> dict[str, Tensor]:
    """``attention_mask`` (padded keys hidden) and BERT's segment ids ``token_type_ids``."""
    kwargs = {"attention_mask": mask.long()}
    if token_types is not None:
        kwargs["token_type_ids"] = token_types
    return kwargs


def encoder_final_residual(
    model: Any, arch: Arch, tokens: Tensor, mask: Tensor, token_types: Tensor | None
) -> Float[Tensor, "batch pos d_model"]:
    """The last block's output (``HookedEncoder.encoder_output``: after ``ln2``, after the user's
    hooks on ``blocks.{L-1}.hook_out``), the forward stopped before the MLM head."""
    point = model.blocks[arch.n_layers - 1].hook_out

    def stop(module: nn.Module, args: Any, output: Tensor) -> None:
        raise _ResidualReached(output)

    handle = point.register_forward_hook(stop)
    try:
        model(tokens, **encoder_forward_kwargs(mask, token_types))
    except _ResidualReached as reached:
        return reached.resid
    finally:
        handle.remove()
    raise RuntimeError("The bridge's forward never reached its last block.")  # pragma: no cover


def _mlm_activation(model: Any) -> Callable[[Tensor], Tensor]:
    """The activation between the MLM head's dense layer and its LayerNorm (BERT's
    ``cls.predictions.transform.transform_act_fn``; RoBERTa's ``RobertaLMHead`` calls its
    module's ``gelu``, the exact GELU, which is read from that module)."""
    hf = model.original_model
    if hasattr(hf, "cls"):
        return cast("Callable[[Tensor], Tensor]", hf.cls.predictions.transform.transform_act_fn)
    act = getattr(sys.modules[type(hf.lm_head).__module__], "gelu", None)
    if not callable(act):
        raise ModelError(f"Cannot find the activation of {type(hf.lm_head).__name__}.")
    return cast("Callable[[Tensor], Tensor]", act)


def mlm_transform(model: Any) -> Head:
    """BERT's MLM transform ``LN(φ(x W + b))`` (``HookedEncoder.mlm_head``): the bridge's
    ``mlm_head`` is the dense layer alone and ``ln_final`` its LayerNorm."""
    act = _mlm_activation(model)

    def transform(x: Tensor) -> Tensor:
        return cast(Tensor, model.ln_final(act(model.mlm_head(x))))

    return transform


def encoder_lm_head(model: Any, arch: Arch) -> Head:
    """``unembed(LN(φ(x W + b)))``, as ``HookedEncoder``'s ``unembed(mlm_head(x))``."""
    if not arch.lm_head:
        from lens_attrib.backend_hooked import lm_head as hooked_lm_head

        return hooked_lm_head(model, arch)  # raises the headless-encoder error
    transform = mlm_transform(model)

    def encoder_head(x: Tensor) -> Tensor:
        return cast(Tensor, model.unembed(transform(x[:, None, :]))[:, 0, :])

    return encoder_head


def mlm_head_parts(model: Any) -> MlmHead:
    """The MLM head's dense layer, activation and LayerNorm (:class:`~lens_attrib.arch.MlmHead`):
    ``mlm_head`` (a linear bridge around ``transform.dense``), ``transform_act_fn``,
    ``ln_final``."""
    dense = model.mlm_head.original_component
    return MlmHead(
        entry=model.mlm_head,
        weight=dense.weight.T,
        bias=dense.bias,
        act=_mlm_activation(model),
        norm=model.ln_final,
    )


HOOKED_ATTENTION = "lens_attrib_hooked_eager"
"""The attention implementation an encoder bridge's self-attentions use during a call
(:func:`hooked_eager_attention`, registered in transformers' ``AttentionInterface``)."""


def hooked_eager_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Eager attention ``softmax(q kᵀ · s + m) v`` with the bridge's ``hook_attn_scores`` and
    ``hook_pattern`` *inside* the computation.

    BERT's attention bridge delegates to Hugging Face's module and fires ``hook_pattern`` after
    the fact on the returned weights (an edit there is discarded: CP-LRP's detached pattern,
    fixed routing), and ``hook_attn_scores`` on the same post-softmax weights. Here the scores
    (masked keys ``−inf``, as ``HookedEncoder``) and the pattern pass through the hooks before
    they are used, as in TransformerLens 3.9; no weights are returned, so the bridge does not
    fire ``hook_pattern`` a second time.
    """
    bridge = cast(Any, module).config.lens_attrib_attention
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, -torch.inf)
        else:
            hidden = attention_mask <= torch.finfo(attention_mask.dtype).min
            scores = (scores + attention_mask).masked_fill(hidden, -torch.inf)
    scores = bridge.hook_attn_scores(scores)
    pattern = bridge.hook_pattern(torch.softmax(scores, dim=-1))
    pattern = nn.functional.dropout(pattern, p=dropout, training=module.training)
    out = torch.matmul(pattern.to(value.dtype), value)
    return out.transpose(1, 2).contiguous(), None


class _HookedAttentionConfig:
    """One self-attention's view of its Hugging Face config during a call: the attention
    implementation is :data:`HOOKED_ATTENTION`, and ``lens_attrib_attention`` its bridge."""

    _attn_implementation = HOOKED_ATTENTION

    def __init__(self, config: Any, bridge: Any) -> None:
        self.lens_attrib_config = config
        self.lens_attrib_attention = bridge

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lens_attrib_config, name)


def live_patterns(model: Any) -> AbstractContextManager[None]:
    """For a call: every BERT self-attention of the bridge computes with
    :func:`hooked_eager_attention` (``hook_pattern`` edits reach the output), then is set back."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(HOOKED_ATTENTION, hooked_eager_attention)
    views: list[tuple[nn.Module, Any]] = []
    for blk in model.blocks:
        self_attention = getattr(blk.attn.original_component, "self", None)
        if self_attention is None or not hasattr(self_attention, "config"):
            raise ModelError(
                f"{blk.attn.name}: expected BERT's attention (attention.self) on this bridge."
            )
        views.append((self_attention, self_attention.config))
    return _with_config_views(views, [blk.attn for blk in model.blocks])


@contextmanager
def _with_config_views(views: list[tuple[nn.Module, Any]], bridges: list[Any]) -> Iterator[None]:
    try:
        for (module, config), bridge in zip(views, bridges):
            setattr(module, "config", _HookedAttentionConfig(config, bridge))  # noqa: B010
        yield
    finally:
        for module, config in views:
            setattr(module, "config", config)  # noqa: B010


def use_tokenizer(model: Any, tokenizer: Any) -> Any:
    """Give the bridge ``tokenizer`` as it is; returns ``model``.

    ``boot_transformers`` (and the ``model.tokenizer = …`` setter) re-load a tokenizer with
    ``add_bos_token=True`` and an ``<|endoftext|>`` BOS/EOS, which for BERT drops the
    ``[CLS] … [SEP]`` framing of its post-processor; encoders need the folder's own tokenizer
    (``load_model(folder, backend="bridge")`` sets it with this function).
    """
    model._tokenizer = tokenizer


# --------------------------------------------------------------------------- mixture of experts
EXPERT_HOOKS = ("hook_gate", "hook_pre", "hook_post")
"""Per-expert hook points a call gives a mixture-of-experts bridge, named as TransformerLens
3.9's expert modules: ``blocks.L.mlp.experts.E.hook_gate`` (gate projection ``x W_gate``),
``.hook_pre`` (up projection ``x W_in``), ``.hook_post`` (``φ(gate) ⊙ up``)."""


def _unwrapped(module: Any) -> Any:
    """The Hugging Face module under bridge wrappers (``original_component`` chains)."""
    while isinstance(getattr(module, "original_component", None), nn.Module):
        module = module.original_component
    return module


def moe_layers(model: Any) -> list[int]:
    """The layers whose MLP is a sparse mixture of experts (a ``MoEBridge``, not a dense layer
    of an interleaved stack)."""
    return [
        layer
        for layer, blk in enumerate(model.blocks)
        if any(cls.__name__ == "MoEBridge" for cls in type(blk.mlp).__mro__)
        and not getattr(blk.mlp, "bound_dense", False)
    ]


def experts_module(model: Any, layer: int) -> Any:
    """The Hugging Face experts of MoE layer ``layer`` in transformers 5's fused layout
    (Mixtral, Qwen2-MoE, Qwen3-MoE): ``gate_up_proj [E, 2·d_mlp, d_model]``, ``down_proj
    [E, d_model, d_mlp]``, no biases, one ``act_fn``; any other layout is a :class:`ModelError`
    (the expert hooks would not see what the experts compute)."""
    block = _unwrapped(model.blocks[layer].mlp)
    experts = _unwrapped(getattr(block, "experts", None))
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    fused = (
        isinstance(gate_up, Tensor)
        and isinstance(down, Tensor)
        and gate_up.ndim == 3
        and down.ndim == 3
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1]
        and not getattr(experts, "is_transposed", False)
        and not any("bias" in name for name, _ in experts.named_parameters())
        and callable(getattr(experts, "act_fn", None))
    )
    if not fused:
        raise ModelError(
            f"TransformerBridge around {type(model.original_model).__name__}: the experts of "
            f"blocks.{layer}.mlp ({type(experts).__name__}) are not in the fused layout the "
            "bridge backend hooks (Mixtral, Qwen2-MoE, Qwen3-MoE: gate_up_proj and down_proj "
            "without biases). Mixtral also loads under TransformerLens 3.9 with "
            "load_model(folder, backend='hooked')."
        )
    return experts


def _hooked_experts_forward(experts: Any, points: list[tuple[Any, Any, Any]]) -> Callable[..., Any]:
    """The experts' forward one expert at a time through its hook points: for expert ``e`` and
    the rows routed to it, ``w_e · W_down,e(φ(hook_gate(x W_gate,e)) ⊙ hook_pre(x W_in,e))``
    with ``hook_post`` on the product, summed in expert order (as TransformerLens 3.9's MoE and
    transformers' eager experts)."""

    def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden_states)
        for expert, (gate_point, up_point, post_point) in enumerate(points):
            token, slot = torch.where(top_k_index == expert)
            fused = torch.nn.functional.linear(hidden_states[token], experts.gate_up_proj[expert])
            gate, up = fused.chunk(2, dim=-1)
            post = post_point(experts.act_fn(gate_point(gate)) * up_point(up))
            rows = torch.nn.functional.linear(post, experts.down_proj[expert])
            out = out.index_add(0, token, (rows * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    return forward


@contextmanager
def expert_hooks(model: Any) -> Iterator[None]:
    """For one call, every MoE layer's experts run through per-expert hook points
    (:data:`EXPERT_HOOKS`, in the bridge's hook registry for the call only), so that the MoE
    relevance rule (:mod:`lens_attrib.hooks.lrp`) finds TransformerLens 3.9's expert hooks;
    the routing weights are the router bridge's ``mlp.hook_expert_weights``."""
    if not getattr(model.cfg, "num_experts", None):
        yield
        return
    from transformer_lens.hook_points import HookPoint

    registry = model._hook_registry
    added: list[str] = []
    patched: list[Any] = []
    try:
        for layer in moe_layers(model):
            experts = experts_module(model, layer)
            points = []
            for expert in range(experts.gate_up_proj.shape[0]):
                trio = []
                for kind in EXPERT_HOOKS:
                    name = f"blocks.{layer}.mlp.experts.{expert}.{kind}"
                    point = HookPoint()
                    point.name = name
                    registry[name] = point
                    added.append(name)
                    trio.append(point)
                points.append((trio[0], trio[1], trio[2]))
            experts.forward = _hooked_experts_forward(experts, points)
            patched.append(experts)
        yield
    finally:
        for name in added:
            registry.pop(name, None)
        for experts in patched:
            experts.__dict__.pop("forward", None)


def _float64_moe(model: Any) -> None:
    """A float64 MoE bridge: transformers' eager experts (its grouped matmul takes no float64)
    and every router's softmax, top-k and renormalisation in float64 (transformers computes the
    softmax in float32: ≈ 1e-8 relative error in the routing weights)."""
    if not getattr(model.cfg, "num_experts", None):
        return
    if hasattr(model.original_model, "set_experts_implementation"):
        model.original_model.set_experts_implementation("eager")
    for layer in moe_layers(model):
        experts_module(model, layer)
        router = _unwrapped(getattr(_unwrapped(model.blocks[layer].mlp), "gate", None))
        if not all(hasattr(router, a) for a in ("weight", "top_k", "hidden_dim")):
            raise ModelError(
                f"exact_float64: the router of blocks.{layer}.mlp ({type(router).__name__}) is "
                "not a top-k softmax router this backend recomputes in float64."
            )
        router.forward = _float64_router(router)


def _float64_router(router: Any) -> Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]:
    """``softmax(x W_router)``, its top-``k`` and (Mixtral; Qwen when ``norm_topk_prob``) the
    weights renormalised to sum 1, all in the input's dtype: ``(logits, weights, indices)``."""
    renormalise = bool(getattr(router, "norm_topk_prob", True))

    def forward(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows = hidden_states.reshape(-1, router.hidden_dim)
        logits = torch.nn.functional.linear(rows, router.weight, getattr(router, "bias", None))
        top, chosen = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
        if renormalise:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, chosen

    return forward


# --------------------------------------------------------------------------- fused attention
def _plain_rotary_attention(attn: Any) -> bool:
    """A rotary attention bridge with nothing but ``q/k/v → RoPE → softmax(qkᵀ·s + causal) v → o``
    (Llama, Mistral, Qwen2, Phi-3, Mixtral, SmolLM2): no q/k norms, soft-cap, sinks, gated or
    split queries, key multiplier, q/k/v clipping, query scaling, per-head results, adjacent-pair
    or interleaved rotary, sliding window or dropout."""
    from transformer_lens.model_bridge.generalized_components import (
        PositionEmbeddingsAttentionBridge,
    )

    if type(attn) is not PositionEmbeddingsAttentionBridge or attn.original_component is None:
        return False
    hf_attn, config = attn.original_component, attn.config
    hf_config = getattr(hf_attn, "config", None)
    rope = getattr(hf_config, "rope_parameters", None)
    flags = ("use_split_qkv_input", "use_attn_in", "gated_q_proj", "use_attn_result")
    return (
        attn.is_causal
        and not attn.is_cross_attention
        and not any(getattr(config, flag, False) for flag in flags)
        and not getattr(config, "rotary_interleaved_cos_sin", False)
        and not getattr(config, "rotary_adjacent_pairs", False)
        and "q_norm" not in attn.submodules
        and "k_norm" not in attn.submodules
        and "gate" not in attn._modules
        and getattr(hf_attn, "attn_logit_softcapping", None) is None
        and getattr(hf_attn, "sinks", None) is None
        and getattr(hf_attn, "key_multiplier", None) is None
        and getattr(hf_config, "clip_qkv", None) is None
        and getattr(hf_attn, "sliding_window", None) is None
        and not (isinstance(rope, dict) and rope.get("llama_4_scaling_beta") is not None)
        and float(getattr(hf_attn, "attention_dropout", 0.0) or 0.0) == 0.0
        and type(attn)._pre_output_projection
        is PositionEmbeddingsAttentionBridge._pre_output_projection
    )


def _only_causal(mask: Tensor | None, length: int) -> bool:
    """``mask`` hides exactly the future keys (no padding): what ``is_causal`` computes."""
    if mask is None:
        return True
    if mask.ndim == 2:  # padding mask [batch, key]
        return bool(mask.bool().all()) if mask.dtype == torch.bool else bool((mask == 1).all())
    if mask.ndim != 4 or mask.shape[-2:] != (length, length):
        return False
    hidden = ~mask if mask.dtype == torch.bool else mask < 0
    future = torch.ones(length, length, dtype=torch.bool, device=mask.device).triu(1)
    return bool((hidden == future).all())


def _fused_attention_forward(attn: Any) -> Callable[..., Any]:
    """:func:`_fused_forward` as a method bound to ``attn`` (not a closure over it), so that
    ``copy.deepcopy`` of the bridge (fine-tuning's copy) binds it to the copy's attention: a
    closure would run the copy on the original's weights."""
    return types.MethodType(_fused_forward, attn)


def _fused_forward(attn: Any, *args: Any, **kwargs: Any) -> Any:
    """The attention bridge's forward with ``scaled_dot_product_attention`` when nothing
    observes the scores or the pattern (no hook on ``hook_attn_scores``/``hook_pattern``) and
    :func:`_lean_eager_attention` when something does, for a causal-only mask without KV cache;
    otherwise (padding, cache, partial rotary) the bridge's own forward.

    The fast path's fused attention (:mod:`lens_attrib.fastpath`) brought to the bridge: the
    bridge's forward makes ~8 passes over every ``[batch, head, query, key]`` tensor (scale, mask,
    the compatibility softmax's ``isneginf``/``masked_fill`` pair, float32 round trip, NaN scrub)
    and keeps several of them for the backward. ``hook_q/k/v`` (``q/k/v.hook_out``),
    ``hook_rot_q/k``, ``hook_z`` (``o.hook_in``) and ``hook_out`` fire as in the bridge's forward,
    with the same tensors; the output equals the eager one to float rounding.
    """
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    eager = PositionEmbeddingsAttentionBridge.forward.__get__(attn)
    hf_attn = attn.original_component
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    position_embeddings = kwargs.get("position_embeddings")
    cached = kwargs.get("past_key_values", kwargs.get("layer_past"))  # what the bridge reads
    if (
        not isinstance(hidden, Tensor)
        or position_embeddings is None
        or cached is not None
        or attn.training
        or not _only_causal(kwargs.get("attention_mask"), hidden.shape[1])
    ):
        return eager(*args, **kwargs)
    observed = has_hooks(attn.hook_attn_scores) or has_hooks(attn.hook_pattern)
    hidden = attn.hook_in(hidden)
    shape = (*hidden.shape[:-1], -1, hf_attn.head_dim)
    q = attn.q(hidden).view(shape).transpose(1, 2)
    k = attn.k(hidden).view(shape).transpose(1, 2)
    v = attn.v(hidden).view(shape).transpose(1, 2)
    cos, sin = attn._apply_position_embedding_hooks(position_embeddings)
    if cos.shape[-1] != hf_attn.head_dim:  # partial rotary: the bridge's own forward
        return eager(*args, **kwargs)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if hasattr(attn, "hook_rot_q"):
        q = attn.hook_rot_q(q)
    if hasattr(attn, "hook_rot_k"):
        k = attn.hook_rot_k(k)
    groups = getattr(hf_attn, "num_key_value_groups", 1)
    if groups > 1:
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scale = getattr(hf_attn, "scaling", hf_attn.head_dim**-0.5)
    if not observed:
        z = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        pattern = None
    else:  # the bridge's eager attention without the passes a causal-only mask needs not
        z, pattern = _lean_eager_attention(attn, q, k, v, scale)
    z = z.transpose(1, 2).reshape(*hidden.shape[:-1], -1)
    return attn.hook_out(attn.o(z)), pattern


def _lean_eager_attention(
    attn: Any, q: Tensor, k: Tensor, v: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """``softmax(q kᵀ·s, causal −inf) v`` with ``hook_attn_scores`` and ``hook_pattern`` firing
    on what the bridge's eager forward gives them (to float rounding: float64 ≈ 3e-16), for a
    causal-only mask: no query row is
    fully masked, so the compatibility softmax's zeroing and the NaN scrub change nothing and are
    left out, and the mask is filled in place. The softmax is in float32 as the bridge's (float64
    where :func:`exact_float64` made it so), then cast to the queries' dtype."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    length = scores.shape[-1]
    future = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
    hidden = -torch.inf if attn.compatibility_mode else torch.finfo(scores.dtype).min
    scores = attn.hook_attn_scores(scores.masked_fill_(future, hidden))
    keep = "_masked_softmax" in vars(attn) and scores.dtype == torch.float64  # exact_float64
    probs = torch.softmax(scores, dim=-1, dtype=None if keep else torch.float32).to(q.dtype)
    pattern = attn.hook_pattern(probs)
    return torch.matmul(pattern, v), pattern


@contextmanager
def fused_attention(model: Any, attns: list[Any] | None = None) -> Iterator[None]:
    """For one call, every plain rotary attention bridge (:func:`_plain_rotary_attention`) takes
    :func:`_fused_attention_forward`; restored on exit. ``attns``: the model's attention bridges
    when the caller has them (:func:`_attention_bridges`; one walk of the module tree less)."""
    patched = [
        m
        for m in (_attention_bridges(model) if attns is None else attns)
        if "forward" not in vars(m) and _plain_rotary_attention(m)  # not already fused
    ]
    try:
        for attn in patched:  # in the instance dict: a bridge's setattr goes to the HF module
            vars(attn)["forward"] = _fused_attention_forward(attn)
        yield
    finally:
        for attn in patched:
            attn.__dict__.pop("forward", None)


def enable_fused_attention(model: Any) -> Any:
    """Give every plain rotary attention bridge of ``model`` :func:`_fused_attention_forward`
    for good (``load_model(..., backend="bridge")`` does this, as it enables the fast path on a
    HookedTransformer); returns ``model``. Each forward still checks its hooks, mask and cache
    and falls back to the bridge's own forward; a user's own bridge gets it inside each call
    only (:func:`call_context`)."""
    for attn in _attention_bridges(model):
        if "forward" not in vars(attn) and _plain_rotary_attention(attn):
            vars(attn)["forward"] = _fused_attention_forward(attn)
    return model


# --------------------------------------------------------------------------- deep copies
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def deep_copy(model: Any, value: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(value, memo)``, then the copy of ``model`` re-wired to its own modules.

    ``copy.deepcopy`` copies functions by reference, and TransformerLens 4 wires some hooks as
    closures over the bridge's modules: every ``HookPoint.add_hook`` wrapper closes over its
    hook point, a symbolic MLP's ``hook_in``/``hook_out`` mirrors (BERT) over the MLP bridge,
    a block's capture hooks (split-qkv inputs, ``hook_mlp_in``) over weak proxies of its
    attention and itself. A plain deep copy therefore fires the original's hook points and
    stores its attention inputs, with their graph, on the original's modules (and the original
    then cannot be deep-copied again). Here every hook function of the copy that closes over a
    copied object is rebuilt with the copy's object, and each block's capture hooks are
    removed and wired anew on the copy (TransformerLens' own ``_teardown_capture_hooks`` /
    ``_maybe_wire_capture_hooks``).
    """
    copied = copy.deepcopy(value, memo)
    bridge = memo.get(id(model), model)
    for module in bridge.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if not hooks:
                continue
            for key, hook in list(hooks.items()):
                rebound = _rebound(hook, memo)
                if rebound is not hook:
                    hooks[key] = rebound
    for block in getattr(bridge, "blocks", []):
        if hasattr(block, "_teardown_capture_hooks") and hasattr(
            block, "_maybe_wire_capture_hooks"
        ):
            block._teardown_capture_hooks()
            block._maybe_wire_capture_hooks()
    return copied


def _rebound(function: Any, memo: dict[int, Any], seen: dict[int, Any] | None = None) -> Any:
    """``function`` with every closure cell that holds a deep-copied object (or such a closure)
    holding the copy instead; ``function`` itself when none does (``seen``: the functions met
    on the way, so that a closure that holds itself ends the walk)."""
    closure = getattr(function, "__closure__", None)
    if not isinstance(function, types.FunctionType) or not closure:
        return function
    seen = {} if seen is None else seen
    if id(function) in seen:
        return seen[id(function)]
    seen[id(function)] = function
    cells, changed = [], False
    for cell in closure:
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        new = _rebound(content, memo, seen) if callable(content) else content
        if new is content and id(content) in memo and memo[id(content)] is not content:
            new = memo[id(content)]
        changed = changed or new is not content
        cells.append(types.CellType(new) if new is not content else cell)
    if not changed:
        return function
    rebuilt = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__,
        tuple(cells),
    )  # fmt: skip
    rebuilt.__kwdefaults__ = function.__kwdefaults__
    rebuilt.__dict__.update(function.__dict__)
    rebuilt.__qualname__ = function.__qualname__
    seen[id(function)] = rebuilt
    return rebuilt
