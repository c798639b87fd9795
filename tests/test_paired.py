"""Paired differences from a journal (``experiments.paired``).

Oracles: the mean of per-item differences computed by hand from the records written; the
Pearson-drop difference equal to the two methods' drops computed directly; units under other
settings (another unit-key suffix) kept apart; conflicting records an error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments import paired
from lens_attrib.evaluation import pearson_drop
from lens_attrib.evaluation.journal import Journal

RNG = np.random.default_rng(3)
N = 40
GOLD = RNG.uniform(0, 5, N)
FULL = GOLD + RNG.normal(0, 0.5, N)
CUTS = {"a": FULL[:, None] * [0.7, 0.4] + RNG.normal(0, 1, (N, 2)),
        "b": FULL[:, None] * [0.9, 0.8] + RNG.normal(0, 0.3, (N, 2))}  # fmt: skip
COMP = {"a": RNG.normal(0.5, 0.2, N), "b": RNG.normal(0.3, 0.2, N), "a[x=1]": RNG.normal(0, 1, N)}


def _records(method: str, label: str) -> list[dict]:
    rows = [
        {"dataset": "d", "item": i, "method": method, "metric": "comprehensiveness",
         "value": float(COMP[label][i])}
        for i in range(N)
    ]  # fmt: skip
    if label in CUTS:
        for i in range(N):
            rows.append({"dataset": "d", "item": i, "method": method, "metric": "output_full",
                         "value": float(FULL[i]), "gold": float(GOLD[i])})  # fmt: skip
            for k, f in enumerate((0.3, 0.6)):
                rows.append({"dataset": "d", "item": i, "method": method,
                             "metric": f"output_without_top@{f}", "value": float(CUTS[label][i, k]),
                             "gold": float(GOLD[i])})  # fmt: skip
    return rows


def _journal(tmp_path, labels=("a", "b", "a[x=1]")):
    path = tmp_path / "run" / "records.jsonl.gz"
    journal = Journal.open(path, {"experiment": "test"})
    for label in labels:
        method = label.split("[")[0]  # records carry the bare name; the key the label
        for start in range(0, N, 10):
            items = list(range(start, start + 10))
            rows = [r for r in _records(method, label) if r["item"] in items]
            journal.append(f"d:ab12|{label}", items, rows, batch_size=10, bucket=0)
    return path


def test_paired_mean_is_the_mean_of_item_differences(tmp_path) -> None:
    path = _journal(tmp_path)
    rows = paired.main([str(path.parent), "--metric", "comprehensiveness", "--pair", "a", "b",
                        "--pair", "a[x=1]", "a", "--n-boot", "2000"])  # fmt: skip
    want = float(np.mean(COMP["a"] - COMP["b"]))
    assert rows[0]["n"] == N and abs(rows[0]["difference"] - want) < 1e-12
    assert rows[0]["low"] < want < rows[0]["high"] and rows[0]["statistic"] == "mean"
    other = float(np.mean(COMP["a[x=1]"] - COMP["a"]))  # the variant's own units, not mixed
    assert abs(rows[1]["difference"] - other) < 1e-12


def test_paired_pearson_drop_equals_the_two_drops(tmp_path) -> None:
    path = _journal(tmp_path)
    (row,) = paired.main([str(path), "--metric", "pearson_drop", "--pair", "a", "b",
                          "--n-boot", "500", "--where", "dataset=d"])  # fmt: skip

    def drop(label: str) -> float:
        f, g = torch.as_tensor(FULL), torch.as_tensor(GOLD)
        return float(np.mean([pearson_drop(f, torch.as_tensor(CUTS[label][:, k]), g)
                              for k in range(2)]))  # fmt: skip

    want = drop("a") - drop("b")
    assert abs(row["difference"] - want) < 1e-12
    assert row["low"] <= want <= row["high"] and row["n"] == N


def test_paired_median_is_the_difference_of_medians_and_ignores_one_huge_item(tmp_path) -> None:
    """``--statistic median`` on a metric where one item of ``a`` is a thousand times the rest
    (an NC ratio over a near-zero ΔP₀): the mean difference follows that item, the difference
    of medians equals numpy's on the same items and its interval stays near it."""
    path = tmp_path / "run" / "records.jsonl.gz"
    journal = Journal.open(path, {"experiment": "test"})
    values = {"a": COMP["a"].copy(), "b": COMP["b"]}
    values["a"][7] = 1000.0
    for label, column in values.items():
        rows = [{"dataset": "d", "item": i, "method": label, "metric": "pi_soft_nc",
                 "value": float(column[i])} for i in range(N)]  # fmt: skip
        journal.append(f"d:ab12|{label}", list(range(N)), rows, batch_size=N, bucket=0)
    args = [str(path), "--metric", "pi_soft_nc", "--pair", "a", "b", "--n-boot", "2000"]
    (mean,) = paired.main(args)
    (median,) = paired.main([*args, "--statistic", "median"])
    assert mean["difference"] > 20  # one item of 40 sets the mean
    want = float(np.median(values["a"]) - np.median(values["b"]))
    assert median["statistic"] == "median" and abs(median["difference"] - want) < 1e-12
    assert median["low"] <= want <= median["high"] < 1
    with pytest.raises(SystemExit):
        paired.main([str(path), "--metric", "pearson_drop", "--pair", "a", "b",
                     "--statistic", "median"])  # fmt: skip


def test_two_values_for_one_item_are_an_error(tmp_path) -> None:
    path = _journal(tmp_path, labels=("a", "b"))
    journal = Journal.open(path, {"experiment": "test"})
    clash = [dict(r, value=r["value"] + 1) for r in _records("a", "a") if r["item"] == 0]
    journal.append("d:cd34|a", [0], clash, batch_size=1, bucket=0)
    with pytest.raises(ValueError, match="two different values"):
        paired.main([str(path), "--metric", "comprehensiveness", "--pair", "a", "b"])


def test_a_missing_method_is_named_with_the_methods_held(tmp_path) -> None:
    """A plain name whose units carry resolved options (``value_zeroing[aggregation=mean]``)
    is not found: the error lists the labels to use."""
    path = _journal(tmp_path, labels=("a",))
    with pytest.raises(ValueError, match=r"'b'.*\['a'\]"):
        paired.main([str(path), "--metric", "comprehensiveness", "--pair", "a", "b"])
