"""Local checkpoint folders written by transformers load with the transformers model's outputs.

Per architecture, a tiny random checkpoint is saved with ``save_pretrained`` (weights and a
word-level tokenizer) and loaded with ``load_model(folder)``; the oracle is the transformers
model read back from the same folder. In float64 the oracle is made float64 throughout (see
``float64_throughout``), so agreement to 1e-10 shows that no weight and no table passed through
float32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lens_attrib import load_model
from lens_attrib.backend import arch_of, final_residual, has_lm_head, is_encoder
from lens_attrib.tiny_models import tiny_tokenizer
from tests.tl_versions import BRIDGE, hooked_only

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


def float64_throughout(hf_model: Any) -> Any:
    """Make a transformers model compute in its own dtype where it forces float32, in place.

    transformers computes RMSNorm and the rotary angles in float32 whatever the model dtype
    (``LlamaRMSNorm``: ``hidden_states.to(torch.float32)``; ``*RotaryEmbedding``: float32
    ``inv_freq`` and angles). Here RMSNorm is ``w ⊙ x / sqrt(mean(x²) + eps)`` in the input dtype,
    and the rotary tables are ``cos/sin(pos · base^(−2i/d))`` computed in float64. Attention is
    transformers' own (sdpa, which keeps the dtype).
    """
    for module in hf_model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):

            def rms_forward(x: torch.Tensor, norm: Any = module) -> torch.Tensor:
                scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                return norm.weight * (x * scale)

            module.forward = rms_forward
        elif kind.endswith("RotaryEmbedding"):
            dim = 2 * module.inv_freq.numel()
            base = module.config.rope_parameters["rope_theta"]
            inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

            def rotary_forward(
                x: torch.Tensor, position_ids: torch.Tensor, inv: Any = inv_freq, rot: Any = module
            ) -> tuple[torch.Tensor, torch.Tensor]:
                angles = position_ids[..., None].to(torch.float64) * inv
                angles = torch.cat((angles, angles), dim=-1)
                scale = rot.attention_scaling
                return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)

            module.forward = rotary_forward
    return hf_model


def _gpt2(vocab: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=16, n_layer=2, n_head=2)
    return GPT2LMHeadModel(cfg)


def _llama(vocab: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _neox(vocab: int) -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rotary_pct=0.5,
        rope_theta=10000.0,
        use_parallel_residual=True,
    )
    return GPTNeoXForCausalLM(cfg)


def _bert_config(vocab: int) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )


def _bert_mlm(vocab: int) -> Any:
    from transformers import BertForMaskedLM

    return BertForMaskedLM(_bert_config(vocab))


def _bert_encoder(vocab: int) -> Any:
    from transformers import BertModel

    return BertModel(_bert_config(vocab))


CHECKPOINTS: dict[str, Callable[[int], Any]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "gpt_neox": _neox,
    "bert_mlm": _bert_mlm,
    "bert_encoder": _bert_encoder,
}
ENCODERS = {"bert_mlm", "bert_encoder"}


def _randomize_biases_and_norms(hf_model: Any, seed: int) -> None:
    """transformers initialises biases to 0 and norm gains to 1: make every parameter count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.ndim == 1:
                base = 1.0 if "weight" in name else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    saved = {}
    for arch, build in CHECKPOINTS.items():
        torch.manual_seed(0)
        tok = tiny_tokenizer(encoder=arch in ENCODERS)
        hf_model = build(len(tok)).eval()
        _randomize_biases_and_norms(hf_model, seed=1)
        # a neutral name would hide the loader's reliance on it: keep the architecture in it
        folder = tmp_path_factory.mktemp("ckpt") / f"tiny-{arch}-checkpoint"
        hf_model.save_pretrained(folder)
        tok.save_pretrained(folder)
        saved[arch] = folder
    return saved


def _reference(folder: Path, arch: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM, BertForMaskedLM, BertModel

    loader = {"bert_mlm": BertForMaskedLM, "bert_encoder": BertModel}.get(
        arch, AutoModelForCausalLM
    )
    hf_model = loader.from_pretrained(folder, dtype=dtype).eval()
    return float64_throughout(hf_model) if dtype == torch.float64 else hf_model


def _inputs(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    texts = ["the keys to the cabinet is", "the capital of france is paris"]
    if is_encoder(model):
        enc = model.tokenizer(texts, return_tensors="pt", padding=True)
        return enc.input_ids, enc.attention_mask
    ids = model.tokenizer(texts[1], return_tensors="pt").input_ids
    return ids, torch.ones_like(ids)


def _computing_buffers(model: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    """The floating buffers the forward computes with. A float64 bridge keeps Hugging Face's
    float32 rotary ``inv_freq`` buffers and computes its angles from the float64 copy that
    ``exact_float64`` puts beside them (``lens_attrib_inv_freq``), which is checked here."""
    skip = set()
    if BRIDGE and dtype == torch.float64:
        for name, module in model.named_modules():
            if hasattr(module, "lens_attrib_inv_freq"):
                assert module.lens_attrib_inv_freq.dtype == torch.float64, name
                skip |= {f"{name}.inv_freq", f"{name}.original_inv_freq"}
    return [b for n, b in model.named_buffers() if b.is_floating_point() and n not in skip]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("arch", sorted(CHECKPOINTS))
def test_local_folder_matches_transformers(folders, arch, dtype):
    folder = folders[arch]
    model = load_model(str(folder), dtype=dtype)
    assert is_encoder(model) == (arch in ENCODERS)
    assert has_lm_head(model) == (arch != "bert_encoder")
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(b.dtype == dtype for b in _computing_buffers(model, dtype))
    hf_model = _reference(folder, arch, dtype)
    ids, mask = _inputs(model)
    with torch.no_grad():
        if arch == "bert_encoder":  # the final residual (HookedEncoder.encoder_output on 3.9)
            ours = final_residual(model, arch_of(model), ids, mask.bool(), padded=True)
            ref = hf_model(input_ids=ids, attention_mask=mask).last_hidden_state
        elif arch == "bert_mlm":
            ours = model(ids, one_zero_attention_mask=mask)
            ref = hf_model(input_ids=ids, attention_mask=mask).logits
        else:
            ours, ref = model(ids), hf_model(ids).logits
    real = mask.bool()
    assert ours.dtype == dtype
    worst = float((ours - ref)[real].abs().max())
    assert worst <= TOLERANCE[dtype], f"{arch} {dtype}: max |Δ| = {worst:.3e}"


def test_gpt2_context_comes_from_n_positions(folders):
    model = load_model(str(folders["gpt2"]))
    assert model.cfg.n_ctx == 64 and model.cfg.positional_embedding_type == "standard"


@hooked_only(
    "the HookedEncoder loader fills a BertModel folder's missing MLM head with NaN; a bridge "
    "has no such weights to fill and says so through Arch.lm_head (has_lm_head is False: "
    "test_local_folder_matches_transformers; refusals: test_bridge_encoder_folders)"
)
def test_bert_encoder_folder_has_no_usable_heads(folders):
    """A BertModel folder has no MLM head: its parameters hold NaN so any use is loudly wrong."""
    model = load_model(str(folders["bert_encoder"]))
    assert torch.isnan(model.mlm_head.W).all() and torch.isnan(model.unembed.W_U).all()
    assert not torch.isnan(model.pooler.W).any()  # BertModel ships its pooler
