"""Token relevances aggregated to words and character spans (lens_attrib.aggregate)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lens_attrib import Attribution, Target, attribute
from lens_attrib.aggregate import REDUCTIONS
from lens_attrib.tiny_models import tiny_llama, zero_biases

TEXT = "the cat sat on the mat"
SMOL_TEXT = "The capital of Tamara, isn't it?\n\nYes"


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zero_biases(tiny_llama(dtype=torch.float64))


def _attr(model, inputs, method: str, **kw) -> Attribution:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attribute(model, inputs, method=method, **kw)


def test_tiny_tokenizer_words_need_offsets_and_reconstruct_the_text(tiny):
    attr = _attr(tiny, [TEXT, "a dog ran"], "grad_x_input")
    words = attr.to_words(tokenizer=tiny.tokenizer, text=[TEXT.upper(), "A dog ran"])
    # word-level pieces carry no spaces: the offsets restore them (text as given, unlowercased)
    assert words.tokens[0] == ["<bos>", "THE", " CAT", " SAT", " ON", " THE", " MAT"]
    assert "".join(words.tokens[1][1:]) == "A dog ran"
    assert words.meta["unit_chars"][0][0] is None  # the special token has no text
    assert torch.equal(words.scores[0, :7], attr.scores[0][attr.mask[0]])  # one token per word
    # with left padding, the second item's words start at 0 and its padding is masked
    assert words.mask[1].tolist() == [True] * 4 + [False] * 3
    assert words.top(2, item=1)[0][1] in words.tokens[1]


def test_smollm2_subwords_merge_by_leading_space_and_by_offsets(smollm2):
    attr = _attr(smollm2, SMOL_TEXT, "grad_x_input")
    assert attr.tokens[0][0] == "<|endoftext|>"  # the start token: a word of its own
    assert attr.tokens[0][4:6] == [" Tam", "ara"]  # the split this test is about
    expected = [
        "<|endoftext|>",
        "The",
        " capital",
        " of",
        " Tamara,",
        " isn't",
        " it?",
        "\n",
        "\n",
        "Yes",
    ]
    by_space = attr.to_words()
    by_offsets = attr.to_words(tokenizer=smollm2.tokenizer, text=SMOL_TEXT)
    assert by_space.tokens[0] == expected
    assert by_offsets.tokens[0] == expected
    assert "".join(by_space.tokens[0][1:]) == SMOL_TEXT
    assert by_space.meta["unit_tokens"] == by_offsets.meta["unit_tokens"]
    real = attr.scores[0][attr.mask[0]].double()
    tamara = [4, 5, 6]  # " Tam", "ara", ","
    assert by_space.meta["unit_tokens"][0][4] == tamara
    for reduce in REDUCTIONS:
        got = float(attr.to_words(reduce).scores[0, 4])
        piece = real[tamara]
        want = {
            "sum": piece.sum(),
            "mean": piece.mean(),
            "absmax": piece[int(piece.abs().argmax())],
        }[reduce]
        assert got == pytest.approx(float(want), rel=1e-6, abs=1e-6 * float(piece.abs().sum()))
    # sums conserve the total: |Σ_words − Σ_tokens| within float32 rounding of the reordering
    total_words = float(by_space.scores[0].double().sum())
    bound = 4 * real.numel() * torch.finfo(torch.float32).eps * float(real.abs().sum())
    assert abs(total_words - float(real.sum())) <= bound
    # the explained token (last one, "Yes") maps to the last word
    assert int(by_space.target.positions[0]) == len(expected) - 1
    assert by_space.n_context(0) == len(expected)


@pytest.mark.parametrize("method", ["attnlrp", "lrp", "grad_x_input"])
def test_sums_over_spans_conserve_the_explained_value(tiny, method):
    """With zero biases LRP is conservative (Σ tokens = f, as tests/test_lrp.py checks); AttnLRP
    reports its softmax gap in ``relevance_sum``; word and span sums keep the token total."""
    attr = _attr(tiny, TEXT, method)
    tokens_total = float(attr.scores[0].sum())
    if method == "lrp":
        f = float(attr.meta["explained_value"][0])
        assert tokens_total == pytest.approx(f, rel=1e-6)
    if "relevance_sum" in attr.meta:
        assert tokens_total == pytest.approx(float(attr.meta["relevance_sum"][0]), rel=1e-12)
    spans = attr.to_spans([(0, 7), (8, 22)], text=TEXT, tokenizer=tiny.tokenizer)
    assert spans.tokens[0] == ["the cat", "sat on the mat"]
    assert spans.meta["unit_tokens"][0] == [[1, 2], [3, 4, 5, 6]]  # <bos> in no span: left out
    real = attr.scores[0][attr.mask[0]]
    assert float(spans.scores[0].sum() + real[0]) == pytest.approx(tokens_total, rel=1e-12)
    words = attr.to_words(tokenizer=tiny.tokenizer)
    assert float(words.scores[0].sum()) == pytest.approx(tokens_total, rel=1e-12, abs=1e-15)


def test_layer_and_head_token_scores_aggregate_like_scores(tiny):
    logat = _attr(tiny, [TEXT, "a dog ran"], "logat")
    spans = logat.to_spans([[(0, 7), (8, 22)], [(0, 5), (6, 9)]], tokenizer=tiny.tokenizer)
    real = logat.layer_scores[1][:, logat.mask[1]]  # [layer, real pos]
    assert torch.allclose(spans.layer_scores[1, :, 0], real[:, 1:3].sum(-1), rtol=1e-12, atol=0)
    assert torch.allclose(spans.layer_scores[1, :, 1], real[:, 3:].sum(-1), rtol=1e-12, atol=0)
    lrp = _attr(tiny, TEXT, "attnlrp", heads=True)
    mean = lrp.to_words("mean", tokenizer=tiny.tokenizer)
    assert torch.equal(mean.head_scores, lrp.head_scores)
    assert mean.head_token_scores.shape[-1] == len(mean.tokens[0])
    assert mean.parts == {} and mean.meta["aggregation"]["dropped_parts"] == ["head_dim_relevance"]


def test_word_attributions_plot_table_and_save(tiny, tmp_path):
    gen = _attr(tiny, TEXT, "grad_x_input", target=Target(generate=2))
    words = gen.to_words(tokenizer=tiny.tokenizer)
    assert len(words) == len(gen)
    assert words.plot(item=1).data[0].x is not None
    df = words.to_pandas()
    assert set(df["token"]) <= set(words.tokens[0]) and set(df["step"]) == {0, 1}
    loaded = Attribution.load(words.save(tmp_path / "w.safetensors"))
    assert loaded.meta["unit_chars"] == words.meta["unit_chars"]
    assert torch.equal(loaded.scores, words.scores)
    with pytest.raises(ValueError, match="already aggregated"):
        words.to_words()


def test_bad_aggregation_requests_are_clear_errors(tiny):
    attr = _attr(tiny, TEXT, "grad_x_input")
    kw = {"tokenizer": tiny.tokenizer}
    with pytest.raises(ValueError, match="reduce must be one of"):
        attr.to_words("max", **kw)
    with pytest.raises(ValueError, match="overlap or are out of order"):
        attr.to_spans([(0, 7), (4, 10)], **kw)
    with pytest.raises(ValueError, match="not inside the text"):
        attr.to_spans([(0, 99)], **kw)
    with pytest.raises(ValueError, match="hold no token"):
        attr.to_spans([(3, 4)], **kw)
    with pytest.raises(ValueError, match="differ from"):
        attr.to_words(tokenizer=tiny.tokenizer, text="the cat sat")
    with pytest.raises(ValueError, match="concatenate to"):
        attr.to_words(text=TEXT)  # word-level pieces lack spaces: the rule needs the offsets
    assert np.isfinite(attr.to_words(**kw).scores.numpy()).all()
