"""Plausibility metrics: worked examples with known answers, an independent AP oracle, and the
Attribution-level wrapper (padding, special tokens, correct-only, per layer)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lens_attrib.attribution import Attribution
from lens_attrib.evaluation.plausibility import (
    average_precision,
    dot_product,
    mrr,
    plausibility,
    pointing_game,
    relevance_mass_accuracy,
    token_accuracy,
)
from lens_attrib.target import ResolvedTarget


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_average_precision_normxlogit_example():
    assert average_precision(t([0.3, 0.1, 0.5, 0.1]), [0]) == pytest.approx(0.5, abs=1e-12)


def test_average_precision_two_evidence_tokens():
    # ranking 2,0,3,1 with E={0,1}: precision@2 = 1/2, precision@4 = 2/4 -> AP = 0.5
    assert average_precision(t([0.3, 0.1, 0.5, 0.2]), [0, 1]) == pytest.approx(0.5)
    # E={2,0}: the top two -> AP = 1
    assert average_precision(t([0.3, 0.1, 0.5, 0.2]), [0, 2]) == pytest.approx(1.0)


def _ap_oracle(scores: np.ndarray, evidence: set[int]) -> float:
    """AP as the mean over evidence tokens of (#evidence scoring ≥ it) / (#tokens scoring ≥ it)."""
    vals = []
    for e in evidence:
        above = scores >= scores[e]
        vals.append(sum(1 for i in evidence if above[i]) / above.sum())
    return float(np.mean(vals))


def test_average_precision_matches_independent_oracle_without_ties():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(3, 15))
        s = rng.normal(size=n)
        ev = set(rng.choice(n, size=int(rng.integers(1, n)), replace=False).tolist())
        assert average_precision(t(s), sorted(ev)) == pytest.approx(_ap_oracle(s, ev), abs=1e-12)


def test_pointing_game():
    assert pointing_game(t([0.1, 0.9, 0.3]), [1]) == 1.0
    assert pointing_game(t([0.1, 0.9, 0.3]), [0, 2]) == 0.0
    # ties at the max: the first position counts
    assert pointing_game(t([0.5, 0.5]), [1]) == 0.0
    assert pointing_game(t([0.5, 0.5]), [0]) == 1.0


def test_mrr_tie_rules_differ_on_zero_relevance_ties():
    s = t([0.0, 0.0, 0.0, 1.0])
    # optimistic: only one token scores strictly higher -> rank 2
    assert mrr(s, [2], ties="optimistic") == pytest.approx(0.5)
    # ferrando: stable descending order 3,0,1,2 -> rank 4
    assert mrr(s, [2], ties="ferrando") == pytest.approx(0.25)
    # without ties both agree; best-ranked evidence token counts
    s2 = t([0.2, 0.9, 0.5, 0.1])
    for ties in ("optimistic", "ferrando"):
        assert mrr(s2, [3, 2], ties=ties) == pytest.approx(0.5)
        assert mrr(s2, [1], ties=ties) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        mrr(s2, [1], ties="random")


def test_relevance_mass_accuracy_clips_negatives():
    assert relevance_mass_accuracy(t([1.0, -2.0, 3.0, 0.0]), [2]) == pytest.approx(0.75)
    assert relevance_mass_accuracy(t([1.0, -2.0, 3.0, 0.0]), [1]) == pytest.approx(0.0)
    assert relevance_mass_accuracy(t([-1.0, -2.0]), [0]) == 0.0


def test_token_accuracy():
    assert token_accuracy(t([0.9, 0.1, 0.8, 0.7]), [0, 3]) == pytest.approx(0.5)
    assert token_accuracy(t([0.9, 0.1, 0.8, 0.7]), [0, 2]) == pytest.approx(1.0)
    assert token_accuracy(t([0.9, 0.1, 0.8, 0.7]), [1]) == pytest.approx(0.0)


def test_dot_product_normalizations():
    s = t([1.0, -1.0, 2.0])
    assert dot_product(s, [2], normalize="raw") == pytest.approx(2.0)
    assert dot_product(s, [2], normalize="l1") == pytest.approx(0.5)
    soft = math.exp(2) / (math.exp(1) + math.exp(-1) + math.exp(2))
    assert dot_product(s, [2], normalize="softmax") == pytest.approx(soft)
    assert dot_product(s, [0, 2], normalize="l1") == pytest.approx(0.75)


def test_empty_evidence_is_nan_and_bad_positions_raise():
    assert math.isnan(mrr(t([1.0, 2.0]), []))
    with pytest.raises(IndexError):
        mrr(t([1.0, 2.0]), [5])


def test_valid_mask_excludes_positions():
    s = t([5.0, 0.1, 0.9, 0.3])  # position 0 plays BOS
    valid = torch.tensor([False, True, True, True])
    assert pointing_game(s, [2]) == 0.0
    assert pointing_game(s, [2], valid) == 1.0
    assert mrr(s, [3], valid) == pytest.approx(0.5)


def _attr(scores, mask, ids, layer_scores=None):
    b = scores.shape[0]
    target = ResolvedTarget(torch.full((b,), scores.shape[1] - 1), torch.zeros(b, dtype=torch.long),
                            None)
    tokens = [[str(int(i)) for i in row[m]] for row, m in zip(ids, mask)]
    return Attribution(scores=scores, tokens=tokens, token_ids=ids, mask=mask, target=target,
                       method="hand", layer_scores=layer_scores)


def test_attribution_wrapper_padding_special_correct_and_layers():
    # item 0 left-padded by two; id 1 is BOS (special)
    ids = torch.tensor([[0, 0, 1, 7, 8, 9], [1, 5, 6, 7, 8, 9]])
    mask = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    scores = t([[9.0, 9.0, 3.0, 0.2, 1.0, 0.1], [4.0, 0.1, 0.2, 0.3, 2.0, 0.5]])
    layers = torch.stack([scores, -scores], dim=1)
    attr = _attr(scores, mask, ids, layers)
    evidence = [[2], [4]]  # real-token positions: item 0 -> id 8, item 1 -> id 8
    res = plausibility(attr, evidence, ["pointing_game", "mrr"])
    assert res["pointing_game"].tolist() == [0.0, 0.0]  # BOS wins when not excluded
    res = plausibility(attr, evidence, ["pointing_game", "mrr"], special_ids=[1])
    assert res["pointing_game"].tolist() == [1.0, 1.0]
    res = plausibility(attr, evidence, ["mrr"], special_ids=[1], correct=[True, False])
    assert res["mrr"][0] == 1.0 and math.isnan(float(res["mrr"][1]))
    per = plausibility(attr, evidence, ["mrr", "rma"], special_ids=[1], per_layer=True)
    assert per["mrr"].shape == (2, 2)
    for layer in range(2):
        for b in range(2):
            real = layers[b, layer][mask[b]]
            valid = ids[b][mask[b]] != 1
            assert per["mrr"][b, layer] == pytest.approx(mrr(real, evidence[b], valid))
    with pytest.raises(KeyError):
        plausibility(attr, evidence, ["nope"])
