"""A ForwardMemo shares perturbed forwards across evaluation calls on the same items.

Oracles: every method scored without a memo (float64, 1e-12 relative to each metric's largest
magnitude); the rows forwarded, counted at the backend's ``final_residual`` — with the memo a
later call forwards exactly the distinct rows no earlier call made (per-token Soft masks and
hard rows, counted independently of the memo); per-element Soft draws are not shared.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lens_attrib.forward as forward_mod
from lens_attrib import attribute
from lens_attrib.evaluation import ForwardMemo, ScoreOptions, score
from lens_attrib.evaluation.metrics import SOFT_BASE
from lens_attrib.target import Target
from lens_attrib.tiny_models import tiny_bert, tiny_llama
from tests.test_shared_forwards import distinct_soft_masks

pytestmark = pytest.mark.filterwarnings("ignore:π unreachable")

PIS = (0.2, 0.5, 0.8)
DRAWS = 3
PROMPTS = ["the cat sat", "a dog ran over the big hill today", "big red cat sat on a mat"]
METHODS = ("grad_x_input", "gradient", "attention", "random")
NAMES = [
    "comprehensiveness",
    "sufficiency",
    "deletion_auc",
    "insertion_auc",
    "deletion_flip_auc",
    "insertion_flip_auc",
] + [m + s for s in ("", "_fixed") for m in SOFT_BASE]
OPTIONS = ScoreOptions(
    max_batch=7,
    aopc={"fractions": (0.1, 0.3, 0.5, 0.9), "label": "target"},
    curves={"steps": 4, "label": "target"},
    soft={"pis": PIS, "n_draws": DRAWS},
)


@pytest.fixture(scope="module")
def llama():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama(dtype=torch.float64)


def attributions(model, methods=METHODS, target=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {m: attribute(model, PROMPTS, target, method=m) for m in methods}


def by_name(records) -> dict[tuple, float]:
    return {(r.item, r.name): r.value for r in records}


def same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in {k[1] for k in want}:
        keys = [k for k in want if k[1] == name]
        scale = max(abs(want[k]) for k in keys) or 1.0
        for k in keys:
            assert abs(got[k] - want[k]) <= 1e-12 * scale, (k, got[k], want[k])


class Rows:
    """Rows forwarded, counted where every forward of the library passes."""

    def __init__(self, monkeypatch):
        self.rows = 0
        real = forward_mod.final_residual

        def counted(model, arch, tokens, mask, padded, token_types=None):
            self.rows += int(tokens.shape[0])
            return real(model, arch, tokens, mask, padded, token_types)

        monkeypatch.setattr(forward_mod, "final_residual", counted)


def test_scores_with_a_memo_equal_scores_without(llama) -> None:
    attrs = attributions(llama)
    memo = ForwardMemo(llama, None)
    for attr in attrs.values():
        alone = by_name(score(llama, attr, NAMES, options=OPTIONS))
        shared = by_name(score(llama, attr, NAMES, options=OPTIONS, memo=memo))
        same(shared, alone)
    assert memo.served > 0  # the methods' perturbations coincided somewhere
    assert memo.soft and memo.hard


def test_a_later_call_forwards_only_the_soft_rows_no_earlier_call_made(llama, monkeypatch) -> None:
    """Soft alone: per call, the clean forward, the pattern forward, and per routing the
    distinct per-token masks not in an earlier method's set (counted without the memo)."""
    attrs = attributions(llama)
    names = [m + s for s in ("", "_fixed") for m in SOFT_BASE]
    opts = ScoreOptions(max_batch=7, soft={"pis": PIS, "n_draws": DRAWS})
    seen: list[set] = [set() for _ in PROMPTS]
    memo = ForwardMemo(llama, None)
    for attr in attrs.values():
        new = 0
        for b in range(len(PROMPTS)):
            masks = masks_of(llama, attr, b)
            new += len(masks - seen[b])
            seen[b] |= masks
        counter = Rows(monkeypatch)
        score(llama, attr, names, options=opts, memo=memo)
        clean = len(PROMPTS)  # one clean forward per item (with its patterns)
        assert counter.rows == clean + 2 * new


def masks_of(model, attr, b: int) -> set[bytes]:
    """Item ``b``'s distinct per-token keep masks but all-ones (as the forward plan keys them)."""
    return distinct_soft_masks(model, attr, b, DRAWS, PIS)[0]


def test_the_same_attribution_twice_forwards_only_its_clean_rows(llama, monkeypatch) -> None:
    attr = attributions(llama, ("grad_x_input",))["grad_x_input"]
    memo = ForwardMemo(llama, None)
    score(llama, attr, NAMES, options=OPTIONS, memo=memo)
    counter = Rows(monkeypatch)
    again = by_name(score(llama, attr, NAMES, options=OPTIONS, memo=memo))
    assert counter.rows == len(PROMPTS)  # the clean forwards (with the patterns) only
    same(again, by_name(score(llama, attr, NAMES, options=OPTIONS)))


def test_per_element_draws_are_not_shared(llama, monkeypatch) -> None:
    """Per-element rows are keyed by their index (their masks are not drawn to be compared), so
    the memo must not serve them to another method."""
    attrs = attributions(llama, ("grad_x_input", "gradient"))
    opts = ScoreOptions(max_batch=7, soft={"pis": PIS, "n_draws": DRAWS, "per_element": True})
    memo = ForwardMemo(llama, None)
    for attr in attrs.values():
        same(
            by_name(score(llama, attr, list(SOFT_BASE), options=opts, memo=memo)),
            by_name(score(llama, attr, list(SOFT_BASE), options=opts)),
        )
    assert not any(key[3].startswith(b"r") for key in memo.soft)


def test_a_memo_of_another_model_or_head_is_an_error(llama) -> None:
    attr = attributions(llama, ("random",))["random"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = tiny_llama(dtype=torch.float64)
    for memo in (ForwardMemo(other, None), ForwardMemo(llama, torch.nn.Identity())):
        with pytest.raises(ValueError, match="another model or head"):
            score(llama, attr, ["comprehensiveness"], options=OPTIONS, memo=memo)


def test_an_encoder_with_a_classifier_head(monkeypatch) -> None:
    """A head on a BERT encoder (the classifier tables' setting): the memo is keyed by the head
    the Target carries, and its scores equal the plain ones."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = tiny_bert(dtype=torch.float64)
    torch.manual_seed(0)
    head = torch.nn.Linear(int(bert.cfg.d_model), 2).to(torch.float64)
    target = Target(head=head, position=0, labels=["a", "b"])
    attrs = attributions(bert, ("grad_x_input", "attention", "random"), target)
    memo = ForwardMemo(bert, head)
    for attr in attrs.values():
        same(
            by_name(score(bert, attr, NAMES, options=OPTIONS, memo=memo)),
            by_name(score(bert, attr, NAMES, options=OPTIONS)),
        )
    assert memo.served > 0
