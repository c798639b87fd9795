"""Per-layer alignment with BLiMP evidence (the NormXLogit paper's Figures 4–5 analogue).

Abbasi et al., "NormXLogit: The head-on-top never lies": per-layer Dot Product (DP, scores
l1-normalised, ``Σ_{i∈E} s_i / Σ_i |s_i|``) and Average Precision (AP) between token scores and
the evidence word of five BLiMP paradigms:

    ana   anaphor_number_agreement                     evidence: the subject head noun
    dna   determiner_noun_agreement_1                  evidence: the demonstrative
    dnaa  determiner_noun_agreement_with_adjective_1   evidence: the demonstrative
    darn  distractor_agreement_relational_noun         evidence: the head noun before "of"
    rpsv  regular_plural_subject_verb_agreement_1      evidence: the subject head noun

(evidence from :mod:`lens_attrib.data.blimp_evidence`; one-prefix split, single-token targets).

Methods (one row per layer; layer 0 is the embedding, layer ``l ≥ 1`` the residual after block
``l``): NormXLogit, LogAt read at the target word, at the foil word and at the word ``" plural"``
(the paper's probe of a number direction), per-layer ALTI-Logit (``alti_logit``'s per-block logit
contributions traced to tokens), the embedding norm (layer 0 only) and random scores (the same at
every layer). For encoders (``--methods``, not in the default list): GlobEnc and ALTI rolled out
(``globenc``, ``alti``) and per layer without rollout (``globenc_layer``, ``alti_layer``: the
paper's GlobEnc¬ and ALTI¬).

    python -m experiments.blimp_alignment --model smollm2-135m --n 10 --out results/blimp_alignment
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from experiments.common import (
    base_parser,
    format_table,
    parse_list,
    setup,
    write_outputs,
)
from lens_attrib import Attribution, Target, attribute
from lens_attrib.data import item_evidence_positions, load_blimp
from lens_attrib.evaluation.items import method_options
from lens_attrib.evaluation.metrics import MetricRecord, ScoreOptions, score
from lens_attrib.evaluation.records import summarize as summarize_records
from lens_attrib.inputs import start_token_of
from lens_attrib.progress import progress_bar
from lens_attrib.scoring import correctness, single_token_items

PARADIGMS = {
    "ana": "anaphor_number_agreement",
    "dna": "determiner_noun_agreement_1",
    "dnaa": "determiner_noun_agreement_with_adjective_1",
    "darn": "distractor_agreement_relational_noun",
    "rpsv": "regular_plural_subject_verb_agreement_1",
}
METHODS = (
    "normxlogit",
    "logat_target",
    "logat_foil",
    "logat_plural",
    "alti_logit",
    "embed_norm",
    "random",
)
#: Per-layer methods for encoders (accepted by ``--methods``; ``_layer``: without rollout).
ENCODER_METHODS = ("globenc", "globenc_layer", "alti", "alti_layer")
METRICS = {"DP": "dot_product", "AP": "average_precision"}
PLURAL = " plural"


def parse_args(argv: Sequence[str] | None = None) -> Any:
    parser = base_parser(__doc__.split("\n")[0], n=10, out="results/blimp_alignment")
    parser.add_argument("--paradigms", default=",".join(PARADIGMS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument(
        "--only-correct",
        action="store_true",
        help="explain only items where logit(good) > logit(bad)",
    )
    return parser.parse_args(argv)


def items_for(model: Any, paradigm: str, n: int, seed: int, only_correct: bool) -> list[Any]:
    """``n`` single-token items with evidence (seeded sample of the paradigm)."""
    items, _ = single_token_items(model, load_blimp(PARADIGMS[paradigm], n=4 * n, seed=seed))
    items = [it for it in items if it.evidence_words]
    if only_correct and items:
        prompts, targets = [it.prompt for it in items], [it.target for it in items]
        correct = correctness(model, prompts, targets, [it.foil for it in items]).correct
        items = [it for it, ok in zip(items, correct) if ok]
    return items[:n]


def layer_rows(
    model: Any, method: str, prompts: list[str], targets: list[str], foils: list[str], seed: int
) -> tuple[Attribution, torch.Tensor]:
    """The Attribution and its per-layer scores ``[batch, n_layers + 1, pos]`` (row 0: embed).

    Rows a method does not define are NaN (the embedding norm has only row 0; layer methods
    have no embedding row except NormXLogit/LogAt, whose row 0 is left NaN too).
    """
    if method == "logat_target":
        attr = attribute(model, prompts, Target(token=targets), method="logat")
    elif method == "logat_foil":
        attr = attribute(model, prompts, Target(token=foils), method="logat")
    elif method == "logat_plural":
        attr = attribute(model, prompts, Target(token=PLURAL), method="logat")
    elif method == "random":
        opts = method_options("random", seed)
        attr = attribute(model, prompts, Target(token=targets), method="random", **opts)
    elif method in ("globenc_layer", "alti_layer"):
        name = method.removesuffix("_layer")
        attr = attribute(model, prompts, Target(token=targets), method=name, rollout=False)
    else:
        attr = attribute(model, prompts, Target(token=targets), method=method)
    n_layers = int(model.cfg.n_layers)
    out = torch.full(
        (len(prompts), n_layers + 1, attr.scores.shape[-1]), float("nan"), dtype=torch.float64
    )
    if method in ("embed_norm",):
        out[:, 0] = attr.scores.detach().cpu().double()
    elif method == "random":
        out[:] = attr.scores.detach().cpu().double()[:, None]
    else:
        if attr.layer_scores is None:
            raise ValueError(f"{method} has no layer_scores")
        out[:, 1:] = attr.layer_scores.detach().cpu().double()
    return attr, out


def layer_records(
    model: Any,
    attr: Attribution,
    rows: torch.Tensor,
    evidence: list[list[int]],
    special: list[int],
) -> list[MetricRecord]:
    """DP and AP of every defined layer of ``rows`` (``[batch, n_layers + 1, pos]``, NaN where
    a method has no such layer), layer by layer (metrics, then items, inside)."""
    defined = [k for k in range(rows.shape[1]) if not bool(torch.isnan(rows[:, k]).all())]
    view = Attribution(
        scores=rows[:, defined[-1]].nan_to_num(0.0),
        tokens=attr.tokens,
        token_ids=attr.token_ids,
        mask=attr.mask,
        target=attr.target,
        method=attr.method,
        layer_scores=rows[:, defined].nan_to_num(0.0),
        meta={"layers": defined},
    )
    options = ScoreOptions(special_ids=special, per_layer=True)
    scored = score(model, view, list(METRICS.values()), evidence=evidence, options=options)
    order = list(METRICS.values())
    per_layer = [r for r in scored if r.layer is not None]
    return sorted(per_layer, key=lambda r: (r.layer, order.index(r.metric)))


def score_paradigm(
    model: Any,
    paradigm: str,
    items: list[Any],
    methods: Sequence[str],
    batch_size: int,
    seed: int,
    examples: list[Any] | None = None,
) -> list[dict[str, Any]]:
    """Records: paradigm × item × method × layer × metric.

    ``examples``: when given and empty, receives each method's first item for the report."""
    collect = examples is not None and not examples
    special = sorted(int(i) for i in (model.tokenizer.all_special_ids or []))
    records: list[dict[str, Any]] = []
    starts = range(0, len(items), batch_size)
    for start in progress_bar(starts, desc="batches", unit="batch"):
        chunk = items[start : start + batch_size]
        prompts = [it.prompt for it in chunk]
        evidence = [item_evidence_positions(model, it) for it in chunk]
        for method in methods:
            attr, rows = layer_rows(
                model,
                method,
                prompts,
                [it.target for it in chunk],
                [it.foil for it in chunk],
                seed,
            )
            if collect and examples is not None and start == 0:
                examples.append(attr[0])
            records += [
                {
                    "paradigm": paradigm,
                    "item": start + r.item,
                    "method": method,
                    "layer": r.layer,
                    "metric": r.metric,
                    "value": r.value,
                }
                for r in layer_records(model, attr, rows, evidence, special)
            ]
    return records


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and bootstrap 95% CI per paradigm × method × layer × metric."""
    return summarize_records(records, ("paradigm", "method", "layer", "metric"))


def paradigm_table(
    summary: Sequence[dict[str, Any]], paradigm: str, methods: Sequence[str], n_layers: int
) -> str:
    """Rows: methods; columns: DP and AP at a few layers, and the best layer's value."""
    shown = sorted({0, *range(n_layers // 5, n_layers + 1, max(1, n_layers // 5)), n_layers})
    index = {
        (r["method"], r["metric"], r["layer"]): r["mean"]
        for r in summary
        if r["paradigm"] == paradigm
    }
    header = ["method"]
    for short in METRICS:
        header += [f"{short}@{layer}" for layer in shown] + [f"{short} best (layer)"]
    rows = []
    for m in methods:
        row: list[Any] = [m]
        for metric in METRICS.values():
            per = {layer: v for (mm, met, layer), v in index.items() if mm == m and met == metric}
            row += [_fmt(per.get(layer)) for layer in shown]
            finite = {k: v for k, v in per.items() if v == v}
            best = max(finite, key=lambda k: finite[k]) if finite else None
            row.append("–" if best is None else f"{finite[best]:.3f} ({best})")
        rows.append(row)
    return format_table(rows, header, fmt=str)


def _fmt(value: float | None) -> str:
    return "–" if value is None or value != value else f"{value:.3f}"


def figures(
    summary: Sequence[dict[str, Any]],
    paradigms: Sequence[str],
    methods: Sequence[str],
    n_layers: int,
) -> list[Any]:
    from lens_attrib.plot import layer_curves

    figs = []
    for paradigm in paradigms:
        for short, metric in METRICS.items():
            series = {}
            for m in methods:
                per = {
                    r["layer"]: r["mean"]
                    for r in summary
                    if r["paradigm"] == paradigm and r["method"] == m and r["metric"] == metric
                }
                series[m] = [per.get(layer, float("nan")) for layer in range(n_layers + 1)]
            figs.append(
                layer_curves(
                    series,
                    title=f"{paradigm} ({PARADIGMS[paradigm]}): {short} per layer (0 = embedding)",
                    yaxis=short,
                )
            )
    return figs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    args = parse_args(argv)
    model = setup(args)
    paradigms, methods = parse_list(args.paradigms), parse_list(args.methods)
    unknown = [p for p in paradigms if p not in PARADIGMS] + [
        m for m in methods if m not in METHODS + ENCODER_METHODS
    ]
    if unknown:
        raise SystemExit(
            f"unknown paradigms/methods {unknown}: use {list(PARADIGMS)} / "
            f"{list(METHODS + ENCODER_METHODS)}"
        )
    n_layers = int(model.cfg.n_layers)
    records: list[dict[str, Any]] = []
    examples: list[Any] = []
    counts = {}
    for paradigm in paradigms:
        items = items_for(model, paradigm, args.n, args.seed, args.only_correct)
        counts[paradigm] = len(items)
        print(f"{paradigm}: {len(items)} items", flush=True)
        records += score_paradigm(
            model, paradigm, items, methods, args.batch_size, args.seed, examples=examples
        )
    summary = summarize(records)
    lines = [
        f"Per-layer alignment with BLiMP evidence on {args.model} (DP: l1-normalised dot "
        "product, AP: average precision; layer 0 = embedding; mean over items)"
    ]
    for paradigm in paradigms:
        lines += [
            "",
            f"[{paradigm}] {PARADIGMS[paradigm]}, {counts[paradigm]} items",
            paradigm_table(summary, paradigm, methods, n_layers),
        ]
    table = "\n".join(lines)
    print(table)
    paths = write_outputs(
        args.out,
        "blimp_alignment",
        config={**vars(args), "start_token": start_token_of(model).describe()},
        summary=summary,
        records=records,
        table=table,
        figures=figures(summary, paradigms, methods, n_layers),
        extra={"counts": counts, "n_layers": n_layers},
        examples=examples,
        argv=argv,
        started=started,
    )
    return {"summary": summary, "counts": counts, "paths": paths, "table": table}


if __name__ == "__main__":
    main()
