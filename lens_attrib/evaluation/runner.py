"""Evaluate attribution methods on a task dataset: tidy records, a summary table, shards.

``evaluate(model, dataset, methods, metrics)`` batches the items (anything with ``.prompt``,
``.target``, ``.foil`` and ``.evidence_words`` — e.g. :class:`lens_attrib.data.TaskItem` — or
``.evidence_positions``), checks whether the model gets each item right, explains each batch with
each method, and scores every attribution with every metric. The result holds one record per
item × method × metric (``value`` plus the item's ``correct``/``prediction``) and the mean per
method × metric.

Targets: ``target="gold"`` explains each item's ``.target`` token (with ``contrastive=True`` minus
its ``.foil``); ``target="prediction"`` explains the model's own prediction. An item is
*correct* when the gold target's logit beats the foil's (items with a foil) or is the argmax.

Metrics (names):

- plausibility: ``pointing_game, mrr, mrr_ferrando, rma, token_accuracy, average_precision,
  dot_product, dot_product_raw, dot_product_softmax`` (special tokens excluded; ``per_layer=True``
  adds one record per layer for methods with ``layer_scores``);
- AOPC: ``comprehensiveness, sufficiency, accuracy_perturbation``;
- curves: ``deletion_auc, insertion_auc, deletion_flip, insertion_flip``;
- soft: ``soft_nc, soft_ns, pi_soft_nc, pi_soft_ns, expected_retained_ns, expected_retained_nc``,
  each also with a ``_fixed`` suffix for fixed routing.

Sharding: ``shard=(i, n)`` keeps the items whose dataset index is ``i`` modulo ``n``; records carry
the dataset index, and :func:`merge_records` concatenates shard files into the same sorted
records (and summary) as one run.

CLI::

    python -m lens_attrib.evaluation.runner --model smollm2-135m --task sva \\
        --methods grad_x_input,gradient --metrics pointing_game,mrr --n 50 --shard 0/2 \\
        --out results/x.json
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from lens_attrib.attribution import Attribution
from lens_attrib.evaluation.faithfulness import (
    aopc,
    insertion_deletion,
    special_ids_of,
    target_outputs,
)
from lens_attrib.evaluation.plausibility import PLAUSIBILITY_METRICS, plausibility
from lens_attrib.evaluation.soft import soft_metrics
from lens_attrib.inputs import default_prepend_bos, to_batch
from lens_attrib.methods import attribute
from lens_attrib.models import is_encoder
from lens_attrib.target import Target, single_token_id

AOPC_METRICS = {
    "comprehensiveness": "comprehensiveness",
    "sufficiency": "sufficiency",
    "accuracy_perturbation": "accuracy",
}
CURVE_METRICS = {
    "deletion_auc": "deletion_auc",
    "insertion_auc": "insertion_auc",
    "deletion_flip": "deletion_flip_fraction",
    "insertion_flip": "insertion_flip_fraction",
}
SOFT_BASE = (
    "soft_nc",
    "soft_ns",
    "pi_soft_nc",
    "pi_soft_ns",
    "expected_retained_ns",
    "expected_retained_nc",
)
SOFT_METRICS = {**{m: m for m in SOFT_BASE}, **{f"{m}_fixed": m for m in SOFT_BASE}}
METRICS = (*PLAUSIBILITY_METRICS, *AOPC_METRICS, *CURVE_METRICS, *SOFT_METRICS)
KEY = ("item", "method", "metric", "layer")


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


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean (NaN-ignoring), std and count of ``value`` per method × metric (× layer)."""
    groups: dict[tuple[Any, ...], list[float]] = {}
    for r in records:
        groups.setdefault((r["method"], r["metric"], r.get("layer")), []).append(r["value"])
    rows = []
    for (method, metric, layer), values in groups.items():
        finite = [v for v in values if v is not None and not math.isnan(v)]
        n = len(finite)
        mean = sum(finite) / n if n else float("nan")
        var = sum((v - mean) ** 2 for v in finite) / (n - 1) if n > 1 else float("nan")
        rows.append(
            {
                "method": method,
                "metric": metric,
                "layer": layer,
                "mean": mean,
                "std": math.sqrt(var) if n > 1 else float("nan"),
                "n": n,
                "n_total": len(values),
            }
        )
    rows.sort(key=lambda r: (r["method"], r["metric"], -1 if r["layer"] is None else r["layer"]))
    return rows


# --------------------------------------------------------------------------- items
def _evidence(model: Any, item: Any) -> list[int]:
    if getattr(item, "evidence_positions", None) is not None:
        return [int(p) for p in item.evidence_positions]
    words = getattr(item, "evidence_words", None)
    if not words:
        return []
    from lens_attrib.data import evidence_token_positions

    encoder = is_encoder(model)
    return evidence_token_positions(
        item,
        model.tokenizer,
        prepend_bos=(not encoder) and default_prepend_bos(model),
        offset=1 if encoder else 0,
    )


def _correctness(
    model: Any, items: Sequence[Any], max_batch: int
) -> tuple[list[bool | None], list[str]]:
    """Per item: is the gold target preferred (over the foil, or as argmax); the prediction."""
    batch = to_batch(model, [it.prompt for it in items])
    logits = target_outputs(
        model, batch.tokens, batch.mask, batch.last_real, max_batch=max_batch
    ).cpu()
    pred = logits.argmax(-1)
    correct: list[bool | None] = []
    for i, it in enumerate(items):
        if getattr(it, "target", None) is None:
            correct.append(None)
            continue
        t = single_token_id(model, it.target)
        if getattr(it, "foil", None) is not None:
            correct.append(bool(logits[i, t] > logits[i, single_token_id(model, it.foil)]))
        else:
            correct.append(bool(pred[i] == t))
    tok = model.tokenizer
    names = [tok.decode([int(p)]) if tok is not None else str(int(p)) for p in pred]
    return correct, names


def _target(items: Sequence[Any], target: str, contrastive: bool) -> Target:
    gold = target == "gold" and all(getattr(it, "target", None) is not None for it in items)
    if target not in ("gold", "prediction"):
        raise ValueError(f"target must be 'gold' or 'prediction', got {target!r}")
    foil = None
    if contrastive:
        if not all(getattr(it, "foil", None) is not None for it in items):
            raise ValueError("contrastive=True needs a .foil on every item.")
        foil = [it.foil for it in items]
    return Target(token=[it.target for it in items] if gold else None, foil=foil)


# --------------------------------------------------------------------------- metrics
def _score(
    model: Any,
    attr: Attribution,
    metrics: Sequence[str],
    evidence: list[list[int]],
    opts: dict[str, Any],
    special: list[int],
    per_layer: bool,
) -> list[tuple[str, int | None, torch.Tensor]]:
    out: list[tuple[str, int | None, torch.Tensor]] = []
    plaus = [m for m in metrics if m in PLAUSIBILITY_METRICS]
    if plaus:
        for m, v in plausibility(attr, evidence, plaus, special_ids=special).items():
            out.append((m, None, v))
        if per_layer and attr.layer_scores is not None:
            for m, v in plausibility(
                attr, evidence, plaus, special_ids=special, per_layer=True
            ).items():
                out += [(m, layer, v[:, layer]) for layer in range(v.shape[1])]
    max_batch = int(opts.get("max_batch", 64))
    if any(m in AOPC_METRICS for m in metrics):
        res = aopc(model, attr, max_batch=max_batch, special_ids=special, **opts.get("aopc", {}))
        out += [(m, None, getattr(res, AOPC_METRICS[m])) for m in metrics if m in AOPC_METRICS]
    if any(m in CURVE_METRICS for m in metrics):
        cur = insertion_deletion(
            model, attr, max_batch=max_batch, special_ids=special, **opts.get("curves", {})
        )
        out += [(m, None, getattr(cur, CURVE_METRICS[m])) for m in metrics if m in CURVE_METRICS]
    for routing, suffix in (("dynamic", ""), ("fixed", "_fixed")):
        wanted = [m for m in metrics if m in SOFT_METRICS and m.endswith("_fixed") == bool(suffix)]
        if not wanted:
            continue
        soft_opts = {"seed": opts.get("seed", 0), **opts.get("soft", {})}
        res_s = soft_metrics(
            model, attr, routing=routing, max_batch=max_batch, special_ids=special, **soft_opts
        )
        values = res_s.as_dict()
        out += [(m, None, values[SOFT_METRICS[m]]) for m in wanted]
    return out


def evaluate(
    model: Any,
    dataset: Sequence[Any],
    methods: Sequence[str],
    metrics: Sequence[str],
    *,
    batch_size: int = 8,
    target: str = "gold",
    contrastive: bool = False,
    method_options: dict[str, dict[str, Any]] | None = None,
    metric_options: dict[str, Any] | None = None,
    only_correct: bool = False,
    per_layer: bool = False,
    special_ids: Sequence[int] | None = None,
    shard: tuple[int, int] | None = None,
    max_batch: int = 64,
    seed: int = 0,
    progress: bool = True,
    out: str | Path | None = None,
) -> EvalResult:
    """Score ``methods`` × ``metrics`` on ``dataset`` (see the module doc).

    ``method_options[name]`` go to the method; ``metric_options`` may hold ``"aopc"``,
    ``"curves"`` and ``"soft"`` option dicts for :func:`aopc`, :func:`insertion_deletion` and
    :func:`soft_metrics`. ``only_correct``: skip items the model gets wrong (their correctness
    records are kept). ``out``: save to ``.json`` or ``.csv``.
    """
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise KeyError(f"Unknown metrics {unknown}; known: {list(METRICS)}")
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard}")
    indices = [i for i in range(len(dataset)) if shard is None or i % shard[1] == shard[0]]
    method_options = method_options or {}
    opts = {"max_batch": max_batch, "seed": seed, **(metric_options or {})}
    special = sorted(special_ids_of(model, special_ids))
    records: list[dict[str, Any]] = []
    chunks = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    for chunk in tqdm(chunks, desc="evaluate", disable=not progress):
        items = [dataset[i] for i in chunk]
        correct, predicted = _correctness(model, items, max_batch)
        base = [
            {
                "item": i,
                "task": getattr(it, "task", None),
                "prompt": it.prompt,
                "target": getattr(it, "target", None),
                "foil": getattr(it, "foil", None),
                "prediction": p,
                "correct": c,
            }
            for i, it, p, c in zip(chunk, items, predicted, correct)
        ]
        records += [
            {
                **b,
                "method": "model",
                "metric": "model_correct",
                "layer": None,
                "value": float("nan") if b["correct"] is None else float(b["correct"]),
            }
            for b in base
        ]
        keep = [j for j, c in enumerate(correct) if not only_correct or c]
        if not keep:
            continue
        items = [items[j] for j in keep]
        base = [base[j] for j in keep]
        evidence = [_evidence(model, it) for it in items]
        tgt = _target(items, target, contrastive)
        for method in methods:
            attr = attribute(
                model,
                [it.prompt for it in items],
                tgt,
                method=method,
                **method_options.get(method, {}),
            )
            for metric, layer, values in _score(
                model, attr, metrics, evidence, opts, special, per_layer
            ):
                for b, v in zip(base, values.tolist()):
                    records.append(
                        {**b, "method": method, "metric": metric, "layer": layer, "value": float(v)}
                    )
    records = sort_records(records)
    config = {
        "methods": list(methods),
        "metrics": list(metrics),
        "batch_size": batch_size,
        "target": target,
        "contrastive": contrastive,
        "only_correct": only_correct,
        "shard": list(shard) if shard else None,
        "seed": seed,
        "n_items": len(indices),
        "model": getattr(model.cfg, "model_name", None),
    }
    result = EvalResult(records, summarize(records), config)
    if out is not None:
        save(result, out)
    return result


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


def _load(path: Path) -> list[dict[str, Any]]:
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
    """Concatenate shard results (JSON or CSV) into one sorted result with its summary.

    Raises if two shards hold the same item × method × metric × layer.
    """
    records: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    for p in sorted(Path(x) for x in paths):
        for r in _load(p):
            key = tuple(r.get(k) for k in KEY)
            if key in seen:
                raise ValueError(f"Record {key} appears in more than one shard ({p}).")
            seen.add(key)
            records.append(r)
    records = sort_records(records)
    return EvalResult(records, summarize(records), {"merged": [str(p) for p in paths]})


# --------------------------------------------------------------------------- CLI
def _load_task(task: str, n: int, seed: int) -> list[Any]:
    from lens_attrib import data

    if task in data.GENERATORS:
        return list(data.GENERATORS[task](n, seed=seed))
    if task.startswith("blimp:"):
        return list(data.load_blimp(task.split(":", 1)[1], n=n))
    if task == "linzen":
        return list(data.load_linzen_sva(n=n))
    raise KeyError(
        f"Unknown task {task!r}: use {sorted(data.GENERATORS)}, 'blimp:<paradigm>' or 'linzen'."
    )


def main(argv: Sequence[str] | None = None) -> EvalResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="sva")
    parser.add_argument("--methods", default="grad_x_input")
    parser.add_argument("--metrics", default="pointing_game,mrr")
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--shard", default=None, help="i/n")
    parser.add_argument("--out", default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--target", default="gold", choices=("gold", "prediction"))
    parser.add_argument("--contrastive", action="store_true")
    parser.add_argument("--only-correct", action="store_true")
    parser.add_argument("--n-draws", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    from lens_attrib.models import load_model

    shard = None
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        shard = (i, n)
    model = load_model(args.model)
    dataset = _load_task(args.task, args.n, args.seed)
    result = evaluate(
        model,
        dataset,
        args.methods.split(","),
        args.metrics.split(","),
        batch_size=args.batch_size,
        target=args.target,
        contrastive=args.contrastive,
        only_correct=args.only_correct,
        shard=shard,
        max_batch=args.max_batch,
        seed=args.seed,
        metric_options={"soft": {"n_draws": args.n_draws}},
        progress=not args.no_progress,
        out=args.out,
    )
    print(result.table())  # CLI output
    return result


if __name__ == "__main__":
    main()


__all__ = [
    "METRICS",
    "EvalResult",
    "evaluate",
    "merge_records",
    "save",
    "sort_records",
    "summarize",
]
