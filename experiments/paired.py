"""Paired differences between methods from a run's committed journal (no model needed).

``python -m experiments.paired docs/results/runs/aopc-minilm-sst2 --metric comprehensiveness
--pair normxlogit logat --pair decompx normxlogit``

For each pair ``(A, B)``: the difference of the two methods' statistic over the *same* items,
with a 95 % percentile bootstrap that resamples items jointly for both methods (so the
interval is of the difference, not of two independent means). Statistics:

- an item metric (e.g. ``comprehensiveness``, ``sufficiency``, ``accuracy_perturbation``,
  ``pg``): the mean over items of ``A_i − B_i``;
- with ``--statistic median``, an item metric's difference of medians over the same items,
  ``median_i A_i − median_i B_i``, items resampled jointly: for heavy-tailed metrics, e.g. the
  NC ratios of π-Soft, whose mean over items one item with a near-zero denominator ΔP₀ can
  set (:func:`experiments.faithfulness.median_lines`);
- ``pearson_drop`` (regression, STS-B): a dataset-level statistic,
  ``mean_K [r(ŷ, y) − r(ŷ \\ top K, y)]`` (:func:`lens_attrib.evaluation.pearson_drop`) from the
  records' ``output_full`` and ``output_without_top@K`` points and gold scores, computed for A
  and B on each resample of items and subtracted.

A method is named as in the journal's unit keys (``name`` plus its table suffix, e.g.
``integrated_gradients[max_steps=256]`` or ``grad_x_input[pooling=l1]``); ``--where
field=value`` picks a dataset / task / mode. Records of one (item, method, metric) that occur
twice with different values (units of two item sets in one journal) are an error, not averaged.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.common import format_table
from experiments.resume import journal_file
from lens_attrib.evaluation import pearson_drop
from lens_attrib.evaluation.journal import read_lines
from lens_attrib.evaluation.stats import bootstrap_ci

IDENTITY = ("task", "dataset", "mode", "specials", "item", "metric")


def labelled_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of the journal's finished units, its ``method`` replaced by the unit key's
    method part (``name`` + table suffix), so that units under other settings stay apart."""
    out = []
    for line in read_lines(journal_file(path)):
        if line.get("kind") != "batch":
            continue
        label = str(line["method"]).split("|")[1]
        out += [{**r, "method": label} for r in line["records"]]
    return out


def item_values(
    records: Sequence[Mapping[str, Any]], method: str, metric: str, where: Mapping[str, Any]
) -> dict[Any, float]:
    """``{item: value}`` of ``method``'s ``metric`` records matching ``where``."""
    values: dict[Any, float] = {}
    for r in records:
        if r["method"] != method or r["metric"] != metric:
            continue
        if any(r.get(k) != v for k, v in where.items()):
            continue
        key = tuple(r.get(k) for k in IDENTITY)
        if key in values and values[key] != r["value"]:
            raise ValueError(
                f"{method} {metric}: item {r.get('item')} has two different values in the "
                "journal (units of two item sets?); narrow it with --where"
            )
        values[key] = r["value"]
    return values


STATISTICS = ("mean", "median")


def paired_item_metric(
    records: Sequence[Mapping[str, Any]],
    a: str,
    b: str,
    metric: str,
    where: Mapping[str, Any],
    n_boot: int,
    seed: int,
    statistic: str = "mean",
) -> dict[str, Any]:
    """Over the items both have (finite values): ``mean_i (A_i − B_i)`` (``statistic="mean"``)
    or ``median_i A_i − median_i B_i`` (``"median"``), with its bootstrap CI over items."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    va, vb = item_values(records, a, metric, where), item_values(records, b, metric, where)
    if not va or not vb:
        missing = a if not va else b
        held = sorted({str(r["method"]) for r in records if r.get("metric") == metric})
        raise ValueError(
            f"no {metric!r} records of {missing!r} (where {dict(where)}); the journal's "
            f"methods with {metric!r} records, options as the run resolved them: {held}"
        )
    keys = [k for k in va if k in vb and math.isfinite(va[k]) and math.isfinite(vb[k])]
    if statistic == "mean":
        ci = bootstrap_ci([va[k] - vb[k] for k in keys], n_resamples=n_boot, seed=seed)
    else:
        xa = np.array([va[k] for k in keys], dtype=np.float64)
        xb = np.array([vb[k] for k in keys], dtype=np.float64)
        ci = bootstrap_ci(
            (xa, xb),
            statistic=lambda x, y: float(np.median(x) - np.median(y)),
            n_resamples=n_boot,
            seed=seed,
        )
    return {"pair": f"{a} − {b}", "metric": metric, "statistic": statistic, "n": ci.n,
            "difference": ci.mean, "low": ci.low, "high": ci.high}  # fmt: skip


def regression_points(
    records: Sequence[Mapping[str, Any]], method: str, where: Mapping[str, Any]
) -> tuple[list[Any], np.ndarray, np.ndarray, np.ndarray]:
    """(items, ŷ ``[n]``, ŷ without the top K ``[n, K]``, gold ``[n]``) of ``method``."""
    full: dict[Any, float] = {}
    gold: dict[Any, float] = {}
    cut: dict[float, dict[Any, float]] = {}
    for r in records:
        if r["method"] != method or any(r.get(k) != v for k, v in where.items()):
            continue
        item = r.get("item")
        if r["metric"] == "output_full":
            full[item], gold[item] = r["value"], r["gold"]
        elif r["metric"].startswith("output_without_top@"):
            cut.setdefault(float(r["metric"].split("@")[1]), {})[item] = r["value"]
    if not full or not cut:
        raise ValueError(f"no output_full / output_without_top@K records of {method!r}")
    grid = sorted(cut)
    items = sorted(i for i in full if all(i in cut[k] for k in grid))
    return (
        items,
        np.array([full[i] for i in items], dtype=np.float64),
        np.array([[cut[k][i] for k in grid] for i in items], dtype=np.float64),
        np.array([gold[i] for i in items], dtype=np.float64),
    )


def mean_pearson_drop(full: np.ndarray, cut: np.ndarray, gold: np.ndarray) -> float:
    """``mean_K pearson_drop(ŷ, ŷ \\ top K, y)``."""
    f, g = torch.as_tensor(full), torch.as_tensor(gold)
    return float(np.mean([pearson_drop(f, torch.as_tensor(cut[:, k]), g)
                          for k in range(cut.shape[1])]))  # fmt: skip


def paired_pearson_drop(
    records: Sequence[Mapping[str, Any]],
    a: str,
    b: str,
    where: Mapping[str, Any],
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    """Pearson drop of A minus that of B, items resampled jointly."""
    items_a, full_a, cut_a, gold_a = regression_points(records, a, where)
    items_b, full_b, cut_b, gold_b = regression_points(records, b, where)
    shared = sorted(set(items_a) & set(items_b))
    ia = [items_a.index(i) for i in shared]
    ib = [items_b.index(i) for i in shared]
    if not np.allclose(gold_a[ia], gold_b[ib]) or not np.allclose(full_a[ia], full_b[ib]):
        raise ValueError(f"{a} and {b}: the same items have different gold or full outputs")

    def diff(full, cut_a, cut_b, gold) -> float:
        return mean_pearson_drop(full, cut_a, gold) - mean_pearson_drop(full, cut_b, gold)

    with np.errstate(invalid="ignore", divide="ignore"):
        ci = bootstrap_ci(
            (full_a[ia], cut_a[ia], cut_b[ib], gold_a[ia]),
            statistic=diff,
            n_resamples=n_boot,
            seed=seed,
        )
    return {"pair": f"{a} − {b}", "metric": "pearson_drop", "statistic": "drop", "n": ci.n,
            "difference": ci.mean, "low": ci.low, "high": ci.high}  # fmt: skip


def parse_where(items: Sequence[str]) -> dict[str, Any]:
    """``["dataset=sst2", "mode=plain"]`` -> a dict (numbers stay text unless they parse)."""
    out: dict[str, Any] = {}
    for text in items:
        key, eq, value = text.partition("=")
        if not eq:
            raise SystemExit(f"--where {text!r}: expected field=value")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m experiments.paired", description=__doc__)
    parser.add_argument("journal", help="a run's journal file or its folder")
    parser.add_argument("--metric", required=True, help="e.g. comprehensiveness, pearson_drop")
    parser.add_argument(
        "--pair", nargs=2, action="append", required=True, metavar=("A", "B"),
        help="two methods as in the journal's unit keys; repeat for more pairs",
    )  # fmt: skip
    parser.add_argument(
        "--statistic", choices=STATISTICS, default="mean",
        help="an item metric's mean of differences (default) or difference of medians",
    )  # fmt: skip
    parser.add_argument("--where", action="append", default=[], help="field=value filters")
    parser.add_argument("--n-boot", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    records = labelled_records(args.journal)
    where = parse_where(args.where)
    rows = []
    if args.metric == "pearson_drop" and args.statistic != "mean":
        parser.error("--statistic applies to item metrics; pearson_drop is one value per run")
    for a, b in args.pair:
        if args.metric == "pearson_drop":
            rows.append(paired_pearson_drop(records, a, b, where, args.n_boot, args.seed))
        else:
            rows.append(paired_item_metric(records, a, b, args.metric, where, args.n_boot,
                                           args.seed, args.statistic))  # fmt: skip
    table = [
        [r["pair"], r["metric"], r["statistic"], r["n"],
         f"{r['difference']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}]"]
        for r in rows
    ]  # fmt: skip
    header = ["pair", "metric", "statistic", "n", "difference [95% CI]"]
    print(format_table(table, header, fmt=str))
    return rows


if __name__ == "__main__":
    main()
