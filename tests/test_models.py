"""Real models load offline and compute what their reference implementations compute."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_local_folders import float64_throughout

from lens_attrib import ModelError, attribute, load_model
from lens_attrib.backend import arch_of, final_residual
from lens_attrib.models import architecture, smollm2_hf_from_gguf
from lens_attrib.tiny_models import TINY_DECODERS, tiny_bert
from tests.tl_versions import rotary_facts

PROMPTS = [
    "The capital of France is",
    "The keys to the cabinet",
    "Once upon a time, there was a little",
    "def fibonacci(n):",
    "The authors that the critic praised",
]


@pytest.fixture(scope="module")
def smollm2_hf():
    """transformers' SmolLM2 dequantized from the GGUF in float32, and its tokenizer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return smollm2_hf_from_gguf(torch.float32)


def test_smollm2_matches_transformers_gguf_logits(smollm2, smollm2_hf):
    hf_model, tokenizer = smollm2_hf
    worst = 0.0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            ref = hf_model(ids).logits
            ours = smollm2(ids)
        worst = max(worst, float((ref - ours).abs().max()))
    assert worst <= 1e-3, f"max |Δlogit| = {worst}"


def test_smollm2_float64_matches_transformers_float64(smollm2_hf):
    """float64 SmolLM2 = the GGUF's dequantized float32 weights cast to float64, computed in
    float64 throughout: the explained logit (argmax at the last token) agrees with transformers'
    float64 model to 1e-10 relative (a float32 weight, rotary table or eps would give ~1e-7)."""
    hf32, tokenizer = smollm2_hf
    ours = load_model("smollm2-135m", dtype=torch.float64)
    assert ours.cfg.eps == hf32.config.rms_norm_eps  # the GGUF's float32 epsilon, not 1e-5
    assert torch.equal(ours.embed.W_E, hf32.model.embed_tokens.weight.double())
    hf64 = float64_throughout(copy.deepcopy(hf32).to(torch.float64))
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            ref = hf64(ids).logits[0, -1]
            mine = ours(ids)[0, -1]
        top = int(ref.argmax())
        relative = abs(float(mine[top] - ref[top])) / abs(float(ref[top]))
        assert relative <= 1e-10, f"{prompt!r}: relative error {relative:.2e}"


def test_smollm2_architecture_and_paris(smollm2):
    facts = architecture(smollm2)
    assert facts["gqa"] and facts["n_kv_heads"] == 3 and facts["n_heads"] == 9
    assert facts["rotary"] and facts["normalization"] == "RMS" and facts["n_layers"] == 30
    assert rotary_facts(smollm2)[1] == 100000
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        for _ in range(2):
            nxt = smollm2(ids)[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    continuation = smollm2.tokenizer.decode(ids[0, -2:])
    assert continuation.startswith(" Paris"), continuation


def test_minilm_matches_bert_last_hidden_state(minilm):
    from transformers import AutoTokenizer, BertModel

    from lens_attrib.models import minilm_dir

    bert = BertModel.from_pretrained(minilm_dir(), add_pooling_layer=False).eval()
    tok = AutoTokenizer.from_pretrained(minilm_dir())
    enc = tok(["A man is playing a guitar.", "Paris is lovely"], return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = bert(**enc).last_hidden_state
        # the final residual through the backend (HookedEncoder.encoder_output on 3.9)
        ours = final_residual(
            minilm, arch_of(minilm), enc.input_ids, enc.attention_mask.bool(), padded=True
        )
    real = enc.attention_mask.bool()
    assert float((ref - ours)[real].abs().max()) <= 1e-4


def test_minilm_has_no_lm_head_and_says_so(minilm):
    from lens_attrib import TargetError

    with pytest.raises(TargetError, match="no masked-LM head"):
        attribute(minilm, "a man is playing", method="grad_x_input")


def test_local_hf_folder_roundtrip(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lens_attrib.tiny_models import tiny_tokenizer

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=5000.0,
        bos_token_id=2,
    )
    hf = LlamaForCausalLM(cfg).eval()
    folder = tmp_path / "tiny-llama-checkpoint"  # "llama" in the path must not confuse the loader
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    model = load_model(str(folder))
    ids = torch.tensor([[2, 5, 9, 11, 30]])
    with torch.no_grad():
        assert torch.allclose(model(ids), hf(ids).logits, atol=1e-4)


def test_unknown_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises((ModelError, OSError, ValueError)):
        load_model("definitely-not-a-model-name-xyz")


@pytest.mark.parametrize("name", sorted(TINY_DECODERS))
def test_tiny_decoders_have_their_architecture(name):
    model = TINY_DECODERS[name]()
    facts = architecture(model)
    if name == "llama":
        assert facts["gqa"] and facts["rotary"] and facts["gated_mlp"]
        assert facts["normalization"] == "RMS"
    if name == "pythia":
        assert facts["parallel"] and rotary_facts(model)[0] < model.cfg.d_head
    if name == "gpt2":
        assert facts["positional"] == "standard" and facts["normalization"] == "LN"


def test_tiny_bert_is_an_encoder():
    facts = architecture(tiny_bert())
    assert facts["encoder"]
