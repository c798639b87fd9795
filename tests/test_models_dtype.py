"""``load_model(..., dtype=...)`` builds the bundled models in every supported dtype.

Oracles: every parameter and floating buffer is in the requested dtype; each half-precision
weight is the float32 weight rounded once (equality with ``w32.to(dtype)``); the half-precision
forward agrees with float32 (same next token, logits close); float64 MiniLM matches transformers'
float64 BERT to 1e-10. The float64 SmolLM2 check against transformers is in test_models.py.
"""

from __future__ import annotations

import pytest
import torch

from lens_attrib import ModelError, load_model
from lens_attrib.backend import arch_of, final_residual
from tests.tl_versions import BRIDGE, hooked_only

HALF = [torch.bfloat16, torch.float16]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=HALF, ids=["bfloat16", "float16"])
def smollm2_half(request):
    return load_model("smollm2-135m", dtype=request.param)


def _check_dtype_throughout(model, dtype):
    assert model.cfg.dtype == dtype
    assert {p.dtype for p in model.parameters()} == {dtype}
    floating = {b.dtype for n, b in model.named_buffers() if b.is_floating_point()}
    if BRIDGE and dtype != torch.float64:
        # a bridge runs Hugging Face's rotary module, whose inv_freq buffers transformers keeps
        # in float32 whatever the model's dtype (its angles are float32, then cast)
        floating = {
            b.dtype
            for n, b in model.named_buffers()
            if b.is_floating_point() and not n.endswith("inv_freq")
        }
    # a BERT bridge holds no floating buffer at all
    assert floating <= {dtype} if BRIDGE else floating == {dtype}


def test_half_smollm2_is_half_throughout(smollm2_half):
    _check_dtype_throughout(smollm2_half, smollm2_half.cfg.dtype)


def test_half_weights_are_float32_weights_rounded_once(smollm2, smollm2_half):
    dtype = smollm2_half.cfg.dtype
    for (name, half), (name32, full) in zip(
        smollm2_half.named_parameters(), smollm2.named_parameters(), strict=True
    ):
        assert name == name32
        assert torch.equal(half, full.to(dtype)), name


def test_half_smollm2_forward_is_close_to_float32(smollm2, smollm2_half):
    ids = smollm2.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        full = smollm2(ids)[0, -1]
        half = smollm2_half(ids)[0, -1]
    assert half.dtype == smollm2_half.cfg.dtype
    assert int(half.argmax()) == int(full.argmax())
    spread = float(full.max() - full.min())
    assert float((half.float() - full).abs().max()) <= 0.05 * spread


@hooked_only(
    "load_model unties SmolLM2's unembedding into a parameter of its own in HookedTransformer's "
    "layout; a bridge runs the Hugging Face module, whose lm_head is tied to the embedding"
)
def test_smollm2_tied_unembedding_is_an_independent_parameter(smollm2_half):
    """Tied values in memory of their own, as in plain TransformerLens (test_tl_operations.py)."""
    model = smollm2_half
    assert torch.equal(model.unembed.W_U, model.embed.W_E.T)
    assert model.unembed.W_U.untyped_storage().data_ptr() != (
        model.embed.W_E.untyped_storage().data_ptr()
    )


def test_minilm_float64_matches_bert_float64():
    from transformers import AutoTokenizer, BertModel

    from lens_attrib.models import minilm_dir

    minilm = load_model("minilm-l6", dtype=torch.float64)
    _check_dtype_throughout(minilm, torch.float64)
    bert = BertModel.from_pretrained(minilm_dir(), add_pooling_layer=False, dtype=torch.float64)
    tok = AutoTokenizer.from_pretrained(minilm_dir())
    enc = tok(["A man is playing a guitar.", "Paris is lovely"], return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = bert.eval()(**enc).last_hidden_state
        # the final residual through the backend (HookedEncoder.encoder_output on 3.9)
        ours = final_residual(
            minilm, arch_of(minilm), enc.input_ids, enc.attention_mask.bool(), padded=True
        )
    real = enc.attention_mask.bool()
    assert float((ref - ours)[real].abs().max()) <= 1e-10


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(ModelError, match="dtype"):
        load_model("minilm-l6", dtype=torch.int8)
