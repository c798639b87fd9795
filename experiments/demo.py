"""Main job: SmolLM2 on the template agreement tasks, explained with every registered method.

    python -m experiments.demo [--n 60] [--model smollm2-135m] [--out results/demo]
        [--methods grad_x_input,normxlogit,...] [--n-blimp 100] [--n-explain 16]
        [--n-slow 4] [--ig-steps auto] [--ig-tolerance 0.05] [--ig-max-steps 256]

Prints the model's accuracy on the template tasks (subject–verb agreement, reflexive anaphora,
determiner–noun agreement) and on BLiMP ``regular_plural_subject_verb_agreement_1``, explains one
agreement example with every method in ``METHODS`` (contrastive: target − foil; each method runs
once on the batch of ground-truth items, the example is item 0), prints the ground-truth table
(pointing game, MRR; means over items with 95% bootstrap intervals), and
writes ``<out>/report.html``: a self-contained page (plotly.js inlined, no network) with the
token maps, the methods × tokens map, the per-layer maps, the tables and a footer saying how it
was made. Every stage is announced with the seconds since the start, every method with its time.

To stay within about a minute and a half of CPU time, Integrated Gradients and ReAGent (ten to
thirty times the cost of the other methods) run on the first ``--n-slow`` items (4), and IG's
adaptive panels stop at a 5 % completeness gap or 256 evaluations per item (the library's
defaults: 1 %, 1024); the gap ``|f(x) − f(b) − Σ_i R_i| / |f(x) − f(b)|`` is printed and shown
in the report. A fixed number of nodes, ``--ig-steps 32``, is cheaper but leaves gaps of tens to
hundreds of percent on SmolLM2 (the reason for the adaptive default).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lens_attrib import METHODS, Target, attribute, load_model
from lens_attrib.data import GENERATORS, item_evidence_positions, load_blimp
from lens_attrib.report import (
    attribution_rows,
    ci_rows,
    ci_table_html,
    figure_html,
    footer_html,
    section,
    token_map_html,
    write_page,
)
from lens_attrib.scoring import contrastive_scores, sentence_logprobs, single_token_items

BLIMP_PARADIGM = "regular_plural_subject_verb_agreement_1"
SKIP_IN_DEMO = {"random"}
SLOW_METHODS = ("integrated_gradients", "reagent")
"""Methods that run on only ``--n-slow`` of the ground-truth items (one gradient or forward per
integration point / probe round: ten to thirty times the cost of the others)."""
LAYER_MAPS_FIRST = ("normxlogit", "logat", "alti_logit")
"""Per-layer maps shown first: the logit lens (NormXLogit, LogAt) and ALTI-Logit's layers."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=60, help="items per template task")
    parser.add_argument("--n-blimp", type=int, default=100)
    parser.add_argument("--n-explain", type=int, default=16, help="items for the PG/MRR table")
    parser.add_argument(
        "--n-slow",
        type=int,
        default=4,
        help="of those, the items for " + " and ".join(SLOW_METHODS) + " (default 4)",
    )
    parser.add_argument(
        "--methods",
        default="",
        help="comma list of registered methods (default: all but " + ", ".join(SKIP_IN_DEMO) + ")",
    )
    parser.add_argument(
        "--ig-steps",
        default="auto",
        help='Integrated Gradients\' n_steps: "auto" (default: adaptive panels until the '
        "completeness gap is within --ig-tolerance) or an integer (fixed Gauss–Legendre points)",
    )
    parser.add_argument(
        "--ig-tolerance",
        type=float,
        default=0.05,
        help="IG's completeness tolerance with --ig-steps auto (demo 0.05; library default 0.01)",
    )
    parser.add_argument(
        "--ig-max-steps",
        type=int,
        default=256,
        help="IG's evaluation budget per item with --ig-steps auto (demo 256; library 1024)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1, as in the experiments; 0 leaves torch's default)",
    )
    parser.add_argument("--out", default="results/demo")
    args = parser.parse_args(argv)
    if args.n_slow < 1:
        parser.error(f"--n-slow must be at least 1, got {args.n_slow}")
    if not 0 < args.ig_tolerance < 1 or args.ig_max_steps < 16:
        parser.error(
            f"--ig-tolerance must be in (0, 1) and --ig-max-steps ≥ 16, got "
            f"{args.ig_tolerance} and {args.ig_max_steps}"
        )
    if args.ig_steps != "auto":
        if not args.ig_steps.isdigit() or int(args.ig_steps) < 2:
            parser.error(f'--ig-steps must be "auto" or an integer ≥ 2, got {args.ig_steps!r}')
        args.ig_steps = int(args.ig_steps)
    return args


class Stages:
    """Prints each stage as it starts, with the seconds since ``started`` and the CPU seconds
    of the process so far (on a busy machine the wall time grows, the CPU time does not)."""

    def __init__(self, started: float) -> None:
        self.started = started

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def __call__(self, text: str) -> None:
        cpu = time.process_time()
        print(f"\n[{self.elapsed():6.1f} s, CPU {cpu:6.1f} s] {text}", flush=True)


def method_options(name: str, ig_steps: int | str, **ig_options: Any) -> dict[str, Any]:
    """The demo's options of ``name``: Integrated Gradients at ``ig_steps`` (and
    ``ig_options``: tolerance, max_steps when adaptive), the others their defaults."""
    if name != "integrated_gradients":
        return {}
    return {"n_steps": ig_steps, **(ig_options if ig_steps == "auto" else {})}


def completeness_gaps(attr: Any) -> Any:
    """``|f(x) − f(b) − Σ_i R_i| / |f(x) − f(b)|`` per item of an Integrated Gradients result."""
    delta = (attr.meta["explained_value"] - attr.meta["baseline_value"]).abs()
    return attr.meta["completeness_gap"].abs() / delta.clamp_min(1e-12)


def ig_note(attr: Any, ig_steps: int | str) -> str:
    """One sentence on how IG was integrated and how complete it is (console and report)."""
    gaps = completeness_gaps(attr)
    options = attr.meta["options"]
    if ig_steps == "auto":
        how = (
            f"adaptive panels (n_steps='auto', tolerance {options['tolerance']:g}, at most "
            f"{options['max_steps']} evaluations per item; spent {attr.meta['n_steps']})"
        )
    else:
        how = f"n_steps={ig_steps} fixed Gauss–Legendre points"
    return (
        f"integrated_gradients: {how}; completeness gap |f(x) − f(b) − Σ R| / |f(x) − f(b)| "
        f"median {100 * float(gaps.median()):.1f} %, max {100 * float(gaps.max()):.1f} % over "
        f"{len(gaps)} items (library default: tolerance 0.01, max_steps 1024: "
        "--ig-tolerance 0.01 --ig-max-steps 1024)."
    )


def demo_methods(spec: str) -> list[str]:
    """The methods to run: ``spec`` (comma list) or every registered one but the baselines."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    if not names:
        return sorted(m for m in METHODS if m not in SKIP_IN_DEMO)
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; registered: {sorted(METHODS)}")
    return names


def accuracy_records(model: Any, n: int, n_blimp: int, seed: int) -> list[dict[str, Any]]:
    """One record per scored item: ``{"task", "metric": "accuracy", "item", "value": 0 | 1}``."""
    records: list[dict[str, Any]] = []

    def add(task: str, correct: Any) -> None:
        records.extend(
            {"task": task, "metric": "accuracy", "item": i, "value": float(c)}
            for i, c in enumerate(correct.tolist())
        )

    for task, generate in GENERATORS.items():
        add(f"template {task}", contrastive_scores(model, generate(n, seed=seed)).correct)
    blimp = load_blimp(BLIMP_PARADIGM, n=n_blimp)
    good = sentence_logprobs(model, [it.meta["sentence_good"] for it in blimp])
    bad = sentence_logprobs(model, [it.meta["sentence_bad"] for it in blimp])
    add(f"BLiMP {BLIMP_PARADIGM} (full sentence)", good > bad)
    one_token, dropped = single_token_items(model, blimp)
    add(
        f"BLiMP {BLIMP_PARADIGM} (one-prefix, {dropped} multi-token dropped)",
        contrastive_scores(model, one_token).correct,
    )
    return records


def explain_example(
    model: Any, item: Any, methods: Sequence[str], ig_steps: int | str = "auto"
) -> tuple[list[Any], dict[str, str]]:
    """Every method on one item (contrastive target − foil); methods that raise are skipped."""
    target = Target(token=item.target, foil=item.foil)
    results, skipped = [], {}
    for name in methods:
        try:
            attr = attribute(
                model, item.prompt, target, method=name, **method_options(name, ig_steps)
            )
        except Exception as err:  # a method that does not apply is reported, not fatal
            skipped[name] = f"{type(err).__name__}: {err}"
            print(f"  {name}: skipped ({skipped[name]})", flush=True)
            continue
        results.append(attr)
        top = ", ".join(f"{tok!r} {score:+.3g}" for _, tok, score in attr.top(3))
        print(f"  {name:<22} {attr.meta['seconds']:5.1f} s  top: {top}", flush=True)
    return results, skipped


def ground_truth_records(
    model: Any,
    items: list[Any],
    methods: Sequence[str],
    ig_steps: int | str = "auto",
    notes: list[str] | None = None,
    n_slow: int | None = None,
    attributions: list[Any] | None = None,
    skipped: dict[str, str] | None = None,
    ig_options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Pointing game and MRR of every method on ``items`` (evidence: the subject noun); the
    :data:`SLOW_METHODS` on the first ``n_slow`` items only (all when None). Each method runs
    once on the batch: its Attribution goes to ``attributions`` (item 0 is the report's
    example), a method that does not apply to ``skipped``, the IG completeness note to
    ``notes``; ``ig_options``: more options for Integrated Gradients."""
    from lens_attrib.evaluation.metrics import score

    evidence = [item_evidence_positions(model, it) for it in items]  # the start token included
    records: list[dict[str, Any]] = []
    for k, name in enumerate(methods, 1):
        n = len(items) if n_slow is None or name not in SLOW_METHODS else min(n_slow, len(items))
        try:
            attr = attribute(
                model,
                [it.prompt for it in items[:n]],
                Target(token=[it.target for it in items[:n]], foil=[it.foil for it in items[:n]]),
                method=name,
                **method_options(name, ig_steps, **(ig_options or {})),
            )
        except Exception as err:  # a method that does not apply is reported, not fatal
            if skipped is not None:
                skipped[name] = f"{type(err).__name__}: {err}"
            print(f"  [{k}/{len(methods)}] {name}: skipped ({type(err).__name__}: {err})")
            continue
        on = f", {n} of {len(items)} items" if n < len(items) else ""
        top = ", ".join(f"{tok!r} {score:+.3g}" for _, tok, score in attr.top(3, item=0))
        print(
            f"  [{k}/{len(methods)}] {name:<22} {attr.meta['seconds']:5.1f} s{on:<18} "
            f"example top: {top}",
            flush=True,
        )
        if attributions is not None:
            attributions.append(attr)
        if name == "integrated_gradients" and notes is not None:
            notes.append(ig_note(attr, ig_steps))
        records.extend(
            {"method": name, "metric": r.metric, "item": r.item, "value": r.value}
            for r in score(model, attr, ["pointing_game", "mrr"], evidence=evidence[:n])
        )
    return records


def figures(attributions: Sequence[Any]) -> list[tuple[Any, str]]:
    """The methods × tokens map, then a layer × token map per method with layer scores."""
    from lens_attrib.plot import layer_heatmap, method_grid

    figs: list[tuple[Any, str]] = []
    if attributions:
        figs.append(
            (
                method_grid(list(attributions)),
                "Every method on the example; each row divided by its max |score| "
                "(diverging scale centred at 0).",
            )
        )
    layered = [a for a in attributions if a.layer_scores is not None]
    layered.sort(
        key=lambda a: LAYER_MAPS_FIRST.index(a.method) if a.method in LAYER_MAPS_FIRST else 99
    )
    for attr in layered:
        figs.append(
            (
                layer_heatmap(attr),
                f"{attr.method}: relevance of each token read at every layer (one colour "
                "scale per map, centred at 0, range ± max |score| of the map).",
            )
        )
    return figs


def write_report(
    path: Path,
    *,
    model_name: str,
    accuracy: Sequence[dict[str, Any]],
    attributions: Sequence[Any],
    skipped: dict[str, str],
    ground_truth: Sequence[dict[str, Any]],
    item: Any,
    n_explain: int,
    footer: str,
    notes: Sequence[str] = (),
) -> Path:
    """The demo page: accuracy, one example (token maps, figures), ground truth, footer."""
    from lens_attrib.plot import metric_bars

    body = [
        section(
            "Accuracy",
            ci_table_html(accuracy, ("task",), "metric"),
            intro="Share of items where logit(target) > logit(foil) at the last token (BLiMP "
            "full sentence: log p(good sentence) > log p(bad sentence)).",
        )
    ]
    example = [
        f"<p>Prompt <code>{_escape(item.prompt)}</code> → target <code>{_escape(repr(item.target))}"
        f"</code> vs foil <code>{_escape(repr(item.foil))}</code>: contrastive methods explain "
        "logit(target) − logit(foil); target-free methods say so.</p>"
    ]
    if attributions:
        rows = [row for a in attributions for row in attribution_rows(a, [0])]
        example.append(token_map_html(rows))
    if skipped:
        example.append(
            '<p class="note">Skipped: '
            + "; ".join(f"{_escape(k)} ({_escape(v)})" for k, v in skipped.items())
            + "</p>"
        )
    example += [figure_html(fig, caption) for fig, caption in figures(attributions)]
    body.append(section("One example, every method", *example))
    if ground_truth:
        summary = ci_rows(ground_truth, ["method", "metric"])
        body.append(
            section(
                "Ground truth: the subject noun",
                ci_table_html(ground_truth, ("method",), "metric"),
                figure_html(metric_bars(summary, title="Pointing game and MRR (95% CI)")),
                *(f'<p class="note">{_escape(note)}</p>' for note in notes),
                intro=f"{n_explain} subject–verb agreement items with one attractor; the "
                "evidence is the subject noun. Pointing game: the top token is evidence; MRR: "
                "1 / rank of the best-ranked evidence token.",
            )
        )
    return write_page(
        path,
        f"lens_attrib demo: {model_name}",
        body,
        subtitle="Template agreement tasks and BLiMP, explained with the registered methods.",
        footer=footer,
    )


def _escape(text: str) -> str:
    import html

    return html.escape(text)


def run(model: Any, args: argparse.Namespace, *, started: float, command: str) -> dict[str, Any]:
    """Everything after loading the model: tables printed, ``<out>/report.html`` written."""
    stage = Stages(started)
    methods = demo_methods(args.methods)
    stage(
        f"Accuracy: {args.n} items of each template task, {args.n_blimp} BLiMP pairs "
        "(one forward per batch)"
    )
    accuracy = accuracy_records(model, args.n, args.n_blimp, args.seed)
    print("Accuracy (logit(target) > logit(foil)), mean [95% CI] n:")
    for row in ci_rows(accuracy, ["task"]):
        print(
            f"  {row['task']:<70} {row['mean']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]"
            f" n={row['n']}"
        )

    items = GENERATORS["sva"](max(args.n_explain, 1), seed=args.seed + 1, n_attractors=(1,))
    item = items[0]
    stage(
        f"{len(methods)} methods on {len(items)} subject–verb agreement items (evidence: the "
        f"subject noun; example: item 0, {item.prompt!r} → {item.target!r} vs {item.foil!r})"
    )
    attributions: list[Any] = []
    skipped: dict[str, str] = {}
    notes: list[str] = []
    slow = [m for m in SLOW_METHODS if m in methods]
    if slow and args.n_slow < len(items):
        notes.append(
            f"{' and '.join(slow)} ran on the first {args.n_slow} of the {len(items)} items "
            f"(their n in the table); --n-slow {len(items)} runs them on all."
        )
    ground_truth = ground_truth_records(
        model,
        items,
        methods,
        args.ig_steps,
        notes,
        args.n_slow,
        attributions,
        skipped,
        {"tolerance": args.ig_tolerance, "max_steps": args.ig_max_steps},
    )
    table = ci_rows(ground_truth, ["method", "metric"])
    if table:
        print(f"Ground truth on {len(items)} sva items (mean [95% CI] n):")
        for row in table:
            print(
                f"  {row['method']:<22} {row['metric']:<14} {row['mean']:.3f} "
                f"[{row['ci_low']:.3f}, {row['ci_high']:.3f}] n={row['n']}"
            )
    for note in notes:
        print(note)

    stage(f"Report: {Path(args.out) / 'report.html'}")
    report = write_report(
        Path(args.out) / "report.html",
        model_name=args.model,
        accuracy=accuracy,
        attributions=attributions,
        skipped=skipped,
        ground_truth=ground_truth,
        item=item,
        n_explain=len(items),
        footer=footer_html(
            command=command, model=args.model, seconds=time.perf_counter() - started
        ),
        notes=notes,
    )
    print(f"\nReport: {report}  ({stage.elapsed():.1f} s in all)")
    return {
        "accuracy": accuracy,
        "ground_truth": ground_truth,
        "attributions": attributions,
        "notes": notes,
        "report": report,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = shlex.join(
        ["python", "-m", "experiments.demo", *(sys.argv[1:] if argv is None else argv)]
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    Stages(started)(f"Loading {args.model}")
    model = load_model(args.model, device=args.device)
    print(f"Loaded {args.model} in {time.perf_counter() - started:.1f} s")
    return run(model, args, started=started, command=command)


if __name__ == "__main__":
    torch.set_grad_enabled(True)
    main()
