"""Runner: tidy records, summary, shards merging to the full run, JSON/CSV round trips, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch

from lens_attrib.data import generate_sva
from lens_attrib.evaluation import cli, runner
from lens_attrib.evaluation.runner import evaluate, merge_records, summarize
from lens_attrib.tiny_models import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:π unreachable:RuntimeWarning")

METRICS = [
    "pointing_game",
    "mrr",
    "comprehensiveness",
    "deletion_auc",
    "soft_ns",
    "pi_soft_nc_fixed",
]
OPTS = {"soft": {"n_draws": 2, "pis": (0.3, 0.6)}, "aopc": {"fractions": (0.2, 0.6)}}


@pytest.fixture(scope="module")
def model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama(dtype=torch.float64)


@pytest.fixture(scope="module")
def dataset():
    return generate_sva(5, seed=1, n_attractors=(0, 1))


@pytest.fixture(scope="module")
def full(model, dataset):
    return evaluate(
        model,
        dataset,
        ["grad_x_input", "gradient"],
        METRICS,
        batch_size=2,
        contrastive=True,
        metric_options=OPTS,
        progress=False,
    )


def _value_map(records):
    return {(r["item"], r["method"], r["metric"], r["layer"]): r["value"] for r in records}


def test_records_are_tidy(full, dataset, model):
    n = len(dataset)
    assert len(full.records) == n * (2 * len(METRICS) + 1)
    keys = {(r["item"], r["method"], r["metric"]) for r in full.records}
    assert len(keys) == len(full.records)
    correct = [r for r in full.records if r["metric"] == "model_correct"]
    assert all(r["value"] in (0.0, 1.0) for r in correct)
    for r in full.records:
        assert {"item", "method", "metric", "value", "correct", "prompt", "target"} <= set(r)
    # evidence is the subject noun (word 1 -> token 2 after <bos>): check one pointing game
    from lens_attrib import Target, attribute

    it = dataset[0]
    attr = attribute(model, [it.prompt], Target(it.target, foil=it.foil), method="gradient")
    scores = attr.scores[0, 1:]  # BOS excluded
    expect = float(int(torch.argmax(scores)) + 1 == 2)
    assert _value_map(full.records)[(0, "gradient", "pointing_game", None)] == expect


def test_summary_is_the_mean_of_records(full):
    for row in full.summary:
        vals = [
            r["value"]
            for r in full.records
            if r["method"] == row["method"]
            and r["metric"] == row["metric"]
            and not math.isnan(r["value"])
        ]
        assert row["n"] == len(vals)
        assert row["mean"] == pytest.approx(sum(vals) / len(vals))
    assert "grad_x_input" in full.table()


def test_shards_merge_to_the_full_run(model, dataset, full, tmp_path):
    paths = []
    for i in range(2):
        out = tmp_path / f"shard{i}.json"
        evaluate(
            model,
            dataset,
            ["grad_x_input", "gradient"],
            METRICS,
            batch_size=2,
            contrastive=True,
            metric_options=OPTS,
            progress=False,
            shard=(i, 2),
            out=out,
        )
        paths.append(out)
    merged = merge_records(paths[::-1])
    a, b = _value_map(merged.records), _value_map(full.records)
    assert a.keys() == b.keys()
    for k in a:  # every item was computed in the same batch: exactly equal
        assert (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k], k
    assert [(r["method"], r["metric"]) for r in merged.summary] == [
        (r["method"], r["metric"]) for r in full.summary
    ]
    with pytest.raises(ValueError, match="more than one shard"):
        merge_records(
            [paths[0], paths[0].with_name("copy.json")]
            if paths[0].with_name("copy.json").write_text(paths[0].read_text())
            else []
        )


def test_json_and_csv_round_trip(full, tmp_path):
    runner.save(full, tmp_path / "r.json")
    runner.save(full, tmp_path / "r.csv")
    payload = json.loads((tmp_path / "r.json").read_text())
    assert len(payload["records"]) == len(full.records)
    assert (tmp_path / "r.summary.csv").exists()
    for p in ("r.json", "r.csv"):
        back = merge_records([tmp_path / p])
        a, b = _value_map(back.records), _value_map(full.records)
        assert a.keys() == b.keys()
        assert all(
            (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == pytest.approx(b[k]) for k in a
        )


def test_only_correct_skips_wrong_items(model, dataset, full):
    res = evaluate(
        model,
        dataset,
        ["gradient"],
        ["mrr"],
        batch_size=5,
        contrastive=True,
        only_correct=True,
        progress=False,
    )
    correct = {r["item"] for r in full.records if r["metric"] == "model_correct" and r["value"]}
    assert {r["item"] for r in res.records if r["metric"] == "mrr"} == correct


def test_summarize_ignores_nan():
    rows = summarize(
        [
            {"method": "m", "metric": "x", "value": 1.0},
            {"method": "m", "metric": "x", "value": float("nan")},
            {"method": "m", "metric": "x", "value": 3.0},
        ]
    )
    assert rows[0]["mean"] == 2.0 and rows[0]["n"] == 2 and rows[0]["n_total"] == 3


def test_cli(model, monkeypatch, tmp_path, capsys):
    import lens_attrib.models as models

    monkeypatch.setattr(models, "load_model", lambda name: model)
    out = tmp_path / "x.json"
    res = cli.main(
        [
            "--model",
            "tiny",
            "--task",
            "sva",
            "--methods",
            "grad_x_input,gradient",
            "--metrics",
            "pointing_game,mrr",
            "--n",
            "4",
            "--shard",
            "1/2",
            "--batch-size",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert out.exists()
    # shard 1 of 2 = the 2nd and 4th batch of the plan sorted by (token length, index)
    lengths = runner.token_lengths(model, generate_sva(4, seed=0))
    order = sorted(range(4), key=lambda i: (lengths[i], i))
    assert sorted({r["item"] for r in res.records}) == sorted([order[1], order[3]])
    assert "pointing_game" in capsys.readouterr().out


def test_plausibility_metrics_refuse_items_without_evidence(model, dataset):
    # the linzen task's items name no evidence: every pointing-game record would be NaN
    bare = [dataclasses.replace(item, evidence_words=()) for item in dataset]
    with pytest.raises(ValueError, match=r"none of the 5 items names evidence.*linzen"):
        evaluate(model, bare, ["gradient"], ["comprehensiveness", "pointing_game"], progress=False)
    kept = evaluate(
        model, bare, ["gradient"], ["comprehensiveness"], metric_options=OPTS, progress=False
    )
    assert "comprehensiveness" in {r["metric"] for r in kept.records}
    # items with and without evidence mixed: the bare ones are NaN and left out of the mean
    mixed = [bare[0], *dataset[1:]]
    res = evaluate(model, mixed, ["gradient"], ["pointing_game"], progress=False)
    values = {r["item"]: r["value"] for r in res.records if r["metric"] == "pointing_game"}
    assert math.isnan(values[0]) and all(math.isfinite(values[i]) for i in range(1, 5))
    (pg,) = [row for row in res.summary if row["metric"] == "pointing_game"]
    assert pg["n"] == 4 and pg["n_total"] == 5
