"""Plausibility metrics: worked examples with known answers, an independent AP oracle, and the
Attribution-level wrapper (padding, special tokens, correct-only, per layer)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from lens_attrib.attribution import Attribution
from lens_attrib.evaluation.plausibility import (
    PLAUSIBILITY_METRICS,
    TIE_RULES,
    average_precision,
    degenerate,
    dot_product,
    is_degenerate,
    mrr,
    per_token_accuracy,
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
    # ties at the max under the "first" rule: the first position counts
    assert pointing_game(t([0.5, 0.5]), [1], ties="first") == 0.0
    assert pointing_game(t([0.5, 0.5]), [0], ties="first") == 1.0
    # the default: the share of tied maxima that are evidence
    assert pointing_game(t([0.5, 0.5]), [0]) == 0.5
    assert pointing_game(t([0.5, 0.5, 0.5, 0.1]), [0, 3]) == pytest.approx(1 / 3)


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
    # expected: slots 2, 3, 4 for the tie group {0, 1, 2}, evidence 2 uniform among them
    assert mrr(s, [2]) == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)


def test_relevance_mass_accuracy_clips_negatives():
    assert relevance_mass_accuracy(t([1.0, -2.0, 3.0, 0.0]), [2]) == pytest.approx(0.75)
    assert relevance_mass_accuracy(t([1.0, -2.0, 3.0, 0.0]), [1]) == pytest.approx(0.0)
    assert relevance_mass_accuracy(t([-1.0, -2.0]), [0]) == 0.0


def test_token_accuracy():
    assert token_accuracy(t([0.9, 0.1, 0.8, 0.7]), [0, 3]) == pytest.approx(0.5)
    assert token_accuracy(t([0.9, 0.1, 0.8, 0.7]), [0, 2]) == pytest.approx(1.0)
    assert token_accuracy(t([0.9, 0.1, 0.8, 0.7]), [1]) == pytest.approx(0.0)


def test_per_token_accuracy_is_the_papers_sign_classification():
    """Arras et al. (2025), Section 4: evidence tokens should get s > 0, the others s ≤ 0;
    PTA is the share of tokens the sign classifies right (an independent loop as oracle)."""
    assert per_token_accuracy(t([0.5, -0.1, 0.2, 0.0]), [0, 2]) == 1.0
    assert per_token_accuracy(t([0.5, -0.1, 0.2, 0.0]), [1]) == pytest.approx(0.25)
    assert per_token_accuracy(t([0.5, -0.1, 0.2, 0.0]), [3]) == pytest.approx(0.25)  # 0 is "no"
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(2, 12))
        s = rng.normal(size=n) * (rng.uniform(size=n) > 0.2)  # exact zeros among them
        ev = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
        valid = rng.uniform(size=n) > 0.2
        valid[ev[0]] = True
        kept = [i for i in range(n) if valid[i]]
        right = sum((s[i] > 0) == (i in ev) for i in kept)
        expected = right / len(kept)
        if len(kept) > 1 and len({s[i] for i in kept}) == 1:
            expected = sum(i in ev for i in kept) / len(kept)
        got = per_token_accuracy(t(s), ev, torch.tensor(valid))
        assert got == pytest.approx(expected, abs=1e-15)


def test_per_token_accuracy_of_non_negative_and_constant_scores():
    """Every strictly positive method scores |E|/n (the paper's equal PTA columns for gradient
    norms and rollout); a constant vector, zeros included, scores the same: saying nothing is
    not rewarded with 1 − |E|/n."""
    rng = np.random.default_rng(4)
    for n in range(2, 9):
        ev = list(range(0, n, 3))
        assert per_token_accuracy(t(rng.uniform(0.1, 1, size=n)), ev) == pytest.approx(len(ev) / n)
        for value in (0.0, -2.0, 1.5):
            assert per_token_accuracy(torch.full((n,), value), ev) == pytest.approx(len(ev) / n)
    assert per_token_accuracy(t([-1.0]), [0]) == 0.0  # one token: its sign decides
    assert math.isnan(per_token_accuracy(t([1.0, 2.0]), []))
    with pytest.raises(ValueError, match="NaN"):
        per_token_accuracy(t([1.0, math.nan]), [0])


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
    target = ResolvedTarget(
        torch.full((b,), scores.shape[1] - 1), torch.zeros(b, dtype=torch.long), None
    )
    tokens = [[str(int(i)) for i in row[m]] for row, m in zip(ids, mask)]
    return Attribution(
        scores=scores,
        tokens=tokens,
        token_ids=ids,
        mask=mask,
        target=target,
        method="hand",
        layer_scores=layer_scores,
    )


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


# ------------------------------------------------------------------ ties: exact expectations
RANK_METRICS = {
    "pointing_game": pointing_game,
    "mrr": mrr,
    "token_accuracy": token_accuracy,
    "average_precision": average_precision,
}


def _metric_of_ranking(name: str, order: Sequence[int], evidence: set[int]) -> float:
    """The rank metric of one explicit ranking (an independent, definition-level oracle)."""
    hits = [i in evidence for i in order]
    k = len(evidence)
    if name == "pointing_game":
        return float(hits[0])
    if name == "mrr":
        return 1.0 / (1 + hits.index(True))
    if name == "token_accuracy":
        return sum(hits[:k]) / k
    found, total = 0, 0.0
    for rank, hit in enumerate(hits, start=1):
        if hit:
            found += 1
            total += found / rank
    return total / k


def _brute_force_ties(name: str, s: np.ndarray, evidence: set[int]) -> float:
    """Mean of the metric over every ranking consistent with ``s`` (all tie-breakings)."""
    values = [
        _metric_of_ranking(name, order, evidence)
        for order in itertools.permutations(range(len(s)))
        if all(s[order[i]] >= s[order[i + 1]] for i in range(len(s) - 1))
    ]
    return float(np.mean(values))


@pytest.mark.parametrize("name", list(RANK_METRICS))
def test_expected_ties_equal_enumeration_of_all_tie_breakings(name):
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(2, 7))
        s = rng.integers(0, 3, size=n).astype(np.float64)  # few distinct values: many ties
        ev = set(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
        got = RANK_METRICS[name](t(s), sorted(ev))
        assert got == pytest.approx(_brute_force_ties(name, s, ev), abs=1e-12)


@pytest.mark.parametrize("name", list(RANK_METRICS))
@pytest.mark.parametrize("value", [0.0, -1.5, 3.0])
def test_constant_scores_score_the_random_expectation(name, value):
    # random scores are i.i.d. uniform: their ranking is a uniform permutation of the n tokens
    for n in range(1, 7):
        for k in range(1, n + 1):
            ev = set(range(n - k, n))  # evidence at the end: "first" rules would score it 0
            uniform = np.mean(
                [_metric_of_ranking(name, p, ev) for p in itertools.permutations(range(n))]
            )
            got = RANK_METRICS[name](torch.full((n,), value), sorted(ev))
            assert got == pytest.approx(float(uniform), abs=1e-12)
    # closed forms: PG = |E|/n, PTA = |E|/n
    if name in ("pointing_game", "token_accuracy"):
        assert RANK_METRICS[name](torch.zeros(10), [3, 7]) == pytest.approx(0.2)


@pytest.mark.parametrize("name", list(RANK_METRICS))
def test_expected_ties_match_monte_carlo_of_random_scores(name):
    # an independent check that "constant" = what the random method scores on average
    rng = np.random.default_rng(2)
    n, ev = 6, [1, 4]
    draws = [RANK_METRICS[name](t(rng.uniform(size=n)), ev) for _ in range(3000)]
    assert RANK_METRICS[name](torch.zeros(n), ev) == pytest.approx(np.mean(draws), abs=0.03)


@pytest.mark.parametrize("name", list(RANK_METRICS))
def test_tie_rules_bracket_the_expectation_and_agree_without_ties(name):
    rng = np.random.default_rng(3)
    fn = RANK_METRICS[name]
    for _ in range(40):
        n = int(rng.integers(2, 9))
        s = t(rng.integers(0, 3, size=n).astype(np.float64))
        ev = sorted(set(rng.choice(n, size=int(rng.integers(1, n)), replace=False).tolist()))
        low, mid, high = (fn(s, ev, ties=r) for r in ("pessimistic", "expected", "optimistic"))
        assert low - 1e-12 <= mid <= high + 1e-12
        assert fn(s, ev, ties="first") == fn(s, ev, ties="ferrando")
        distinct = t(rng.permutation(n).astype(np.float64))
        values = {fn(distinct, ev, ties=r) for r in TIE_RULES}
        assert max(values) - min(values) < 1e-12


def test_optimistic_rewards_all_zero_scores_and_expected_does_not():
    # Grad-ELLM-like row: all relevance on the start token, zero on every real word
    s, valid = t([5.0, 0.0, 0.0, 0.0, 0.0]), torch.tensor([False, True, True, True, True])
    assert mrr(s, [2], valid, ties="optimistic") == 1.0
    assert pointing_game(s, [1], valid, ties="first") == 1.0
    assert mrr(s, [2], valid) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    assert pointing_game(s, [1], valid) == pytest.approx(0.25)
    assert is_degenerate(s, valid) and not is_degenerate(s)
    assert not is_degenerate(t([0.0])) and not is_degenerate(s, torch.arange(5) == 0)


def test_boolean_evidence_mask_equals_positions():
    s = t([0.2, 0.9, 0.5, 0.1])
    for name, fn in PLAUSIBILITY_METRICS.items():
        by_pos = fn(s, [2, 3], None)
        assert fn(s, torch.tensor([False, False, True, True]), None) == by_pos, name
        assert fn(s, [False, False, True, True], None) == by_pos, name
        assert fn(s, np.array([False, False, True, True]), None) == by_pos, name
    # a mask is not read as the positions {0, 1}
    assert pointing_game(s, [True, False, False, False]) == 0.0
    with pytest.raises(ValueError, match="mask has 2 entries"):
        pointing_game(s, [True, False])
    with pytest.raises(TypeError):
        pointing_game(s, [True, 2])


def test_degenerate_flags_constant_rows_over_valid_tokens():
    ids = torch.tensor([[0, 1, 7, 8], [1, 5, 6, 7]])
    mask = torch.tensor([[False, True, True, True], [True] * 4])
    scores = t([[9.0, 4.0, 0.0, 0.0], [1.0, 0.3, 0.2, 0.1]])
    attr = _attr(scores, mask, ids, torch.stack([scores, torch.zeros_like(scores)], dim=1))
    assert degenerate(attr).tolist() == [False, False]
    assert degenerate(attr, special_ids=[1]).tolist() == [True, False]
    assert degenerate(attr, special_ids=[1], per_layer=True).tolist() == [
        [True, True],
        [False, True],
    ]


def test_attribution_wrapper_accepts_boolean_masks():
    ids = torch.tensor([[0, 1, 7, 8, 9], [1, 5, 6, 7, 8]])
    mask = torch.tensor([[False, True, True, True, True], [True] * 5])
    scores = t([[0.0, 0.1, 0.9, 0.3, 0.2], [0.3, 0.1, 0.2, 0.9, 0.5]])
    attr = _attr(scores, mask, ids)
    positions = [[2], [4, 1]]
    masks = [torch.tensor([False, False, True, False]), torch.tensor([0, 1, 0, 0, 1]) > 0]
    by_pos = plausibility(attr, positions)
    by_mask = plausibility(attr, masks)
    for name in PLAUSIBILITY_METRICS:
        assert torch.equal(by_pos[name], by_mask[name]), name
    assert by_mask["pointing_game"].tolist() == [0.0, 0.0]
