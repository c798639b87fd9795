"""AOPC and insertion/deletion against hand loops on tiny models (float64)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lens_attrib import attribute
from lens_attrib.attribution import Attribution
from lens_attrib.evaluation.faithfulness import aopc, insertion_deletion, n_perturbed
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama

PROMPTS = ["the keys to the cabinet", "the dog near the cats is", "a man sees"]


@pytest.fixture(scope="module")
def gpt2():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_gpt2(dtype=torch.float64)


@pytest.fixture(scope="module")
def llama():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama(dtype=torch.float64)


def _probs_last(model, ids: list[int]) -> torch.Tensor:
    """p(next token) after ``ids`` — one unpadded forward, no library code."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
    return torch.softmax(logits[0, -1].double(), -1)


def _hand_aopc(model, attr: Attribution, b: int, fractions):
    bos = model.tokenizer.bos_token_id
    ids = attr.token_ids[b][attr.mask[b]].tolist()
    scores = attr.scores[b][attr.mask[b]].tolist()
    last = len(ids) - 1
    cand = [i for i in range(len(ids)) if ids[i] != bos and i != last]
    cand.sort(key=lambda i: (-scores[i], i))
    p_full = _probs_last(model, ids)
    y = int(p_full.argmax())
    comp, suff, acc = [], [], []
    for f in fractions:
        k = math.ceil(round(f * len(cand), 9))
        top = set(cand[:k])
        without = [t for i, t in enumerate(ids) if i not in top]
        only = [t for i, t in enumerate(ids) if i in top or i not in cand]
        pw, po = _probs_last(model, without), _probs_last(model, only)
        comp.append(float(p_full[y] - pw[y]))
        suff.append(float(p_full[y] - po[y]))
        acc.append(float(int(pw.argmax()) == y))
    n = len(fractions)
    return sum(comp) / n, sum(suff) / n, sum(acc) / n


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_aopc_matches_hand_loop(name, request):
    model = request.getfixturevalue(name)
    attr = attribute(model, PROMPTS, method="grad_x_input")
    fractions = (0.1, 0.3, 0.5, 0.7, 0.9)
    before = model_state_fingerprint(model)
    res = aopc(model, attr, fractions=fractions, max_batch=7)
    assert model_state_fingerprint(model) == before
    for b in range(len(PROMPTS)):
        c, s, a = _hand_aopc(model, attr, b, fractions)
        assert float(res.comprehensiveness[b]) == pytest.approx(c, abs=1e-10)
        assert float(res.sufficiency[b]) == pytest.approx(s, abs=1e-10)
        assert float(res.accuracy[b]) == pytest.approx(a, abs=1e-12)


def test_aopc_batched_equals_unbatched(gpt2):
    attr = attribute(gpt2, PROMPTS, method="gradient")
    full = aopc(gpt2, attr, max_batch=64)
    for b in range(len(PROMPTS)):
        one = aopc(gpt2, attr[b], max_batch=3)
        assert torch.allclose(one.comprehensiveness, full.comprehensiveness[b : b + 1], atol=1e-12)
        assert torch.allclose(one.sufficiency, full.sufficiency[b : b + 1], atol=1e-12)


def test_aopc_target_label_and_gold_accuracy(gpt2):
    attr = attribute(gpt2, PROMPTS[:1], method="gradient")
    pred = aopc(gpt2, attr, label="prediction")
    tgt = aopc(gpt2, attr, label="target")  # default Target is the prediction: same label
    assert torch.equal(pred.labels, tgt.labels)
    assert torch.allclose(pred.comprehensiveness, tgt.comprehensiveness, atol=1e-12)
    wrong = (pred.prediction + 1) % gpt2.cfg.d_vocab
    assert float(aopc(gpt2, attr, gold=wrong).accuracy[0]) <= float(pred.accuracy[0])


def test_n_perturbed_rounding():
    assert n_perturbed(0.3, 10) == 3
    assert n_perturbed(0.1, 5) == 1
    assert n_perturbed(0.0, 5) == 0
    assert n_perturbed(1.0, 5) == 5


def test_insertion_deletion_curves(gpt2):
    attr = attribute(gpt2, PROMPTS, method="grad_x_input")
    res = insertion_deletion(gpt2, attr, max_batch=16)
    fr = torch.tensor(res.fractions, dtype=torch.float64)
    assert len(res.fractions) == 21 and res.fractions[1] == pytest.approx(0.05)
    bos = gpt2.tokenizer.bos_token_id
    for b in range(len(PROMPTS)):
        ids = attr.token_ids[b][attr.mask[b]].tolist()
        p = _probs_last(gpt2, ids)
        y = int(p.argmax())
        # deletion starts at the full input, insertion from BOS + the target token
        assert float(res.deletion[b, 0]) == pytest.approx(float(p[y]), abs=1e-10)
        assert float(res.insertion[b, 0]) == pytest.approx(
            float(_probs_last(gpt2, [bos, ids[-1]])[y]), abs=1e-10
        )
        # deleting everything == inserting nothing; inserting everything == the full input
        assert float(res.deletion[b, -1]) == pytest.approx(float(res.insertion[b, 0]), abs=1e-12)
        assert float(res.insertion[b, -1]) == pytest.approx(float(p[y]), abs=1e-10)
        assert float(res.deletion_auc[b]) == pytest.approx(
            float(torch.trapezoid(res.deletion[b], fr)), abs=1e-12
        )
        assert not bool(res.deletion_flipped[b, 0]) and bool(res.insertion_flipped[b, -1])
        flips = torch.nonzero(res.deletion_flipped[b]).flatten()
        expect = float(fr[flips[0]]) if len(flips) else float("nan")
        got = float(res.deletion_flip_fraction[b])
        assert (math.isnan(expect) and math.isnan(got)) or got == pytest.approx(expect)


def test_encoder_replaces_with_mask():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = tiny_bert(dtype=torch.float64)
    attr = attribute(bert, ["the keys to the cabinet"], method="gradient")
    res = aopc(bert, attr, fractions=(0.5,))
    ids = attr.token_ids[0].tolist()
    tok = bert.tokenizer
    scores = attr.scores[0].tolist()
    target = int(attr.target.positions[0])
    cand = [i for i, t in enumerate(ids) if t not in tok.all_special_ids and i != target]
    cand.sort(key=lambda i: (-scores[i], i))
    top = set(cand[: math.ceil(0.5 * len(cand))])
    masked = [tok.mask_token_id if i in top else t for i, t in enumerate(ids)]

    def probs(seq):
        with torch.no_grad():
            return torch.softmax(bert(torch.tensor([seq]))[0, target].double(), -1)

    p = probs(ids)
    y = int(p.argmax())
    assert float(res.comprehensiveness[0]) == pytest.approx(
        float(p[y] - probs(masked)[y]), abs=1e-10
    )
