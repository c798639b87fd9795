"""GlobEnc and DecompX (methods/decomp.py): conservation, the authors' outputs, batching, guard.

The authors' outputs on all-MiniLM-L6-v2 are in ``tests/fixtures/decompx_official`` (see its
README): DecompX with BERT's pooler + a fixed random classifier, and without a head (ℓ2 norms),
in both bias conventions; GlobEnc's per-layer norms and its rolled-out matrix. They were computed
in float32, so they are compared relative to each array's largest |value| at 1e-5.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lens_attrib import METHODS, ModelError, Target, TargetError, attribute, load_model
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.methods.alti import alti_mixing_matrices
from lens_attrib.methods.decomp import decompx_layers
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2
from tests.tl_versions import hooked_only

F64 = torch.float64
FIXTURE = Path(__file__).parent / "fixtures" / "decompx_official" / "outputs.npz"
PROMPTS = ["the keys to the cabinet are", "the dog", "a good film is not very bad"]
OFFICIAL = 1e-5  # float32 reference, relative to the array's largest |value|


@pytest.fixture(scope="module")
def bert():
    return tiny_bert(dtype=F64)


@pytest.fixture(scope="module")
def minilm64():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("minilm-l6", dtype=F64)


@pytest.fixture(scope="module")
def official() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


def _linear(d_model: int, n_out: int = 3, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(d_model, n_out).double()


def _fixture_inputs(official):
    ids = torch.tensor(official["input_ids"])
    lengths = torch.tensor(official["lengths"])
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}


def _pooler_head(model, official) -> torch.nn.Sequential:
    """BERT's pooler (MiniLM's own weights) + the fixture's classifier, as the authors' model."""
    pooler, classifier = torch.nn.Linear(384, 384).double(), torch.nn.Linear(384, 2).double()
    with torch.no_grad():
        pooler.weight.copy_(model.pooler.W.T)
        pooler.bias.copy_(model.pooler.b)
        classifier.weight.copy_(torch.from_numpy(official["classifier_weight"]))
        classifier.bias.copy_(torch.from_numpy(official["classifier_bias"]))
    return torch.nn.Sequential(pooler, torch.nn.Tanh(), classifier)


def _close(actual: np.ndarray, expected: np.ndarray, rel: float) -> None:
    scale = float(np.abs(expected).max())
    assert scale > 0
    err = float(np.abs(actual - expected).max())
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} × {scale:.3g}"


def test_the_methods_are_registered_for_encoders_only():
    for name, instead in (("decompx", "alti_logit"), ("globenc", "alti")):
        spec = METHODS[name]
        assert spec.encoder and not spec.decoder and spec.instead == instead
        with pytest.raises(ModelError, match=repr(instead)):
            attribute(tiny_gpt2(), "the dog", method=name)
    assert METHODS["globenc"].per_layer and METHODS["alti"].per_layer


@hooked_only("the oracle reads HookedEncoder API (run_with_cache masks, encoder_output)")
@pytest.mark.parametrize("biases", ["absdot", "separate"])
@pytest.mark.parametrize("which", ["tiny", "minilm"])
def test_decompx_vectors_sum_to_every_layer_output(bert, minilm64, which, biases):
    model = bert if which == "tiny" else minilm64
    batch, items = decompx_layers(model, PROMPTS, biases=biases)
    _, cache = model.run_with_cache(batch.tokens, one_zero_attention_mask=batch.mask.long())
    for b, item in enumerate(items):
        assert len(item.layers) == batch.arch.n_layers
        for layer, vectors in enumerate(item.layers):
            real = cache[f"blocks.{layer}.hook_normalized_resid_post"][b, item.idx]
            n = len(item.idx)
            assert vectors.shape == (n, n + 1, batch.arch.d_model)
            err = float((vectors.sum(1) - real).abs().max())
            assert err <= 1e-8 * max(1.0, float(real.abs().max())), (layer, err)
            bias_slot = vectors[:, -1].abs().max()
            assert (bias_slot == 0) if biases == "absdot" else (bias_slot > 1e-3)


@hooked_only("the oracle reads HookedEncoder API (run_with_cache masks, encoder_output)")
@pytest.mark.parametrize("biases", ["absdot", "separate"])
@pytest.mark.parametrize("which", ["tiny", "minilm"])
def test_decompx_class_scores_sum_to_the_logit_minus_the_bias_part(bert, minilm64, which, biases):
    model = bert if which == "tiny" else minilm64
    head = _linear(model.cfg.d_model)
    target = Target(2, foil=0, head=head, position=0)
    attr = attribute(model, PROMPTS, target, method="decompx", biases=biases)
    resid = model.encoder_output(attr.token_ids, None, attr.mask.long())
    logits = head(resid[:, 0])
    expected = logits[:, 2] - logits[:, 0]
    torch.testing.assert_close(attr.parts["logit"], expected.detach(), rtol=0, atol=1e-10)
    total = attr.scores.sum(-1) + attr.parts["bias"]
    torch.testing.assert_close(total, expected.detach(), rtol=0, atol=1e-8)
    if biases == "absdot":
        assert float(attr.parts["bias"].abs().max()) == 0.0
    else:
        assert float(attr.parts["bias"].abs().min()) > 1e-4


@hooked_only("the authors' pooler head is built from HookedEncoder's pooler.W/pooler.b")
@pytest.mark.parametrize("biases", ["absdot", "separate"])
def test_decompx_equals_the_authors_code_with_pooler_and_classifier(minilm64, official, biases):
    head = _pooler_head(minilm64, official)
    inputs = _fixture_inputs(official)
    lengths = official["lengths"]
    key = "decompx_classifier" if biases == "absdot" else "decompx_biastoken_classifier"
    # class 1 minus class 0 checks both classes' decompositions in one run
    target = Target(1, foil=0, head=head, position=0)
    attr = attribute(minilm64, inputs, target, method="decompx", biases=biases)
    logits = official["logits"]
    _close(attr.parts["logit"].numpy(), logits[:, 1] - logits[:, 0], OFFICIAL)
    ref = official[key][..., 1] - official[key][..., 0]
    ours = np.zeros_like(ref, dtype=np.float64)
    for b, n in enumerate(lengths):
        ours[b, :n] = attr.scores[b, :n].numpy()
        if biases == "separate":
            ours[b, n] = float(attr.parts["bias"][b])  # the authors' bias token
    _close(ours, ref, OFFICIAL)


@pytest.mark.parametrize("biases", ["absdot", "separate"])
def test_decompx_without_head_equals_the_authors_final_norms(minilm64, official, biases):
    attr = attribute(
        minilm64, _fixture_inputs(official), Target(position=0), method="decompx", biases=biases
    )
    key = "decompx_cls_norm" if biases == "absdot" else "decompx_biastoken_cls_norm"
    ref = official[key]
    ours = np.zeros_like(ref, dtype=np.float64)
    for b, n in enumerate(official["lengths"]):
        ours[b, :n] = attr.scores[b, :n].numpy()
        if biases == "separate":
            ours[b, n] = float(attr.parts["bias"][b])
    _close(ours, ref, OFFICIAL)


def test_globenc_equals_the_authors_norms_and_rollout(minilm64, official):
    inputs, lengths = _fixture_inputs(official), official["lengths"]
    per_layer = official["globenc_layer_norms"]  # [item, layer, i, j], raw
    raw = attribute(minilm64, inputs, Target(position=0), method="globenc", normalize=False)
    _close(raw.scores.numpy(), official["globenc_rollout"][:, 0], OFFICIAL)
    layer = attribute(
        minilm64, inputs, Target(position=0), method="globenc", normalize=False, rollout=False
    )
    _close(layer.layer_scores.numpy(), per_layer[:, :, 0], OFFICIAL)
    # the default: the authors' per-layer matrices, rows normalized, rolled out (numpy)
    default = attribute(minilm64, inputs, Target(position=0), method="globenc")
    for b, n in enumerate(lengths):
        mats = [m[:n, :n] / m[:n, :n].sum(-1, keepdims=True) for m in per_layer[b]]
        rolled = []
        for layer in range(len(mats)):
            row = np.eye(n)[0]
            for k in range(layer, -1, -1):
                row = row @ mats[k]
            rolled.append(row)
        _close(default.scores[b, :n].numpy(), row, OFFICIAL)
        _close(default.layer_scores[b, :, :n].numpy(), np.stack(rolled), OFFICIAL)


@pytest.mark.parametrize("rollout", [True, False])
@pytest.mark.parametrize("which", ["tiny", "minilm"])
def test_globenc_rows_sum_to_one(bert, minilm64, which, rollout):
    model = bert if which == "tiny" else minilm64
    attr = attribute(model, PROMPTS, method="globenc", rollout=rollout)
    ones = torch.ones(len(PROMPTS), dtype=F64)
    torch.testing.assert_close(attr.scores.sum(-1), ones, rtol=0, atol=1e-12)
    n_layers = attr.layer_scores.shape[1]
    expected = ones[:, None].expand(-1, n_layers)
    torch.testing.assert_close(attr.layer_scores.sum(-1), expected, rtol=0, atol=1e-12)
    assert bool((attr.scores >= 0).all()) and bool((attr.scores[~attr.mask] == 0).all())


def test_alti_without_rollout_is_each_layers_own_mixing_row(bert):
    target = Target(position=1)
    attr = attribute(bert, PROMPTS, target, method="alti", rollout=False)
    _, _, mats = alti_mixing_matrices(bert, PROMPTS, target)
    for b in range(len(PROMPTS)):
        t = int(torch.nonzero(attr.mask[b])[1])
        for layer, mat in enumerate(mats):
            torch.testing.assert_close(attr.layer_scores[b, layer], mat[b, t], rtol=0, atol=0)
    rolled = attribute(bert, PROMPTS, target, method="alti")
    assert not torch.allclose(rolled.scores, attr.scores)
    torch.testing.assert_close(rolled.layer_scores[:, 0], attr.layer_scores[:, 0])


@pytest.mark.parametrize(
    ("method", "options", "with_head"),
    [
        ("decompx", {}, True),
        ("decompx", {"biases": "separate"}, True),
        ("globenc", {"rollout": False, "normalize": False}, False),
    ],
)
def test_batched_equals_unbatched_and_the_model_is_unchanged(bert, method, options, with_head):
    head = _linear(32) if with_head else None
    target = Target(1, foil=0, head=head, position=0) if with_head else Target(position=0)
    before = model_state_fingerprint(bert)
    batched = attribute(bert, PROMPTS, target, method=method, **options)
    assert model_state_fingerprint(bert) == before
    for b, prompt in enumerate(PROMPTS):
        single = attribute(bert, [prompt], target, method=method, **options)
        real = batched.mask[b]
        torch.testing.assert_close(
            batched.scores[b, real], single.scores[0], rtol=1e-10, atol=1e-12
        )
        for name, part in single.parts.items():
            torch.testing.assert_close(batched.parts[name][b], part[0], rtol=1e-10, atol=1e-12)


def test_decompx_float32_matches_float64(bert):
    head64 = _linear(32)
    target64 = Target(1, head=head64, position=0)
    ref = attribute(bert, PROMPTS, target64, method="decompx")
    bert32 = tiny_bert()
    head32 = _linear(32).float()
    got = attribute(bert32, PROMPTS, Target(1, head=head32, position=0), method="decompx")
    torch.testing.assert_close(got.scores.double(), ref.scores, rtol=1e-4, atol=1e-5)


def test_decompx_rejects_heads_and_hooks_it_cannot_follow(bert):
    with pytest.raises(TargetError, match=r"nn\.Sequential of Linear"):
        attribute(
            bert, "the dog", Target(0, head=torch.nn.LayerNorm(32).double()), method="decompx"
        )
    with pytest.raises(TargetError, match=r"nn\.Sequential of Linear"):
        attribute(bert, "the dog", Target(0, head=lambda x: x[:, :2]), method="decompx")

    def steer(x, hook):
        return 2.0 * x  # (adding a constant would vanish in the next LayerNorm)

    with bert.hooks(fwd_hooks=[("blocks.1.hook_mlp_out", steer)]):
        with pytest.raises(ModelError, match="does not follow"):
            attribute(bert, "the dog", method="decompx")


@pytest.mark.parametrize("method", ["decompx", "globenc"])
def test_bf16_models_are_decomposed_in_float32(method):
    model = tiny_bert(dtype=torch.bfloat16)
    attr = attribute(model, PROMPTS, Target(position=0), method=method)
    assert attr.meta["upcast_to"] == "torch.float32"
    assert bool(torch.isfinite(attr.scores).all()) and float(attr.scores.abs().max()) > 0


@pytest.mark.parametrize(("method", "chunk"), [("decompx", 1), ("globenc", 2)])
def test_chunking_does_not_change_the_result(bert, method, chunk):
    target = Target(1, head=_linear(32), position=0) if method == "decompx" else None
    whole = attribute(bert, PROMPTS, target, method=method)
    chunked = attribute(bert, PROMPTS, target, method=method, chunk_size=chunk)
    torch.testing.assert_close(chunked.scores, whole.scores, rtol=1e-12, atol=1e-14)


def test_decompx_explains_a_trained_encoder_head(bert):
    from lens_attrib.classifiers.linear import new_head

    head = new_head(bert, 2)
    assert head.norm is None
    torch.manual_seed(1)
    plain = torch.nn.Linear(head.linear.in_features, 2).to(torch.float64)
    head.linear.load_state_dict(plain.state_dict())
    head = head.to(torch.float64)
    target = Target(1, foil=0, head=head, position=0)
    ours = attribute(bert, "the dog sees the cat", target, method="decompx", biases="separate")
    same = attribute(
        bert,
        "the dog sees the cat",
        Target(1, foil=0, head=plain, position=0),
        method="decompx",
        biases="separate",
    )
    assert torch.equal(ours.scores, same.scores)
    logit = ours.meta["explained_value"]
    assert torch.allclose(ours.scores.sum(-1) + ours.parts["bias"], logit, atol=1e-8)
