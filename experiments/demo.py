"""Main job: SmolLM2 on the template agreement tasks, explained with every registered method.

    python -m experiments.demo [--n 60] [--model smollm2-135m] [--out results/demo]

Prints the model's accuracy on the template tasks (subject–verb agreement, reflexive anaphora,
determiner–noun agreement) and on BLiMP ``regular_plural_subject_verb_agreement_1``, explains one
agreement example with every method in ``METHODS`` (contrastive: target − foil), prints the
ground-truth table (pointing game, MRR) when the evaluation package is present, and writes an
HTML report with the figures.
"""

from __future__ import annotations

import argparse
import html
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lens_attrib import METHODS, Target, attribute, load_model
from lens_attrib.data import GENERATORS, evidence_token_positions, load_blimp
from lens_attrib.scoring import contrastive_scores, minimal_pair_accuracy, single_token_items

BLIMP_PARADIGM = "regular_plural_subject_verb_agreement_1"
SKIP_IN_DEMO = {"random"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=60, help="items per template task")
    parser.add_argument("--n-blimp", type=int, default=200)
    parser.add_argument("--n-explain", type=int, default=16, help="items for the PG/MRR table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="results/demo")
    return parser.parse_args(argv)


def accuracy_table(model: Any, n: int, n_blimp: int, seed: int) -> dict[str, float]:
    rows: dict[str, float] = {}
    for task, generate in GENERATORS.items():
        rows[f"template {task}"] = contrastive_scores(model, generate(n, seed=seed)).accuracy
    blimp = load_blimp(BLIMP_PARADIGM, n=n_blimp)
    rows[f"BLiMP {BLIMP_PARADIGM} (full sentence)"] = minimal_pair_accuracy(
        model, [it.meta["sentence_good"] for it in blimp], [it.meta["sentence_bad"] for it in blimp]
    )
    one_token, dropped = single_token_items(model, blimp)
    rows[f"BLiMP {BLIMP_PARADIGM} (one-prefix, {dropped} multi-token dropped)"] = (
        contrastive_scores(model, one_token).accuracy
    )
    return rows


def explain_example(model: Any, item: Any) -> list[Any]:
    target = Target(token=item.target, foil=item.foil)
    results = []
    for name in sorted(METHODS):
        if name in SKIP_IN_DEMO:
            continue
        try:
            results.append(attribute(model, item.prompt, target, method=name))
        except Exception as err:  # a method that does not apply is reported, not fatal
            print(f"  {name}: skipped ({type(err).__name__}: {err})")
    return results


def ground_truth_table(model: Any, items: list[Any]) -> dict[str, dict[str, float]] | None:
    from lens_attrib.evaluation import plausibility

    prepend = bool(model.cfg.default_prepend_bos)
    evidence = [evidence_token_positions(it, model.tokenizer, prepend_bos=prepend) for it in items]
    table: dict[str, dict[str, float]] = {}
    target = Target(token=[it.target for it in items], foil=[it.foil for it in items])
    for name in sorted(METHODS):
        try:
            attr = attribute(model, [it.prompt for it in items], target, method=name)
        except Exception:
            continue
        values = plausibility(attr, evidence, ["pointing_game", "mrr"])
        table[name] = {metric: float(v.nanmean()) for metric, v in values.items()}
    return table


def write_report(
    path: Path,
    accuracy: dict[str, float],
    attributions: list[Any],
    table: dict[str, dict[str, float]] | None,
    item: Any,
) -> None:
    parts = [
        "<html><head><meta charset='utf-8'><title>lens_attrib demo</title></head><body>",
        "<h1>lens_attrib demo: SmolLM2-135M-Instruct</h1><h2>Accuracy</h2><ul>",
    ]
    parts += [f"<li>{html.escape(k)}: {v:.3f}</li>" for k, v in accuracy.items()]
    parts.append(
        f"</ul><h2>One example</h2><p>{html.escape(item.prompt)} → "
        f"{html.escape(repr(item.target))} vs {html.escape(repr(item.foil))}</p>"
    )
    parts += [a.to_html() for a in attributions]
    if table:
        parts.append(
            "<h2>Ground truth (subject noun)</h2><table border=1><tr><th>method</th>"
            "<th>PG</th><th>MRR</th></tr>"
        )
        for name, row in table.items():
            parts.append(
                f"<tr><td>{html.escape(name)}</td><td>{row['pointing_game']:.3f}</td>"
                f"<td>{row['mrr']:.3f}</td></tr>"
            )
        parts.append("</table>")
    parts.append("<h2>Figures</h2>")
    for i, attr in enumerate(attributions):
        parts.append(
            attr.plot().to_html(full_html=False, include_plotlyjs="cdn" if i == 0 else False)
        )
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    started = time.perf_counter()
    model = load_model(args.model, device=args.device)
    print(f"Loaded {args.model} in {time.perf_counter() - started:.1f} s")

    accuracy = accuracy_table(model, args.n, args.n_blimp, args.seed)
    print("\nAccuracy (logit(target) > logit(foil)):")
    for name, value in accuracy.items():
        print(f"  {name:<50} {value:.3f}")

    items = GENERATORS["sva"](max(args.n_explain, 1), seed=args.seed + 1, n_attractors=(1,))
    item = items[0]
    print(f"\nExplaining {item.prompt!r} → {item.target!r} vs {item.foil!r}")
    attributions = explain_example(model, item)
    for attr in attributions:
        top = ", ".join(f"{tok!r} {score:+.3g}" for _, tok, score in attr.top(3))
        print(f"  {attr.method:<22} top: {top}")

    table = ground_truth_table(model, items)
    if table:
        print(f"\nGround truth on {len(items)} sva items (evidence: the subject noun):")
        print(f"  {'method':<22} {'PG':>6} {'MRR':>6}")
        for name, row in table.items():
            print(f"  {name:<22} {row['pointing_game']:>6.3f} {row['mrr']:>6.3f}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report.html"
    write_report(report, accuracy, attributions, table, item)
    print(f"\nReport: {report}  ({time.perf_counter() - started:.1f} s in all)")
    return {"accuracy": accuracy, "table": table}


if __name__ == "__main__":
    torch.set_grad_enabled(True)
    main()
