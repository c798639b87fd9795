"""Ground-truth agreement of token attributions (the decomposition paper's Tables 1–3 analogue).

Arras et al. (2025), "A Close Look at Decomposition-based XAI-Methods for Transformer Language
Models": on tasks whose evidence is known, how often does a method point at it?

    python -m experiments.agreement --model smollm2-135m --n 10 --out results/agreement

Defaults are sized for a shared 2-core CPU; the paper-sized run is e.g. ``--n 200 --tasks
ra,sva,blimp_rpsv,blimp_darn,blimp_ana,qa,linzen --n-qa 500 --n-linzen 2000 --device cuda``.
``--n`` caps the explained (correctly predicted) items per task; ``--n-pool`` sets how many
template/BLiMP items are scored to find them (default ``--n``).

Long runs resume: every finished unit (task × batch × mode × method) is appended to
``<out>/agreement.records.jsonl`` (:mod:`experiments.resume`), so after a kill the same command
with ``--resume`` computes only what is missing. To use more cores, run processes on disjoint
``--methods`` or ``--tasks`` side by side, each with its own ``--journal`` (e.g. Integrated
Gradients, by far the slowest, in its own process), merge their journals when they have stopped
(``python -m experiments.merge_journals``), and a final ``--resume`` run with every method and
task then only reads the journal and writes the tables.

Tasks (``--tasks``):

- ``ra``        reflexive anaphora, template (``generate_anaphora``); evidence: the antecedent.
- ``sva``       subject–verb agreement with attractors, template (``generate_sva``); evidence: the
                subject noun.
- ``blimp_rpsv``, ``blimp_darn``, ``blimp_ana``: BLiMP ``regular_plural_subject_verb_agreement_1``,
                ``distractor_agreement_relational_noun``, ``anaphor_number_agreement``; any other
                BLiMP agreement paradigm as ``blimp:<UID>`` (e.g.
                ``blimp:determiner_noun_agreement_2``; ``--blimp-root`` for another folder of
                BLiMP files); evidence from the rules in :mod:`lens_attrib.data.blimp_evidence`.
- ``qa``        SQuAD v2 answerable questions; target: the first token of the first gold answer,
                kept only where it is the model's own prediction; evidence: every token of the
                answer span in the context. Non-contrastive only (no foil). Its table takes the
                metrics over the context's tokens only (``specials = "context"``), the paper's
                Table 1 setting; the whole prompt (question included) follows it.
- ``linzen``    the Linzen et al. agreement set: accuracy by number of attractors only — the files
                do not say where the subject is, so there is no ground truth (the template
                ``sva`` task stands in for it).

Your own items: ``--data FILE.jsonl`` (or ``.csv``; repeatable) in the format of
:mod:`lens_attrib.data.user` (prompt, target, optional foil, evidence words or character spans)
adds a task named after the file's stem; with ``--data`` and no ``--tasks`` only those files
run. Items with foils are explained contrastively and plainly; files without foils plainly
(kept where the target is the model's own prediction).

Methods (``--methods``; default every method of the paper's Table 1 — ALTI-Logit, AttnLRP, LRP,
Gradient, AttnRollout — plus Gradient×Input, Integrated Gradients, DeepLIFT, NormXLogit, Grad-ELLM,
ReAGent, value zeroing and the random baseline) × metrics PG (pointing game), MRR, RMA (relevance
mass accuracy) and PTA (the paper's per-token accuracy: the share of tokens whose relevance sign,
``> 0`` for evidence and ``≤ 0`` otherwise, is right), for the contrastive target
(``logit(target) − logit(foil)``) and the plain target logit, with special tokens counted ("in")
or excluded ("out"). PG and MRR are expectations under uniformly random tie-breaking
(:mod:`lens_attrib.evaluation.plausibility`), so a method whose scores are constant over the real
tokens scores what ``random`` scores (PTA: ``|E|/n``, what every non-negative method scores); the
``deg`` columns count such degenerate items. Cells are
means over items with a seeded percentile bootstrap 95% CI over items in the JSON/CSV summary
(``ci_low``, ``ci_high``) and, with ``--ci``, in the table.
Only items the model gets right are explained (``logit(target) > logit(foil)``; for qa the
argmax). Prompts get the library's start token (:func:`lens_attrib.inputs.start_token_of`, the
same as ``attribute`` and ``evaluate``: ``<|endoftext|>`` on SmolLM2, whose tokenizer adds none);
``--start-token`` chooses another special token, ``--start-token none`` (or ``--no-bos``) none.
The start token is what makes "special tokens in/out" differ.

Table settings (:mod:`experiments.method_settings`, stated in the table's header and under each
task): value zeroing on decoders aggregates its layers by their mean (``--vz-aggregation``);
Integrated Gradients' completeness-gap distribution and share of items above 1 % are given
under every task (``--ig-max-steps`` caps its adaptive rule). Grad-ELLM's depth is chosen per
task on a tuning split disjoint from the reported items (:mod:`experiments.grad_ellm_depth`;
default criterion the pointing game on 30 tuning items with the contrastive target — a departure
from the π-Soft paper's π-Soft AUCs, whose tuning on every task is unaffordable on 2 cores:
``--depth-metric pi_soft`` runs it), ``--grad-ellm-depth N`` fixes it by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from experiments.common import (
    base_parser,
    device_label,
    format_table,
    parse_list,
    pct,
    setup,
    write_outputs,
)
from experiments.grad_ellm_depth import (
    DepthChoice,
    add_depth_arguments,
    check_disjoint,
    depth_manifest,
    fixed_choice,
    select_depth,
    tuning_seed,
)
from experiments.method_settings import (
    add_method_setting_arguments,
    experiment_options,
    gap_lines,
    gap_records,
    setting_notes,
    unit_suffix,
)
from experiments.resume import Units, add_resume_arguments, fingerprint
from lens_attrib import METHODS, Target, attribute
from lens_attrib.cli import add_methods_argument, add_start_token_argument
from lens_attrib.data import SQUAD_PROMPT, TaskItem, load_linzen_sva, load_squad_v2
from lens_attrib.data.items import item_evidence_positions
from lens_attrib.evaluation.items import ALIASES, is_blimp, load_task, method_options
from lens_attrib.evaluation.metrics import ScoreOptions, by_metric, score
from lens_attrib.evaluation.records import summarize as summarize_records
from lens_attrib.inputs import (
    StartToken,
    prompt_ids,
    start_token_of,
    start_token_setting,
)
from lens_attrib.method_variants import base_method, split_variant, variant_label
from lens_attrib.progress import progress_bar
from lens_attrib.scoring import correctness, single_token_items

PAPER_METHODS = "alti_logit,attnlrp,lrp,gradient,rollout"
"""Table 1 of the decomposition paper (Arras et al.): ALTI-Logit, AttnLRP, LRP, Gradient,
AttnRollout."""
OUR_METHODS = (
    "grad_x_input,integrated_gradients,deeplift,normxlogit,grad_ellm,reagent,value_zeroing"
)
"""The library's further methods in the agreement tables (Gradient×Input: the paper's text)."""
DEFAULT_METHODS = f"{PAPER_METHODS},{OUR_METHODS},random"
DEFAULT_TASKS = "ra,sva,blimp_darn,qa,linzen"
TEMPLATE_TASKS = ("ra", "sva")
OTHER_TASKS = ("qa", "linzen")
METRICS = {"PG": "pointing_game", "MRR": "mrr", "RMA": "rma", "PTA": "per_token_accuracy"}
EXTRA_METRICS = ("mrr_ferrando", "pointing_game_first")
"""Scored and kept in the records and the JSON/CSV summary, not in the printed table: the
decomposition paper's MRR ranks tied tokens in sequence order (Ferrando et al.'s rule, which it
reports as degrading MRR under ties of zero relevance), and the pointing game's first maximum;
the table's PG and MRR take the expectation over tie-breakings."""
BLIMP_TASKS = tuple(t for t in ALIASES if is_blimp(t))


def parse_args(argv: Sequence[str] | None = None) -> Any:
    parser = base_parser(__doc__.split("\n")[0], n=10, out="results/agreement")
    parser.add_argument(
        "--tasks",
        default=None,
        help=f"comma-separated; default {DEFAULT_TASKS} (none with --data). Known: "
        f"{', '.join((*TEMPLATE_TASKS, *BLIMP_TASKS, *OTHER_TASKS))}, blimp:<UID>",
    )
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="FILE",
        help="your own items (.jsonl/.csv, see lens_attrib.data.user); repeatable",
    )
    parser.add_argument("--blimp-root", default=None, help="folder of BLiMP <UID>.jsonl files")
    parser.add_argument("--ci", action="store_true", help="show bootstrap 95%% CIs in the table")
    parser.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples per cell")
    add_methods_argument(parser, DEFAULT_METHODS, variants=True)
    parser.add_argument(
        "--n-qa",
        type=int,
        default=30,
        help="SQuAD questions scored (only those the model answers right are "
        "explained, at most --n)",
    )
    parser.add_argument("--n-linzen", type=int, default=100)
    parser.add_argument(
        "--qa-max-tokens",
        type=int,
        default=160,
        help="skip SQuAD prompts longer than this many tokens",
    )
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument(
        "--n-pool",
        type=int,
        default=None,
        help="template items generated / BLiMP items drawn per task before keeping the "
        "correctly predicted ones (default: --n); e.g. --n 100 --n-pool 200 explains 100",
    )
    add_resume_arguments(parser, "agreement", "task × batch × mode × method")
    add_method_setting_arguments(parser)
    add_depth_arguments(
        parser, metrics=("pointing_game", "pi_soft"), metric="pointing_game", tuning_n=30
    )
    add_start_token_argument(parser)
    parser.add_argument(
        "--no-bos",
        action="store_true",
        help="no start token before the prompts (the same as --start-token none)",
    )
    args = parser.parse_args(argv)
    if args.no_bos:
        args.start_token = False
    return args


# --------------------------------------------------------------------------------- items
@dataclasses.dataclass
class Prepared:
    """A task's items as the model sees them: prompts, targets, evidence token positions."""

    prompts: list[str]
    targets: list[Any]
    foils: list[Any] | None
    evidence: list[list[int]]
    n_total: int
    n_correct: int
    note: str = ""
    scope: list[list[int]] | None = None
    """Per item, the token positions the metrics are taken over (qa: the context, as the paper's
    Table 1); ``None``: every token."""


def data_task(path: str) -> str:
    """The task name of a user item file: its stem."""
    return Path(path).stem


def prepare_contrastive(model: Any, items: Sequence[TaskItem], n: int) -> Prepared:
    """Single-token, correctly predicted items with foils and evidence (at most ``n``)."""
    total = len(items)
    items, _ = single_token_items(model, [it for it in items if it.evidence_words])
    correct = correct_items(model, items)
    kept = [it for it, ok in zip(items, correct) if ok][:n]
    return Prepared(
        prompts=[it.prompt for it in kept],
        targets=[it.target for it in kept],
        foils=[it.foil for it in kept],
        evidence=[item_evidence_positions(model, it) for it in kept],
        n_total=len(items),
        n_correct=int(sum(correct)),
        note=f"{total - len(items)} without a single-token target/foil or evidence dropped"
        if total > len(items)
        else "",
    )


def prepare_plain(model: Any, items: Sequence[TaskItem], n: int) -> Prepared:
    """Items without foils, kept where the single-token target is the model's prediction."""
    tok = model.tokenizer
    rows = []
    for it in items:
        ids = tok(it.target, add_special_tokens=False)["input_ids"] if it.target else []
        if len(ids) == 1 and it.evidence_words:
            rows.append((it, int(ids[0])))
    correct = predicted(model, [it.prompt for it, _ in rows], [a for _, a in rows])
    kept = [r for r, ok in zip(rows, correct) if ok][:n]
    return Prepared(
        prompts=[it.prompt for it, _ in kept],
        targets=[a for _, a in kept],
        foils=None,
        evidence=[item_evidence_positions(model, it) for it, _ in kept],
        n_total=len(rows),
        n_correct=int(sum(correct)),
        note="no foils: plain target only, kept where it is the model's top prediction",
    )


def prepare_items(model: Any, items: Sequence[TaskItem], n: int) -> Prepared:
    """Contrastive when every item has a foil, plain when none has; mixed files are an error."""
    with_foil = [it.foil is not None for it in items]
    if all(with_foil):
        return prepare_contrastive(model, items, n)
    if not any(with_foil):
        return prepare_plain(model, items, n)
    raise ValueError(
        f"{with_foil.count(False)} of {len(items)} items have no foil; give every item a foil "
        "(contrastive and plain targets) or none (plain target only)"
    )


def correct_items(model: Any, items: Sequence[TaskItem]) -> list[bool]:
    """Whether the model prefers each item's target over its foil (:func:`correctness`)."""
    if not items:
        return []
    res = correctness(
        model, [it.prompt for it in items], [it.target for it in items], [it.foil for it in items]
    )
    return [bool(c) for c in res.correct]


_PREDICTED: weakref.WeakKeyDictionary[Any, dict[tuple[int | None, str, int], bool]] = (
    weakref.WeakKeyDictionary()
)
"""Per model, the (start token, prompt, answer) triples already scored by :func:`predicted`
(qa's tuning split re-draws the same SQuAD questions as the reported items: each is scored once
per model and start token)."""


def predicted(model: Any, prompts: Sequence[str], answers: Sequence[int]) -> list[bool]:
    """Whether the model's argmax at each prompt's last token is its answer
    (:func:`correctness`; the prompts not scored before on this model, shortest first, 8 per
    padded forward, so that a batch pads to its own longest prompt; a progress bar)."""
    start = start_token_of(model).id
    keys = [(start, p, int(a)) for p, a in zip(prompts, answers)]
    known = _PREDICTED.setdefault(model, {})
    todo = [k for k in dict.fromkeys(keys) if k not in known]
    if todo:
        lengths = [
            len(model.tokenizer(p, add_special_tokens=False)["input_ids"]) for _, p, _ in todo
        ]
        todo = [todo[i] for i in sorted(range(len(todo)), key=lengths.__getitem__)]
        res = correctness(
            model, [p for _, p, _ in todo], [a for _, _, a in todo], batch_size=8,
            progress=len(todo) > 8,
        )  # fmt: skip
        known.update(zip(todo, (bool(c) for c in res.correct)))
    return [known[k] for k in keys]


def answer_positions(model: Any, prompt: str, spans: Sequence[tuple[int, int]]) -> list[int]:
    """Token positions (in the model's input, its start token included) overlapping the first
    character span of ``spans`` (the answer's, or the context's)."""
    _, shift = prompt_ids(model, prompt, start_token_of(model))
    enc = model.tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    start, end = spans[0]
    return [i + shift for i, (s, e) in enumerate(enc["offset_mapping"]) if s < end and e > start]


def context_span(item: TaskItem) -> tuple[int, int]:
    """The character span of a SQuAD prompt's context (:data:`SQUAD_PROMPT`)."""
    start = SQUAD_PROMPT.index("{context}")
    return start, start + len(item.meta["context"])


SCREENING = "screening"
"""The method name of the journal unit that holds which qa questions the model answers."""


def screened(
    model: Any, prompts: Sequence[str], answers: Sequence[int], units: Units | None
) -> list[bool]:
    """:func:`predicted`, kept in the run's journal as one unit ``qa:<id>|screening`` (one record
    per prompt): qa screens every question up to ``--qa-max-tokens`` (2,404 prompts of ≈ 200
    tokens for SmolLM2, ≈ 0.5 CPU-h), which a resumed run then reads instead of repeating."""
    if units is None:
        return predicted(model, prompts, answers)
    start = start_token_of(model).id
    key = f"qa:{fingerprint([start, list(prompts), [int(a) for a in answers]])}|{SCREENING}"

    def compute() -> list[dict[str, Any]]:
        found = predicted(model, prompts, answers)
        return [{"item": i, "correct": c} for i, c in enumerate(found)]

    rows = units.get(key, list(range(len(prompts))), compute)
    return [bool(r["correct"]) for r in rows]


def prepare_qa(
    model: Any, n: int, n_scored: int, seed: int, max_tokens: int, units: Units | None = None
) -> Prepared:
    """SQuAD v2 answerable questions the model answers with the gold answer's first token
    (prompts of at most ``max_tokens`` tokens, the start token included); ``scope``: the
    context's tokens (the paper's Table 1 evaluates qa on the context only). ``units``: the
    run's journal, which keeps the screening (:func:`screened`)."""
    tok = model.tokenizer
    start = start_token_of(model)
    pool = load_squad_v2(n=n_scored * 3, seed=seed)
    rows = []
    for it in pool:
        ids, _ = prompt_ids(model, it.prompt, start)
        if len(ids) > max_tokens:
            continue
        answer = tok(" " + it.meta["answers"][0].strip(), add_special_tokens=False)["input_ids"]
        rows.append((it, int(answer[0])))
        if len(rows) >= n_scored:
            break
    correct = screened(model, [it.prompt for it, _ in rows], [a for _, a in rows], units)
    kept = [r for r, ok in zip(rows, correct) if ok][:n]
    return Prepared(
        prompts=[it.prompt for it, _ in kept],
        targets=[a for _, a in kept],
        foils=None,
        evidence=[
            answer_positions(model, it.prompt, it.meta["prompt_char_spans"]) for it, _ in kept
        ],
        n_total=len(rows),
        n_correct=int(sum(correct)),
        note=f"prompts ≤ {max_tokens} tokens",
        scope=[answer_positions(model, it.prompt, [context_span(it)]) for it, _ in kept],
    )


def linzen_accuracy(model: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """Accuracy on the Linzen set by number of attractors (no evidence annotation there)."""
    items, _ = single_token_items(model, load_linzen_sva(n=n, seed=seed))
    correct = torch.tensor(correct_items(model, items), dtype=torch.float64)
    rows = []
    for k in sorted({it.meta["n_attractors"] for it in items}):
        sel = [i for i, it in enumerate(items) if it.meta["n_attractors"] == k]
        rows.append({"n_attractors": k, "n": len(sel), "accuracy": float(correct[sel].mean())})
    total = float(correct.mean()) if len(items) else float("nan")
    rows.append({"n_attractors": "all", "n": len(items), "accuracy": total})
    return rows


# ------------------------------------------------------------------------ Grad-ELLM depth
def prepare_tuning(
    model: Any,
    task: str,
    args: Any,
    reported: Prepared,
    files: dict[str, str],
    units: Units | None = None,
) -> Prepared:
    """The task's tuning split for Grad-ELLM's depth (:mod:`experiments.grad_ellm_depth`):
    items of the same source drawn with the tuning seed, prepared like the reported ones
    (correctly predicted, single-token), every prompt equal to a reported one removed, the
    first ``--tuning-n`` kept."""
    seed, n = tuning_seed(args), args.tuning_n
    taken = set(reported.prompts)
    if task == "qa":
        pool = prepare_qa(model, n + len(taken), args.n_qa, seed, args.qa_max_tokens, units)
    else:
        size = 4 * n if is_blimp(task) else 2 * n
        items = load_task(task, size, seed, files=files, blimp_root=args.blimp_root)
        pool = prepare_items(model, [it for it in items if it.prompt not in taken], n)
    keep = [i for i, p in enumerate(pool.prompts) if p not in taken][:n]
    tuning = Prepared(
        prompts=[pool.prompts[i] for i in keep],
        targets=[pool.targets[i] for i in keep],
        foils=[pool.foils[i] for i in keep] if pool.foils else None,
        evidence=[pool.evidence[i] for i in keep],
        n_total=pool.n_total,
        n_correct=pool.n_correct,
        scope=[pool.scope[i] for i in keep] if pool.scope is not None else None,
    )
    check_disjoint(reported.prompts, tuning.prompts, task)
    return tuning


def depth_criterion(
    args: Any,
    evidence: Sequence[Sequence[int]],
    special_ids: list[int],
    scope: Sequence[Sequence[int]] | None = None,
):
    """The per-item criterion of ``--depth-metric`` on the tuning items: the pointing game
    (special tokens excluded and within ``scope``, as the table's main setting) or
    ``(π-Soft-NC + π-Soft-NS) / 2`` (dynamic routing, the π-Soft paper's grid,
    ``--tuning-draws`` draws, default 15)."""
    if args.depth_metric == "pointing_game":
        options = ScoreOptions(special_ids=special_ids, scope=scope)

        def pointing(model: Any, attr: Any) -> torch.Tensor:
            rows = score(model, attr, ["pointing_game"], evidence=list(evidence), options=options)
            return torch.tensor([r.value for r in rows], dtype=torch.float64)

        return pointing
    soft = ScoreOptions(seed=args.seed, soft={"n_draws": args.tuning_draws or 15})

    def pi_soft(model: Any, attr: Any) -> torch.Tensor:
        values = by_metric(score(model, attr, ["pi_soft_nc", "pi_soft_ns"], options=soft))
        nc = torch.tensor([r.value for r in values["pi_soft_nc"]], dtype=torch.float64)
        ns = torch.tensor([r.value for r in values["pi_soft_ns"]], dtype=torch.float64)
        return (nc + ns) / 2

    return pi_soft


def grad_ellm_depth(
    model: Any, task: str, args: Any, data: Prepared, files: dict[str, str], units: Units
) -> DepthChoice:
    """Grad-ELLM's depth for ``task``: fixed (``--grad-ellm-depth N`` / ``default``) or
    selected on the tuning split with the contrastive target where the task has foils (the
    paper's default setup), else the plain one."""
    fixed = fixed_choice(model, args, task)
    if fixed is not None:
        return fixed
    tuning = prepare_tuning(model, task, args, data, files, units)
    target = Target(token=list(tuning.targets), foil=list(tuning.foils) if tuning.foils else None)
    special_out = sorted(int(i) for i in (model.tokenizer.all_special_ids or []))
    mode = "contrastive" if tuning.foils else "plain"
    departure = (
        "Departure: the π-Soft paper selects by the π-Soft AUCs; here the pointing game on the "
        "tuning items (π-Soft tuning on every task is unaffordable on 2 CPU cores)."
        if args.depth_metric == "pointing_game"
        else ""
    )
    choice = select_depth(
        model,
        units,
        task,
        tuning.prompts,
        target,
        depth_criterion(args, tuning.evidence, special_out, tuning.scope),
        args,
        source=f"{task}, {mode} target, {tuning.n_correct} of {tuning.n_total} scored correct",
        departure=departure,
    )
    print(f"{task}: {choice.note()}", flush=True)
    return choice


# ----------------------------------------------------------------------------- scoring
def unit_records(
    model: Any,
    task: str,
    prompts: Sequence[str],
    evidence: Sequence[Sequence[int]],
    target: Target,
    method: str,
    mode: str,
    first_item: int,
    seed: int,
    kept: dict[str, Any] | None = None,
    explained: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    scope: Sequence[Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """Records of one unit: ``method`` on a batch of items in one mode, every metric, special
    tokens counted ("in") and excluded ("out"), and with a ``scope`` (qa: the context's token
    positions per item) also over the scope with special tokens excluded ("context"), and for
    IG its per-item completeness gap
    (:func:`experiments.method_settings.gap_records`). ``kept``: receives the first item's
    Attribution (by method); ``options``: the method's options (default
    :func:`method_options`). ``explained``: the batch's Attributions of target-free methods
    (``MethodSpec.target_free``: the scores do not depend on the target or foil, and the
    plausibility metrics read only the scores), made in the batch's first mode and reused in
    the others."""
    special_out = sorted(int(i) for i in (model.tokenizer.all_special_ids or []))
    if options is None:
        name, variant = split_variant(method)
        options = method_options(name, seed, variant)
    attr = explained.get(method) if explained is not None else None
    if attr is None:
        attr = attribute(model, list(prompts), target, method=base_method(method), **options)
        if explained is not None and METHODS[base_method(method)].target_free:
            explained[method] = attr
    if kept is not None:
        kept[method] = attr[0]
    records: list[dict[str, Any]] = []
    passes = [("in", ScoreOptions(special_ids=[])), ("out", ScoreOptions(special_ids=special_out))]
    if scope is not None:
        passes.append(("context", ScoreOptions(special_ids=special_out, scope=list(scope))))
    for specials, metric_options in passes:
        scored = by_metric(
            score(
                model,
                attr,
                [*METRICS.values(), *EXTRA_METRICS, "degenerate"],
                evidence=list(evidence),
                options=metric_options,
            )
        )
        flat = [bool(r.value) for r in scored.pop("degenerate")]
        records += [
            {
                "task": task,
                "item": first_item + r.item,
                "method": method,
                "mode": mode,
                "specials": specials,
                "metric": metric,
                "value": r.value,
                "degenerate": flat[r.item],
            }
            for metric, rows in scored.items()
            for r in rows
        ]
    base = {"task": task, "mode": mode, "specials": "n/a"}
    return records + gap_records(attr, method, base, first_item)


def score_task(
    model: Any,
    task: str,
    data: Prepared,
    methods: Sequence[str],
    batch_size: int,
    seed: int,
    examples: list[Any] | None = None,
    units: Units | None = None,
    options: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Records: item × method × mode (contrastive / plain) × specials (in / out) × metric.

    ``options``: method → the options it is called with (default :func:`method_options`); a
    method's table options (:func:`experiments.method_settings.unit_suffix`) are part of its
    unit keys.

    ``units``: the run's journal (:mod:`experiments.resume`); each batch × mode × method is one
    unit, taken from it when it holds that unit for these very items and journaled otherwise
    (a ``so_far`` journal: batches it lacks any unit of are left out).
    ``examples``: when given and empty, receives each method's first item (first mode) for the
    report's token maps (computed anew for units taken from the journal)."""
    units = units if units is not None else Units(None, "agreement", {})
    opts = {m: (options or {}).get(m) or method_options(m, seed) for m in methods}
    collect = examples is not None and not examples
    kept: dict[str, Any] = {}
    items_id = fingerprint([data.prompts, data.targets, data.foils, data.evidence])
    modes = [("contrastive", True), ("plain", False)] if data.foils else [("plain", False)]
    records: list[dict[str, Any]] = []
    starts = range(0, len(data.prompts), batch_size)
    for start in progress_bar(starts, desc=f"{task} batches", unit="batch"):
        sl = slice(start, start + batch_size)
        prompts, evidence = data.prompts[sl], data.evidence[sl]
        scope = data.scope[sl] if data.scope is not None else None
        items = list(range(start, start + len(prompts)))
        keys = {
            (method, mode): f"{task}:{items_id}|{method}{unit_suffix(method, opts[method])}|{mode}"
            for mode, _ in modes
            for method in methods
        }
        if units.so_far and not units.finished(keys.values(), items):
            continue  # --so-far: a batch some method has not finished is left out
        explained: dict[str, Any] = {}  # target-free methods: one explanation per batch
        for mode, contrastive in modes:
            target = Target(
                token=list(data.targets[sl]),
                foil=list(data.foils[sl]) if contrastive and data.foils else None,
            )
            keep = kept if collect and start == 0 and mode == modes[0][0] else None
            for method in methods:
                compute = functools.partial(
                    unit_records,
                    model,
                    task,
                    prompts,
                    evidence,
                    target,
                    method,
                    mode,
                    start,
                    seed,
                    keep,
                    explained,
                    opts[method],
                    scope,
                )
                records += units.get(keys[method, mode], items, compute)
    if collect and examples is not None and data.prompts:
        first = Target(
            token=list(data.targets[:1]),
            foil=list(data.foils[:1]) if data.foils else None,
        )
        for method in methods:
            if method not in kept:
                one = attribute(
                    model, data.prompts[:1], first, method=base_method(method), **opts[method]
                )
                kept[method] = one[0]
        examples += [kept[m] for m in methods]
    return records


def so_far_note(count: dict[str, Any]) -> str:
    """``--so-far``: how many of the task's explained items the table covers."""
    if "so_far" not in count:
        return ""
    return (
        f"so far {count['so_far']} of the {count['n_explained']} items (the batches every "
        "method has finished); "
    )


def summarize(
    records: Sequence[dict[str, Any]], *, n_boot: int = 1000, seed: int = 0
) -> list[dict[str, Any]]:
    """Mean, bootstrap 95% CI and degenerate-item count per task × method × mode × specials ×
    metric (:func:`lens_attrib.evaluation.records.summarize`; ``degenerate`` counts the scored
    items whose scores are constant)."""
    return summarize_records(
        records, ("task", "method", "mode", "specials", "metric"), n_resamples=n_boot, seed=seed
    )


def _cell(row: dict[str, Any] | None, ci: bool) -> str:
    if row is None:
        return pct(None)
    if not ci or math.isnan(row["ci_low"]):
        return pct(row["mean"])
    return f"{pct(row['mean'])} [{pct(row['ci_low'])},{pct(row['ci_high'])}]"


def task_table(
    summary: Sequence[dict[str, Any]],
    task: str,
    methods: Sequence[str],
    specials: str,
    ci: bool = False,
) -> str:
    """Rows: methods; columns: PG MRR RMA PTA for each mode (percent, as in the paper), with
    bootstrap 95% CIs when ``ci``, and ``deg``: items whose scores are constant over the
    counted tokens, of those scored."""
    index = {
        (r["method"], r["mode"], r["metric"]): r
        for r in summary
        if r["task"] == task and r["specials"] == specials
    }
    modes = [m for m in ("contrastive", "plain") if any(k[1] == m for k in index)]
    short_mode = {"contrastive": "C", "plain": "NC"}
    header = ["method"] + [
        f"{col} {short_mode[mode]}" for mode in modes for col in (*METRICS, "deg")
    ]
    rows = []
    for m in methods:
        name, variant = split_variant(m)
        target_free = name in METHODS and METHODS[name].target_free
        label = variant_label(METHODS[name].label, variant) if name in METHODS else m
        cells = [f"{label} (target-free)" if target_free else label]
        for i, mode in enumerate(modes):
            if target_free and i > 0:  # its scores ignore the target: shown once
                cells += ["·"] * (len(METRICS) + 1)
                continue
            cells += [_cell(index.get((m, mode, METRICS[s])), ci) for s in METRICS]
            first = index.get((m, mode, METRICS["PG"]))
            deg = first.get("degenerate", 0) if first else 0
            cells.append(f"{deg}/{first['n']}" if first else "–")
        rows.append(cells)
    footnote = (
        "\n(target-free) methods ignore the target and foil (MethodSpec.target_free): their "
        "scores are the same for every mode, shown once."
        if any(base_method(m) in METHODS and METHODS[base_method(m)].target_free for m in methods)
        else ""
    )
    return format_table(rows, header, fmt=str) + footnote


def main_scope(records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Tasks whose table is taken over a scope (qa: ``"context"``), by task."""
    return {r["task"]: "context" for r in records if r.get("specials") == "context"}


def figures(records: Sequence[dict[str, Any]], tasks: Sequence[str]) -> list[Any]:
    """Per task and mode (specials out; qa over its context): bars of each method's metrics
    with 95% intervals."""
    from lens_attrib.plot import metric_bars
    from lens_attrib.report import ci_rows

    scoped = main_scope(records)
    figs = []
    for task in tasks:
        specials = scoped.get(task, "out")
        for mode in ("contrastive", "plain"):
            picked = [
                r
                for r in records
                if r["task"] == task and r["mode"] == mode and r["specials"] == specials
            ]
            if picked:
                rows = ci_rows(picked, ["method", "metric"])
                title = f"{task}: {mode} target, specials out"
                title += ", context only" if specials == "context" else ""
                figs.append(metric_bars(rows, title=f"{title} (95% CI)"))
    return figs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    args = parse_args(argv)
    model = setup(args)
    with start_token_setting(model, args.start_token) as start:
        return run(args, model, start, started, argv)


def run(
    args: Any, model: Any, start: StartToken, started: float, argv: Sequence[str] | None
) -> dict[str, Any]:
    """The experiment on ``model`` under the start token ``start`` (see :func:`main`)."""
    random.seed(args.seed)
    data_files = {data_task(path): str(path) for path in args.data}
    if len(data_files) != len(args.data):
        raise ValueError(f"--data files need distinct names (stems): {args.data}")
    tasks = parse_list(
        args.tasks if args.tasks is not None else "" if data_files else DEFAULT_TASKS
    )
    tasks += [t for t in data_files if t not in tasks]
    methods = parse_list(args.methods)
    prefix = start.text or ""
    units = Units(
        args.out,
        "agreement",
        {
            "model": args.model,
            "seed": args.seed,
            "n": args.n,
            "n_pool": args.n_pool or args.n,
            "batch_size": args.batch_size,
            "prefix": prefix,
            "n_qa": args.n_qa,
            "qa_max_tokens": args.qa_max_tokens,
            "blimp_root": args.blimp_root,
            "data": {
                task: fingerprint([Path(p).read_bytes().hex()]) for task, p in data_files.items()
            },
            "metrics": METRICS,
            "extra_metrics": list(EXTRA_METRICS),
            "vz_aggregation": args.vz_aggregation,
            "ig_max_steps": args.ig_max_steps,
            **depth_manifest(args),
        },
        resume=args.resume,
        overwrite=args.overwrite,
        journal=args.journal,
        device=device_label(args.device),
        so_far=args.so_far,
    )
    records: list[dict[str, Any]] = []
    counts: dict[str, dict[str, Any]] = {}
    linzen: list[dict[str, Any]] = []
    examples: list[Any] = []
    depths: dict[str, DepthChoice] = {}
    for task in tasks:
        if task == "linzen":
            linzen = linzen_accuracy(model, args.n_linzen, args.seed)
            continue
        if task == "qa":
            data = prepare_qa(model, args.n, args.n_qa, args.seed, args.qa_max_tokens, units)
        else:
            pool = args.n_pool or args.n
            size = 4 * pool if is_blimp(task) else pool  # BLiMP: a pool to keep n from
            items = load_task(task, size, args.seed, files=data_files, blimp_root=args.blimp_root)
            data = prepare_items(model, items, args.n)
        counts[task] = {
            "n_scored": data.n_total,
            "n_correct": data.n_correct,
            "n_explained": len(data.prompts),
            "note": data.note,
        }
        print(
            f"{task}: model correct on {data.n_correct}/{data.n_total}; explaining "
            f"{len(data.prompts)}",
            flush=True,
        )
        depth = None
        if "grad_ellm" in methods and data.prompts:
            depths[task] = grad_ellm_depth(model, task, args, data, data_files, units)
            depth = depths[task].depth
        options = {m: experiment_options(m, args.seed, model, args, depth) for m in methods}
        task_records = score_task(
            model, task, data, methods, args.batch_size, args.seed,
            examples=None if args.so_far else examples, units=units, options=options,
        )  # fmt: skip
        records += task_records
        if args.so_far:
            counts[task]["so_far"] = len({r["item"] for r in task_records})
    if units.reused:
        print(f"{units.reused} units taken from {units.path}, {units.computed} computed")
    summary = summarize(records, n_boot=args.n_boot, seed=args.seed)

    lines = [
        f"Ground-truth agreement on {args.model} (percent; C = contrastive target − foil, "
        f"NC = target logit; correctly predicted items only; special tokens excluded"
        f"{', prompts start with ' + repr(prefix) if prefix else ''})",
        *setting_notes(methods, model, args),
    ]
    scoped = main_scope(records)
    for task in counts:
        lines += [
            "",
            f"[{task}] {so_far_note(counts[task])}explained {counts[task]['n_explained']} of "
            f"{counts[task]['n_correct']} correct / {counts[task]['n_scored']} scored "
            f"{counts[task]['note']}".rstrip()
            + ("; metrics over the context only (the paper's setting)" if task in scoped else ""),
            task_table(summary, task, methods, scoped.get(task, "out"), ci=args.ci),
            *([depths[task].note()] if task in depths else []),
            *gap_lines(records, {"task": task}, "mode", args.ig_max_steps),
        ]
    if scoped:
        lines += ["", "Whole prompt (the question and the template counted; special tokens out):"]
        for task in scoped:
            lines += ["", f"[{task}]", task_table(summary, task, methods, "out", ci=args.ci)]
    if prefix:
        lines += ["", "Special tokens counted (specials in):"]
        for task in counts:
            lines += ["", f"[{task}]", task_table(summary, task, methods, "in", ci=args.ci)]
    if linzen:
        lines += [
            "",
            "Linzen et al. agreement set: accuracy by attractors (no evidence "
            "annotation, so no attribution metrics)",
            format_table(
                [[r["n_attractors"], r["n"], r["accuracy"]] for r in linzen],
                ["attractors", "n", "accuracy"],
            ),
        ]
    table = "\n".join(lines)
    print(table)
    config = {**vars(args), "methods": methods, "tasks": tasks, "prefix": prefix}
    config["start_token"] = start.describe()
    config["metric_ties"] = "expected (uniformly random tie-breaking)"
    paths = write_outputs(
        args.out,
        "agreement",
        config=config,
        summary=summary,
        records=records,
        figures=figures(records, list(counts)),
        table=table,
        extra={
            "counts": counts,
            "linzen": linzen,
            "grad_ellm_depth": {task: c.as_dict() for task, c in depths.items()},
        },
        examples=examples,
        argv=argv,
        started=started,
    )
    return {
        "summary": summary,
        "counts": counts,
        "linzen": linzen,
        "paths": paths,
        "table": table,
        "grad_ellm_depth": depths,
    }


if __name__ == "__main__":
    main()
