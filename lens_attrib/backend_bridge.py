"""The TransformerLens 4 backend: ``TransformerBridge`` decoders (a Hugging Face model with hooks).

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

Not supported yet, each with a :class:`~lens_attrib.errors.ModelError` naming
``backend="hooked"``: mixture-of-experts bridges (:func:`arch_of`; the MoE LRP rule hooks
TransformerLens 3.9's expert modules) and a forward split at a block (:func:`block_forward`,
:func:`residual_before`, :func:`residual_from`: value zeroing, frozen-prefix training). The
logit soft-cap (Gemma 2) is applied by :func:`lm_head` as the bridge's forward applies it after
``unembed``, and :func:`unembedding` refuses a soft-capped head as the hooked backend does.

Encoder bridges (BERT) are not supported yet: :func:`arch_of` raises, naming
``load_model(..., backend="hooked")`` under TransformerLens 3.9.

A float64 bridge computes exactly in float64 only where Hugging Face and the bridge do:
Llama-family rotary tables are float32 in transformers, and the rotary attention bridge takes its
softmax in float32. :func:`exact_float64` makes both float64 (``load_model(...,
backend="bridge")`` does this), as TransformerLens 3.9's loader does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_attrib.arch import Arch, Head, arch_from_config, soft_cap
from lens_attrib.errors import ModelError, TargetError

DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")


# --------------------------------------------------------------------------- architecture facts
def is_encoder(model: Any) -> bool:
    """True when the wrapped Hugging Face model is not a causal LM (e.g. BERT)."""
    name = type(model.original_model).__name__
    return not name.endswith(DECODER_SUFFIXES)


def arch_of(model: Any) -> Arch:
    """Read the architecture facts of a ``TransformerBridge`` (decoders)."""
    if is_encoder(model):
        raise ModelError(
            f"TransformerBridge around {type(model.original_model).__name__}: only decoder "
            "(causal LM) bridges are supported so far. Load this encoder under TransformerLens "
            "3.9 with load_model(folder, backend='hooked')."
        )
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
    """``attention_mask`` when the batch is padded."""
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
    hooks there), the forward stopped before the final norm and the unembedding."""
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
    model(tokens, stop_at_layer=0, **forward_kwargs(arch, mask, padded))


def _not_on_bridge(what: str) -> ModelError:
    return ModelError(
        f"{what} is not supported on a TransformerBridge yet (the bridge's "
        "start_at_layer/stop_at_layer differ from TransformerLens 3.9's: stop_at_layer=n_layers "
        "returns logits, and a split forward is not checked against the whole one here). Load "
        "the model with load_model(..., backend='hooked') under TransformerLens 3.9 for this "
        "(value zeroing, frozen-prefix classifier training)."
    )


def block_forward(
    model: Any, arch: Arch, layer: int, resid: Tensor, mask: Tensor, padded: bool
) -> Float[Tensor, "batch pos d_model"]:
    """Not supported on the bridge: raises a :class:`ModelError` naming the hooked backend."""
    raise _not_on_bridge("Running one block alone (block_forward)")


def residual_before(
    model: Any,
    arch: Arch,
    layer: int,
    tokens: Tensor,
    mask: Tensor,
    padded: bool,
    token_types: Tensor | None = None,
) -> Float[Tensor, "batch pos d_model"]:
    """Not supported on the bridge: raises a :class:`ModelError` naming the hooked backend."""
    raise _not_on_bridge("Splitting the forward at a block (residual_before)")


def residual_from(
    model: Any, arch: Arch, resid: Tensor, layer: int, mask: Tensor
) -> Float[Tensor, "batch pos d_model"]:
    """Not supported on the bridge: raises a :class:`ModelError` naming the hooked backend."""
    raise _not_on_bridge("Running the blocks from a given layer on (residual_from)")


def lm_head(model: Any, arch: Arch) -> Head:
    """``ln_final`` + ``unembed`` (+ the logit soft-cap ``c·tanh(u/c)`` where the model has one)."""
    if not arch.lm_head:  # pragma: no cover - encoders are refused by arch_of
        raise TargetError("This model has no LM head: pass Target(head=...).")
    final = pre_unembed(model, arch)
    cap = arch.logit_soft_cap  # the bridge applies it after ``unembed``, in its forward

    def decoder_head(x: Tensor) -> Tensor:
        logits = cast(Tensor, model.unembed(final(x[:, None, :]))[:, 0, :])
        return cap * torch.tanh(logits / cap) if cap else logits  # Gemma 2's logit soft-cap

    return decoder_head


def pre_unembed(model: Any, arch: Arch) -> Head:
    """``ln_final`` (the identity for models without a final norm)."""
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
    """The Hugging Face MLP's activation module (``act_fn`` or ``act``)."""
    mlp = model.blocks[layer].mlp
    for owner in (mlp, mlp.original_component):
        for attr in ("act_fn", "act", "activation_fn"):
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
    rotary attention (GPT-NeoX) fires ``hook_rot_q``/``hook_rot_k``.
    """
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
        yield
    finally:
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
    """The attention bridge's softmax in the scores' dtype (it asks for float32) for float64."""
    masked_softmax = type(attn)._masked_softmax

    def softmax(scores: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        keep = scores.dtype if scores.dtype == torch.float64 else dtype
        return cast(Tensor, masked_softmax(attn, scores, dtype=keep))

    attn._masked_softmax = softmax


def _float64_rotary(rotary: Any) -> None:
    """Recompute ``rotary``'s ``inv_freq`` in float64 from its config, and its angles too."""
    config = rotary.config
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ModelError(
            f"exact_float64: rotary scaling {rope_type!r} is not recomputed in float64 here."
        )
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    dim = 2 * rotary.inv_freq.numel()
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def forward(x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        angles = position_ids[..., None].to(torch.float64) * inv_freq.to(x.device)
        angles = torch.cat((angles, angles), dim=-1)
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)

    rotary.forward = forward
