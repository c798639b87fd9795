"""Grad-ELLM depth: the default (last quarter of the layers) and the tuning-split selection."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lens_attrib import Target, attribute
from lens_attrib.evaluation import plausibility, soft_metrics
from lens_attrib.evaluation.depth_selection import depth_candidates, select_grad_ellm_depth
from lens_attrib.tiny_models import tiny_gpt2

F64 = torch.float64
PROMPTS = ["the keys to the cabinet", "the author near the books is", "a dog sees the cats"]
SOFT = {"pis": (0.25, 0.5, 0.75), "n_draws": 2, "raw": False}


@pytest.fixture(scope="module")
def model5():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_gpt2(dtype=F64, n_layers=5)


@pytest.mark.parametrize(("n_layers", "expected"), [(3, 1), (5, 2), (8, 2), (9, 3)])
def test_default_depth_is_the_last_quarter(n_layers, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_gpt2(dtype=F64, n_layers=n_layers)
    default = attribute(model, PROMPTS, method="grad_ellm")
    explicit = attribute(model, PROMPTS, method="grad_ellm", n_layers=expected)
    assert default.meta["options"]["n_layers"] == expected
    assert default.meta["layers"] == list(range(n_layers - expected, n_layers))
    assert torch.equal(default.scores, explicit.scores)


def test_candidates_are_clipped_to_the_model(model5):
    assert depth_candidates(model5, (1, 4, 8, 16, 32)) == [1, 4, 5]
    with pytest.raises(ValueError, match="positive integers"):
        depth_candidates(model5, (0, 2))


def test_the_best_depth_of_a_known_criterion_wins_and_ties_go_shallow(model5):
    def peaked(model, attr):  # best at 4 aggregated layers
        return torch.full((len(attr),), -float((len(attr.meta["layers"]) - 4) ** 2))

    chosen = select_grad_ellm_depth(model5, PROMPTS, candidates=(1, 2, 4, 8), metric=peaked)
    assert chosen.candidates == [1, 2, 4, 5] and chosen.depth == 4
    assert chosen.scores == {1: -9.0, 2: -4.0, 4: 0.0, 5: -1.0} and chosen.n_items == 3
    flat = select_grad_ellm_depth(
        model5, PROMPTS, candidates=(2, 4), metric=lambda m, a: torch.zeros(len(a))
    )
    assert flat.depth == 2


@pytest.mark.filterwarnings("ignore:π unreachable")  # sparse maps on a tiny random model
def test_pi_soft_criterion_is_the_papers_auc_mean(model5):
    """Each depth's score is the mean over items of (π-Soft-NC + π-Soft-NS) / 2, computed here
    independently from attribute + soft_metrics; the chosen depth is the argmax."""
    target = Target(position=-1)
    chosen = select_grad_ellm_depth(model5, PROMPTS, target, candidates=(1, 3), soft_options=SOFT)
    for depth in (1, 3):
        attr = attribute(model5, PROMPTS, target, method="grad_ellm", n_layers=depth)
        res = soft_metrics(model5, attr, **SOFT)
        expected = ((res.pi_soft_nc + res.pi_soft_ns) / 2).double()
        torch.testing.assert_close(chosen.per_item[depth], expected, rtol=0, atol=0)
        assert math.isclose(chosen.scores[depth], float(expected.nanmean()), rel_tol=1e-15)
    assert chosen.depth == max((1, 3), key=lambda d: (chosen.scores[d], -d))
    assert chosen.as_dict()["metric"] == "pi_soft"


def test_pointing_game_criterion(model5):
    evidence = [[1], [2], [1, 2]]
    chosen = select_grad_ellm_depth(
        model5, PROMPTS, candidates=(1, 5), metric="pointing_game", evidence=evidence
    )
    for depth in (1, 5):
        attr = attribute(model5, PROMPTS, method="grad_ellm", n_layers=depth)
        pg = plausibility(attr, evidence, ["pointing_game"])["pointing_game"].double()
        torch.testing.assert_close(chosen.per_item[depth], pg, rtol=0, atol=0)


def test_bad_requests_are_errors(model5):
    with pytest.raises(ValueError, match="needs evidence"):
        select_grad_ellm_depth(model5, PROMPTS, metric="pointing_game")
    with pytest.raises(ValueError, match="must not fix n_layers"):
        select_grad_ellm_depth(model5, PROMPTS, grad_ellm_options={"n_layers": 2})
    with pytest.raises(ValueError, match="metric must be"):
        select_grad_ellm_depth(model5, PROMPTS, metric="auc")
    with pytest.raises(ValueError, match="one value per item"):
        select_grad_ellm_depth(model5, PROMPTS, candidates=(1,), metric=lambda m, a: torch.ones(1))
