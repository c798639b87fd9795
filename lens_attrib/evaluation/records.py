"""Evaluation records: tidy rows, summaries with bootstrap confidence intervals, files, shards.

A *record* is one dict per item × method × metric (× layer) with at least ``item``, ``method``,
``metric``, ``layer`` and ``value``. Everything that evaluates (the runner, the experiments, the
benchmarks) produces records, summarizes them with :func:`summarize` (mean, std, n and a seeded
95% percentile-bootstrap interval of the mean over items) and writes them with :func:`save`
(``.json``: config, records, summary; ``.csv``: records, and the summary beside it).
:func:`merge_records` concatenates shard files into the records of one run.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.evaluation.stats import bootstrap_ci

KEY = ("item", "method", "metric", "layer")
"""The fields that identify a record."""


@dataclass
class EvalResult:
    """Tidy records (one dict per item × method × metric [× layer]) and their summary."""

    records: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        """The summary as a plain-text table (method × metric means)."""
        lines = [f"{'method':<20} {'metric':<24} {'mean':>10} {'n':>6}"]
        for row in self.summary:
            layer = "" if row.get("layer") is None else f"@{row['layer']}"
            lines.append(
                f"{row['method']:<20} {row['metric'] + layer:<24} "
                f"{row['mean']:>10.4f} {row['n']:>6}"
            )
        return "\n".join(lines)


GROUP = ("method", "metric", "layer")
"""The default grouping of :func:`summarize`."""


def summarize(
    records: Sequence[Mapping[str, Any]],
    by: Sequence[str] = GROUP,
    *,
    value: str = "value",
    level: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
    ordered: bool = True,
) -> list[dict[str, Any]]:
    """Mean, std, count and bootstrap interval of ``value`` per group of ``by`` fields.

    Rows are sorted by the ``by`` fields (``ordered=False``: in first-seen order).

    Default groups: method × metric × layer (experiments add fields such as ``task``).
    ``ci_low``/``ci_high``: the seeded percentile bootstrap of the mean over the group's records
    (:func:`lens_attrib.evaluation.stats.bootstrap_ci`, i.e. over items); NaN values are left
    out of everything but ``n_total``. When records carry a ``degenerate`` flag (scores constant
    over the valid tokens), ``degenerate`` counts the flagged records with a finite value.
    """
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault(tuple(r.get(k) for k in by), []).append(r)
    flagged = any("degenerate" in r for r in records)
    rows = []
    for key, group in groups.items():
        values = [r.get(value) for r in group]
        finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        n = len(finite)
        stat = bootstrap_ci(finite, level=level, n_resamples=n_resamples, seed=seed)
        var = sum((v - stat.mean) ** 2 for v in finite) / (n - 1) if n > 1 else float("nan")
        row = {
            **dict(zip(by, key)),
            "mean": stat.mean,
            "std": math.sqrt(var) if n > 1 else float("nan"),
            "n": n,
            "n_total": len(values),
            "ci_low": stat.low,
            "ci_high": stat.high,
        }
        if flagged:
            row["degenerate"] = sum(
                1
                for r in group
                if r.get("degenerate")
                and r.get(value) is not None
                and math.isfinite(float(r[value]))
            )
        rows.append(row)
    if ordered:
        rows.sort(key=lambda r: tuple(_order(r[k]) for k in by))
    return rows


def _order(value: Any) -> tuple[int, Any]:
    """Sort key that puts None first and never compares None with numbers or strings."""
    return (0, "") if value is None else (1, value)


# --------------------------------------------------------------------------- I/O
def _sort_key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["item"], r["method"], r["metric"], -1 if r.get("layer") is None else r["layer"])


def sort_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=_sort_key)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def save(result: EvalResult, path: str | Path) -> Path:
    """Write ``.json`` (config, records, summary) or ``.csv`` (records; summary beside it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        _write_csv(result.records, path)
        _write_csv(result.summary, path.with_name(path.stem + ".summary.csv"))
    else:
        payload = {
            "config": result.config,
            "records": [{k: _json_safe(v) for k, v in r.items()} for r in result.records],
            "summary": [{k: _json_safe(v) for k, v in r.items()} for r in result.summary],
        }
        path.write_text(json.dumps(payload, indent=1))
    return path


def _write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def load(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``.json`` or ``.csv`` file written by :func:`save`, or of a journal.

    A ``.jsonl`` journal (:mod:`lens_attrib.evaluation.journal`) gives the records of its
    finished batches, so the journals of unfinished shards can be merged too.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        from lens_attrib.evaluation.journal import load_journal_records

        return load_journal_records(path)
    if path.suffix == ".csv":
        with path.open() as fh:
            rows = list(csv.DictReader(fh))
        for r in rows:
            r["item"] = int(r["item"])
            r["value"] = float(r["value"]) if r["value"] not in ("", None) else float("nan")
            r["layer"] = int(r["layer"]) if r.get("layer") not in ("", None) else None
            r["method"] = r["method"]
        return rows
    rows = json.loads(path.read_text())["records"]
    for r in rows:
        r["value"] = float("nan") if r["value"] is None else float(r["value"])
    return rows


def merge_records(paths: Sequence[str | Path]) -> EvalResult:
    """Concatenate shard results (JSON, CSV or JSONL journals) into one sorted result.

    Raises if two shards hold the same item × method × metric × layer.
    """
    records: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    for p in sorted(Path(x) for x in paths):
        for r in load(p):
            key = tuple(r.get(k) for k in KEY)
            if key in seen:
                raise ValueError(f"Record {key} appears in more than one shard ({p}).")
            seen.add(key)
            records.append(r)
    records = sort_records(records)
    return EvalResult(records, summarize(records), {"merged": [str(p) for p in paths]})


# --------------------------------------------------------------------------- curves
@dataclass(frozen=True)
class CurvePoints:
    """A curve of every item, read back from records: ``values[i, k]`` at ``grid[k]``."""

    grid: list[float]
    values: Float[Tensor, "item point"]


def curve_points(records: Sequence[Mapping[str, Any]], prefix: str, **where: Any) -> CurvePoints:
    """The ``<prefix>@x`` records (e.g. ``comprehensiveness@0.3``, written by
    :attr:`lens_attrib.evaluation.metrics.MetricRecord.name`) of the records matching every
    ``field=value`` of ``where``, as ``[item, x]`` in ascending ``x`` and item order; a metric
    without ``@`` is one point at ``x = 0`` (e.g. ``output_full``)."""
    points: dict[float, dict[int, float]] = {}
    for r in records:
        if all(r.get(k) == v for k, v in where.items()) and r["metric"].startswith(prefix):
            x = float(r["metric"].split("@")[1]) if "@" in r["metric"] else 0.0
            points.setdefault(x, {})[r["item"]] = r["value"]
    grid = sorted(points)
    items = sorted(points[grid[0]]) if grid else []
    values = torch.tensor([[points[x][i] for x in grid] for i in items], dtype=torch.float64)
    return CurvePoints(grid, values)


@dataclass(frozen=True)
class AOPCCurves:
    """Per-item AOPC curves (the fields :func:`lens_attrib.plot.aopc_curves` reads)."""

    fractions: Float[Tensor, "fraction"]
    comprehensiveness_k: Float[Tensor, "item fraction"]
    sufficiency_k: Float[Tensor, "item fraction"]

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, Any]], **where: Any) -> AOPCCurves:
        comp = curve_points(records, "comprehensiveness@", **where)
        suff = curve_points(records, "sufficiency@", **where)
        return cls(torch.tensor(comp.grid), comp.values, suff.values)


@dataclass(frozen=True)
class PiCurves:
    """Per-item π-Soft curves (the fields :func:`lens_attrib.plot.pi_curves` reads)."""

    pis: Float[Tensor, "pi"]
    pi_nc_curve: Float[Tensor, "item pi"]
    pi_ns_curve: Float[Tensor, "item pi"]

    @classmethod
    def from_records(
        cls, records: Sequence[Mapping[str, Any]], routing: str = "dynamic", **where: Any
    ) -> PiCurves | None:
        """``None`` when the records hold no π-Soft curve points."""
        suffix = "" if routing == "dynamic" else "_fixed"
        nc = curve_points(records, f"pi_soft_nc{suffix}@", **where)
        if not nc.grid:
            return None
        ns = curve_points(records, f"pi_soft_ns{suffix}@", **where)
        return cls(torch.tensor(nc.grid), nc.values, ns.values)


__all__ = [
    "GROUP",
    "KEY",
    "AOPCCurves",
    "CurvePoints",
    "EvalResult",
    "PiCurves",
    "curve_points",
    "load",
    "merge_records",
    "save",
    "sort_records",
    "summarize",
]
