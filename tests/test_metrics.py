"""The evaluation layer's doors: metrics.score (registry, records, one computation per family),
scoring.correctness, items.load_task and the random baseline's one seeding rule."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from lens_attrib import Target, attribute
from lens_attrib.data import generate_sva
from lens_attrib.evaluation import faithfulness, metrics, soft
from lens_attrib.evaluation.items import item_evidence, load_task, method_options
from lens_attrib.evaluation.metrics import METRICS, MetricRecord, ScoreOptions, score
from lens_attrib.evaluation.plausibility import degenerate, plausibility
from lens_attrib.scoring import contrastive_scores, correctness
from lens_attrib.tiny_models import tiny_llama
from tests.tl_versions import BRIDGE

SOFT = {"pis": (0.3, 0.6), "n_draws": 2}


@pytest.fixture(scope="module")
def model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama(dtype=torch.float64)


@pytest.fixture(scope="module")
def items():
    return generate_sva(3, seed=2, n_attractors=(0, 1))


@pytest.fixture(scope="module")
def attr(model, items):
    target = Target(token=[it.target for it in items], foil=[it.foil for it in items])
    return attribute(model, [it.prompt for it in items], target, method="grad_x_input")


def _values(records, name):
    return torch.tensor([r.value for r in records if r.name == name], dtype=torch.float64)


def _same_forward_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal, on TransformerLens 3.9 bit for bit; on a bridge to float64 rounding (1e-12 of the
    largest |value|): ``score``'s shared clean forward keeps the attention patterns for the soft
    metrics, and a bridge's attention takes its eager kernel when a pattern is observed and the
    fused one when not (``backend_bridge._fused_forward``), so the clean logits differ by
    rounding (~2e-15 relative) from those of ``aopc`` called alone."""
    if not BRIDGE:
        return torch.equal(got, want)
    return float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())


def test_score_equals_the_metric_functions(model, items, attr):
    evidence = [item_evidence(model, it) for it in items]
    names = ["pointing_game", "mrr", "degenerate", "comprehensiveness", "sufficiency",
             "comprehensiveness_curve", "pi_soft_nc", "pi_soft_ns_curve",
             "soft_ns_fixed"]  # fmt: skip
    options = ScoreOptions(max_batch=5, seed=3, aopc={"fractions": (0.25, 0.5)}, soft=SOFT)
    got = score(model, attr, names, evidence=evidence, options=options)
    assert all(isinstance(r, MetricRecord) for r in got)
    plaus = plausibility(attr, evidence, ["pointing_game", "mrr"])
    assert torch.equal(_values(got, "pointing_game"), plaus["pointing_game"])
    assert torch.equal(_values(got, "mrr"), plaus["mrr"])
    assert torch.equal(_values(got, "degenerate"), degenerate(attr).double())
    res = faithfulness.aopc(model, attr, fractions=(0.25, 0.5), max_batch=5)
    assert _same_forward_values(_values(got, "comprehensiveness"), res.comprehensiveness)
    assert _same_forward_values(
        _values(got, "comprehensiveness@0.5"), res.comprehensiveness_k[:, 1]
    )
    dyn = soft.soft_metrics(model, attr, seed=3, max_batch=5, **SOFT)
    fixed = soft.soft_metrics(model, attr, seed=3, max_batch=5, routing="fixed", **SOFT)
    assert _same_forward_values(_values(got, "pi_soft_nc"), dyn.pi_soft_nc)
    assert _same_forward_values(_values(got, "pi_soft_ns@0.3"), dyn.pi_ns_curve[:, 0])
    assert _same_forward_values(_values(got, "soft_ns_fixed"), fixed.soft_ns)
    # items inside, one record per item × metric (× point)
    assert [r.item for r in got if r.name == "mrr"] == [0, 1, 2]
    assert len(got) == 3 * (len(names) + 2)  # two curves of two points each


def test_each_family_runs_once(model, attr, monkeypatch):
    calls: list[str] = []
    real_aopc, real_soft = metrics.aopc, metrics.soft_metrics
    monkeypatch.setattr(metrics, "aopc", lambda *a, **k: calls.append("aopc") or real_aopc(*a, **k))
    monkeypatch.setattr(
        metrics,
        "soft_metrics",
        lambda *a, **k: calls.append(k["routing"]) or real_soft(*a, **k),
    )
    names = ["sufficiency", "pi_soft_nc", "comprehensiveness", "soft_nc", "sufficiency_curve",
             "pi_soft_nc_fixed", "pi_soft_ns_fixed_curve"]  # fmt: skip
    got = score(model, attr, names, options=ScoreOptions(aopc={"fractions": (0.5,)}, soft=SOFT))
    assert sorted(calls) == ["aopc", "dynamic", "fixed"]
    # families in the order first asked, metrics in the order asked within a family
    assert list(dict.fromkeys(r.metric for r in got)) == [
        "sufficiency", "comprehensiveness", "sufficiency_curve", "pi_soft_nc", "soft_nc",
        "pi_soft_nc_fixed", "pi_soft_ns_fixed_curve",
    ]  # fmt: skip


def test_score_reads_the_targets_own_head(model, items):
    torch.manual_seed(0)
    head = torch.nn.Linear(model.cfg.d_model, 2, dtype=torch.float64)
    attr = attribute(model, [it.prompt for it in items], Target(head=head), method="gradient")
    assert attr.target.head is head and attr[1:].target.head is head
    got = score(model, attr, ["comprehensiveness", "accuracy_perturbation"], gold=[0, 1, 1])
    res = faithfulness.aopc(model, attr, head=head, gold=torch.tensor([0, 1, 1]))
    assert _same_forward_values(_values(got, "comprehensiveness"), res.comprehensiveness)
    assert torch.equal(_values(got, "accuracy_perturbation"), res.accuracy)
    own = faithfulness.aopc(
        model, attr, head=lambda x: model.unembed(model.ln_final(x[:, None]))[:, 0]
    )
    assert not torch.equal(own.comprehensiveness, res.comprehensiveness)


def test_per_layer_records_name_the_real_layers(model, items):
    attr = attribute(model, [it.prompt for it in items], None, method="normxlogit")
    evidence = [item_evidence(model, it) for it in items]
    got = score(model, attr, ["mrr"], evidence=evidence, options=ScoreOptions(per_layer=True))
    layers = [r.layer for r in got]
    assert layers[:3] == [None] * 3
    assert sorted(set(layers[3:])) == list(attr.meta.get("layers") or range(model.cfg.n_layers))
    per = plausibility(attr, evidence, ["mrr"], per_layer=True)["mrr"]
    assert [r.value for r in got if r.layer == layers[3]] == per[:, 0].tolist()


def test_score_errors_name_the_fix(model, attr):
    with pytest.raises(KeyError, match=r"unknown metrics.*pointing_gam"):
        score(model, attr, ["pointing_gam"])
    with pytest.raises(TypeError, match="list of names"):
        score(model, attr, "mrr")
    with pytest.raises(ValueError, match="need evidence="):
        score(model, attr, ["mrr"])
    with pytest.raises(KeyError, match="Unknown metric options"):
        ScoreOptions.from_dict({"n_draws": 3})
    assert (
        MetricRecord(0, "pi_soft_nc_fixed_curve", 1.0, point=0.25).name == "pi_soft_nc_fixed@0.25"
    )
    assert {"pointing_game", "soft_nc_fixed", "output_full", "deletion_flip",
            "deletion_flip_auc", "insertion_flip_auc"} <= set(METRICS)  # fmt: skip


def test_correctness_rules(model, items):
    prompts = [it.prompt for it in items]
    targets, foils = [it.target for it in items], [it.foil for it in items]
    both = correctness(model, prompts, targets, foils)
    assert both.correct == contrastive_scores(model, items).correct.tolist()
    assert torch.equal((both.logit_diff > 0), torch.tensor(both.correct))
    # batch-independent: one item per batch gives the same decisions and margins
    single = correctness(model, prompts, targets, foils, batch_size=1)
    assert single.correct == both.correct
    torch.testing.assert_close(single.logit_diff, both.logit_diff, rtol=1e-12, atol=1e-12)
    plain = correctness(model, prompts, targets)
    assert plain.correct == [bool(p == model.tokenizer.convert_tokens_to_ids(t.strip()))
                             for p, t in zip(plain.prediction.tolist(), targets)]  # fmt: skip
    assert bool(torch.isnan(plain.logit_diff).all())
    ids = [model.tokenizer.convert_tokens_to_ids(w) for w in ("is", "are")]
    among = correctness(model, prompts, [0, 1, 1], candidates=ids)
    assert among.correct == [p == g for p, g in zip(among.prediction.tolist(), [0, 1, 1])]
    none = correctness(model, prompts)
    assert none.correct == [None] * 3 and torch.equal(none.prediction, plain.prediction)
    with pytest.raises(ValueError, match="one of each per prompt"):
        correctness(model, prompts, targets[:2])


def test_tasks_come_through_one_door(tmp_path):
    assert [it.prompt for it in load_task("ra", 3, 1)] == [
        it.prompt for it in load_task("anaphora", 3, 1)
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "The keys", "target": " are", "evidence_words": [1]}))
    by_name = load_task("mine", None, files={"mine": path})
    assert [it.prompt for it in by_name] == [it.prompt for it in load_task(str(path), None)]
    with pytest.raises(KeyError, match=r"Unknown task 'nope'.*jsonl"):
        load_task("nope", 3)


def test_random_gets_the_run_seed_per_item(model, items):
    """The one seeding rule: an item's random scores depend on the run seed and the item, not
    on its batch."""
    assert method_options("random", 7) == {"seed": 7}
    assert method_options("random", 7, {"seed": 1}) == {"seed": 1}
    assert method_options("gradient", 7) == {}
    prompts = [it.prompt for it in items]
    whole = attribute(model, prompts, None, method="random", **method_options("random", 7))
    last = attribute(model, prompts[2:], None, method="random", **method_options("random", 7))
    assert torch.equal(whole.scores[2][whole.mask[2]], last.scores[0][last.mask[0]])
    other = attribute(model, prompts[2:], None, method="random", **method_options("random", 8))
    assert not torch.equal(other.scores, last.scores)
