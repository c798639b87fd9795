"""Tiny random-weight models of every supported architecture, for fast unit tests.

Each builder returns a model with a small word-level tokenizer (whitespace split, lower-case
vocabulary below, unknown words map to ``<unk>``):

- ``tiny_gpt2``:   LayerNorm, learned absolute positions, GELU MLP, biases.
- ``tiny_llama``:  RMSNorm, rotary, grouped-query attention, gated SiLU MLP, no biases.
- ``tiny_pythia``: LayerNorm, parallel attention + MLP, partial rotary (``rotary_dim < d_head``).
- ``tiny_bert``:   ``HookedEncoder`` (post-LN BERT) with ``[CLS] … [SEP]`` and an MLM head.

Biases are given random values (not zeros) so that tests exercise bias terms; ``zero_biases``
sets every bias to zero for conservation tests.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from lens_attrib.models import keep_tokenizer_as_is, quiet_deprecation

# re-exported: the tiny models' definition, for callers of this module
from lens_attrib.tiny_spec import TINY_SIZES as TINY_SIZES
from lens_attrib.tiny_spec import WORDS as WORDS
from lens_attrib.tiny_spec import decoder_config, draw_parameter, encoder_config
from lens_attrib.tiny_spec import tiny_tokenizer as tiny_tokenizer


def _randomize(model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    """Random weights with a fixed seed; norm gains near 1, biases small but non-zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(draw_parameter(name, tuple(p.shape), gen, scale))


def _decoder(kind: str, overrides: dict[str, Any], seed: int, dtype: torch.dtype) -> Any:
    from transformer_lens import HookedTransformer
    from transformer_lens.config import HookedTransformerConfig

    cfg = decoder_config(kind, seed, overrides)
    with quiet_deprecation():
        model = HookedTransformer(
            HookedTransformerConfig(**cfg), tokenizer=keep_tokenizer_as_is(tiny_tokenizer())
        )
    _randomize(model, seed)
    model = model.to(dtype)
    model.cfg.dtype = dtype
    model.eval()
    if kind == "llama":
        zero_biases(model)  # Llama has no biases
    return model


def _tiny(
    kind: str, seed: int, dtype: torch.dtype, backend: str | None, overrides: dict[str, Any]
) -> Any:
    """Tiny model ``kind`` on ``backend`` (default: the installed TransformerLens'): a
    HookedTransformer/HookedEncoder on 3.9, the same function as a Hugging Face checkpoint on
    the TransformerBridge (:mod:`lens_attrib.tiny_checkpoints`)."""
    from lens_attrib.models import check_backend

    if check_backend(backend) == "bridge":
        from lens_attrib.tiny_checkpoints import load_tiny

        return load_tiny(kind, seed, dtype, overrides, backend="bridge")
    if kind == "bert":
        return _encoder(overrides, seed, dtype)
    return _decoder(kind, overrides, seed, dtype)


def tiny_gpt2(
    seed: int = 0, dtype: torch.dtype = torch.float32, backend: str | None = None, **overrides: Any
) -> Any:
    """GPT-2 shape: LayerNorm, learned positions, GELU MLP, biases everywhere."""
    return _tiny("gpt2", seed, dtype, backend, overrides)


def tiny_llama(
    seed: int = 0, dtype: torch.dtype = torch.float32, backend: str | None = None, **overrides: Any
) -> Any:
    """Llama shape: RMSNorm, rotary, GQA (4 query heads over 2 KV heads), gated SiLU MLP."""
    return _tiny("llama", seed, dtype, backend, overrides)


def tiny_pythia(
    seed: int = 0, dtype: torch.dtype = torch.float32, backend: str | None = None, **overrides: Any
) -> Any:
    """GPT-NeoX/Pythia shape: LayerNorm, parallel attention + MLP, partial rotary (4 of 8 dims)."""
    return _tiny("pythia", seed, dtype, backend, overrides)


def tiny_bert(
    seed: int = 0, dtype: torch.dtype = torch.float32, backend: str | None = None, **overrides: Any
) -> Any:
    """BERT shape (HookedEncoder): post-LN, learned positions, token types, MLM head."""
    return _tiny("bert", seed, dtype, backend, overrides)


def _encoder(overrides: dict[str, Any], seed: int, dtype: torch.dtype) -> Any:
    from transformer_lens import HookedEncoder
    from transformer_lens.config import HookedTransformerConfig

    cfg = encoder_config(seed, overrides)
    with quiet_deprecation():
        model = HookedEncoder(HookedTransformerConfig(**cfg), tokenizer=tiny_tokenizer(True))
    _randomize(model, seed)
    model = model.to(dtype)
    model.cfg.dtype = dtype
    model.eval()
    return model


def zero_biases(model: torch.nn.Module) -> torch.nn.Module:
    """Set every bias to zero, in place: the ``b_*`` parameters and norm biases of a
    HookedTransformer/HookedEncoder, or every ``bias`` of a TransformerBridge's Hugging Face
    modules (the LM head's included, which the bridge keeps as a buffer)."""
    from lens_attrib.backend import is_bridge

    with torch.no_grad():
        if is_bridge(model):
            for name, p in model.named_parameters():
                if name.split(".")[-1] == "bias":
                    p.zero_()
            head_bias = getattr(cast(Any, model).unembed.original_component, "bias", None)
            if isinstance(head_bias, torch.Tensor):
                head_bias.zero_()
            return model
        for name, p in model.named_parameters():
            # GQA stores its key/value biases as ``_b_K``/``_b_V``.
            if name.split(".")[-1].lstrip("_").startswith("b"):
                p.zero_()
    return model


TINY_DECODERS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "pythia": tiny_pythia}


# --------------------------------------------------------------------------- transformers folders
HF_SIZES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


HF_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", {"n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4}),
    "llama": ("LlamaConfig", {"rope_theta": 5000.0}),
    "gpt_neox": (
        "GPTNeoXConfig",
        {"num_key_value_heads": None, "rotary_pct": 0.5, "use_parallel_residual": True},
    ),
    "mistral": ("MistralConfig", {"sliding_window": 3}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "phi3": ("Phi3Config", {"sliding_window": 3}),
    "gemma": ("GemmaConfig", {"head_dim": 8, "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 8,
            "query_pre_attn_scalar": 12,
            "sliding_window": 3,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "head_dim": 8},
    ),
}
"""Family → transformers config class and its settings beyond :data:`HF_SIZES` (sliding windows
of 3 tokens where the family has one, so that short prompts cross them)."""


def _hf_config(family: str, vocab: int) -> Any:
    """A tiny transformers config of ``family`` (:data:`HF_FAMILIES`)."""
    import transformers

    if family not in HF_FAMILIES:
        raise ValueError(f"No tiny checkpoint for {family!r}: one of {sorted(HF_FAMILIES)}.")
    name, extra = HF_FAMILIES[family]
    sizes: dict[str, Any] = {} if family == "gpt2" else dict(HF_SIZES)
    kwargs = {"vocab_size": vocab, "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}
    return getattr(transformers, name)(**{**kwargs, **sizes, **extra})


TINY_CHECKPOINTS = tuple(HF_FAMILIES)
"""Families :func:`save_tiny_checkpoint` builds."""


def save_tiny_checkpoint(family: str, folder: Any, seed: int = 0) -> Any:
    """Save a tiny random transformers causal LM of ``family`` and the word-level tokenizer to
    ``folder`` (``save_pretrained``, no download); returns the folder as a ``Path``.

    Every 1-D parameter is randomised (transformers initialises biases to 0 and norm gains to 1,
    or 0 for Gemma's ``1 + w`` gains), so that biases and norm gains are exercised.
    """
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(family, len(tokenizer))).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                base = 1.0 if name.endswith("weight") and not gemma else 0.0  # a norm gain
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    path = Path(folder)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
