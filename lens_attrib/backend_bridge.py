"""The TransformerLens 4 backend: ``TransformerBridge`` decoders and BERT encoders (a Hugging Face
model with hooks).

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
- ``hook_resid_mid`` on the bridge is the MLP's input only (an edit there does not reach the
  residual stream): no method hooks it.

Not supported yet, with a :class:`~lens_attrib.errors.ModelError` naming ``backend="hooked"``:
mixture-of-experts bridges (:func:`arch_of`; the MoE LRP rule hooks TransformerLens 3.9's expert
modules). The logit soft-cap (Gemma 2) is applied by :func:`lm_head` as the bridge's forward
applies it after ``unembed``, and :func:`unembedding` refuses a soft-capped head as the hooked
backend does.

A forward split at a block (:func:`block_forward`, :func:`residual_before`,
:func:`residual_from`: value zeroing, frozen-prefix training) calls the block modules directly
with the arguments the Hugging Face forward passes them (masks, positions, rotary tables), read
by a forward pre-hook on a short forward (:func:`block_arguments`): the bridge's own
``start_at_layer`` still runs every block below.

BERT encoders (``BertForMaskedLM``, ``BertModel``; section "encoders" below): the bridge names
their activations otherwise than ``HookedEncoder`` (``embed.hook_out`` for ``embed.hook_embed``,
``embed_ln.hook_out`` for ``hook_full_embed``, and ``hook_attn_out``, ``hook_resid_mid``,
``hook_resid_post`` are other activations), so :func:`call_context` resolves the 3.9 names for the
length of each call (:func:`encoder_hook_names`); the attention bridge runs Hugging Face's
attention and fires ``hook_pattern`` after the fact, so each call computes it with
:func:`hooked_eager_attention` (pattern edits reach the output, as CP-LRP and fixed routing need);
the MLM head is ``mlm_head`` (dense) + Hugging Face's activation + ``ln_final``
(:func:`mlm_transform`, :func:`mlm_head_parts`); a ``BertModel`` checkpoint booted as
``BertForMaskedLM`` has no token logits (:func:`has_mlm_head`); and ``boot_transformers``' tokenizer
drops ``[CLS] … [SEP]`` (:func:`use_tokenizer`). Other encoders (RoBERTa, …) raise naming
``backend="hooked"``.

A float64 bridge computes exactly in float64 only where Hugging Face and the bridge do:
Llama-family rotary tables are float32 in transformers, and the rotary attention bridge takes its
softmax in float32. :func:`exact_float64` makes both float64 (``load_model(...,
backend="bridge")`` does this), as TransformerLens 3.9's loader does.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_attrib.arch import Arch, Head, MlmHead, arch_from_config, soft_cap
from lens_attrib.errors import ModelError

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
    cfg = model.cfg
    if getattr(cfg, "num_experts", None):
        raise ModelError(
            f"TransformerBridge around {type(model.original_model).__name__}: mixture-of-experts "
            "bridges are not supported (the MoE relevance rule hooks TransformerLens 3.9's "
            "expert modules). Load this model under TransformerLens 3.9 with "
            "load_model(folder, backend='hooked')."
        )
    return arch_from_config(model, encoder=False, backend="bridge")


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
        model(tokens, **forward_kwargs(arch, mask, padded))
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


def mlp_activation(model: Any, layer: int) -> Callable[[Tensor], Tensor]:
    """The Hugging Face MLP's activation module (``act_fn`` or ``act``; BERT's
    ``intermediate.intermediate_act_fn``)."""
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
    return [m for m in model.modules() if hasattr(m, "use_native_layernorm_autograd")]


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
    norms = _norm_bridges(model)
    before = [n.use_native_layernorm_autograd for n in norms]
    attns = [m for m in model.modules() if hasattr(m, "_masked_softmax")]
    compat = [m.compatibility_mode for m in attns]
    silent_rotary = [m for m in attns if _rotary_hooks_silent(m)]
    folding = getattr(model.cfg, "layer_norm_folding", False)
    try:
        for norm in norms:
            norm.use_native_layernorm_autograd = False
        for attn in attns:  # -inf masks; fully masked (left-pad) query rows give a 0 pattern
            attn.compatibility_mode = True
        for attn in silent_rotary:
            attn._apply_rotary_pos_emb = _rotary_firing_hooks(attn)
        if folding:  # a folding flag also routes norms to the native path
            model.cfg.layer_norm_folding = False
        if encoder_names:
            model._add_aliases_to_hooks = _aliases_with(model, encoder_names)
            with live_patterns(model):
                yield
        else:
            yield
    finally:
        if encoder_names:
            model.__dict__.pop("_add_aliases_to_hooks", None)
        for norm, value in zip(norms, before):
            norm.use_native_layernorm_autograd = value
        for attn, value in zip(attns, compat):
            attn.compatibility_mode = value
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
    and the rotary attention bridge's softmax keeps float64 (it asks for float32). Other dtypes:
    norms only.
    """
    for norm in _norm_bridges(model):
        norm.use_native_layernorm_autograd = False
    if next(model.parameters()).dtype != torch.float64:
        return model
    for module in model.original_model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            _float64_rotary(module)
    for attn in model.modules():
        if hasattr(attn, "_masked_softmax"):
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
ENCODER_ADAPTERS = ("BertArchitectureAdapter",)
"""The encoder bridges mapped here: BERT (post-LN blocks, learned positions, token types)."""


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
    ``cls.predictions.transform.transform_act_fn``)."""
    transform = model.original_model.cls.predictions.transform
    return cast("Callable[[Tensor], Tensor]", transform.transform_act_fn)


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
    return model
