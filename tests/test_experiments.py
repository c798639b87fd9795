"""Each experiment's ``main([...])`` runs end to end on SmolLM2 with tiny settings and writes
JSON + CSV + HTML whose keys and values make sense."""

from __future__ import annotations

import csv
import json
import math
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from experiments import common


@pytest.fixture(scope="module", autouse=True)
def shared_model(smollm2):
    """The experiments load their model through ``common.get_model``: hand them the fixture's."""
    common._MODELS[("smollm2-135m", "cpu")] = smollm2
    yield
    common._MODELS.pop(("smollm2-135m", "cpu"), None)


def _outputs(folder: Path, name: str) -> tuple[dict, list[dict]]:
    for ext in ("json", "csv", "html"):
        assert (folder / f"{name}.{ext}").stat().st_size > 0
    payload = json.loads((folder / f"{name}.json").read_text())
    assert {"config", "summary", "records", "table"} <= set(payload)
    with (folder / f"{name}.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(payload["summary"])
    assert "plotly" in (folder / f"{name}.html").read_text()
    return payload, rows


def _in_unit(value) -> bool:
    return value is None or 0.0 <= value <= 1.0


def test_agreement(tmp_path):
    from experiments import agreement

    out = agreement.main(
        [
            "--n",
            "2",
            "--tasks",
            "ra,linzen",
            "--methods",
            "grad_x_input,random",
            "--n-linzen",
            "4",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ]
    )
    payload, _ = _outputs(tmp_path, "agreement")
    wanted = {*agreement.METRICS.values(), *agreement.EXTRA_METRICS}
    assert {r["metric"] for r in payload["summary"]} == wanted
    assert {(r["mode"], r["specials"]) for r in payload["summary"]} == {
        ("contrastive", "in"),
        ("contrastive", "out"),
        ("plain", "in"),
        ("plain", "out"),
    }
    assert all(_in_unit(r["mean"]) for r in payload["summary"])
    assert payload["counts"]["ra"]["n_explained"] <= 2
    assert payload["counts"]["ra"]["n_explained"] == min(2, payload["counts"]["ra"]["n_correct"])
    assert payload["linzen"][-1]["n_attractors"] == "all" and _in_unit(
        payload["linzen"][-1]["accuracy"]
    )
    # one record per explained item × method × mode × specials × metric
    n = payload["counts"]["ra"]["n_explained"]
    assert len(payload["records"]) == n * 2 * 2 * 2 * 6
    assert "PG C" in out["table"] and "Gradient×Input" in out["table"]
    # the BOS-like prefix is special: excluding it can only move PG among real words
    assert payload["config"]["prefix"] == "<|endoftext|>"


def test_agreement_on_user_jsonl(tmp_path):
    from experiments import agreement
    from lens_attrib.data import generate_sva, word_spans

    rows = []
    for i, item in enumerate(generate_sva(20, seed=5)):
        row = {"prompt": item.prompt, "target": item.target, "foil": item.foil}
        if i % 2:
            row["evidence_spans"] = [list(word_spans(item.prompt)[w]) for w in item.evidence_words]
        else:
            row["evidence_words"] = list(item.evidence_words)
        rows.append(row)
    data = tmp_path / "my_items.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = agreement.main(
        ["--data", str(data), "--n", "20", "--methods", "grad_x_input,random", "--ci",
         "--n-boot", "200", "--device", "cpu", "--out", str(tmp_path / "out")]
    )  # fmt: skip
    payload, _ = _outputs(tmp_path / "out", "agreement")
    assert payload["config"]["tasks"] == ["my_items"]
    counts = payload["counts"]["my_items"]
    assert counts["n_scored"] == 20 and 0 < counts["n_explained"] <= 20
    n = counts["n_explained"]
    assert len(payload["records"]) == n * 2 * 2 * 2 * 6
    assert all(isinstance(r["degenerate"], bool) for r in payload["records"])
    for r in payload["summary"]:
        assert r["n"] == n and 0 <= r["degenerate"] <= n
        assert r["ci_low"] - 1e-12 <= r["mean"] <= r["ci_high"] + 1e-12
    assert "[my_items]" in out["table"] and "deg C" in out["table"] and " [" in out["table"]


def test_blimp_alignment(tmp_path):
    from experiments import blimp_alignment

    blimp_alignment.main(
        [
            "--n",
            "2",
            "--paradigms",
            "dna",
            "--methods",
            "normxlogit,embed_norm,random",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ]
    )
    payload, _ = _outputs(tmp_path, "blimp_alignment")
    n_layers = payload["n_layers"]
    layers = {
        m: sorted({r["layer"] for r in payload["summary"] if r["method"] == m})
        for m in ("normxlogit", "embed_norm", "random")
    }
    assert layers["embed_norm"] == [0]
    assert layers["normxlogit"] == list(range(1, n_layers + 1))
    assert layers["random"] == list(range(n_layers + 1))
    for r in payload["summary"]:
        if r["metric"] == "average_precision":
            assert 0.0 < r["mean"] <= 1.0
        else:
            assert -1.0 <= r["mean"] <= 1.0
    # random scores are the same at every layer
    rnd = {
        r["mean"]
        for r in payload["summary"]
        if r["method"] == "random" and r["metric"] == "dot_product"
    }
    assert len(rnd) == 1


def test_faithfulness(tmp_path):
    from experiments import faithfulness

    faithfulness.main(
        [
            "--mode",
            "zero-shot",
            "--n",
            "1",
            "--datasets",
            "sst2",
            "--methods",
            "grad_x_input,random",
            "--max-tokens",
            "12",
            "--pis",
            "0.3,0.7",
            "--n-draws",
            "1",
            "--fractions",
            "0.5",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ]
    )
    payload, _ = _outputs(tmp_path, "faithfulness")
    metrics = {r["metric"] for r in payload["summary"]}
    assert {
        "comprehensiveness",
        "sufficiency",
        "pi_soft_nc",
        "pi_soft_ns",
        "pi_soft_nc_fixed",
        "soft_nc",
        "soft_ns",
        "expected_retained_ns",
    } <= metrics
    for r in payload["summary"]:
        if r["metric"] in ("comprehensiveness", "sufficiency"):
            assert -1.0 <= r["mean"] <= 1.0
        elif r["metric"].startswith(("pi_soft_ns", "soft_ns")):
            # NS is clipped to [0, 1] per point; the π-AUC spans a grid of width 0.4
            assert r["mean"] is None or 0.0 <= r["mean"] <= 1.0
        elif r["metric"].startswith(("pi_soft_nc", "soft_nc")):
            # NC = H(p, q) / H(p, p0) may exceed 1 (a perturbation further than the baseline)
            assert r["mean"] is None or r["mean"] >= 0.0
    assert _in_unit(payload["accuracy"]["sst2"])


def test_faithfulness_classifiers(tmp_path, minilm, monkeypatch):
    """Classifier mode on MiniLM (SST-2 classification and STS-B regression), with heads
    trained on a few items in a temporary cache (the built-in ones are not trained here)."""
    from experiments import faithfulness
    from lens_attrib import classifiers

    monkeypatch.setattr(
        classifiers, "load_classifier", partial(classifiers.load_classifier, cache_dir=tmp_path)
    )
    monkeypatch.setattr(faithfulness, "load_classifier", classifiers.load_classifier)
    common._MODELS[("minilm-l6", "cpu")] = minilm
    try:
        faithfulness.main(
            [
                *("--model", "minilm-l6", "--n", "5", "--train-n", "24", "--dev-n", "8"),
                *("--methods", "normxlogit,alti_logit,random", "--fractions", "0.5"),
                *("--pis", "0.3,0.7", "--n-draws", "1", "--steps", "4", "--out", str(tmp_path)),
            ]
        )
    finally:
        common._MODELS.pop(("minilm-l6", "cpu"), None)
    payload, _ = _outputs(tmp_path, "faithfulness")
    assert payload["config"]["skipped_methods"] == ["alti_logit"]  # decoder only
    metrics = {(r["dataset"], r["metric"]) for r in payload["summary"]}
    assert {
        ("sst2", m)
        for m in ("accuracy_perturbation", "deletion_auc", "deletion_flip_auc", "pi_soft_ns_fixed")
    } <= metrics
    assert {("stsb", "comprehensiveness"), ("stsb", "pearson_drop")} <= metrics
    assert not any(d == "stsb" and m.startswith(("soft", "pi_soft")) for d, m in metrics)
    assert _in_unit(payload["accuracy"]["sst2"])
    assert -1.0 <= payload["accuracy"]["stsb"] <= 1.0
    for r in payload["summary"]:
        if r["metric"] in ("accuracy_perturbation", "deletion_auc", "insertion_auc",
                           "deletion_flip_auc", "insertion_flip_auc"):  # fmt: skip
            assert _in_unit(r["mean"])
        if r["metric"] == "pearson_drop":
            assert r["ci_low"] <= r["mean"] <= r["ci_high"]


def test_faithfulness_resumes_with_curves_and_pearson_drop(tmp_path, minilm, monkeypatch):
    """A --resume run computes only the new method's units; the old method's summary rows,
    Pearson drop included (made from the records' curve points), are unchanged. The resume
    starts from an empty classifier cache, as on a fresh machine: the classifier is retrained
    (to the same metadata but for its timings) and its units are still found."""
    from experiments import faithfulness
    from lens_attrib import classifiers

    cache = tmp_path / "cache"
    monkeypatch.setattr(
        faithfulness, "load_classifier", partial(classifiers.load_classifier, cache_dir=cache)
    )
    computed: list[str] = []
    real = faithfulness.classifier_unit
    monkeypatch.setattr(
        faithfulness, "classifier_unit", lambda *a, **k: computed.append(a[4]) or real(*a, **k)
    )
    common._MODELS[("minilm-l6", "cpu")] = minilm
    args = ["--model", "minilm-l6", "--datasets", "stsb", "--n", "6", "--train-n", "24",
            "--dev-n", "8", "--fractions", "0.3,0.6", "--batch-size", "3",
            "--out", str(tmp_path / "out")]  # fmt: skip
    try:
        first = faithfulness.main([*args, "--methods", "random"])
        assert computed == ["random", "random"]
        trained = {
            str(p.relative_to(cache)): json.loads(p.read_text()) for p in cache.rglob("head.json")
        }
        shutil.rmtree(cache)
        again = faithfulness.main([*args, "--methods", "random,embed_norm", "--resume"])
        retrained = {
            str(p.relative_to(cache)): json.loads(p.read_text()) for p in cache.rglob("head.json")
        }
    finally:
        common._MODELS.pop(("minilm-l6", "cpu"), None)
    assert computed == ["random", "random", "embed_norm", "embed_norm"]
    # The emptied cache was filled again, so the classifier was retrained; the retrain is
    # reproducible: its metadata equals the first one's but for the timings.
    assert trained.keys() == retrained.keys()
    assert _without_timings(trained) == _without_timings(retrained)
    old = [r for r in first["summary"] if r["method"] == "random"]
    new = [r for r in again["summary"] if r["method"] == "random"]
    assert old == new
    drops = {r["metric"] for r in old if r["metric"].startswith("pearson_drop")}
    assert drops == {"pearson_drop", "pearson_drop@0.3", "pearson_drop@0.6"}
    points = {r["metric"] for r in old}
    assert {"output_full", "output_without_top@0.3", "comprehensiveness@0.6"} <= points


def test_faithfulness_resume_keeps_the_journals_metric_set(tmp_path, minilm, monkeypatch, capsys):
    """A new journal records the flip-probability AUCs; a journal whose insertion/deletion units
    lack them (written before they existed) is resumed without them, so that a new method's
    units hold the same metrics as the old ones, and the run says so."""
    from experiments import faithfulness
    from lens_attrib import classifiers

    load = partial(classifiers.load_classifier, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(faithfulness, "load_classifier", load)
    common._MODELS[("minilm-l6", "cpu")] = minilm
    journal = tmp_path / "out" / "faithfulness.records.jsonl"
    args = ["--model", "minilm-l6", "--datasets", "sst2", "--n", "3", "--train-n", "24",
            "--dev-n", "8", "--metric-groups", "curves", "--steps", "4", "--batch-size", "3",
            "--out", str(tmp_path / "out")]  # fmt: skip

    def unit_metrics() -> dict[str, set[str]]:
        lines = [json.loads(ln) for ln in journal.read_text().splitlines()]
        return {ln["method"].split("|")[1]: {r["metric"] for r in ln["records"]}
                for ln in lines if ln.get("kind") == "batch"}  # fmt: skip

    try:
        faithfulness.main([*args, "--methods", "random"])
        assert set(faithfulness.FLIP_AUCS) <= unit_metrics()["random"]
        lines = journal.read_text().splitlines(keepends=True)
        old = []
        for ln in lines:  # the journal as written before the flip AUCs existed
            row = json.loads(ln)
            if row.get("kind") == "batch":
                row["records"] = [r for r in row["records"]
                                  if r["metric"] not in faithfulness.FLIP_AUCS]  # fmt: skip
            old.append(json.dumps(row) + "\n")
        journal.write_text("".join(old))
        capsys.readouterr()
        again = faithfulness.main([*args, "--methods", "random,embed_norm", "--resume"])
    finally:
        common._MODELS.pop(("minilm-l6", "cpu"), None)
    metrics = unit_metrics()
    assert metrics["embed_norm"] == metrics["random"]
    assert "deletion_auc" in metrics["embed_norm"]
    assert not set(faithfulness.FLIP_AUCS) & metrics["embed_norm"]
    assert not any(r["metric"] in faithfulness.FLIP_AUCS for r in again["summary"])
    assert "written before the flip-probability AUCs" in capsys.readouterr().out


def _without_timings(meta: object) -> object:
    """``meta`` with every ``*_seconds`` entry left out, at any depth."""
    if isinstance(meta, dict):
        return {k: _without_timings(v) for k, v in meta.items() if not k.endswith("_seconds")}
    if isinstance(meta, list):
        return [_without_timings(v) for v in meta]
    return meta


def _drop_unit(journal: Path, method: str, items: list[int]) -> None:
    """Remove one unit's line from a plain journal (a run that has not reached it yet)."""
    lines = journal.read_text().splitlines(keepends=True)
    kept = [
        ln
        for ln in lines
        if not (
            json.loads(ln).get("kind") == "batch"
            and json.loads(ln)["method"].endswith(f"|{method}")
            and json.loads(ln)["items"] == items
        )
    ]
    assert len(kept) == len(lines) - 1
    journal.write_text("".join(kept))


def test_faithfulness_so_far_scores_the_batches_every_method_finished(
    tmp_path, minilm, monkeypatch
):
    """--so-far on a journal that lacks one method's second batch: nothing computed, the
    journal untouched, and the table over the first batch's items only: its rows (Pearson
    drop included, whose gold must follow the items scored) are those of the finished run's
    records of those items."""
    from experiments import faithfulness
    from lens_attrib.evaluation.records import curve_points

    monkeypatch.setattr(
        faithfulness,
        "load_classifier",
        partial(faithfulness.load_classifier, cache_dir=tmp_path / "cache"),
    )
    common._MODELS[("minilm-l6", "cpu")] = minilm
    out = tmp_path / "out"
    args = ["--model", "minilm-l6", "--datasets", "stsb", "--n", "6", "--train-n", "24",
            "--dev-n", "8", "--fractions", "0.3,0.6", "--batch-size", "3",
            "--methods", "random,embed_norm", "--out", str(out)]  # fmt: skip
    computed: list[str] = []
    try:
        faithfulness.main(args)
        records = json.loads((out / "faithfulness.json").read_text())["records"]
        journal = out / "faithfulness.records.jsonl"
        _drop_unit(journal, "embed_norm", [3, 4, 5])
        before = journal.read_bytes()
        real = faithfulness.classifier_unit
        monkeypatch.setattr(
            faithfulness, "classifier_unit", lambda *a, **k: computed.append(a[4]) or real(*a, **k)
        )
        so_far = faithfulness.main([*args, "--so-far"])
    finally:
        common._MODELS.pop(("minilm-l6", "cpu"), None)
    assert computed == [] and journal.read_bytes() == before
    assert "so far: 3 of the run's 6 items" in so_far["table"]
    first = [r for r in records if r["item"] < 3]
    expected = faithfulness.summarize(first)
    for method in ("random", "embed_norm"):
        where = {"dataset": "stsb", "method": method}
        full = curve_points(first, "output_full", **where).values[:, 0]
        perturbed = curve_points(first, "output_without_top@", **where).values
        gold = torch.as_tensor(  # as the run holds it: torch's default float (float32)
            [next(r["gold"] for r in first if r["item"] == i) for i in range(3)]
        ).double()
        expected += faithfulness.pearson_drop_rows(
            "stsb", method, full, perturbed, gold, [0.3, 0.6], 0
        )
    assert so_far["summary"] == expected
    assert {r["metric"] for r in so_far["summary"]} >= {"pearson_drop", "comprehensiveness"}


def test_agreement_so_far_scores_the_batches_every_method_finished(tmp_path, monkeypatch):
    """--so-far on an agreement journal lacking one unit of the second batch: the summary is
    that of the first batch's records, nothing is computed and the journal is untouched; a
    run without its journal is refused."""
    from experiments import agreement

    args = ["--n", "3", "--n-pool", "12", "--tasks", "sva", "--batch-size", "2", "--device",
            "cpu", "--methods", "grad_x_input,random", "--out", str(tmp_path)]  # fmt: skip
    assert agreement.main(args)["counts"]["sva"]["n_explained"] == 3
    records = json.loads((tmp_path / "agreement.json").read_text())["records"]
    journal = tmp_path / "agreement.records.jsonl"
    _drop_unit(journal, "random|plain", [2])
    before = journal.read_bytes()
    computed: list[str] = []
    real = agreement.unit_records
    monkeypatch.setattr(
        agreement, "unit_records", lambda *a, **k: computed.append(a[5]) or real(*a, **k)
    )
    so_far = agreement.main([*args, "--so-far"])
    assert computed == [] and journal.read_bytes() == before
    assert so_far["summary"] == agreement.summarize([r for r in records if r["item"] < 2])
    assert "so far 2 of the 3 items" in so_far["table"]
    with pytest.raises(FileNotFoundError, match="no such journal"):
        agreement.main([*args[:-1], str(tmp_path / "elsewhere"), "--so-far"])


def test_prompt_labels_are_single_tokens(smollm2):
    from experiments import faithfulness
    from lens_attrib.data import load_boolq

    for dataset in ("sst2", "boolq"):
        a, b = faithfulness.label_ids(smollm2.tokenizer, dataset)
        assert a != b
    item = load_boolq(n=1)[0]
    prompt = faithfulness.make_prompt(smollm2.tokenizer, "boolq", item, 8, chat=True)
    assert prompt.startswith("<|im_start|>") and prompt.endswith("Answer:")
    plain = faithfulness.make_prompt(smollm2.tokenizer, "boolq", item, 8, chat=False)
    assert plain.endswith("Answer (true or false):")
    passage = plain.split("\nQuestion:")[0]
    assert len(smollm2.tokenizer(passage, add_special_tokens=False)["input_ids"]) <= 8


def test_speed(tmp_path):
    from experiments import speed

    out = speed.main(
        [
            "--methods",
            "gradient,embed_norm",
            "--lengths",
            "8,16",
            "--mem-length",
            "8",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ]
    )
    payload, _ = _outputs(tmp_path, "speed")
    times = [r for r in payload["summary"] if r["kind"] == "time"]
    assert {(r["method"], r["length"]) for r in times} == {
        (m, n) for m in ("forward", "gradient", "embed_norm") for n in (8, 16)
    }
    for r in times:
        assert r["seconds"] > 0 and math.isclose(
            r["ratio"],
            r["seconds"]
            / next(
                t["seconds"]
                for t in times
                if t["method"] == "forward" and t["length"] == r["length"]
            ),
        )
    mem = {r["method"]: r for r in payload["summary"] if r["kind"] == "memory"}
    assert set(mem) == {"forward", "gradient", "embed_norm"}
    assert all(0 <= r["largest_batch"] <= 4096 for r in mem.values())
    assert "×fwd @8" in out["table"]


def test_largest_batch_linear_fit():
    from experiments.speed import largest_batch

    gb = 2**30
    # mem(b) = 1 GB + 0.5 GB·b within 8 GB -> 14
    assert largest_batch(1.5 * gb, 2.0 * gb, 8 * gb, 4096) == 14
    assert largest_batch(1.5 * gb, 2.0 * gb, 1 * gb, 4096) == 0
    assert largest_batch(1.0, 2.0, 8 * gb, 4096) == 4096  # capped
    # a noisy non-increasing measurement still gives a finite, positive slope
    assert 0 < largest_batch(2 * gb, 1.9 * gb, 8 * gb, 4096) < 4096


def test_nc_medians_under_the_table_are_not_moved_by_one_item():
    """One item with a tiny ΔP₀ sets the mean of its column; the median line does not follow
    it, names it, and bounds its ΔP₀; without NC records there is no median table."""
    from experiments.faithfulness import median_lines

    def rec(method: str, metric: str, item: int, value: float) -> dict[str, Any]:
        return {"dataset": "sst2", "method": method, "metric": metric, "item": item,
                "value": value}  # fmt: skip

    values = {"ig": [0.5, 0.9, 1.2, 400.0], "random": [0.4, 0.6, 0.7, math.nan]}
    records = [
        rec(m, "pi_soft_nc_fixed", i, v) for m, vs in values.items() for i, v in enumerate(vs)
    ] + [rec("ig", "pi_soft_ns", 0, 0.3), rec("ig", "pi_soft_nc_fixed@0.5", 0, 9000.0)]
    lines = median_lines(records, "sst2", ["ig", "random"])
    assert "πNC fix ↑ 400.0 (ig, item 3; " in lines[0] and "ΔP₀ ≤ 0.0025 there" in lines[0]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1].splitlines()[2:]}
    assert rows == {"ig": ["1.050"], "random": ["0.600"]}  # NaN left out, 400 not followed
    assert median_lines(records, "stsb", ["ig"]) == []
    assert median_lines([rec("ig", "comprehensiveness", 0, 0.2)], "sst2", ["ig"]) == []


def test_format_table_and_json_safe():
    table = common.format_table([["a", 0.5, float("nan")], ["bb", 1, None]], ["m", "x", "y"])
    lines = table.splitlines()
    assert lines[0].split() == ["m", "x", "y"] and set(lines[1]) <= {"-", " "}
    assert "0.500" in lines[2] and "–" in lines[2]
    assert common.json_safe({"a": [float("nan"), 1.0]}) == {"a": [None, 1.0]}
    assert common.pct(0.456) == "46" and common.pct(float("nan")) == "–"


def test_bootstrap_ci_is_seeded_and_brackets_the_mean():
    import numpy as np

    from lens_attrib.evaluation.stats import bootstrap_ci as mean_ci

    def bootstrap_ci(values, n_boot=1000, seed=0):
        stat = mean_ci(values, n_resamples=n_boot, seed=seed)
        return stat.low, stat.high

    values = [0.0, 1.0, 1.0, 0.5, float("nan"), 0.25]
    low, high = bootstrap_ci(values, n_boot=500, seed=3)
    assert (low, high) == bootstrap_ci(values, n_boot=500, seed=3)
    assert low < np.nanmean(values) < high and 0.0 <= low and high <= 1.0
    assert bootstrap_ci([0.4] * 7) == pytest.approx((0.4, 0.4), abs=1e-12)
    assert all(math.isnan(v) for v in bootstrap_ci([float("nan")]))
    # the percentile interval of an independent resampling of the same size agrees loosely
    rng = np.random.default_rng(0)
    data = rng.uniform(size=200)
    low, high = bootstrap_ci(list(data), n_boot=2000, seed=1)
    half = 1.96 * data.std(ddof=1) / np.sqrt(data.size)
    assert abs((high - low) / 2 - half) < 0.2 * half


def test_agreement_resumes_from_its_journal(tmp_path, monkeypatch):
    """A rerun with --resume computes only the units the journal lacks and gives the same
    records; an existing journal is never overwritten without --overwrite."""
    from experiments import agreement

    args = ["--n", "3", "--tasks", "sva", "--batch-size", "2", "--device", "cpu",
            "--out", str(tmp_path)]  # fmt: skip
    first = agreement.main([*args, "--methods", "grad_x_input,random"])
    journal = tmp_path / "agreement.records.jsonl"
    lines = journal.read_text().splitlines()
    n = first["counts"]["sva"]["n_explained"]
    batches = -(-n // 2)
    assert len(lines) == 1 + batches * 2 * 2  # manifest + batches × modes × methods
    assert all(json.loads(ln)["info"]["code"] for ln in lines[1:])

    with pytest.raises(FileExistsError, match="--resume"):
        agreement.main([*args, "--methods", "grad_x_input"])
    assert journal.read_text().splitlines() == lines

    computed: list[str] = []
    real = agreement.unit_records
    monkeypatch.setattr(
        agreement,
        "unit_records",
        lambda *a, **k: computed.append(a[5]) or real(*a, **k),
    )
    again = agreement.main([*args, "--methods", "grad_x_input,random,gradient", "--resume"])
    assert set(computed) == {"gradient"} and len(computed) == batches * 2
    old = [r for r in first["summary"] if r["method"] != "gradient"]
    new = [r for r in again["summary"] if r["method"] != "gradient"]
    assert old == new

    with pytest.raises(ValueError, match="n: 3 -> 2"):
        agreement.main([*args[:1], "2", *args[2:], "--methods", "random", "--resume"])


def test_agreement_split_over_processes_merges_into_one_journal(tmp_path, monkeypatch):
    """Two processes of one run on disjoint tasks, each with its own compressed journal: after
    merge_journals the run's command over both tasks computes nothing and gives each task's
    records as its process computed them."""
    from experiments import agreement, merge_journals
    from lens_attrib.evaluation.journal import read_lines

    main_journal, ra_journal = tmp_path / "records.jsonl.gz", tmp_path / "records.ra.jsonl.gz"
    args = ["--n", "3", "--batch-size", "2", "--device", "cpu", "--methods",
            "grad_x_input,random", "--out", str(tmp_path)]  # fmt: skip
    sva = agreement.main([*args, "--tasks", "sva", "--journal", str(main_journal)])
    ra = agreement.main([*args, "--tasks", "ra", "--journal", str(ra_journal)])
    n_sva, n_ra = (len(read_lines(j)) - 1 for j in (main_journal, ra_journal))
    assert n_sva and n_ra
    assert merge_journals.main([str(main_journal), str(ra_journal)]) == 0
    assert len(read_lines(main_journal)) == 1 + n_sva + n_ra
    assert merge_journals.main([str(main_journal), str(ra_journal)]) == 0  # nothing added
    assert len(read_lines(main_journal)) == 1 + n_sva + n_ra

    computed: list[str] = []
    real = agreement.unit_records
    monkeypatch.setattr(
        agreement, "unit_records", lambda *a, **k: computed.append(a[5]) or real(*a, **k)
    )
    both = agreement.main([*args, "--tasks", "sva,ra", "--journal", str(main_journal), "--resume"])
    assert computed == []
    for task, alone in (("sva", sva), ("ra", ra)):
        merged = [r for r in both["summary"] if r["task"] == task]
        assert merged == alone["summary"] and merged


def test_predicted_scores_each_prompt_once_per_start_token(smollm2, monkeypatch):
    """qa's tuning split re-draws the reported questions: a prompt already scored is not
    forwarded again, and the answers equal an uncached scoring; another start token re-scores."""
    from experiments import agreement
    from lens_attrib.inputs import set_start_token

    tok = smollm2.tokenizer
    prompts = ["The cat sat on the", "Paris is the capital of", "One, two, three,"]
    answers = [
        tok(w, add_special_tokens=False)["input_ids"][0] for w in (" mat", " France", " four")
    ]
    fresh = [bool(c) for c in agreement.correctness(smollm2, prompts, answers).correct]
    scored: list[list[str]] = []
    real = agreement.correctness
    monkeypatch.setattr(
        agreement, "correctness", lambda m, p, a, **k: scored.append(list(p)) or real(m, p, a, **k)
    )
    monkeypatch.setattr(agreement, "_PREDICTED", agreement.weakref.WeakKeyDictionary())
    assert agreement.predicted(smollm2, prompts[:2], answers[:2]) == fresh[:2]
    assert agreement.predicted(smollm2, prompts[::-1], answers[::-1]) == fresh[::-1]
    assert [sorted(p) for p in scored] == [sorted(prompts[:2]), prompts[2:]]
    before = getattr(smollm2, "lens_attrib_start_token", None)
    set_start_token(smollm2, False)
    try:
        agreement.predicted(smollm2, prompts[:1], answers[:1])
    finally:
        set_start_token(smollm2, before)
    assert scored[-1] == prompts[:1]


def test_qa_screening_is_journaled_and_read_back_on_resume(smollm2, monkeypatch, tmp_path):
    """qa's screening (which questions the model answers) is one journal unit: a resumed run
    reads it instead of forwarding the questions again, and prepares the same items."""
    from experiments import agreement
    from experiments.resume import Units

    def prepare(resume: bool) -> tuple[Any, list[int]]:
        monkeypatch.setattr(agreement, "_PREDICTED", agreement.weakref.WeakKeyDictionary())
        forwarded: list[int] = []
        real = agreement.correctness
        monkeypatch.setattr(
            agreement,
            "correctness",
            lambda m, p, a, **k: forwarded.append(len(p)) or real(m, p, a, **k),
        )
        units = Units(None, "agreement", {"n_qa": 8}, resume=resume, journal=journal)
        data = agreement.prepare_qa(smollm2, 2, 8, 0, 160, units)
        return data, forwarded

    journal = tmp_path / "records.jsonl.gz"
    first, forwarded = prepare(resume=False)
    assert sum(forwarded) == first.n_total > 0
    again, forwarded = prepare(resume=True)
    assert forwarded == []
    assert again == first
    lines = Units(None, "agreement", {"n_qa": 8}, resume=True, journal=journal)
    keys = [b["method"] for b in lines.journal.batches]
    assert len(keys) == 1 and keys[0].startswith("qa:") and keys[0].endswith("|screening")


def test_qa_scope_is_the_context_and_holds_the_evidence(smollm2):
    """qa's scope is the context's tokens: they decode to the context, the answer's evidence
    lies inside it, and the question's tokens are outside it."""
    from experiments import agreement

    start = agreement.start_token_of(smollm2)
    for item in agreement.load_squad_v2(n=6, seed=0):
        scope = agreement.answer_positions(smollm2, item.prompt, [agreement.context_span(item)])
        evidence = agreement.answer_positions(smollm2, item.prompt, item.meta["prompt_char_spans"])
        ids, _ = agreement.prompt_ids(smollm2, item.prompt, start)
        text = smollm2.tokenizer.decode([int(ids[p]) for p in scope])
        assert text.strip() == item.meta["context"].strip()
        assert evidence and set(evidence) <= set(scope)
        assert scope == list(range(scope[0], scope[-1] + 1))
        assert scope[0] >= 2 and max(scope) < len(ids) - 3  # "Question: …\nAnswer:" follows
