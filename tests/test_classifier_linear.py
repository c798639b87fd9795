"""Trainable linear heads (lens_attrib.classifiers.linear) and the classifier cache, on tiny
models: training reaches a separable toy task, save → load is bit-exact, and Target(head=h)
explains exactly h(final residual at the feature position)."""

import itertools
import random

import pytest
import torch

from lens_attrib import Target, attribute, to_batch
from lens_attrib.classifiers import ClassifierInfo, train_or_load
from lens_attrib.classifiers.linear import (
    HEAD_FIT,
    LinearHead,
    evaluate_head,
    feature_position,
    fit_head,
    head_norm,
    load_head,
    residual_features,
    save_head,
)
from lens_attrib.forward import no_grad_context, resid_of
from lens_attrib.tiny_models import tiny_bert, tiny_llama

POSITIVE = ("good", "great")
NEGATIVE = ("bad", "terrible")


def toy_sentiment(seed: int = 0) -> tuple[list[str], torch.Tensor]:
    """Sentences whose label is the sentiment word (positive = 1); shuffled, seeded."""
    rows = []
    for subject, verb, word in itertools.product(
        ("the movie", "this film", "the book", "that house", "a car", "the dog"),
        ("is", "was", "is very", "was not"),
        POSITIVE + NEGATIVE,
    ):
        rows.append((f"{subject} {verb} {word}", int(word in POSITIVE)))
    random.Random(seed).shuffle(rows)
    return [r[0] for r in rows], torch.tensor([r[1] for r in rows])


@pytest.fixture(scope="module", params=["llama", "bert"])
def model(request):
    torch.manual_seed(0)
    return tiny_llama() if request.param == "llama" else tiny_bert()


@pytest.fixture(scope="module")
def trained(model):
    texts, labels = toy_sentiment()
    cut = int(0.7 * len(texts))
    feats = residual_features(model, texts, batch_size=16)
    head, info = fit_head(model, feats[:cut], labels[:cut], n_out=2, seed=0, weight_decays=(1e-3,))
    return head, info, texts, labels, feats, cut


def test_separable_toy_task(trained):
    head, info, _, labels, feats, cut = trained
    assert evaluate_head(head, feats[cut:], labels[cut:], regression=False) >= 0.95
    assert info["train_score"] >= 0.95


def test_features_are_the_residual_at_the_feature_position(model):
    texts = ["the movie is good", "a car was not very bad"]
    feats = residual_features(model, texts, batch_size=1)
    batch = to_batch(model, texts)
    with no_grad_context(model):
        resid = resid_of(model, batch)
    position = Target(position=feature_position(model)).positions(batch)
    expected = resid[torch.arange(2), position]
    torch.testing.assert_close(feats, expected, rtol=1e-5, atol=1e-6)


def test_save_load_round_trip_is_bit_exact(model, trained, tmp_path):
    head, _, _, _, _, _ = trained
    meta = {"data_hash": "abc", "seed": 3, "n_train": 67, "dev_score": 0.5}
    save_head(head, tmp_path, meta)
    loaded, loaded_meta = load_head(tmp_path, model)
    for key, value in head.linear.state_dict().items():
        other = loaded.linear.state_dict()[key]
        assert other.dtype == value.dtype and torch.equal(other, value)
    assert {k: loaded_meta[k] for k in meta} == meta
    assert loaded_meta["norm"] == (not model.cfg.original_architecture.startswith("Bert"))
    x = torch.randn(5, model.cfg.d_model)
    assert torch.equal(loaded(x), head(x))


def test_target_explains_the_head_output(model, trained, tmp_path):
    head, _, texts, _, _, _ = trained
    save_head(head, tmp_path, {})
    loaded, _ = load_head(tmp_path, model)
    info = ClassifierInfo("toy", ("negative", "positive"), False, feature_position(model))
    prompts = texts[:3]
    attr = attribute(model, prompts, info.target(loaded), method="grad_x_input")
    batch = to_batch(model, prompts)
    with no_grad_context(model):
        resid = resid_of(model, batch)
        pos = batch.last_real if feature_position(model) is None else batch.first_real
        out = loaded(resid[torch.arange(3), pos])
    expected = out[torch.arange(3), out.argmax(-1)]
    explained = torch.as_tensor([float(v) for v in attr.meta["explained_value"]])
    torch.testing.assert_close(explained, expected.double().float(), rtol=1e-5, atol=1e-6)


def test_head_uses_the_models_own_final_norm(model, trained):
    head, _, _, _, _, _ = trained
    if feature_position(model) == 0:
        assert head.norm is None
    else:
        assert head.norm is model.ln_final
    assert set(head.state_dict()) == {"linear.weight", "linear.bias"}


def test_regression_head_fits_a_linear_target(model):
    texts, labels = toy_sentiment(1)
    feats = residual_features(model, texts, batch_size=32)
    y = 2.0 * labels.double() + 1.0
    _head, info = fit_head(model, feats, y, n_out=1, regression=True, weight_decays=(1e-4,))
    assert info["train_score"] >= 0.9
    with pytest.raises(ValueError, match="one output"):
        fit_head(model, feats, y, n_out=2, regression=True, weight_decays=(1e-4,))


def test_train_or_load_trains_once(model, tmp_path):
    texts, labels = toy_sentiment(2)
    args = (texts[:40], labels[:40], texts[40:], labels[40:])
    head, meta = train_or_load(model, tmp_path, *args, n_out=2, seed=1, weight_decays=(1e-3,))
    assert meta["n_train"] == 40 and meta["seed"] == 1 and len(meta["data_hash"]) == 64
    assert 0.0 <= meta["dev_score"] <= 1.0
    again, meta2 = train_or_load(model, tmp_path, *args, n_out=2, seed=1, weight_decays=(1e-3,))
    assert meta2 == meta
    assert torch.equal(again.linear.weight, head.linear.weight)


def test_load_head_refuses_another_model(trained, tmp_path):
    head, _, _, _, _, _ = trained
    save_head(head, tmp_path, {})
    other = tiny_llama(d_model=16, d_head=4)
    with pytest.raises(ValueError, match="d_model"):
        load_head(tmp_path, other)


def test_alti_logit_reads_a_linear_head_through_ln_final():
    """ALTI-Logit with a LinearHead whose map is the unembedding equals the default head's."""
    model = tiny_llama()
    head = LinearHead(model.cfg.d_model, model.cfg.d_vocab, head_norm(model))
    with torch.no_grad():
        head.linear.weight.copy_(model.unembed.W_U.T)
        head.linear.bias.copy_(model.unembed.b_U)
    prompts = ["the keys to the cabinet", "the author near the doors is"]
    ours = attribute(model, prompts, Target(head=head, token=7), method="alti_logit")
    default = attribute(model, prompts, Target(token=7), method="alti_logit")
    torch.testing.assert_close(ours.scores, default.scores, rtol=1e-5, atol=1e-6)


def test_constant_features_get_zero_weight():
    """A feature constant over the training set (as in MiniLM's final LayerNorm, weights ~1e-9)
    gets weight 0, not ``A / σ`` with ``σ ≈ 0``; the fit on the other features is unchanged."""
    torch.manual_seed(0)
    model = tiny_bert()
    texts, labels = toy_sentiment()
    feats = residual_features(model, texts, batch_size=32).double()
    d = feats.shape[1]
    frozen = feats.clone()
    frozen[:, 0] = 0.25 + 1e-9 * torch.randn(len(feats), dtype=feats.dtype)  # ≈ constant
    frozen[:, 1] = -0.5  # exactly constant
    model64 = model.to(torch.float64)
    head, info = fit_head(model64, frozen, labels, n_out=2, weight_decays=(1e-3,))
    weight = head.linear.weight
    assert torch.equal(weight[:, :2], torch.zeros_like(weight[:, :2]))
    assert info["constant_features"] == 2 and info["fit"] == HEAD_FIT
    assert weight.abs().max() < 1e3
    zeroed = frozen.clone()
    zeroed[:, :2] = 0.0  # the same information, the constant columns at 0
    reference, _ = fit_head(model64, zeroed, labels, n_out=2, weight_decays=(1e-3,))
    torch.testing.assert_close(head(frozen), reference(zeroed), rtol=1e-9, atol=1e-9)
    assert evaluate_head(head, frozen, labels, regression=False) >= 0.95
    assert d > 2


def test_train_or_load_refits_heads_of_an_earlier_recipe(model, tmp_path):
    texts, labels = toy_sentiment(2)
    args = (texts[:40], labels[:40], texts[40:], labels[40:])
    head, meta = train_or_load(model, tmp_path, *args, n_out=2, seed=1, weight_decays=(1e-3,))
    save_head(head, tmp_path, {**meta, "fit": 1})  # as saved by the earlier recipe
    again, meta2 = train_or_load(model, tmp_path, *args, n_out=2, seed=1, weight_decays=(1e-3,))
    assert meta2["fit"] == HEAD_FIT
    assert torch.equal(again.linear.weight, head.linear.weight)


def test_classifier_digest_follows_the_weights_not_the_metadata():
    """The key of a classifier's journaled units: equal for the same weights whatever the
    training metadata says (a retrain on a fresh machine records other timings), different
    when one weight moves by one ulp or the model is in another dtype."""
    import copy

    from lens_attrib.classifiers import Classifier

    torch.manual_seed(0)
    model = tiny_llama()
    head = LinearHead(model.cfg.d_model, 2)
    info = ClassifierInfo("toy", ("neg", "pos"), False, None, {"train_seconds": 1.0})
    digest = Classifier(model, head, info).digest()
    later = ClassifierInfo("toy", ("neg", "pos"), False, None, {"train_seconds": 7.5})
    assert Classifier(copy.deepcopy(model), copy.deepcopy(head), later).digest() == digest
    moved = copy.deepcopy(head)
    with torch.no_grad():
        w = moved.linear.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf"), dtype=w.dtype))
    assert Classifier(model, moved, info).digest() != digest
    other = torch.float64 if next(model.parameters()).dtype == torch.float32 else torch.float32
    assert Classifier(copy.deepcopy(model).to(other), head, info).digest() != digest
