"""Baselines: raw attention, rollout (reference product), value zeroing, random."""

from __future__ import annotations

import warnings

import pytest
import torch

from lens_attrib.methods import attribute
from lens_attrib.methods.attention import attention, rollout
from lens_attrib.methods.perturbation import random
from lens_attrib.methods.value_zeroing import value_zeroing
from lens_attrib.target import Target
from lens_attrib.tiny_models import TINY_DECODERS, tiny_bert

PROMPTS = ["the dog sees the cat", "a man likes the keys of the cabinet near the table"]
DECODERS = sorted(TINY_DECODERS)


@pytest.fixture(scope="module")
def models64():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: f(dtype=torch.float64) for k, f in TINY_DECODERS.items()}


@pytest.fixture(scope="module")
def bert64():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_bert(dtype=torch.float64)


def patterns(model, text):
    tokens = model.to_tokens(text)
    _, cache = model.run_with_cache(tokens)
    return tokens, [cache[f"blocks.{i}.attn.hook_pattern"][0] for i in range(model.cfg.n_layers)]


@pytest.mark.parametrize("arch", DECODERS)
def test_attention_and_rollout_match_reference(models64, arch):
    model = models64[arch]
    text = PROMPTS[1]
    _, pats = patterns(model, text)
    t = pats[0].shape[-1] - 1
    att = attention(model, text)
    assert torch.allclose(att.scores[0], pats[-1][:, t].mean(0), atol=1e-12)
    att0 = attention(model, text, layer=0)
    assert torch.allclose(att0.scores[0], pats[0][:, t].mean(0), atol=1e-12)
    # reference rollout: full matrix products bottom-up
    eye = torch.eye(t + 1, dtype=torch.float64)
    joint = eye
    roll = rollout(model, text)
    for layer, p in enumerate(pats):
        a = 0.5 * p.mean(0) + 0.5 * eye
        a = a / a.sum(-1, keepdim=True)
        joint = a @ joint
        assert torch.allclose(roll.layer_scores[0, layer], joint[t], atol=1e-12)
    assert torch.allclose(roll.scores[0], joint[t], atol=1e-12)


@pytest.mark.parametrize("method", ["attention", "rollout"])
@pytest.mark.parametrize("arch", DECODERS)
def test_attention_and_rollout_rows_of_a_padded_batch_are_distributions(models64, method, arch):
    batched = attribute(models64[arch], PROMPTS, Target(position=-2), method=method)
    assert not batched.mask.all()
    if method == "rollout":
        assert torch.allclose(batched.layer_scores.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    if method == "attention":
        assert torch.allclose(batched.scores.sum(-1), torch.ones(2, dtype=torch.float64))


def test_value_zeroing_token_nobody_attends_is_zero(models64):
    """Force every other query to ignore token j: zeroing its values cannot move the target."""
    model = models64["llama"]
    j = 2

    def ignore_j(pattern, hook):
        p = pattern.clone()
        keep = p[:, :, :, j].clone()
        p[:, :, :, j] = 0
        idx = torch.arange(p.shape[-1])
        p[:, :, idx == j, j] = keep[:, :, idx == j]  # j still attends to itself
        return p / p.sum(-1, keepdim=True).clamp_min(1e-300)

    free = value_zeroing(model, PROMPTS[1])
    assert free.scores[0, j] > 1e-6  # without the forced pattern the token matters
    with model.hooks(fwd_hooks=[(lambda n: n.endswith("hook_pattern"), ignore_j)]):
        forced = value_zeroing(model, PROMPTS[1])
    assert forced.scores[0, j].abs() < 1e-12
    others = forced.mask[0].clone()
    others[j] = False
    assert (forced.scores[0, others] > 0).any()


def test_encoder_baselines(bert64):
    for method in ("attention", "rollout", "value_zeroing", "random"):
        r = attribute(bert64, PROMPTS, method=method)
        assert (r.scores[~r.mask] == 0).all()
        single = attribute(bert64, PROMPTS[0], method=method)
        n = single.scores.shape[1]
        assert torch.allclose(r.scores[0, :n], single.scores[0], atol=1e-8)
    r = rollout(bert64, PROMPTS)
    assert torch.allclose(r.scores.sum(-1), torch.ones(2, dtype=torch.float64))


def test_random_is_seeded(models64):
    model = models64["gpt2"]
    a = random(model, PROMPTS, seed=1)
    b = random(model, PROMPTS, seed=1)
    c = random(model, PROMPTS, seed=2)
    assert torch.equal(a.scores, b.scores) and not torch.equal(a.scores, c.scores)
    assert ((a.scores[a.mask] > 0) & (a.scores[a.mask] < 1)).all()


def test_bad_options(models64):
    model = models64["gpt2"]
    with pytest.raises(ValueError, match="layer"):
        attention(model, PROMPTS, layer=7)
    with pytest.raises(ValueError, match="batch_size"):
        value_zeroing(model, PROMPTS, batch_size=0)
