"""Decoder families that TransformerLens 3.9 converts wrongly or not at all, built exactly.

``load_model(folder)`` reads most causal LMs through TransformerLens' own converters. For the
families below it uses this module instead (or after them), so that the HookedTransformer
computes what the transformers model computes, in every dtype:

- **Gemma** (``GemmaForCausalLM``) and **Gemma 2** (``Gemma2ForCausalLM``): TransformerLens 3.9
  builds them only from hub names. Here the config is read from ``config.json``: RMSNorm with gain
  ``1 + w`` (stored as ``1 + w`` rounded once in the model's dtype; TransformerLens' converter
  rounds it through float32), GeGLU MLP (``hidden_activation``), embeddings scaled by ``√d_model``
  (folded into ``W_E``: ``hook_embed`` holds the scaled embedding that enters the residual, as in
  transformers, and the tied unembedding keeps the unscaled matrix). Gemma 2 adds the post-norms
  (``ln1_post``, ``ln2_post``), attention soft-capping ``c·tanh(s/c)``, the attention scale
  ``query_pre_attn_scalar^-½``, sliding-window layers from ``layer_types`` and the final logit
  soft-cap (``cfg.output_logits_soft_cap``; :func:`lens_attrib.backend.lm_head` applies it).
- **Phi-3** (``Phi3ForCausalLM``: fused ``qkv_proj`` and ``gate_up_proj``): TransformerLens'
  converter is used without the zero LayerNorm biases it writes for RMSNorm layers.
- **Mixture of experts** (Mixtral): TransformerLens' ``MoE`` computes the router softmax in
  float32 whatever the model's dtype and builds its ``nn.Linear`` layers in the default dtype.
  :class:`ExactMoE` computes it in float64 for float64 models (float32 otherwise, as transformers
  does) with the same hooks and parameters.

Configurations these converters cannot reproduce (scaled rotary embeddings, partial rotary
Phi-3) raise a :class:`~lens_attrib.errors.ModelError` instead of loading a different model.
"""

from __future__ import annotations

import re
import types
from typing import Any

import einops
import torch
import torch.nn.functional as F
from torch import Tensor

from lens_attrib.errors import ModelError

GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM")


def architecture_name(hf_config: Any) -> str:
    names = list(getattr(hf_config, "architectures", None) or [])
    return str(names[0]) if names else ""


def rope_theta(hf_config: Any) -> float:
    """The rotary base: ``rope_parameters["rope_theta"]`` (transformers 5) or ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


def check_plain_rope(hf_config: Any) -> None:
    """Refuse rotary scalings (linear, dynamic, YaRN, LongRoPE) these converters do not build."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = params if isinstance(params, dict) else {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        raise ModelError(
            f"{architecture_name(hf_config)} with rotary scaling {kind!r} is not supported by the "
            "TransformerLens 3.9 conversion (it would build unscaled rotary tables and give "
            "different logits). Use a checkpoint without rope scaling."
        )


# --------------------------------------------------------------------------- configs
def gemma_config(hf_config: Any, dtype: torch.dtype, model_name: str) -> Any:
    """HookedTransformerConfig of a Gemma / Gemma 2 checkpoint, read from its config."""
    from transformer_lens.config import HookedTransformerConfig

    check_plain_rope(hf_config)
    arch = architecture_name(hf_config)
    d_head = int(getattr(hf_config, "head_dim", None) or 0) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    act = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
    cfg: dict[str, Any] = {
        "d_model": hf_config.hidden_size,
        "d_head": d_head,
        "n_heads": hf_config.num_attention_heads,
        "n_key_value_heads": hf_config.num_key_value_heads,
        "d_mlp": hf_config.intermediate_size,
        "n_layers": hf_config.num_hidden_layers,
        "n_ctx": hf_config.max_position_embeddings,
        "eps": hf_config.rms_norm_eps,
        "d_vocab": hf_config.vocab_size,
        "act_fn": "gelu_pytorch_tanh" if act == "gelu" else act,  # transformers does the same
        "normalization_type": "RMS",
        "final_rms": True,
        "gated_mlp": True,
        "positional_embedding_type": "rotary",
        "rotary_dim": d_head,
        "rotary_base": rope_theta(hf_config),
        "rotary_adjacent_pairs": False,
        "use_attn_scale": True,
        "original_architecture": arch,
        "model_name": model_name,
        "default_prepend_bos": False,
        "tokenizer_prepends_bos": False,
        "init_weights": False,
        "device": "cpu",
        "dtype": dtype,
    }
    if arch == "Gemma2ForCausalLM":
        layer_types = list(
            getattr(hf_config, "layer_types", None)
            or [
                "sliding_attention" if (i + 1) % 2 else "full_attention"
                for i in range(hf_config.num_hidden_layers)
            ]
        )
        local = [t == "sliding_attention" for t in layer_types]
        window = getattr(hf_config, "sliding_window", None)
        cfg.update(
            attn_scale=float(hf_config.query_pre_attn_scalar) ** 0.5,
            attn_scores_soft_cap=float(hf_config.attn_logit_softcapping or -1.0),
            output_logits_soft_cap=float(hf_config.final_logit_softcapping or -1.0),
            use_normalization_before_and_after=True,
        )
        if window and any(local):
            cfg.update(
                use_local_attn=True,
                window_size=int(window),
                attn_types=["local" if is_local else "global" for is_local in local],
            )
    return HookedTransformerConfig(**cfg)


def check_phi3(hf_config: Any) -> None:
    """Phi-3 settings TransformerLens' config converter ignores: refuse them."""
    check_plain_rope(hf_config)
    factor = float(getattr(hf_config, "partial_rotary_factor", 1.0) or 1.0)
    if factor != 1.0:
        raise ModelError(
            f"Phi-3 with partial_rotary_factor={factor} is not supported by the TransformerLens "
            "3.9 conversion (it rotates every dimension). Use a checkpoint with factor 1."
        )


# --------------------------------------------------------------------------- weights
def gemma_state_dict(hf_model: Any, cfg: Any) -> dict[str, Tensor]:
    """HookedTransformer weights of a Gemma / Gemma 2 model (see the module docstring).

    Norm gains are ``1 + w`` and the token embedding ``√d_model · E``, each rounded once in
    ``cfg.dtype``; attention and MLP weights are rearranged, not changed.
    """
    base = hf_model.model
    dtype = cfg.dtype
    n_kv = cfg.n_key_value_heads

    def gain(norm: Any) -> Tensor:
        return 1.0 + norm.weight.detach().to(dtype)

    scale = torch.tensor(cfg.d_model**0.5, dtype=dtype)
    sd: dict[str, Tensor] = {"embed.W_E": base.embed_tokens.weight.detach().to(dtype) * scale}
    for i, layer in enumerate(base.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"blocks.{i}."
        for name, proj, heads in (("Q", attn.q_proj, cfg.n_heads), ("K", attn.k_proj, n_kv)):
            key = "W_Q" if name == "Q" else "_W_K"
            sd[p + "attn." + key] = einops.rearrange(
                proj.weight.detach(), "(n h) m -> n m h", n=heads
            )
        sd[p + "attn._W_V"] = einops.rearrange(
            attn.v_proj.weight.detach(), "(n h) m -> n m h", n=n_kv
        )
        sd[p + "attn.W_O"] = einops.rearrange(
            attn.o_proj.weight.detach(), "m (n h) -> n h m", n=cfg.n_heads
        )
        biases = (("b_Q", attn.q_proj, cfg.n_heads), ("_b_K", attn.k_proj, n_kv))
        for key, proj, heads in (*biases, ("_b_V", attn.v_proj, n_kv)):
            if proj.bias is not None:
                bias = proj.bias.detach()
                sd[p + "attn." + key] = einops.rearrange(bias, "(n h) -> n h", n=heads)
        if attn.o_proj.bias is not None:
            sd[p + "attn.b_O"] = attn.o_proj.bias.detach()
        sd[p + "ln1.w"] = gain(layer.input_layernorm)
        if cfg.use_normalization_before_and_after:  # Gemma 2
            sd[p + "ln1_post.w"] = gain(layer.post_attention_layernorm)
            sd[p + "ln2.w"] = gain(layer.pre_feedforward_layernorm)
            sd[p + "ln2_post.w"] = gain(layer.post_feedforward_layernorm)
        else:  # Gemma: post_attention_layernorm is the norm before the MLP
            sd[p + "ln2.w"] = gain(layer.post_attention_layernorm)
        sd[p + "mlp.W_gate"] = mlp.gate_proj.weight.detach().T
        sd[p + "mlp.W_in"] = mlp.up_proj.weight.detach().T
        sd[p + "mlp.W_out"] = mlp.down_proj.weight.detach().T
    sd["ln_final.w"] = gain(base.norm)
    sd["unembed.W_U"] = hf_model.lm_head.weight.detach().T
    return sd


def without_rms_biases(cfg: Any, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop the ``ln*.b`` entries a converter writes for RMSNorm layers (TransformerLens' Phi-3
    converter writes zeros of the wrong size); RMSNorm has no bias, so a non-zero one is an error.
    """
    if cfg.normalization_type != "RMS":
        return state_dict
    kept = {}
    for key, value in state_dict.items():
        if re.search(r"(^|\.)ln[^.]*\.b$", key):
            if bool((value != 0).any()):
                raise ModelError(f"{key} is a non-zero bias of an RMSNorm layer: not convertible.")
            continue
        kept[key] = value
    return kept


def convert(hf_config: Any, hf_model: Any, dtype: torch.dtype, model_name: str) -> tuple[Any, Any]:
    """``(cfg, state_dict)`` of Gemma / Gemma 2 (:data:`GEMMA_ARCHITECTURES`)."""
    cfg = gemma_config(hf_config, dtype, model_name)
    return cfg, gemma_state_dict(hf_model, cfg)


def check_converter_limits(hf_config: Any) -> None:
    """Refuse settings TransformerLens' own converters would silently ignore (Phi-3, Mixtral)."""
    arch = architecture_name(hf_config)
    if arch == "Phi3ForCausalLM":
        check_phi3(hf_config)
    elif arch == "MixtralForCausalLM":
        check_plain_rope(hf_config)


# --------------------------------------------------------------------------- mixture of experts
def exact_moe_forward(self: Any, x: Tensor) -> Tensor:
    """TransformerLens' ``MoE`` forward with the router softmax in the model's precision.

    ``p = softmax(x W_gate)`` (float64 for float64 models, float32 otherwise as in
    transformers), the top-``k`` experts per token with weights ``p_top`` (renormalised to sum 1
    when ``cfg.norm_topk_prob``), ``out = Σ_e w_e · expert_e(x)`` summed in expert order. Hooks
    as in TransformerLens: ``hook_expert_weights`` (all ``p``), ``hook_expert_indices``.
    """
    batch, pos, d_model = x.shape
    rows = x.reshape(-1, d_model)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    probs = self.hook_expert_weights(F.softmax(self.W_gate(rows).to(work), dim=-1))
    top, chosen = torch.topk(probs, self.experts_per_token, dim=-1)
    if self.cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    chosen = self.hook_expert_indices(chosen)
    weights = top.to(x.dtype)
    out = torch.zeros_like(rows)
    for index, expert in enumerate(self.experts):
        token, slot = torch.where(chosen == index)
        out = out.index_add(0, token, expert(rows[token]) * weights[token, slot, None])
    return out.reshape(batch, pos, d_model)


def is_moe(module: Any) -> bool:
    """A TransformerLens mixture-of-experts MLP (router ``W_gate`` + ``experts``)."""
    from transformer_lens.components.mlps.moe import MoE

    return isinstance(module, MoE)


def use_exact_moe(model: Any) -> int:
    """Give every ``MoE`` block of ``model`` :func:`exact_moe_forward`; returns how many."""
    count = 0
    for block in getattr(model, "blocks", []):
        mlp = getattr(block, "mlp", None)
        if mlp is not None and is_moe(mlp):
            mlp.forward = types.MethodType(exact_moe_forward, mlp)
            count += 1
    return count


def parameters_in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Build-time: give floating parameters created in the default dtype (``nn.Linear`` inside
    TransformerLens' ``MoE``) the model's dtype before the checkpoint is copied in."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                module._parameters[name] = torch.nn.Parameter(
                    param.detach().to(dtype), requires_grad=param.requires_grad
                )
