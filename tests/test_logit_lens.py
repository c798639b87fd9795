"""embed_norm, LogAt and NormXLogit against independent hand computations (run_with_cache)."""

from __future__ import annotations

import pytest
import torch

from lens_attrib import Target
from lens_attrib.hooks.guard import model_guard
from lens_attrib.inputs import to_batch
from lens_attrib.methods.registry import attribute
from lens_attrib.target import TargetError
from lens_attrib.tiny_models import TINY_DECODERS, tiny_bert, tiny_gpt2
from tests.tl_versions import BRIDGE

PROMPTS = ["the dog near the cabinets sees", "the keys to the cabinet", "a man"]
F64 = dict(rtol=1e-10, atol=1e-10)


def _cache(model, prompt):
    with torch.no_grad(), model_guard(model):
        tokens = to_batch(model, prompt).tokens
        logits, cache = model.run_with_cache(tokens)
    return tokens, logits, cache


def _hand_logat(model, cache, token_ids):
    """[layer, pos] reading of model.unembed(model.ln_final(resid_post))[..., token]."""
    rows = []
    for layer in range(model.cfg.n_layers):
        resid = cache[f"blocks.{layer}.hook_resid_post"]
        with torch.no_grad():
            logits = model.unembed(model.ln_final(resid))[0]
        rows.append(
            logits[:, token_ids[0]] - (logits[:, token_ids[1]] if len(token_ids) > 1 else 0)
        )
    return torch.stack(rows)


@pytest.mark.parametrize("arch", sorted(TINY_DECODERS))
def test_logat_and_normxlogit_equal_hand_computation(arch):
    model = TINY_DECODERS[arch](dtype=torch.float64)
    prompt = PROMPTS[0]
    tokens, logits, cache = _cache(model, prompt)
    pred = int(logits[0, -1].argmax())
    hand = _hand_logat(model, cache, [pred])
    a = attribute(model, prompt, method="logat")
    assert a.layer_scores.shape == (1, model.cfg.n_layers, tokens.shape[1])
    torch.testing.assert_close(a.layer_scores[0], hand, **F64)
    torch.testing.assert_close(a.scores[0], hand[-1], **F64)
    assert int(a.target.token_ids[0]) == pred
    # the final layer at the target position is the model's own logit
    torch.testing.assert_close(a.scores[0, -1], logits[0, -1, pred], **F64)

    emb = cache["hook_embed"] + (cache["hook_pos_embed"] if arch == "gpt2" else 0)
    norm = emb[0].norm(dim=-1)
    n = attribute(model, prompt, method="normxlogit")
    torch.testing.assert_close(n.layer_scores[0], norm[None, :] * hand, **F64)
    torch.testing.assert_close(n.scores[0], norm * hand[-1], **F64)
    torch.testing.assert_close(n.parts["embed_norm"][0], norm, **F64)
    e = attribute(model, prompt, method="embed_norm")
    torch.testing.assert_close(e.scores[0], norm, **F64)
    p = attribute(model, prompt, method="embed_norm", embeddings="partial")
    torch.testing.assert_close(p.scores[0], cache["hook_embed"][0].norm(dim=-1), **F64)
    if arch == "gpt2":  # learned positions: the two options differ
        assert not torch.allclose(p.scores, e.scores)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_label_and_contrastive_readings(arch):
    model = TINY_DECODERS[arch](dtype=torch.float64)
    prompt = PROMPTS[1]
    _, _, cache = _cache(model, prompt)
    tok, foil = model.tokenizer.convert_tokens_to_ids(["is", "are"])
    a = attribute(model, prompt, Target(token="is"), method="logat")
    torch.testing.assert_close(a.layer_scores[0], _hand_logat(model, cache, [tok]), **F64)
    c = attribute(model, prompt, Target(token="is", foil="are"), method="logat")
    torch.testing.assert_close(c.layer_scores[0], _hand_logat(model, cache, [tok, foil]), **F64)
    # prediction path (keeps residuals) and label path (reduces in hooks) agree
    pred = attribute(model, prompt, method="logat")
    given = attribute(model, prompt, Target(token=int(pred.target.token_ids[0])), method="logat")
    torch.testing.assert_close(given.layer_scores, pred.layer_scores, **F64)
    # full logits when asked, equal to the hand lens at every layer
    full = attribute(model, prompt, Target(token="is"), method="logat", full_logits=True)
    layer_logits = full.parts["layer_logits"][0]
    assert layer_logits.shape[-1] == model.cfg.d_vocab_out
    for layer in range(model.cfg.n_layers):
        with torch.no_grad():
            ref = model.unembed(model.ln_final(cache[f"blocks.{layer}.hook_resid_post"]))[0]
        torch.testing.assert_close(layer_logits[layer], ref, **F64)
    torch.testing.assert_close(full.layer_scores, a.layer_scores, **F64)


def test_the_prediction_target_under_inference_mode_gives_plain_results():
    model = tiny_gpt2()
    with torch.inference_mode():
        for method in ("logat", "normxlogit", "embed_norm"):
            a = attribute(model, PROMPTS, method=method)
            assert not a.scores.requires_grad


def test_regression_and_class_head():
    model = tiny_gpt2(dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(model.cfg.d_model, 3, generator=gen, dtype=torch.float64)
    reg_w = torch.randn(model.cfg.d_model, 1, generator=gen, dtype=torch.float64)
    prompt = PROMPTS[0]
    _, _, cache = _cache(model, prompt)

    cls = attribute(
        model, prompt, Target(head=lambda x: x @ weight, token=2, foil=0), method="logat"
    )
    reg = attribute(
        model, prompt, Target(head=lambda x: x @ reg_w, regression=True), method="logat"
    )
    for layer in range(model.cfg.n_layers):
        resid = cache[f"blocks.{layer}.hook_resid_post"][0]
        out = resid @ weight
        torch.testing.assert_close(cls.layer_scores[0, layer], out[:, 2] - out[:, 0], **F64)
        r = (resid @ reg_w)[:, 0]
        torch.testing.assert_close(reg.layer_scores[0, layer], (r - r[-1]).abs(), **F64)
    assert reg.scores[0, -1] == 0


def mlm_logits(model, resid):
    """The MLM head on ``resid``: HookedEncoder's ``mlm_head`` + ``unembed``; a bridge's
    Hugging Face ``cls`` head (its ``mlm_head`` attribute is only the transform's dense)."""
    if BRIDGE:
        return model.original_model.cls(resid)
    return model.unembed(model.mlm_head(resid))


def test_encoder_mlm_head_and_hook_full_embed():
    model = tiny_bert(dtype=torch.float64)
    prompt = "the dog sees a cat"
    with torch.no_grad(), model_guard(model):
        batch = to_batch(model, prompt)
        _, cache = model.run_with_cache(batch.tokens)
    tok = model.tokenizer.convert_tokens_to_ids("dog")
    a = attribute(model, prompt, Target(token="dog", position=2), method="normxlogit")
    norm = cache["hook_full_embed"][0].norm(dim=-1)
    for layer in range(model.cfg.n_layers):
        resid = cache[f"blocks.{layer}.hook_normalized_resid_post"]
        with torch.no_grad():
            ref = mlm_logits(model, resid)[0, :, tok]
        torch.testing.assert_close(a.layer_scores[0, layer], norm * ref, **F64)
    with torch.no_grad():
        final = model(batch.tokens)[0, 2, tok]
    torch.testing.assert_close(a.parts["logat"][0, 2], final, **F64)
    e = attribute(model, prompt, method="embed_norm", embeddings="partial")
    torch.testing.assert_close(e.scores[0], cache["embed.hook_embed"][0].norm(dim=-1), **F64)


def test_minilm_default_head_raises_and_class_head_works(minilm):
    with pytest.raises(TargetError, match="no masked-LM head"):
        attribute(minilm, "a sentence", method="logat")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(minilm.cfg.d_model, 2, generator=gen)
    a = attribute(
        minilm,
        ["a good movie", "bad"],
        Target(head=lambda x: x @ weight, position=0),
        method="normxlogit",
    )
    assert a.layer_scores.shape[:2] == (2, minilm.cfg.n_layers)
    assert torch.isfinite(a.layer_scores).all()
    e = attribute(minilm, "a sentence", method="embed_norm")  # needs no head
    assert e.meta["no_label"] and (e.scores[0][e.mask[0]] > 0).all()


def test_smollm2_final_layer_is_the_models_logit(smollm2):
    prompt = "The keys to the cabinet"
    with torch.inference_mode():
        a = attribute(smollm2, prompt, Target(token=" is", foil=" are"), method="normxlogit")
        b = to_batch(smollm2, prompt)
        logits = smollm2(b.tokens)[0, -1]
    ids = [smollm2.tokenizer.convert_tokens_to_ids(t) for t in ("Ġis", "Ġare")]
    torch.testing.assert_close(
        a.parts["logat"][0, -1], logits[ids[0]] - logits[ids[1]], rtol=1e-4, atol=1e-4
    )
    assert a.layer_scores.shape == (1, 30, b.length)
    assert all(p.grad is None for p in smollm2.parameters())
