"""The tables of a π-Soft results page, read from the run's committed journal alone (no model).

``python -m experiments.pisoft_tables docs/results/runs/pisoft-minilm-sst2 \\
--curves docs/results/runs/flips-minilm-sst2``

prints, as Markdown, every table of ``docs/results/pisoft_*.md`` (Huang & Chan 2026, the π-Soft
paper, ``../shared/papers/003_*``):

- **reach**: per method the share of items whose keep scores reach π ∈ {0.1, 0.3, 0.5, 0.7,
  0.8, 0.9} and the median largest reachable π (:func:`experiments.pi_reach.reach_table`);
- **dynamic** (its Table 1) and **fixed** routing (its Table 8): π-Soft-NS as a mean and
  π-Soft-NC as a median over items (an NC ratio divides by ΔP₀ and one item near ΔP₀ = 0 can set
  a mean), each with a 95 % percentile-bootstrap interval over items; the NC mean next to it;
- **paired**: each method minus random over the same items, items resampled jointly
  (:func:`experiments.paired.paired_item_metric`);
- **per π** (its Fig. 3): the π at which a method's ``π-Soft@π`` is above or below random's,
  by the paired interval at that π;
- **raw**: Soft-NS (mean) and Soft-NC (median) before the π transformation with the expected
  number of kept tokens ``E[R] = Σ_i s_i`` (its Table 2), and the Spearman correlation of
  Soft-NS with E[R] over the methods (the paper's argument that raw Soft rewards dense maps);
- **curves** (its Tables 4–5, from ``--curves``, a run with ``--metric-groups curves``):
  deletion and insertion as flip-probability AUCs (the paper's App. E, 20 steps of 5 %) and as
  AUCs of p(ŷ);
- **paper**: the Spearman correlation over the paper's nine methods of this run's statistic with
  the paper's SST2 rows for Llama-3.1-8B and Mistral-7B (Tables 1, 8, 4, 5).

Methods are journal labels (unit-key method parts: ``grad_x_input[pooling=l2]``,
``grad_ellm[n_layers=4]``); ``--methods`` picks and orders them, by default every labelled method
with π-Soft records. Every table reads the items that all shown methods (and random) hold, so
that a run still going compares methods on the same items (``--each-method-own-items`` reads
each method's own). The paper's columns map to labels as the π-Soft pages read them (DL, I×G and
IG to the ℓ²-pooled rows, which pool over the embedding as the paper's Inseq attributions do;
Sal to the gradient norm); where several labels of one method are shown (a Grad-ELLM depth or a
ReAGent rule the run later replaced), the one with the most items stands for it.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.paired import IDENTITY, item_values, labelled_records, paired_item_metric
from experiments.pi_reach import reach_table
from lens_attrib.evaluation.stats import MeanCI, bootstrap_ci
from lens_attrib.method_variants import split_method_list

Records = Mapping[str, list[dict[str, Any]]]

GRID = tuple(round(0.05 * k, 2) for k in range(1, 20))
REACH_PIS = (0.1, 0.3, 0.5, 0.7, 0.8, 0.9)
NAMES = {
    "alti_logit": "ALTI-Logit",
    "alti": "ALTI",
    "attnlrp": "AttnLRP",
    "lrp": "CP-LRP",
    "gradient": "Gradient (norm)",
    "grad_x_input": "G×I (signed)",
    "integrated_gradients": "IG (signed)",
    "deeplift": "DeepLIFT (signed)",
    "rollout": "rollout",
    "attention": "attention",
    "logat": "LogAt",
    "normxlogit": "NormXLogit",
    "embed_norm": "embedding ℓ² norm",
    "random": "random",
    "decompx": "DecompX",
    "globenc": "GlobEnc",
    "reagent": "ReAGent",
    "reagent[stopping_condition_top_k=1]": "ReAGent (top-1 rule)",
    "value_zeroing[aggregation=rollout]": "value zeroing (rollout)",
    "value_zeroing[aggregation=mean]": "value zeroing (mean)",
    "grad_x_input[pooling=l2]": "G×I (ℓ²)",
    "integrated_gradients[pooling=l2]": "IG (ℓ²)",
    "deeplift[pooling=l2]": "DeepLIFT (ℓ²)",
}

# The paper's SST2 rows, columns Attn DL I×G IG Rnd Sal VZ RG Ours (Grad-ELLM with its loosened,
# min–max attention, the library's default): (Llama-3.1-8B, Mistral-7B).
PAPER_COLUMNS = ("Attn", "DL", "I×G", "IG", "Rnd", "Sal", "VZ", "RG", "Ours")
PAPER_SST2: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    # Table 1 (dynamic routing)
    "pi_soft_ns": (
        (0.592, 0.588, 0.588, 0.577, 0.549, 0.577, 0.594, 0.562, 0.586),
        (0.453, 0.437, 0.439, 0.451, 0.317, 0.443, 0.474, 0.324, 0.414),
    ),
    "pi_soft_nc": (
        (0.296, 0.306, 0.303, 0.304, 0.312, 0.290, 0.304, 0.305, 0.315),
        (0.336, 0.384, 0.384, 0.435, 0.466, 0.374, 0.314, 0.458, 0.431),
    ),
    # Table 8 (fixed routing)
    "pi_soft_ns_fixed": (
        (0.512, 0.509, 0.510, 0.503, 0.433, 0.490, 0.524, 0.464, 0.517),
        (0.502, 0.499, 0.499, 0.517, 0.485, 0.498, 0.503, 0.478, 0.517),
    ),
    "pi_soft_nc_fixed": (
        (0.505, 0.521, 0.519, 0.524, 0.504, 0.501, 0.533, 0.476, 0.519),
        (0.711, 0.728, 0.730, 0.779, 1.031, 0.891, 0.719, 1.262, 1.076),
    ),
    # Tables 4 and 5 (flip probability; "Ours" is the w/ column, loosened attention)
    "deletion_flip_auc": (
        (0.3310, 0.3050, 0.3058, 0.2821, 0.2868, 0.2741, 0.3462, 0.2987, 0.3251),
        (0.3550, 0.2821, 0.2839, 0.3013, 0.2903, 0.2828, 0.3486, 0.2857, 0.3167),
    ),
    "insertion_flip_auc": (
        (0.1816, 0.2022, 0.2022, 0.2174, 0.2579, 0.2217, 0.1754, 0.2532, 0.2160),
        (0.1863, 0.2127, 0.2121, 0.2073, 0.2652, 0.2089, 0.1899, 0.2532, 0.2023),
    ),
}
PAPER_LABELS = {
    "Attn": "attention",
    "DL": "deeplift[pooling=l2]",
    "I×G": "grad_x_input[pooling=l2]",
    "IG": "integrated_gradients[pooling=l2]",
    "Rnd": "random",
    "Sal": "gradient",
    "VZ": "value_zeroing",
    "RG": "reagent",
    "Ours": "grad_ellm",
}


def display_name(label: str) -> str:
    """A table's name for a journal label (``grad_ellm[n_layers=4]`` -> ``Grad-ELLM (depth 4)``)."""
    if label.startswith("grad_ellm[n_layers="):
        return f"Grad-ELLM (depth {label.split('=', 1)[1].rstrip(']')})"
    return NAMES.get(label, label)


def markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def signed(x: float) -> str:
    """``+0.012`` / ``−0.034`` (a minus sign, as the pages print it)."""
    return f"{x:+.3f}".replace("-", "−")


def with_ci(ci: MeanCI | Mapping[str, float], sign: bool = False) -> str:
    """``x [low, high]`` at three decimals."""
    mid, low, high = (
        (ci["difference"], ci["low"], ci["high"])
        if isinstance(ci, Mapping)
        else (ci.mean, ci.low, ci.high)
    )
    if sign:
        return f"{signed(mid)} [{signed(low)}, {signed(high)}]"
    return f"{mid:.3f} [{low:.3f}, {high:.3f}]"


def by_method(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The metric records grouped by their labelled method."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in (r for r in records if "metric" in r):
        groups[str(r["method"])].append(r)
    return dict(groups)


def finite(records: Records, method: str, metric: str) -> np.ndarray:
    """The finite per-item values of ``method``'s ``metric``."""
    values = item_values(records.get(method, []), method, metric, {}).values()
    return np.array([v for v in values if math.isfinite(v)], dtype=np.float64)


def summary(records: Records, method: str, metric: str, how: str, n_resamples: int) -> MeanCI:
    """Mean or median over items with its 95 % bootstrap interval (seed 0)."""
    v = finite(records, method, metric)
    if how == "median":
        return bootstrap_ci(
            (v,), statistic=lambda x: float(np.median(x)), n_resamples=n_resamples, seed=0
        )
    return bootstrap_ci(v, n_resamples=n_resamples, seed=0)


def paired(records: Records, a: str, b: str, metric: str, how: str, n: int) -> dict[str, Any]:
    """:func:`experiments.paired.paired_item_metric` on the two methods' records."""
    both = records.get(a, []) + records.get(b, [])
    return paired_item_metric(both, a, b, metric, {}, n, 0, how)


def grid_runs(pis: Sequence[float]) -> str:
    """π values of the 0.05 grid written as runs, e.g. ``0.05–0.75, 0.85``; ``—`` if none."""
    if not pis:
        return "—"
    steps = sorted(round(p / 0.05) for p in pis)
    runs, start = [], steps[0]
    for a, b in zip(steps, [*steps[1:], None], strict=True):
        if b != a + 1:
            runs.append((start, a))
            start = b if b is not None else start

    def text(k: int) -> str:
        return f"{k * 0.05:.2f}".rstrip("0").rstrip(".")

    return ", ".join(text(a) if a == b else f"{text(a)}–{text(b)}" for a, b in runs)


def ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks with ties given their mean rank."""
    v = np.asarray(values, dtype=np.float64)
    r = np.empty_like(v)
    r[v.argsort(kind="stable")] = np.arange(len(v))
    for x in np.unique(v):
        r[v == x] = r[v == x].mean()
    return r


def spearman(a: Sequence[float | None], b: Sequence[float | None]) -> tuple[float, int]:
    """Spearman correlation over the positions both hold, and their number."""
    keep = [i for i in range(len(a)) if a[i] is not None and b[i] is not None]
    if len(keep) < 2:
        return math.nan, len(keep)
    ra = ranks([float(a[i]) for i in keep])  # type: ignore[arg-type]
    rb = ranks([float(b[i]) for i in keep])  # type: ignore[arg-type]
    return float(np.corrcoef(ra, rb)[0, 1]), len(keep)


def paper_methods(methods: Sequence[str], records: Records) -> list[str | None]:
    """The label standing for each of the paper's nine columns (``None``: not shown)."""
    out: list[str | None] = []
    for column in PAPER_COLUMNS:
        want = PAPER_LABELS[column]
        exact = column not in ("VZ", "RG", "Ours")
        held = [m for m in methods if m == want or (not exact and m.split("[")[0] == want)]
        out.append(max(held, key=lambda m: len(finite(records, m, "pi_soft_ns")), default=None))
    return out


def reach_section(reach: Mapping[str, Any], methods: Sequence[str]) -> str:
    rows = [
        [
            display_name(m),
            reach[m]["n"],
            *[f"{100 * reach[m][f'reach@{p:g}']:.0f} %" for p in REACH_PIS],
            f"{reach[m]['median_max_pi']:.2f}",
        ]
        for m in methods
        if m in reach
    ]
    rows.sort(key=lambda r: -float(r[-1]))
    header = ["method", "items", *[f"π = {p:g}" for p in REACH_PIS], "median largest π"]
    return markdown(header, rows)


def routing_section(
    records: Records, reach: Mapping[str, Any], methods: Sequence[str], suffix: str, n: int
) -> str:
    rows = []
    for m in methods:
        ns = summary(records, m, f"pi_soft_ns{suffix}", "mean", n)
        nc = summary(records, m, f"pi_soft_nc{suffix}", "median", n)
        nc_mean = finite(records, m, f"pi_soft_nc{suffix}").mean()
        row = [display_name(m), with_ci(ns), with_ci(nc), f"{nc_mean:.2f}"]
        if not suffix:
            row += [f"{100 * reach[m][f'reach@{p:g}']:.0f} %" for p in (0.5, 0.8)]
        rows.append((-ns.mean, row))
    label = " fixed" if suffix else ""
    header = [
        "method",
        f"π-Soft-NS{label} ↑ mean [95 % CI]",
        f"π-Soft-NC{label} ↑ median [95 % CI]",
        f"π-Soft-NC{label} mean",
    ]
    if not suffix:
        header += ["reaches π = 0.5", "reaches π = 0.8"]
    return markdown(header, [r for _, r in sorted(rows, key=lambda x: x[0])])


PAIRED_COLUMNS = (
    ("pi_soft_ns", "mean"),
    ("pi_soft_nc", "median"),
    ("pi_soft_ns_fixed", "mean"),
    ("pi_soft_nc_fixed", "median"),
)


def paired_section(records: Records, methods: Sequence[str], n: int) -> str:
    rows = [
        [
            display_name(m),
            *[
                with_ci(paired(records, m, "random", metric, how, n), sign=True)
                for metric, how in PAIRED_COLUMNS
            ],
        ]
        for m in methods
        if m != "random"
    ]
    header = [
        "method − random",
        "π-Soft-NS (mean)",
        "π-Soft-NC (median)",
        "π-Soft-NS fixed (mean)",
        "π-Soft-NC fixed (median)",
    ]
    return markdown(header, rows)


def per_pi_section(records: Records, methods: Sequence[str], n: int) -> str:
    rows = []
    for m in (m for m in methods if m != "random"):
        cells = []
        for family, how in (("pi_soft_ns", "mean"), ("pi_soft_nc", "median")):
            above: list[float] = []
            below: list[float] = []
            for p in GRID:
                r = paired(records, m, "random", f"{family}@{p:g}", how, n)
                (above if r["low"] > 0 else below if r["high"] < 0 else []).append(p)
            cells += [grid_runs(above), grid_runs(below)]
        rows.append([display_name(m), *cells])
    header = [
        "method",
        "NS above random at π",
        "NS below random at π",
        "NC above random at π (median)",
        "NC below random at π (median)",
    ]
    return markdown(header, rows)


def raw_section(records: Records, methods: Sequence[str], n: int) -> tuple[str, float]:
    rows, soft_ns, retained = [], [], []
    for m in methods:
        ns, nc = (
            summary(records, m, "soft_ns", "mean", n),
            summary(records, m, "soft_nc", "median", n),
        )
        e_ns = finite(records, m, "expected_retained_ns").mean()
        e_nc = finite(records, m, "expected_retained_nc").mean()
        soft_ns.append(ns.mean)
        retained.append(e_ns)
        rows.append(
            (-ns.mean, [display_name(m), with_ci(ns), with_ci(nc), f"{e_ns:.2f}", f"{e_nc:.2f}"])
        )
    header = [
        "method",
        "Soft-NS ↑ mean [95 % CI]",
        "Soft-NC ↑ median [95 % CI]",
        "E[R] NS (tokens kept)",
        "E[R] NC (tokens kept)",
    ]
    table = markdown(header, [r for _, r in sorted(rows, key=lambda x: x[0])])
    return table, spearman(soft_ns, retained)[0]


CURVE_METRICS = ("deletion_flip_auc", "insertion_flip_auc", "deletion_auc", "insertion_auc")


def curves_section(curves: Records, methods: Sequence[str], n: int) -> str:
    rows = []
    for m in methods:
        cis = [bootstrap_ci(finite(curves, m, k), n_resamples=n, seed=0) for k in CURVE_METRICS]
        rows.append((-cis[0].mean, [display_name(m), *map(with_ci, cis), cis[0].n]))
    header = [
        "method",
        "deletion, flip-probability AUC ↑",
        "insertion, flip-probability AUC ↓",
        "deletion AUC of p(ŷ) ↓",
        "insertion AUC of p(ŷ) ↑",
        "items",
    ]
    return markdown(header, [r for _, r in sorted(rows, key=lambda x: x[0])])


def paper_section(records: Records, curves: Records | None, methods: Sequence[str]) -> str:
    labels = paper_methods(methods, records)
    rows = []
    for metric, (llama, mistral) in PAPER_SST2.items():
        source = curves if metric.endswith("flip_auc") else records
        if source is None:
            continue
        for how in ("mean", "median") if "_nc" in metric else ("mean",):
            f: Callable[[np.ndarray], Any] = np.median if how == "median" else np.mean
            ours = [None if m is None else float(f(finite(source, m, metric))) for m in labels]
            cells = []
            for a, b in ((ours, llama), (ours, mistral), (llama, mistral)):
                rho, k = spearman(a, b)
                cells.append(f"{rho:+.2f} ({k})".replace("-", "−"))
            shown = " ".join(
                f"{c} {v:.3f}" for c, v in zip(PAPER_COLUMNS, ours, strict=True) if v is not None
            )
            rows.append([metric + (f" ({how})" if "_nc" in metric else ""), *cells, shown])
    header = [
        "metric",
        "Spearman ours vs Llama (methods)",
        "ours vs Mistral",
        "Llama vs Mistral",
        "ours, the paper's nine methods",
    ]
    return markdown(header, rows)


def same_items(records: Records, metric: str) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """The records of the items whose ``metric`` every method holds, and how many of how many."""
    held = [{key(r) for r in rows if r["metric"] == metric} for rows in records.values()]
    common = set.intersection(*held)
    kept = {m: [r for r in rows if key(r) in common] for m, rows in records.items()}
    return kept, f"{len(common)} items held by every method (of {len(set.union(*held))})"


def key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """An item's identity (task, dataset, mode, specials, item)."""
    return tuple(record.get(k) for k in IDENTITY[:-1])


SECTIONS = ("reach", "dynamic", "fixed", "paired", "per_pi", "raw", "curves", "paper")


def pisoft_tables(
    journal: str | Path,
    *,
    curves_journal: str | Path | None = None,
    methods: Sequence[str] | None = None,
    n_resamples: int = 10_000,
    sections: Sequence[str] = SECTIONS,
    common_items: bool = True,
) -> dict[str, str]:
    """``{section: Markdown table}`` of the π-Soft run's journal (and the curves run's), plus
    ``"spearman_soft_ns_retained"`` with the raw section and ``"items"``, the items read;
    sections as in the module doc.

    ``common_items``: read only the items that every shown method (and random) holds, so that
    every row of a table is over the same items while a run is still going; ``False`` reads
    each method's own items."""
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown sections {unknown}; choose from {SECTIONS}")
    all_records = labelled_records(journal)
    records = by_method(all_records)
    soft = [m for m in records if finite(records, m, "pi_soft_ns").size]
    if not soft:
        raise ValueError(
            f"{journal}: no pi_soft_ns records; π-Soft journals are written by "
            "experiments.faithfulness with the soft metric group"
        )
    chosen = list(methods) if methods else sorted(soft)
    missing = [m for m in chosen if m not in soft]
    if missing:
        raise ValueError(
            f"no π-Soft records of {missing} in {journal}; its methods: {sorted(soft)}"
        )
    curves = by_method(labelled_records(curves_journal)) if curves_journal else None
    if curves is not None:
        lacking = [m for m in chosen if not finite(curves, m, "deletion_flip_auc").size]
        if lacking:
            raise ValueError(f"{curves_journal}: no deletion_flip_auc records of {lacking}")
    against_random = [s for s in sections if s in ("paired", "per_pi")]
    if against_random and "random" not in soft:
        raise ValueError(
            f"the {against_random} tables compare each method with random, and {journal} holds "
            "no π-Soft records of random; leave them out (--sections) or add random to the run"
        )
    read = set(chosen) | ({"random"} & set(soft))
    records = {m: v for m, v in records.items() if m in read}
    out: dict[str, str] = {}
    if common_items:
        records, out["items"] = same_items(records, "pi_soft_ns")
        if curves is not None:
            curves, out["curve_items"] = same_items(
                {m: v for m, v in curves.items() if m in read}, "deletion_flip_auc"
            )
    all_records = [r for rows in records.values() for r in rows]
    reach = {r["method"]: r for r in reach_table(all_records, REACH_PIS)}
    for section in sections:
        if section == "reach":
            out[section] = reach_section(reach, chosen)
        elif section in ("dynamic", "fixed"):
            suffix = "_fixed" if section == "fixed" else ""
            out[section] = routing_section(records, reach, chosen, suffix, n_resamples)
        elif section == "paired":
            out[section] = paired_section(records, chosen, n_resamples)
        elif section == "per_pi":
            out[section] = per_pi_section(records, chosen, min(n_resamples, 2000))
        elif section == "raw":
            out[section], rho = raw_section(records, chosen, n_resamples)
            out["spearman_soft_ns_retained"] = f"{rho:.3f}"
        elif section == "curves" and curves is not None:
            out[section] = curves_section(curves, chosen, n_resamples)
        elif section == "paper":
            out[section] = paper_section(records, curves, chosen)
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.pisoft_tables",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("journal", help="the π-Soft run's journal file or its folder")
    parser.add_argument("--curves", help="the insertion/deletion run's journal (flip AUCs)")
    parser.add_argument("--methods", help="comma-separated journal labels, in the tables' order")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="which tables")
    parser.add_argument(
        "--each-method-own-items",
        action="store_true",
        help="read every item of each method (default: only the items all shown methods hold)",
    )
    parser.add_argument(
        "--n-resamples",
        type=int,
        default=10_000,
        help="bootstrap resamples (the per-π table uses at most 2,000)",
    )
    args = parser.parse_args(argv)
    methods = None
    if args.methods:
        methods = split_method_list(args.methods)
    try:
        tables = pisoft_tables(
            args.journal,
            curves_journal=args.curves,
            methods=methods,
            n_resamples=args.n_resamples,
            sections=args.sections.split(","),
            common_items=not args.each_method_own_items,
        )
    except ValueError as err:
        parser.error(str(err))
    for name, table in tables.items():
        print(f"\n{name}\n{table}" if table.startswith("|") else f"\n{name}: {table}")
    return tables


if __name__ == "__main__":
    main()
