"""DeepLIFT (Rescale): exact summation to delta, Captum 0.9 equality, a prepended sink.

Batched == unbatched and the model guard: tests/test_contract.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lens_attrib import Target, attribute
from lens_attrib.tiny_models import tiny_gpt2, tiny_pythia
from tests.tl_versions import hooked_only

F64 = torch.float64
PROMPTS = ["the keys to the cabinet", "the author near the books is", "a dog"]
FIXTURE = Path(__file__).parent / "fixtures" / "deeplift_captum" / "captum_deeplift.npz"


def frozen_attention(builder, **overrides):
    """No norms and ``W_Q = W_K = 0``: a constant (uniform causal) attention pattern.

    The network from the embeddings to the logits is then affine maps (embedding sums, value
    mixing with a constant pattern, ``W_O``, ``W_in``, ``W_out``, unembedding) and the element-wise
    MLP activation, the class of networks on which the Rescale rule sums to ``f(x) − f(x₀)``
    exactly. (A norm, a softmax over input-dependent scores or a gate ``φ(g)·u`` is a
    multi-input nonlinearity that Captum's rules differentiate at ``x``, so the sum is not
    exact there.)
    """
    model = builder(dtype=F64, normalization_type=None, **overrides)
    with torch.no_grad():
        for block in model.blocks:
            for name in ("W_Q", "W_K", "b_Q", "b_K", "_W_K", "_b_K"):
                param = getattr(block.attn, name, None)
                if isinstance(param, torch.nn.Parameter):
                    param.zero_()
    return model


def word_ids(model, words):
    return [model.tokenizer.convert_tokens_to_ids(w) for w in words]


def unembed_head(model):
    return lambda x: model.unembed(x[:, None, :])[:, 0, :]


@hooked_only("needs normalization_type=None, which no transformers checkpoint expresses")
@pytest.mark.parametrize("builder", [tiny_gpt2, tiny_pythia])
@pytest.mark.parametrize(
    ("baseline", "keep_sink"), [(None, True), ("zero", False), ("mean", "special"), ("pad", True)]
)
def test_relevances_sum_to_the_output_difference_where_rescale_is_exact(
    builder, baseline, keep_sink
):
    model = frozen_attention(builder)
    target = Target(word_ids(model, ["are", "is", "sees"]), head=unembed_head(model))
    attr = attribute(
        model, PROMPTS, target, method="deeplift", baseline=baseline, keep_sink=keep_sink
    )
    delta = attr.meta["explained_value"] - attr.meta["baseline_value"]
    assert float(delta.abs().max()) > 1e-2  # a real difference to explain
    torch.testing.assert_close(attr.scores.sum(-1), delta, atol=1e-8, rtol=0)
    # the baseline value is the model's own output on the baseline embeddings
    assert float(attr.meta["completeness_gap"].abs().max()) < 1e-8


def test_the_gap_is_reported_where_rescale_is_not_exact():
    model = tiny_gpt2(dtype=F64)  # LayerNorm and softmax attention
    attr = attribute(model, PROMPTS, method="deeplift")
    gap = attr.meta["explained_value"] - attr.meta["baseline_value"] - attr.scores.sum(-1)
    torch.testing.assert_close(attr.meta["completeness_gap"], gap, atol=1e-12, rtol=0)
    assert float(gap.abs().max()) > 1e-3


def test_a_prepended_sink_is_batched_like_the_items_alone():
    model = tiny_gpt2(dtype=F64)
    ids = [model.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    ids[2] = [model.tokenizer.bos_token_id, *ids[2]]  # this one already starts with <bos>
    batched = attribute(model, ids, method="deeplift", keep_sink="special")
    assert batched.meta["prepended_sink"] == [True, True, False]
    for b, one in enumerate(ids):
        alone = attribute(model, [one], method="deeplift", keep_sink="special")
        torch.testing.assert_close(
            batched.scores[b][batched.mask[b]], alone.scores[0], rtol=1e-6, atol=1e-9
        )
        assert float(alone.scores[0, 0].abs()) > 0 or b == 2  # the first word is attributed


@hooked_only("needs normalization_type=None, which no transformers checkpoint expresses")
def test_user_hooks_act_in_both_forwards():
    model = frozen_attention(tiny_gpt2)
    target = Target(word_ids(model, ["are", "is", "sees"]), head=unembed_head(model))

    def ablate(x, hook):
        return x * 0.5

    model.blocks[0].mlp.hook_post.add_hook(ablate)
    try:
        attr = attribute(model, PROMPTS, target, method="deeplift")
        with torch.no_grad():
            logits = model(attr.token_ids, attention_mask=attr.mask.long())
    finally:
        model.reset_hooks()
    last = logits[:, -1]
    expected = last[torch.arange(3), attr.target.token_ids]
    torch.testing.assert_close(attr.meta["explained_value"], expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        attr.scores.sum(-1),
        attr.meta["explained_value"] - attr.meta["baseline_value"],
        atol=1e-8,
        rtol=0,
    )


@pytest.fixture(scope="module")
def captum_fixture():
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


def _fixture_model(captum_fixture, act_fn):
    model = tiny_gpt2(dtype=F64, act_fn=act_fn, n_layers=2)
    weights = {k[2:]: torch.tensor(v) for k, v in captum_fixture.items() if k.startswith("w.")}
    model.load_state_dict(weights, strict=False)
    return model


@hooked_only("loads the Captum fixture's weights by TransformerLens 3.9 names")
@pytest.mark.parametrize(
    ("act_fn", "activations"), [("relu", "all"), ("relu", "captum"), ("gelu_new", "captum")]
)
def test_equals_captum_deeplift(captum_fixture, act_fn, activations):
    model = _fixture_model(captum_fixture, act_fn)
    ids = torch.tensor(captum_fixture["input_ids"])
    with torch.no_grad():
        logits = model(ids)[:, -1]
    np.testing.assert_allclose(
        logits.numpy(), captum_fixture[f"captum.{act_fn}_last_logits"], atol=1e-10
    )
    attr = attribute(model, ids, method="deeplift", activations=activations)
    assert attr.target.token_ids.tolist() == captum_fixture[f"captum.{act_fn}_target"].tolist()
    np.testing.assert_allclose(
        attr.scores.numpy(), captum_fixture[f"captum.{act_fn}_scores"], atol=1e-6, rtol=0
    )
    np.testing.assert_allclose(
        attr.meta["completeness_gap"].numpy(), -captum_fixture[f"captum.{act_fn}_delta"], atol=1e-6
    )


def test_rescale_at_gelu_departs_from_captum_by_design(captum_fixture):
    model = _fixture_model(captum_fixture, "gelu_new")
    ids = torch.tensor(captum_fixture["input_ids"])
    attr = attribute(model, ids, method="deeplift")
    assert attr.meta["options"]["activations"] == "all"
    diff = np.abs(attr.scores.numpy() - captum_fixture["captum.gelu_new_scores"]).max()
    assert diff > 1e-2
