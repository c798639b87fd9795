"""Head pruning with per-head relevances (Arras et al. 2025, "A Close Look at
Decomposition-based XAI-Methods for Transformer Language Models", head-pruning experiment).

For every method × pooling the heads are pruned least relevant first and the task accuracy
(target vs foil logit at the last token) is recorded; random orders are the baseline. Writes a JSON
result and a self-contained HTML report per task (``<task>.html``: the AUC table, the accuracy
and logit-difference curves with plotly.js inlined, a footer) to ``--out`` and prints the AUC
table.

    python -m experiments.head_pruning --model smollm2-135m --n 40 --step 10 \
        --out results/head_pruning

Defaults are small (16 items, a point every 30 heads) so that a run takes minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import html
import random
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lens_attrib import load_model
from lens_attrib.cli import choice_list
from lens_attrib.evaluation import load_task
from lens_attrib.plot import pruning_curve
from lens_attrib.pruning import (
    POOLINGS,
    RANDOM,
    PruningResult,
    head_relevance_methods,
    run_pruning,
)
from lens_attrib.report import figure_html, footer_html, section, write_page
from lens_attrib.scoring import single_token_items

PAPER_METHODS = ["attnlrp", "lrp", "grad_x_input", "gradient", "alti_logit"]
"""The methods whose per-head relevances the decomposition paper compares."""

BLIMP_PARADIGM = "regular_plural_subject_verb_agreement_1"


def task_items(model: Any, task: str, n: int, seed: int, paradigm: str) -> list[Any]:
    """``n`` items of ``task`` whose target and foil are single tokens for ``model``, loaded
    through the one task registry (:func:`lens_attrib.evaluation.load_task`): ``sva`` draws
    ``4n`` template items, ``blimp`` reads the whole paradigm and shuffles it with ``seed``."""
    if task not in ("sva", "blimp"):
        raise ValueError(f"unknown task {task!r}: use 'sva' or 'blimp'")
    if task == "sva":
        items, _ = single_token_items(model, load_task("sva", 4 * n, seed))
    else:
        items, _ = single_token_items(model, load_task(f"blimp:{paradigm}", None, seed))
        random.Random(seed).shuffle(items)
    if len(items) < n:
        warnings.warn(f"{task}: only {len(items)} single-token items (asked for {n})", stacklevel=2)
    return items[:n]


def plateau(curve_accuracy: Sequence[float], n_pruned: Sequence[int], keep: float = 0.9) -> int:
    """Most heads pruned while accuracy stays ≥ ``keep`` × the unpruned accuracy at every point."""
    floor = keep * curve_accuracy[0]
    last = 0
    for acc, k in zip(curve_accuracy, n_pruned):
        if acc < floor:
            break
        last = k
    return last


def auc_table(result: PruningResult) -> str:
    """AUC (accuracy and logit difference, over the fraction pruned) per method/pooling."""
    acc, ld = result.aucs("accuracy"), result.aucs("logit_diff")
    rows = []
    for label in result.labels():
        curves = result.by_label(label)
        heads90 = sum(plateau(c.accuracy, c.n_pruned) for c in curves) / len(curves)
        rows.append((label, acc[label], ld[label], heads90, curves[0].accuracy[-1]))
    rows.sort(key=lambda r: -r[1][0])
    lines = [
        f"{'method/pooling':<26} {'AUC acc':>15} {'AUC logit diff':>17} {'heads@90%':>10} "
        f"{'acc@end':>8}"
    ]
    for label, (a_m, a_s, n), (l_m, l_s, _), heads90, end in rows:
        a = f"{a_m:.3f} ± {a_s:.3f}" if n > 1 else f"{a_m:.3f}"
        b = f"{l_m:.3f} ± {l_s:.3f}" if n > 1 else f"{l_m:.3f}"
        lines.append(f"{label:<26} {a:>15} {b:>17} {heads90:>10.1f} {end:>8.3f}")
    return "\n".join(lines)


def best_method(result: PruningResult) -> str:
    aucs = {k: v[0] for k, v in result.aucs().items() if k != RANDOM}
    best = max(aucs, key=lambda k: aucs[k])
    return f"{best} (AUC {aucs[best]:.3f}; random {result.aucs()[RANDOM][0]:.3f})"


def write_task_report(
    path: Path, result: PruningResult, *, model_name: str, task: str, command: str, seconds: float
) -> Path:
    """``<task>.html``: the AUC table, both pruning curves, the footer."""
    figs = [
        figure_html(
            pruning_curve(
                result, metric, title=f"{model_name} · {task}: {metric}", pooling_labels=POOLINGS
            ),
            f"{metric.replace('_', ' ')} after pruning the least relevant heads first; random "
            "orders: mean ± std band.",
        )
        for metric in ("accuracy", "logit_diff")
    ]
    n_items = result.meta.get("n_items", "?")
    body = [
        section(
            "AUC",
            f"<pre>{html.escape(auc_table(result))}</pre>",
            intro="Area under the curve over the fraction of heads pruned (higher: the "
            "relevances found the heads that do not matter); random: mean ± std over seeds.",
        ),
        section("Pruning curves", *figs),
    ]
    return write_page(
        path,
        f"Head pruning: {model_name} · {task}",
        body,
        subtitle=f"{n_items} items; best: {best_method(result)}",
        footer=footer_html(command=command, model=model_name, seconds=seconds),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="sva,blimp", help="comma list of sva, blimp")
    parser.add_argument("--blimp-paradigm", default=BLIMP_PARADIGM)
    parser.add_argument("--n", type=int, default=16, help="evaluation items per task")
    parser.add_argument(
        "--relevance-n",
        type=int,
        default=0,
        help="separate items for the relevances (0: the evaluation items)",
    )
    parser.add_argument("--step", type=int, default=30, help="heads pruned per step")
    parser.add_argument("--max-pruned", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=10, help="random orders for the baseline")
    parser.add_argument(
        "--methods",
        type=choice_list(head_relevance_methods(), "method(s) with per-head relevances"),
        default=PAPER_METHODS,
        help="comma-separated methods with per-head relevances, from: "
        f"{', '.join(head_relevance_methods())} (default: the decomposition paper's five)",
    )
    parser.add_argument("--poolings", default=",".join(POOLINGS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--out", default="results/head_pruning")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    command = shlex.join(
        ["python", "-m", "experiments.head_pruning", *(sys.argv[1:] if argv is None else argv)]
    )

    methods = list(args.methods)
    poolings = [p for p in args.poolings.split(",") if p]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    n_total = model.cfg.n_layers * model.cfg.n_heads
    print(
        f"{args.model}: {model.cfg.n_layers} layers × {model.cfg.n_heads} heads = {n_total}; "
        f"step {args.step}, max_pruned {args.max_pruned}, {args.seeds} random seeds, "
        f"device {args.device}, {torch.get_num_threads()} threads"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for task in [t for t in args.tasks.split(",") if t]:
        try:
            pool = task_items(
                model, task, args.n + args.relevance_n, args.seed, args.blimp_paradigm
            )
        except (FileNotFoundError, ImportError) as err:
            print(f"{task}: data not available ({err}); skipped")
            continue
        items, rel_items = pool[: args.n], pool[args.n :] or None
        started = time.perf_counter()
        result = run_pruning(
            model,
            items,
            methods,
            poolings,
            relevance_items=rel_items,
            step=args.step,
            max_pruned=args.max_pruned,
            n_random=args.seeds,
            seed=args.seed,
            batch_size=args.batch_size,
            progress=not args.no_progress,
        )
        seconds = time.perf_counter() - started
        result.meta.update(task=task, args=vars(args), seconds=seconds)
        result.save(out / f"{task}.json")
        page = write_task_report(
            out / f"{task}.html",
            result,
            model_name=args.model,
            task=task,
            command=command,
            seconds=time.perf_counter() - started,
        )
        print(
            f"\n== {task}: {len(items)} items, unpruned accuracy {result.curves[0].accuracy[0]:.3f}"
            f", {result.meta['masks_evaluated']} masks evaluated, {seconds:.0f} s =="
        )
        print(auc_table(result))
        print(f"keeps accuracy longest: {best_method(result)}")
        print(f"wrote {out / f'{task}.json'} and {page}")


if __name__ == "__main__":
    main()
