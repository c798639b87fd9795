"""Inputs, Target, Attribution, attribute() and the model guard."""

from __future__ import annotations

import pytest
import torch

from lens_attrib import (
    METHODS,
    Attribution,
    InputError,
    Target,
    TargetError,
    attribute,
    to_batch,
)
from lens_attrib.forward import resid_of
from lens_attrib.hooks.guard import model_guard, model_state_fingerprint
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama, tiny_pythia

DECODERS = [tiny_gpt2, tiny_llama, tiny_pythia]


def test_multi_token_target_error_shows_the_split(smollm2):
    with pytest.raises(TargetError) as err:
        attribute(smollm2, "The capital of France is", Target("Parisian!"))
    message = str(err.value)
    assert "tokens under this tokenizer" in message and "[" in message


def test_missing_leading_space_gets_a_hint(smollm2):
    with pytest.raises(TargetError, match="leading space"):
        attribute(smollm2, "The keys to the", Target("cabinet", foil=" house"))


def test_empty_prompt_is_an_error():
    model = tiny_gpt2()
    with pytest.raises(InputError, match="empty"):
        attribute(model, "")
    with pytest.raises(InputError, match="empty"):
        attribute(model, ["the dog", "   "])


def test_prompt_longer_than_context_is_an_error():
    model = tiny_gpt2()
    with pytest.raises(InputError, match="n_ctx"):
        attribute(model, " ".join(["dog"] * 100))


def test_float_token_tensor_is_an_error():
    with pytest.raises(InputError, match="integer"):
        to_batch(tiny_gpt2(), torch.zeros(3))


@pytest.mark.parametrize("builder", DECODERS)
def test_left_padded_batch_equals_single_items(builder):
    model = builder(dtype=torch.float64)
    prompts = ["the keys to the cabinet", "the dog", "a man near the house sees"]
    batch = to_batch(model, prompts)
    assert batch.padding_side == "left" and batch.padded
    with torch.no_grad():
        batched, _, _ = Target().evaluate(model, batch, resid_of(model, batch))
        for i, prompt in enumerate(prompts):
            single = to_batch(model, prompt)
            value, _, _ = Target().evaluate(model, single, resid_of(model, single))
            assert torch.allclose(batched[i], value[0], rtol=1e-10, atol=1e-10)


def test_encoder_batches_pad_right_and_match_single_items():
    model = tiny_bert(dtype=torch.float64)
    prompts = ["the keys to the cabinet", "the dog"]
    batch = to_batch(model, prompts)
    assert batch.padding_side == "right"
    assert batch.str_tokens[1][0] == "[CLS]" and batch.str_tokens[1][-1] == "[SEP]"
    target = Target(token="is", position=-2)
    with torch.no_grad():
        batched, _, _ = target.evaluate(model, batch, resid_of(model, batch))
        for i, prompt in enumerate(prompts):
            single = to_batch(model, prompt)
            value, _, _ = target.evaluate(model, single, resid_of(model, single))
            assert torch.allclose(batched[i], value[0], rtol=1e-10, atol=1e-10)


def test_target_defaults_to_prediction_at_last_real_token():
    model = tiny_gpt2()
    batch = to_batch(model, ["the keys to the cabinet", "the dog"])
    assert batch.last_real.tolist() == [5, 5]
    with torch.no_grad():
        logits = model(batch.tokens, **batch.model_kwargs())
        value, resolved, _ = Target().evaluate(model, batch, resid_of(model, batch))
    assert torch.equal(resolved.token_ids, logits[:, -1].argmax(-1))
    assert torch.allclose(value, logits[:, -1].max(-1).values, atol=1e-5)


def test_contrastive_target_is_a_logit_difference():
    model = tiny_gpt2()
    batch = to_batch(model, "the keys to the cabinet")
    tok = model.tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        logits = model(batch.tokens)[0, -1]
        value, _, _ = Target("are", foil="is").evaluate(model, batch, resid_of(model, batch))
    assert torch.allclose(value[0], logits[tok("are")] - logits[tok("is")], atol=1e-5)


def test_target_position_counts_real_tokens_under_padding():
    model = tiny_gpt2()
    batch = to_batch(model, ["the keys to the cabinet", "the dog"])
    # real position 1 of item 1 ("the") sits after 3 pads
    assert Target(position=1).positions(batch).tolist() == [1, 4]
    assert Target(position=[-1, 0]).positions(batch).tolist() == [5, 3]
    with pytest.raises(InputError, match="outside"):
        Target(position=7).positions(batch)


def test_html_is_escaped_and_plot_is_plotly(smollm2):
    attr = attribute(smollm2, "The <script>alert(1)</script> dog", method="grad_x_input")
    assert any("<" in t for t in attr.tokens[0])
    html = attr._repr_html_()
    assert "<script" not in html and "</script" not in html and "&lt;" in html
    fig = attr.plot()
    assert fig.data[0].type == "heatmap"


def test_attribution_helpers():
    model = tiny_gpt2()
    attr = attribute(model, ["the keys to the cabinet", "the dog"], method="grad_x_input")
    assert isinstance(attr, Attribution) and len(attr) == 2
    assert attr.scores.shape == attr.mask.shape
    assert float(attr.scores[~attr.mask].abs().sum()) == 0.0
    top = attr.top(2, item=1)
    values = attr.numpy(1)
    assert len(values) == 3 and top[0][2] == pytest.approx(float(values.max()))
    sub = attr[1]
    assert len(sub) == 1 and sub.tokens[0] == attr.tokens[1]
    assert attr.normalized().scores.abs().max() <= 1.0 + 1e-6


def test_registry_and_unknown_method():
    assert "grad_x_input" in METHODS and "gradient" in METHODS
    with pytest.raises(KeyError, match="Registered"):
        attribute(tiny_gpt2(), "the dog", method="no_such_method")


@pytest.mark.parametrize("builder", [*DECODERS, tiny_bert])
def test_guard_restores_model_after_exception(builder):
    model = builder()
    model.train()
    params = list(model.parameters())
    params[0].requires_grad_(False)
    params[1].grad = torch.ones_like(params[1])
    user_hook_handle = model.blocks[0].hook_resid_pre.register_forward_hook(lambda m, i, o: None)
    before = model_state_fingerprint(model)

    def boom(x, hook):
        raise RuntimeError("boom inside the method")

    with pytest.raises(RuntimeError, match="boom"), model_guard(model):
        model.add_hook("blocks.0.hook_resid_post", boom)
        model.blocks[1].hook_resid_pre.register_forward_hook(lambda m, i, o: None)
        with torch.enable_grad():
            batch = to_batch(model, "the dog")
            model(batch.tokens)
    assert model_state_fingerprint(model) == before
    assert model.training
    user_hook_handle.remove()


def test_nan_model_is_reported():
    model = tiny_gpt2()
    with torch.no_grad():
        model.blocks[0].attn.W_V.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="not finite"):
        attribute(model, "the dog", method="grad_x_input")
