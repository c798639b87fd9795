"""Which π each method's keep scores reach, read from a π-Soft run's journal (no model needed).

``python -m experiments.pi_reach docs/results/runs/pisoft-minilm-sst2``

π-Soft (Huang & Chan 2026, §3.1) keeps token ``i`` with probability ``s_i^α``, where
``s = max(r, 0) / max_j max(r_j, 0)`` (:func:`lens_attrib.evaluation.soft.keep_scores`) and ``α``
solves ``mean_i s_i^α = π``. As ``α`` runs over ``(0, ∞)`` the mean runs from the share of tokens
with ``s > 0`` down to the share with ``s = 1``, so a signed method whose scores are negative on
half the tokens cannot reach ``π > 0.5``, and no method reaches ``π`` below ``1/T`` on a
``T``-token item with one top token. Outside that range the solver returns the boundary ``α``
(``solve_alpha``), whose masks are deterministic (every ``s^α`` is 0 or 1): every draw of every
unreachable ``π`` at one end deletes the same tokens, the shared forwards evaluate that one mask
once, and the item's curve ``pi_soft_ns@π`` (or ``pi_soft_nc@π``) is exactly constant there.

So an item's reachable grid is its curves without their constant ends: a run of two or more
equal values (relative difference ≤ ``1e-9``) at the top of the grid marks those ``π``
unreachable, and so at the bottom. Both curves are read, and a ``π`` counts as unreachable only
where both are constant: π-Soft-NS is clipped at 0, so an item whose kept tokens never move the
prediction has a constant NS curve at reachable ``π`` too, while its NC curve still varies.

The read can err in two ways, both known. A single end value cannot be told apart from a
reachable one (the boundary then lies between that ``π`` and its neighbour), so at the grid's
two ends the shares are upper bounds. Next to a boundary, where ``s^α`` is close to 0 or 1 for
almost every token, all draws of a reachable ``π`` can give the boundary mask; it then reads as
unreachable, which it is in effect (its π-Soft value is the boundary's). With 15 draws over
≈ 20 tokens this is rare; ``tests/test_pi_reach.py`` checks the read against the solver's own
``SoftResult.pi_reached``.

Printed per method: the items read, the share of items whose scores reach each asked ``π``, and
the median over items of the largest reachable ``π``. A π-Soft mean over the grid at ``π`` that
most items of a method cannot reach measures that method's boundary mask, not its ranking; the
results pages state these shares next to the curves.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.common import format_table
from experiments.paired import IDENTITY, labelled_records, parse_where

REL_TOL = 1e-9
METRICS = ("pi_soft_ns", "pi_soft_nc")
DEFAULT_SHOWN = (0.1, 0.3, 0.5, 0.7, 0.8, 0.9)


def _equal(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(1.0, abs(a), abs(b))


def reachable_span(curve: Sequence[float]) -> tuple[int, int] | None:
    """Indices ``(first, last)`` of the grid points outside the curve's constant ends.

    A constant end is a run of ≥ 2 equal values at the start or the end of ``curve`` (values in
    increasing π). ``None`` when the whole curve is one constant run (no π reachable: e.g. every
    positive score ties at the maximum).
    """
    n = len(curve)
    if n == 0:
        return None
    if all(_equal(v, curve[0]) for v in curve):
        return None if n > 1 else (0, 0)
    last = n - 1
    while last > 0 and _equal(curve[last - 1], curve[n - 1]):
        last -= 1
    last = last - 1 if last < n - 1 else last  # the run [last, n-1] is unreachable
    first = 0
    while first < n - 1 and _equal(curve[first + 1], curve[0]):
        first += 1
    first = first + 1 if first > 0 else first
    return (first, last) if first <= last else None


def item_curves(
    records: Sequence[Mapping[str, Any]], metric: str, where: Mapping[str, Any]
) -> tuple[list[float], dict[str, dict[tuple[Any, ...], list[float]]]]:
    """The π grid of ``metric@π`` records and ``{method: {item key: curve over the grid}}`` for
    the items whose curve is complete and finite."""
    prefix = f"{metric}@"
    values: dict[str, dict[tuple[Any, ...], dict[float, float]]] = defaultdict(dict)
    grid: set[float] = set()
    for r in records:
        name = str(r.get("metric", ""))
        if not name.startswith(prefix) or any(r.get(k) != v for k, v in where.items()):
            continue
        pi = float(name[len(prefix) :])
        grid.add(pi)
        key = tuple(r.get(k) for k in IDENTITY if k != "metric")
        values[str(r["method"])].setdefault(key, {})[pi] = float(r["value"])
    pis = sorted(grid)
    curves = {
        method: {key: [per_pi[p] for p in pis] for key, per_pi in items.items()
                 if len(per_pi) == len(pis) and all(math.isfinite(per_pi[p]) for p in pis)}
        for method, items in values.items()
    }  # fmt: skip
    return pis, curves


def combined_span(spans: Sequence[tuple[int, int] | None]) -> tuple[int, int] | None:
    """The grid points reachable by any of the curves' spans (a ``π`` is unreachable only
    where every curve is on a constant end)."""
    held = [sp for sp in spans if sp is not None]
    if not held:
        return None
    return min(sp[0] for sp in held), max(sp[1] for sp in held)


def reach_table(
    records: Sequence[Mapping[str, Any]],
    shown: Sequence[float] = DEFAULT_SHOWN,
    where: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Per method: ``n`` items, ``reach@π`` (share of items reaching each shown ``π``) and
    ``median_max_pi`` (median over items of the largest reachable grid ``π``; 0 when none),
    from the items' π-Soft-NS and π-Soft-NC curves."""
    grids, curves = {}, {}
    for metric in METRICS:
        grids[metric], curves[metric] = item_curves(records, metric, where or {})
    pis = grids[METRICS[0]] or grids[METRICS[1]]
    if not pis:
        raise ValueError(
            "no pi_soft_ns@π / pi_soft_nc@π records in the journal: π-Soft curves are written "
            "by experiments.faithfulness with the soft metric group"
        )
    missing = [p for p in shown if not any(abs(p - q) < 1e-12 for q in pis)]
    if missing:
        raise ValueError(f"π = {missing} is not on the run's grid {pis}")
    rows = []
    methods = sorted(set(curves[METRICS[0]]) | set(curves[METRICS[1]]))
    for method in methods:
        keys = set().union(*(curves[m].get(method, {}) for m in METRICS))
        spans = [
            combined_span([reachable_span(curves[m][method][key]) for m in METRICS
                           if grids[m] == pis and key in curves[m].get(method, {})])
            for key in keys
        ]  # fmt: skip
        if not spans:
            continue
        row: dict[str, Any] = {"method": method, "n": len(spans)}
        for p in shown:
            j = min(range(len(pis)), key=lambda i: abs(pis[i] - p))
            row[f"reach@{p:g}"] = float(np.mean([s is not None and s[0] <= j <= s[1]
                                                 for s in spans]))  # fmt: skip
        row["median_max_pi"] = float(np.median([pis[s[1]] if s else 0.0 for s in spans]))
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m experiments.pi_reach", description=__doc__)
    parser.add_argument("journal", help="a π-Soft run's journal file or its folder")
    parser.add_argument(
        "--pis", default=",".join(f"{p:g}" for p in DEFAULT_SHOWN), help="π values to show"
    )
    parser.add_argument("--where", action="append", default=[], help="field=value filters")
    args = parser.parse_args(argv)
    shown = [float(p) for p in args.pis.split(",") if p.strip()]
    try:
        rows = reach_table(labelled_records(Path(args.journal)), shown, parse_where(args.where))
    except ValueError as err:
        parser.error(str(err))
    header = ["method", "n", *[f"π={p:g}" for p in shown], "median largest π"]
    table = [
        [r["method"], r["n"], *[f"{100 * r[f'reach@{p:g}']:.0f} %" for p in shown],
         f"{r['median_max_pi']:.2f}"]
        for r in rows
    ]  # fmt: skip
    print(format_table(table, header, fmt=str))
    return rows


if __name__ == "__main__":
    main()
