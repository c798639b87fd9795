"""The STS-B classifier path and the faithfulness experiment carry sentence-pair segments.

Oracle: TransformerLens's own encoder forward (``HookedEncoder.encoder_output``) on the
tokenizer's pair encoding with the tokenizer's own ``token_type_ids``, one unpadded pair at a
time (float64). The library's features, head outputs, attributions and perturbed outputs must
equal it to float64 rounding and differ from the same ids with segment 0 everywhere (so the
equality is not trivially true).
"""

from __future__ import annotations

import hashlib
import json
import math
from argparse import Namespace
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from experiments.faithfulness import classifier_items, classifier_outputs
from lens_attrib import attribute
from lens_attrib.classifiers import (
    CLASSIFIERS,
    PAIR_ENCODING,
    Classifier,
    ClassifierInfo,
    data_hash,
    stsb_inputs,
    task_data,
)
from lens_attrib.classifiers.finetune import fine_tune, head_rows
from lens_attrib.classifiers.linear import new_head, residual_features
from lens_attrib.evaluation.faithfulness import aopc
from lens_attrib.tiny_models import tiny_bert
from tests.tl_versions import hooked_only

F64 = torch.float64
PAIRS = [
    ("the cat sat on the mat", "a dog is near the door"),
    ("the keys are", "the dog sat"),
    ("a man sees the cat", "the man"),
]
SCORES = [3.2, 1.0, 4.5]
EXACT = 1e-10  # relative to the largest |value|: the same float64 arithmetic on both sides


@pytest.fixture(scope="module")
def bert() -> Any:
    return tiny_bert(dtype=F64)


@pytest.fixture(scope="module")
def head(bert: Any) -> Any:
    torch.manual_seed(0)
    head = new_head(bert, 1)
    with torch.no_grad():
        head.linear.weight.normal_()
    return head


def items(pairs: list[tuple[str, str]]) -> list[Any]:
    """STS-B-like items (the fields :func:`stsb_inputs` and the experiment read)."""
    return [
        SimpleNamespace(meta={"sentence1": a, "sentence2": b, "score": s})
        for (a, b), s in zip(pairs, SCORES)
    ]


def cls_rows(model: Any, pairs: list[tuple[str, str]], segments: bool = True) -> torch.Tensor:
    """Final residual at ``[CLS]`` from TransformerLens's forward, one pair at a time, with the
    tokenizer's own ``token_type_ids`` (``segments=False``: segment 0 everywhere)."""
    rows = []
    for a, b in pairs:
        enc = model.tokenizer(a, b, return_tensors="pt", return_token_type_ids=True)
        types = enc["token_type_ids"] if segments else torch.zeros_like(enc["token_type_ids"])
        assert int(enc["token_type_ids"].sum()) > 0  # the pair really has a second segment
        with torch.no_grad():
            rows.append(model.encoder_output(enc["input_ids"], types)[0, 0])
    return torch.stack(rows)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = EXACT) -> bool:
    a, b = a.detach(), b.detach()
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-300)
    return float((a - b).abs().max()) <= tol * scale


def test_stsb_inputs_are_sentence_pairs():
    assert stsb_inputs(items(PAIRS)) == PAIRS


def test_task_data_gives_pairs_and_records_the_encoding():
    spec = CLASSIFIERS["minilm-l6-stsb"]
    train, y, dev, y_dev, about = task_data(None, replace(spec, n_train=5), n_dev=3)
    assert len(train) == 5 and len(dev) == 3 and len(y) == 5 and len(y_dev) == 3
    assert all(isinstance(x, tuple) and len(x) == 2 for x in train + dev)
    assert all(isinstance(s, str) and s for x in train + dev for s in x)
    assert about["pair_encoding"] == PAIR_ENCODING


@hooked_only("the oracle is HookedEncoder.encoder_output")
def test_residual_features_of_pairs_use_segments(bert):
    features = residual_features(bert, PAIRS, batch_size=2)  # padded batches
    assert close(features, cls_rows(bert, PAIRS))
    segment0 = cls_rows(bert, PAIRS, segments=False)
    assert float((features - segment0).abs().max()) > 1e-3 * float(segment0.abs().max())


@hooked_only("the oracle is HookedEncoder.encoder_output")
def test_head_rows_of_pairs_use_segments(bert, head):
    out = head_rows(bert, head, PAIRS)
    expected = head(cls_rows(bert, PAIRS))
    assert close(out, expected)
    assert not close(out, head(cls_rows(bert, PAIRS, segments=False)), 1e-3)


@hooked_only("the oracle is HookedEncoder.encoder_output")
def test_fine_tune_on_pairs_trains_with_segments(bert, head):
    targets = torch.tensor(SCORES, dtype=F64)
    tuned, tuned_head, info = fine_tune(
        bert, head, PAIRS, targets, k=1, regression=True, epochs=1, batch_size=2
    )
    assert info["steps"] == 2 and math.isfinite(info["final_loss"])
    # the tuned copy scores pairs with their segments, like the oracle forward on it
    assert close(head_rows(tuned, tuned_head, PAIRS), tuned_head(cls_rows(tuned, PAIRS)))


def test_data_hash_marks_pairs_and_keeps_single_sentence_keys():
    y = torch.tensor([0, 1])
    texts = ["a good film", "a bad film"]
    # single sentences (SST-2): the key the cache always had
    payload = json.dumps(["minilm-l6", texts, [0, 1]], ensure_ascii=False)
    assert data_hash("minilm-l6", texts, y) == hashlib.sha256(payload.encode()).hexdigest()
    # pairs: the encoding is part of the key, unlike the same texts given without it
    pairs = [("a", "b"), ("c", "d")]
    plain = json.dumps(["minilm-l6", [["a", "b"], ["c", "d"]], [0, 1]], ensure_ascii=False)
    key = data_hash("minilm-l6", pairs, y)
    assert key != hashlib.sha256(plain.encode()).hexdigest()
    marked = json.dumps(
        ["minilm-l6", [["a", "b"], ["c", "d"]], [0, 1], {"pairs": PAIR_ENCODING}],
        ensure_ascii=False,
    )
    assert key == hashlib.sha256(marked.encode()).hexdigest()


@pytest.fixture(scope="module")
def clf(bert, head) -> Classifier:
    return Classifier(bert, head, ClassifierInfo("tiny-stsb", None, True, 0))


@hooked_only("the oracle is HookedEncoder.encoder_output")
def test_faithfulness_items_and_outputs_carry_segments(bert, clf, monkeypatch):
    from experiments import faithfulness

    monkeypatch.setattr(faithfulness, "stsb_split", lambda: ([], items(PAIRS)))
    args = Namespace(n=3, max_tokens=32, seed=0)
    inputs, gold = classifier_items(bert, clf, "stsb", args)
    assert inputs == PAIRS and gold == SCORES
    out = classifier_outputs(bert, clf, inputs)
    assert close(out, clf.head(cls_rows(bert, PAIRS)))
    assert not close(out, clf.head(cls_rows(bert, PAIRS, segments=False)), 1e-3)


def masked_output(
    model: Any,
    head: Any,
    pair: tuple[str, str],
    scores: list[float],
    f: float,
    segments: bool = True,
) -> torch.Tensor:
    """The head's output after replacing the top ``ceil(f · n)`` of the ``n`` non-special tokens
    (an unknown word is content) by ``[MASK]`` (ties: earlier position first), segments kept (the
    encoder AOPC deletion)."""
    tok = model.tokenizer
    enc = tok(*pair, return_tensors="pt", return_token_type_ids=True)
    ids = enc["input_ids"][0].clone()
    special = set(tok.all_special_ids) - {tok.unk_token_id}
    cand = [i for i in range(len(ids)) if int(ids[i]) not in special]
    cand.sort(key=lambda i: (-scores[i], i))
    ids[cand[: math.ceil(round(f * len(cand), 9))]] = tok.mask_token_id
    types = enc["token_type_ids"] if segments else torch.zeros_like(enc["token_type_ids"])
    with torch.no_grad():
        return head(model.encoder_output(ids[None], types)[:, 0])[0, 0]


@hooked_only("the oracle is HookedEncoder.encoder_output")
def test_attribution_and_aopc_keep_segments(bert, clf):
    attr = attribute(bert, PAIRS, clf.info.target(clf.head), method="grad_x_input")
    for b, (a, s) in enumerate(PAIRS):
        enc = bert.tokenizer(a, s, return_token_type_ids=True)
        assert attr.token_types is not None
        assert attr.token_types[b][attr.mask[b]].tolist() == enc["token_type_ids"]
    res = aopc(bert, attr, fractions=[0.5], head=clf.head, label="target")
    assert close(res.p_full, clf.head(cls_rows(bert, PAIRS))[:, 0])
    for b, pair in enumerate(PAIRS):
        scores = attr.scores[b][attr.mask[b]].tolist()
        expected = masked_output(bert, clf.head, pair, scores, 0.5)
        assert close(res.perturbed_values["without_top"][b, 0], expected)
        segment0 = masked_output(bert, clf.head, pair, scores, 0.5, segments=False)
        # half masked, the segments move the tiny model's output less (~1e-4 relative), still
        # far above float64 rounding
        assert not close(res.perturbed_values["without_top"][b, 0], segment0, 1e-8)


@hooked_only("the oracle is HookedEncoder.encoder_output")
def test_frozen_classifier_is_the_linear_head_on_pairs(bert, tmp_path):
    from lens_attrib.classifiers import load_classifier

    clf = load_classifier(
        "minilm-l6-stsb", model=bert, cache_dir=tmp_path, n_train=16, n_dev=4, frozen=True
    )
    assert clf.model is bert and "fine_tune" not in clf.info.metadata
    assert clf.info.metadata["pair_encoding"] == PAIR_ENCODING and clf.info.regression
    pairs = task_data(bert, replace(CLASSIFIERS["minilm-l6-stsb"], n_train=16))[0]
    assert close(head_rows(bert, clf.head, pairs), clf.head(cls_rows(bert, pairs)))
