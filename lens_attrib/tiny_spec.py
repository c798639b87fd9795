"""What the tiny test models are, independent of TransformerLens: the word-level vocabulary and
tokenizer, the sizes and config fields of each kind (TransformerLens 3.9's
``HookedTransformerConfig`` names), and how each parameter is drawn.

:mod:`lens_attrib.tiny_models` builds them (HookedTransformer on 3.9);
:mod:`lens_attrib.tiny_checkpoints` writes them as Hugging Face checkpoints for the bridge.
"""

from __future__ import annotations

from typing import Any

import torch

WORDS = (
    "the a an this these that those some one two of to in on near behind with by for from and or "
    "is are was were has have had does do likes like sees see saw knows know "
    "key keys cabinet cabinets author authors book books dog dogs cat cats man men woman women "
    "boy boys girl girls king kings queen queens actor actors actress actresses doctor doctors "
    "teacher teachers table tables house houses car cars friend friends "
    "himself herself themselves itself he she they it his her their "
    "paris france capital city of is good bad movie great terrible film not very "
    "john mary carl lisa bought cleaned saw hurt praised washed liked "
    "dish dishes chair chairs picture pictures shirt shirts"
).split()


TINY_SIZES: dict[str, Any] = {
    "d_model": 32,
    "d_head": 8,
    "n_heads": 4,
    "d_mlp": 64,
    "n_layers": 3,
    "n_ctx": 64,
    "device": "cpu",
    "dtype": torch.float32,
}


def _unique(words: list[str]) -> list[str]:
    seen: dict[str, None] = {}
    for w in words:
        seen.setdefault(w, None)
    return list(seen)


def tiny_tokenizer(encoder: bool = False) -> Any:
    """Word-level fast tokenizer: ``<bos>``/``<eos>``/``<pad>`` (decoders) or BERT specials."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = (
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        if encoder
        else ["<pad>", "<unk>", "<bos>", "<eos>"]
    )
    vocab = {tok: i for i, tok in enumerate(_unique(specials + list(WORDS)))}
    unk = "[UNK]" if encoder else "<unk>"
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if encoder:
        tok.post_processor = processors.BertProcessing(
            ("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"])
        )
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
        )
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="<unk>",
            pad_token="<pad>",
            bos_token="<bos>",
            eos_token="<eos>",
        )
    fast.padding_side = "right" if encoder else "left"
    return fast


def draw_parameter(
    name: str, shape: tuple[int, ...], gen: torch.Generator, scale: float = 0.2
) -> torch.Tensor:
    """One tiny-model parameter of TransformerLens name ``name``, drawn in float64 from ``gen``:
    norm gains ``1 + 0.1·N(0, 1)``, biases ``0.05·N(0, 1)``, embeddings and the unembedding
    ``scale·N(0, 1)``, other matrices ``N(0, 1/fan_in)`` (``fan_in = shape[-2]``)."""
    if name.endswith((".w", "ln_final.w")) and len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
    if name.split(".")[-1].startswith("b"):
        return 0.05 * torch.randn(shape, generator=gen, dtype=torch.float64)
    fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
    std = scale if "embed" in name or "W_pos" in name else fan_in**-0.5
    return std * torch.randn(shape, generator=gen, dtype=torch.float64)


DECODER_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"positional_embedding_type": "standard"},
    "llama": {
        "normalization_type": "RMS",
        "positional_embedding_type": "rotary",
        "rotary_dim": 8,
        "rotary_base": 10000,
        "rotary_adjacent_pairs": False,
        "n_key_value_heads": 2,
        "gated_mlp": True,
        "act_fn": "silu",
        "final_rms": True,
        "original_architecture": "LlamaForCausalLM",
    },
    "pythia": {
        "positional_embedding_type": "rotary",
        "rotary_dim": 4,
        "rotary_adjacent_pairs": False,
        "parallel_attn_mlp": True,
        "act_fn": "gelu",
        "original_architecture": "GPTNeoXForCausalLM",
    },
}
"""Each tiny decoder's HookedTransformerConfig settings beyond :func:`decoder_config`'s."""


def decoder_config(kind: str, seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The HookedTransformerConfig fields of tiny decoder ``kind`` (``gpt2``, ``llama``,
    ``pythia``) with ``overrides``; Llama rotates its whole head (``rotary_dim = d_head``)."""
    cfg: dict[str, Any] = {
        **TINY_SIZES,
        "d_vocab": len(tiny_tokenizer()),
        "act_fn": "gelu_new",
        "normalization_type": "LN",
        "default_prepend_bos": True,
        "seed": seed,
        **DECODER_DEFAULTS[kind],
    }
    if kind == "llama" and "d_head" in overrides:
        cfg["rotary_dim"] = overrides["d_head"]
    cfg.update(overrides)
    return cfg


def encoder_config(seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The HookedTransformerConfig fields of the tiny BERT with ``overrides``."""
    return {
        **TINY_SIZES,
        "d_vocab": len(tiny_tokenizer(encoder=True)),
        "act_fn": "gelu",
        "attention_dir": "bidirectional",
        "normalization_type": "LN",
        "original_architecture": "BertForMaskedLM",
        "seed": seed,
        **overrides,
    }
