"""One IG pass for a batch's signed unit and its pooled sibling (``experiments.pooling_share``).

Oracles: each variant computed by its own call (float64, to 1e-12); the calls made, counted;
a faithfulness run holding both variants writes the records of two runs holding one each.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from experiments.pooling_share import PoolingShare, is_pooled, sibling_group
from lens_attrib.method_variants import base_method
from lens_attrib.methods.registry import attribute
from lens_attrib.tiny_models import tiny_llama

F64 = torch.float64
PROMPTS = ["the dog sees the cat near the house", "a man likes books"]
IG, L1, L2 = (
    "integrated_gradients",
    "integrated_gradients[pooling=l1]",
    "integrated_gradients[pooling=l2]",
)
OPTIONS = {
    IG: {"max_steps": 64},
    L1: {"max_steps": 64, "pooling": "l1"},
    L2: {"max_steps": 64, "pooling": "l2"},
    "grad_x_input": {},
    "integrated_gradients[max_steps=32]": {"max_steps": 32},
}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(dtype=F64)


def _caller(model, calls: list[str]):
    def call(label: str, options: dict) -> object:
        calls.append(label)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return attribute(model, PROMPTS, method=base_method(label), **options)

    return call


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_siblings_are_the_same_method_with_the_same_options_but_pooling() -> None:
    assert sibling_group(IG, OPTIONS[IG]) == sibling_group(L1, OPTIONS[L1])
    assert sibling_group(IG, OPTIONS[IG]) != sibling_group(
        "integrated_gradients[max_steps=32]", {"max_steps": 32}
    )
    assert sibling_group("grad_x_input", {}) is None  # records no signed scores
    assert is_pooled(OPTIONS[L1]) and not is_pooled(OPTIONS[IG])


@pytest.mark.parametrize("order", [(IG, L1), (L1, IG)])
def test_a_signed_and_a_pooled_unit_share_one_call(model, order) -> None:
    calls: list[str] = []
    share = PoolingShare(OPTIONS, [IG, L1, "grad_x_input"])
    got = {m: share.attribution(m, _caller(model, calls)) for m in order}
    assert calls == [L1]  # the pooled call, once, whichever unit comes first
    alone: list[str] = []
    for m in order:
        own = _caller(model, alone)(m, OPTIONS[m])
        assert _rel(got[m].scores, own.scores) < 1e-12, m
        assert got[m].meta["options"]["pooling"] == OPTIONS[m].get("pooling", "sum")
        assert torch.equal(got[m].meta["completeness_gap"], own.meta["completeness_gap"])
    assert not share.kept  # nothing left over


def test_a_unit_whose_sibling_is_journaled_is_computed_alone(model) -> None:
    calls: list[str] = []
    share = PoolingShare(OPTIONS, [IG])  # the ℓ1 unit came from the journal
    share.attribution(IG, _caller(model, calls))
    assert calls == [IG]
    calls.clear()
    share = PoolingShare(OPTIONS, [L1])
    share.attribution(L1, _caller(model, calls))
    assert calls == [L1] and not share.kept


def test_two_pooled_siblings_each_need_their_pass_and_feed_the_signed_one(model) -> None:
    calls: list[str] = []
    share = PoolingShare(OPTIONS, [IG, L1, L2, "integrated_gradients[max_steps=32]"])
    for m in (IG, L1, L2, "integrated_gradients[max_steps=32]"):
        share.attribution(m, _caller(model, calls))
    assert calls == [L1, L2, "integrated_gradients[max_steps=32]"]


def test_a_faithfulness_run_with_both_variants_writes_the_records_of_two_runs(
    tmp_path, monkeypatch
) -> None:
    """MiniLM in float64 with a seeded random head (``tests/experiments_small.py``)."""
    from experiments import faithfulness
    from tests.experiments_small import faithfulness_on_random_heads, journal_values

    calls = faithfulness_on_random_heads(monkeypatch)

    def run(methods: str, name: str):
        journal = tmp_path / name / "records.jsonl.gz"
        faithfulness.main(
            [
                *("--model", "minilm-l6", "--datasets", "sst2", "--n", "3"),
                *("--methods", methods, "--fractions", "0.5"),
                *("--metric-groups", "aopc", "--out", str(tmp_path / name)),
                *("--journal", str(journal)),
            ]
        )
        return journal_values(journal)

    both = run(f"{IG},{L1}", "both")
    assert [c.get("pooling", "sum") for c in calls] == ["l1"]  # one IG pass
    calls.clear()
    signed = run(IG, "signed")
    pooled = run(L1, "pooled")
    assert [c.get("pooling", "sum") for c in calls] == ["sum", "l1"]
    alone = {**signed, **pooled}
    assert both.keys() == alone.keys()
    assert {m for m, _, _ in both} == {IG, L1}
    for key, value in alone.items():
        assert both[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
