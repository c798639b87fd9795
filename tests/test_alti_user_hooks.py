"""ALTI and ALTI-Logit follow the user's hooks: head ablations at hook_z, steering vectors.

Oracle: a head zeroed by a hook on ``attn.hook_z`` is the same model as one whose ``W_O`` rows of
that head are zero (weight surgery), so every ALTI output must be the same for both.
"""

from __future__ import annotations

import pytest
import torch

from lens_attrib import ModelError, Target, attribute
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama

F64 = torch.float64
PROMPTS = ["the keys to the cabinet", "the author near the doors is"]
LAYER, HEAD = 1, 2


def _zero_head(z, hook):
    z = z.clone()
    z[:, :, HEAD] = 0.0
    return z


def _surgery(model):
    with torch.no_grad():
        model.blocks[LAYER].attn.W_O[HEAD] = 0.0
    return model


def _parts_sum(a):
    p = a.parts
    return (
        a.scores.sum(-1)
        + p["mlp"].sum(-1)
        + p["attn_bias"].sum(-1)
        + p["embedding"]
        + p["bias"]
        + p["hooks"]
    )


@pytest.mark.parametrize("builder", [tiny_gpt2, tiny_llama])
def test_zero_head_ablation_is_followed_exactly(builder):
    target = Target(["are", "is"], foil=["is", "are"])
    hooked = builder(seed=3, dtype=F64)
    hooked.add_hook(f"blocks.{LAYER}.attn.hook_z", _zero_head)
    try:
        a = attribute(hooked, PROMPTS, target, method="alti_logit")
        alti_h = attribute(hooked, PROMPTS, target, method="alti")
    finally:
        hooked.reset_hooks()
    cut = _surgery(builder(seed=3, dtype=F64))
    b = attribute(cut, PROMPTS, target, method="alti_logit")
    alti_c = attribute(cut, PROMPTS, target, method="alti")
    assert a.head_scores is not None
    assert float(a.head_scores[:, LAYER, HEAD].abs().max()) == 0.0
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(alti_h.scores, alti_c.scores, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(_parts_sum(a), a.parts["logit"], rtol=1e-10, atol=1e-12)
    assert float(a.parts["hooks"].abs().max()) < 1e-12


def test_bert_alti_follows_a_zero_head_ablation():
    hooked = tiny_bert(seed=3, dtype=F64)
    hooked.add_hook(f"blocks.{LAYER}.attn.hook_z", _zero_head)
    try:
        a = attribute(hooked, PROMPTS, Target(position=1), method="alti")
    finally:
        hooked.reset_hooks()
    b = attribute(
        _surgery(tiny_bert(seed=3, dtype=F64)), PROMPTS, Target(position=1), method="alti"
    )
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-10, atol=1e-12)


def test_steering_changes_the_decomposition_exactly_as_the_logit():
    target = Target(["are", "is"], foil=["is", "are"])
    model = tiny_gpt2(seed=3, dtype=F64)
    clean = attribute(model, PROMPTS, target, method="alti_logit")
    steer = torch.randn(model.cfg.d_model, dtype=F64, generator=torch.Generator().manual_seed(0))
    model.add_hook("blocks.0.hook_resid_post", lambda x, hook: x + steer)
    try:
        steered = attribute(model, PROMPTS, target, method="alti_logit")
    finally:
        model.reset_hooks()
    assert not torch.allclose(steered.parts["logit"], clean.parts["logit"])
    torch.testing.assert_close(_parts_sum(steered), steered.parts["logit"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        _parts_sum(steered) - _parts_sum(clean),
        steered.parts["logit"] - clean.parts["logit"],
        rtol=1e-10,
        atol=1e-12,
    )
    assert float(steered.parts["hooks"].abs().min()) > 1e-6


def test_a_hook_alti_cannot_follow_is_named():
    model = tiny_gpt2(seed=3, dtype=F64)
    model.add_hook(f"blocks.{LAYER}.attn.hook_z", lambda z, hook: z + 1.0)
    try:
        with pytest.raises(ModelError, match=f"blocks.{LAYER}.attn.hook_z"):
            attribute(model, PROMPTS, method="alti_logit")
    finally:
        model.reset_hooks()
