"""How the experiments call the methods whose table protocol is not the library's default call.

Every experiment explains a unit with ``attribute(model, inputs, target, method=m,
**experiment_options(m, …))``. Besides the ``random`` baseline's seed
(:func:`lens_attrib.evaluation.items.method_options`) three methods get table settings here:

- ``value_zeroing``: ``aggregation="mean"`` on decoders (``--vz-aggregation auto``), the mean of
  the per-layer context-mixing rows — Inseq's default aggregation; the π-Soft paper (Huang &
  Chan) ran its baselines through Inseq at their defaults (its App. A), value zeroing among
  them. The authors' rollout (Mohebbi et al.) drains
  every row of a causal model onto the start token (the method's docstring: ≥ 0.999999 on it in
  every SmolLM2 item). Encoders keep the rollout: the NormXLogit paper (its Figure 6, "the
  inherent limitations of the rollout aggregation") reports value zeroing rolled out on BERT.
- ``integrated_gradients``: ``--ig-max-steps`` caps the adaptive rule's integrand evaluations
  (library default 1024). Capped or not, every IG unit also gives one ``completeness_gap``
  record per item: ``|f(x) − f(b) − Σ_i R_i| / |f(x) − f(b)|`` (from ``meta["completeness_gap"]``
  and ``meta["relevance_sum"]``), and every table states its distribution and the share of
  items above 1 % (:func:`gap_lines`), so that a converged cell and a capped cell never look
  alike.
- ``grad_ellm``: ``n_layers`` as chosen per task/dataset (:mod:`experiments.grad_ellm_depth`).

A unit's journal key carries these options (:func:`unit_suffix`), so a unit computed under other
settings is never taken for one of this run; methods with no table setting keep their old keys.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lens_attrib.attribution import Attribution
from lens_attrib.backend import arch_of
from lens_attrib.evaluation.items import method_options
from lens_attrib.method_variants import base_method, split_variant

GAP_METRIC = "completeness_gap"
"""The record metric of IG's relative completeness gap."""
GAP_THRESHOLD = 0.01
"""The share of items above this relative gap is reported (the adaptive rule's tolerance)."""


def add_method_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """``--vz-aggregation`` and ``--ig-max-steps``."""
    parser.add_argument(
        "--vz-aggregation",
        choices=("auto", "rollout", "mean"),
        default="auto",
        help="value zeroing's layer aggregation: auto (default) = 'mean' on decoders (Inseq's "
        "default, through which the π-Soft paper ran its baselines), 'rollout' on encoders "
        "(Mohebbi et al., as the NormXLogit paper reports it)",
    )
    parser.add_argument(
        "--ig-max-steps",
        type=int,
        default=None,
        help="cap on Integrated Gradients' adaptive integrand evaluations per item (library "
        "default 1024); the tables report the completeness-gap distribution either way",
    )


def vz_aggregation(model: Any, choice: str) -> str:
    """Value zeroing's aggregation for ``model`` under ``--vz-aggregation choice``."""
    if choice != "auto":
        return choice
    return "rollout" if arch_of(model).encoder else "mean"


def experiment_options(
    method: str,
    seed: int,
    model: Any,
    args: Any,
    depth: int | None = None,
) -> dict[str, Any]:
    """The options ``method`` is called with in a table (module docstring); ``depth``:
    Grad-ELLM's chosen ``n_layers`` (``None``: the library default)."""
    method, variant = split_variant(method)
    options = method_options(method, seed)
    if method == "value_zeroing":
        options["aggregation"] = vz_aggregation(model, getattr(args, "vz_aggregation", "auto"))
    if method == "integrated_gradients" and getattr(args, "ig_max_steps", None) is not None:
        if args.ig_max_steps < 1:
            raise ValueError(f"--ig-max-steps must be a positive integer, got {args.ig_max_steps}")
        options["max_steps"] = int(args.ig_max_steps)
    if method == "grad_ellm" and depth is not None:
        options["n_layers"] = int(depth)
    options.update(variant)  # a variant's own options (name[option=value]) win
    return options


def unit_suffix(method: str, options: Mapping[str, Any]) -> str:
    """The journal-key suffix of ``method``'s table options (``""`` for methods with none):
    e.g. ``"[aggregation=mean]"``, ``"[max_steps=256]"``, ``"[n_layers=8]"``. A variant label
    (``name[option=value]``, :mod:`lens_attrib.method_variants`) already names its own options,
    which the suffix then leaves out."""
    method, variant = split_variant(method)
    keys = {"value_zeroing": ("aggregation",), "integrated_gradients": ("max_steps",),
            "grad_ellm": ("n_layers",)}.get(method, ())  # fmt: skip
    parts = [f"{k}={options[k]}" for k in keys if k in options and k not in variant]
    return f"[{','.join(parts)}]" if parts else ""


def relative_gaps(attr: Attribution) -> list[float]:
    """IG's per-item ``|gap| / |f(x) − f(b)|`` (``inf`` where ``f(x) = f(b)`` and the gap is not
    0, ``0`` where both are 0)."""
    gaps = torch.as_tensor(attr.meta["completeness_gap"], dtype=torch.float64).reshape(-1)
    sums = torch.as_tensor(attr.meta["relevance_sum"], dtype=torch.float64).reshape(-1)
    deltas = sums + gaps  # relevance_sum = f(x) − f(b) − gap
    out = []
    for gap, delta in zip(gaps.tolist(), deltas.tolist()):
        if delta == 0:
            out.append(0.0 if gap == 0 else math.inf)
        else:
            out.append(abs(gap) / abs(delta))
    return out


def gap_records(attr: Attribution, method: str, base: Mapping[str, Any], first_item: int):
    """One ``completeness_gap`` record per item of an IG unit (``base``: the unit's other
    identity fields, e.g. task and mode); none for other methods."""
    if base_method(method) != "integrated_gradients" or "completeness_gap" not in attr.meta:
        return []
    return [
        {**base, "item": first_item + i, "method": method, "metric": GAP_METRIC, "value": gap}
        for i, gap in enumerate(relative_gaps(attr))
    ]


def gap_summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, 90th percentile and maximum of the relative gaps, and how many exceed 1 %."""
    kept = sorted(float(v) for v in values if v is not None and not math.isnan(float(v)))
    if not kept:
        return {"n": 0}

    def quantile(q: float) -> float:
        return kept[min(len(kept) - 1, max(0, math.ceil(q * len(kept)) - 1))]

    above = sum(1 for v in kept if v > GAP_THRESHOLD)
    return {
        "n": len(kept),
        "median": quantile(0.5),
        "p90": quantile(0.9),
        "max": kept[-1],
        "above_1pct": above,
        "share_above_1pct": above / len(kept),
    }


def gap_line(values: Sequence[float], where: str, max_steps: int | None) -> str:
    """One table line: IG's gap distribution and share above 1 % (``where``: e.g. the mode)."""
    s = gap_summary(values)
    cap = f"max_steps={max_steps}" if max_steps is not None else "max_steps=1024 (default)"
    if not s["n"]:
        return f"IG completeness gap {where}: no items ({cap})"
    return (
        f"IG completeness gap |f(x)−f(b)−ΣR|/|f(x)−f(b)|{' ' + where if where else ''}: "
        f"median {s['median']:.2%}, "
        f"90th pct {s['p90']:.2%}, max {s['max']:.2%}; {s['above_1pct']}/{s['n']} items "
        f"({s['share_above_1pct']:.0%}) above 1 % ({cap})"
    )


def gap_lines(
    records: Sequence[Mapping[str, Any]],
    group: Mapping[str, Any],
    by: str | None,
    max_steps: int | None,
) -> list[str]:
    """:func:`gap_line` for the IG gap records matching ``group``, one line per value of ``by``
    (e.g. ``mode``) or one line in all, and per IG variant label when the run has several (e.g.
    ``integrated_gradients[pooling=l1]``); empty when the run has no IG records."""
    picked = [
        r
        for r in records
        if r.get("metric") == GAP_METRIC and all(r.get(k) == v for k, v in group.items())
    ]
    if not picked:
        return []
    labels = sorted({str(r.get("method")) for r in picked})
    keys = sorted({r.get(by) for r in picked}, key=str) if by else [None]
    lines = []
    for label in labels:
        for key in keys:
            vals = [
                r["value"]
                for r in picked
                if str(r.get("method")) == label and (by is None or r.get(by) == key)
            ]
            where = [f"{by} {key}"] if by else []
            if len(labels) > 1:
                where.insert(0, label)
            text = f"({', '.join(where)})" if where else ""
            lines.append(gap_line(vals, text, max_steps))
    return lines


def setting_notes(methods: Sequence[str], model: Any, args: Any) -> list[str]:
    """Header lines stating the table settings of the methods in the run."""
    notes = []
    if "value_zeroing" in methods:
        agg = vz_aggregation(model, getattr(args, "vz_aggregation", "auto"))
        why = (
            "the mean of the per-layer context-mixing rows (Inseq's default, through which the "
            "π-Soft paper ran its baselines; the authors' rollout puts all mass on the start "
            "token of a causal model)"
            if agg == "mean"
            else "the authors' rollout of the per-layer context-mixing matrices (Mohebbi et al.)"
        )
        notes.append(f"Value zeroing: aggregation={agg!r}, {why}.")
    if "integrated_gradients" in methods:
        cap = getattr(args, "ig_max_steps", None)
        notes.append(
            "Integrated Gradients: adaptive Gauss–Legendre panels to a 1 % completeness gap, "
            + (f"capped at max_steps={cap}" if cap is not None else "max_steps=1024 (default)")
            + "; its gap distribution is stated under each table."
        )
    return notes


__all__ = [
    "GAP_METRIC",
    "GAP_THRESHOLD",
    "add_method_setting_arguments",
    "experiment_options",
    "gap_line",
    "gap_lines",
    "gap_records",
    "gap_summary",
    "relative_gaps",
    "setting_notes",
    "unit_suffix",
    "vz_aggregation",
]
