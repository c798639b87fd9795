"""Faithfulness by perturbation (NormXLogit paper Table 1/3; π-Soft paper Tables 1–2 analogue).

Two modes (``--mode``):

- ``classifier`` (default): the built-in trained classifiers of :mod:`lens_attrib.classifiers`
  (the model's last blocks fine-tuned with a linear head on its final residual, trained once
  and cached; the explained model is the classifier's own fine-tuned copy):
  ``<model>-sst2`` (SmolLM2-135M or MiniLM-L6) on SST-2 dev sentences, ``minilm-l6-stsb`` on the
  held-out 30 % of STS-B dev (regression; each ``(sentence1, sentence2)`` pair carries its
  segment ids, as in training, through every forward and perturbation). The explained scalar is
  the head's logit of its predicted class (regression: its output),
  ``Target(head=…, position=<feature position>)``. ``--frozen`` explains the classifier's first
  training stage instead, the linear head on the frozen model.
- ``zero-shot``: an instruction-tuned decoder (SmolLM2-135M-Instruct) prompted for the label:
  SST-2 (validation), an IMDb sample and BoolQ (validation) become chat prompts —
  ``tokenizer.apply_chat_template`` with the generation prompt, followed by ``"Sentiment:"`` /
  ``"Answer:"`` in the assistant turn — or, without a chat template, plain
  ``"Review: …\\nSentiment (Positive or Negative):"`` / ``"…\\nQuestion: …?\\nAnswer (true or
  false):"`` prompts. Labels are the single tokens ``" Positive"``/``" Negative"`` and
  ``" true"``/``" false"`` (checked); the explained target is the label the model prefers.

Metrics per method (:mod:`lens_attrib.evaluation`; methods that do not apply to the model's
architecture are skipped, e.g. ALTI-Logit on the encoder):

- AOPC comprehensiveness (↑) and sufficiency (↓) over the fractions ``--fractions`` (the
  NormXLogit paper's K = 10…90 %), probability of the explained class (regression: the head's
  output); decoders delete tokens, encoders replace them by ``[MASK]``;
- accuracy under perturbation (↓; classification, against the gold labels) and, for STS-B, the
  Pearson drop ``r(full, gold) − r(perturbed, gold)`` (↑) averaged over the fractions, with a
  bootstrap interval over items;
- π-Soft-NC (↑) / π-Soft-NS (↑) with dynamic and fixed routing, raw Soft-NC / Soft-NS and the
  expected number of retained tokens E[R] of the Soft-NS perturbation (classification only: the
  soft metrics compare output distributions, which a one-output regression head does not have);
- insertion / deletion AUC of the explained class's probability (classification; ``--steps``).

Every cell is a mean over items with a 95 % percentile-bootstrap interval (records.summarize).
The records also keep each item's curve points (``comprehensiveness@K``, ``pi_soft_nc@π``, …),
from which the figures and the Pearson drop are made.

Long runs resume: every finished unit (dataset × batch × method) is appended to
``<out>/faithfulness.records.jsonl`` (:mod:`experiments.resume`); after a kill the same command
with ``--resume`` computes only what is missing. Processes on disjoint ``--methods`` run side by
side each with its own ``--journal``, merged afterwards (``python -m experiments.merge_journals``).
Prompts get the library's start token (:func:`lens_attrib.inputs.start_token_of`: ``<|endoftext|>``
before a plain SmolLM2 prompt; a chat-template prompt already starts with ``<|im_start|>``), the
same in training the classifiers and in explaining them. Special tokens, the start token among
them, are never perturbed; the decoder's last token is kept (the class is read there).

    python -m experiments.faithfulness --model smollm2-135m --datasets sst2 --n 2
    python -m experiments.faithfulness --model minilm-l6 --datasets sst2,stsb --n 2
    python -m experiments.faithfulness --mode zero-shot --datasets sst2,imdb,boolq --n 2

Defaults are sized for a shared 2-core CPU (2 items per dataset, 5 methods, 4 AOPC fractions, a
3-point π grid, 2 draws, 32 text tokens). ``--paper-protocol`` takes the papers' settings where
no flag gives them: AOPC K = 10 … 90 % (NormXLogit), π ∈ {0.05, …, 0.95} with 15 draws
(π-Soft; dynamic and fixed routing unless ``--no-fixed``), insertion/deletion in ``--steps``
(default 20). ``--metric-groups`` picks what every unit computes (``aopc``, ``curves``,
``soft``), so that the AOPC tables and the π-Soft tables run as separate journals. Every
applicable method: ``--methods`` :data:`PAPER_METHODS` (those that do not apply to the
architecture are skipped). The exact paper-size commands are in ``docs/results/README.md``.

Table settings (:mod:`experiments.method_settings`): value zeroing aggregates by the layer
mean on decoders (rollout on encoders), IG's completeness-gap distribution is stated under every
table; Grad-ELLM's depth is chosen per dataset on a tuning split disjoint from the reported items
(:mod:`experiments.grad_ellm_depth`; criterion π-Soft, the paper's, with ``--tuning-draws``; the
STS-B regression head by AOPC, stated), ``--grad-ellm-depth N`` fixes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from experiments.attribution_cache import AttributionCache
from experiments.common import (
    base_parser,
    device_label,
    format_table,
    parse_list,
    setup,
    write_outputs,
)
from experiments.grad_ellm_depth import (
    DepthChoice,
    add_depth_arguments,
    check_disjoint,
    depth_manifest,
    disjoint_sample,
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
from experiments.pi_reach import item_curves, reach_table
from experiments.pooling_share import PoolingShare
from experiments.resume import Units, add_resume_arguments, fingerprint
from lens_attrib import METHODS, Target, attribute
from lens_attrib.backend import arch_of
from lens_attrib.classifiers import Classifier, load_classifier, stsb_split
from lens_attrib.classifiers.builtin import tensors_digest
from lens_attrib.cli import add_methods_argument
from lens_attrib.data import load_boolq, load_imdb, load_sst2
from lens_attrib.evaluation import ForwardMemo, pearson_drop
from lens_attrib.evaluation.items import method_options
from lens_attrib.evaluation.metrics import SOFT_BASE, ScoreOptions, score
from lens_attrib.evaluation.records import AOPCCurves, PiCurves, curve_points
from lens_attrib.evaluation.records import summarize as summarize_records
from lens_attrib.evaluation.stats import bootstrap_ci
from lens_attrib.forward import head_outputs
from lens_attrib.inputs import start_token_of, to_batch
from lens_attrib.method_variants import base_method, split_variant
from lens_attrib.progress import progress_bar
from lens_attrib.scoring import correctness

DEFAULT_METHODS = "alti_logit,attnlrp,grad_x_input,normxlogit,random"
PAPER_METHODS = (
    "alti_logit,alti,attnlrp,lrp,gradient,grad_x_input,integrated_gradients,deeplift,rollout,"
    "attention,logat,normxlogit,embed_norm,grad_ellm,reagent,value_zeroing,decompx,globenc,random"
)
"""Every method of the three papers' faithfulness and agreement tables; those that do not
apply to the model's architecture are skipped (ALTI-Logit on encoders, DecompX and GlobEnc on
decoders)."""
PAPER_FRACTIONS = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
"""The NormXLogit paper's AOPC fractions K = 10 … 90 %."""
PAPER_PIS = ",".join(f"{0.05 * k:.2f}" for k in range(1, 20))
"""The π-Soft paper's grid π = 0.05, 0.10, …, 0.95."""
NO_REGRESSION = ("reagent",)
"""Methods skipped on a regression head (STS-B): ReAGent's score is the drop in the target's
probability, which a one-output regression head does not have (it raises)."""
SMALL = {"fractions": "0.2,0.4,0.6,0.8", "pis": "0.2,0.5,0.8", "n_draws": 2}
PAPER = {"fractions": PAPER_FRACTIONS, "pis": PAPER_PIS, "n_draws": 15}
LABELS = {
    "sst2": (" Negative", " Positive"),
    "imdb": (" Negative", " Positive"),
    "boolq": (" false", " true"),
}
COLUMNS = {
    "AOPC-comp ↑": "comprehensiveness",
    "AOPC-suff ↓": "sufficiency",
    "Acc pert ↓": "accuracy_perturbation",
    "r drop ↑": "pearson_drop",
    "Del AUC ↓": "deletion_auc",
    "Ins AUC ↑": "insertion_auc",
    "Del flip ↑": "deletion_flip_auc",
    "Ins flip ↓": "insertion_flip_auc",
    "πNC ↑": "pi_soft_nc",
    "πNS ↑": "pi_soft_ns",
    "πNC fix ↑": "pi_soft_nc_fixed",
    "πNS fix ↑": "pi_soft_ns_fixed",
    "Soft-NC ↑": "soft_nc",
    "Soft-NS ↑": "soft_ns",
    "E[R] NS": "expected_retained_ns",
}

UNBOUNDED = ("πNC ↑", "πNC fix ↑", "Soft-NC ↑")
"""Columns whose item values have no upper bound: the NC ratios (their medians are printed
under the table, :func:`median_lines`)."""


def parse_args(argv: Sequence[str] | None = None) -> Any:
    parser = base_parser(__doc__.split("\n")[0], n=2, out="results/faithfulness")
    parser.add_argument(
        "--mode",
        choices=("classifier", "zero-shot"),
        default="classifier",
        help="explain the trained classifier heads (default) or zero-shot prompting",
    )
    parser.add_argument(
        "--datasets",
        default=None,
        help="classifier: sst2 (both models), stsb (minilm-l6); zero-shot: sst2,imdb,boolq "
        "(default: every dataset of the mode that the model has)",
    )
    parser.add_argument(
        "--train-n", type=int, default=None, help="classifier training items (default: built-in)"
    )
    parser.add_argument(
        "--dev-n", type=int, default=None, help="classifier dev items scored (default: all)"
    )
    parser.add_argument(
        "--frozen",
        action="store_true",
        help="classifier: explain the linear head on the frozen model (the classifier's first "
        "training stage) instead of the fine-tuned classifier",
    )
    parser.add_argument("--steps", type=int, default=20, help="insertion/deletion steps")
    parser.add_argument("--no-curves", action="store_true", help="skip insertion/deletion")
    parser.add_argument(
        "--metric-groups",
        default="aopc,curves,soft",
        help="which metric groups every unit computes (default all): aopc (AOPC "
        "comprehensiveness / sufficiency over --fractions, accuracy under perturbation, the "
        "Pearson drop: the NormXLogit paper's tables), curves (insertion / deletion in --steps: "
        "AUCs of p(ŷ), first flips, and the flip-probability AUCs of the π-Soft paper's Tables "
        "4-5), soft (Soft-NC/NS and π-Soft-NC/NS, dynamic and fixed routing: the π-Soft "
        "paper's tables); e.g. an AOPC-table run takes aopc alone, a π-Soft-table run soft,curves",
    )
    add_methods_argument(parser, DEFAULT_METHODS, variants=True)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="truncate each review / passage / sentence of a pair to this many tokens",
    )
    parser.add_argument(
        "--paper-protocol",
        action="store_true",
        help="the papers' settings where not given explicitly: AOPC fractions 0.1,…,0.9 "
        "(NormXLogit), π grid 0.05,…,0.95 and 15 draws (π-Soft); insertion/deletion keep "
        "--steps (default 20), both routings unless --no-fixed",
    )
    parser.add_argument(
        "--n-draws",
        type=int,
        default=None,
        help="Monte-Carlo draws for Soft (default 2; --paper-protocol 15)",
    )
    parser.add_argument(
        "--pis", default=None, help="π grid (default 0.2,0.5,0.8; the paper: 0.05,0.1,…,0.95)"
    )
    parser.add_argument(
        "--fractions",
        default=None,
        help="AOPC fractions (default 0.2,0.4,0.6,0.8; the paper: 0.1,…,0.9)",
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=32, help="rows per perturbed forward")
    parser.add_argument("--no-fixed", action="store_true", help="skip fixed-routing π-Soft")
    parser.add_argument("--no-chat", action="store_true", help="plain prompts, no chat template")
    parser.add_argument(
        "--tuning-disjoint-from",
        type=int,
        default=None,
        metavar="N",
        help="classifier mode: draw Grad-ELLM's tuning split outside the items a run of N items "
        "reports too (N > --n), so that this run tunes on the larger run's split",
    )
    parser.add_argument(
        "--attribution-cache",
        default=None,
        metavar="DIR",
        help="keep every unit's Attribution in DIR and load it where another run (or a rerun) "
        "makes the same call: same library code, weights, method, options, inputs and target "
        "(experiments.attribution_cache; CPU runs; the numbers are unchanged)",
    )
    add_resume_arguments(parser, "faithfulness", "dataset × batch × method")
    add_method_setting_arguments(parser)
    add_depth_arguments(parser, metrics=("pi_soft", "aopc"), metric="pi_soft", tuning_n=20)
    args = parser.parse_args(argv)
    for key, value in (PAPER if args.paper_protocol else SMALL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ------------------------------------------------------------------------------- prompts
def truncate(tokenizer: Any, text: str, max_tokens: int) -> str:
    """The first ``max_tokens`` tokens of ``text`` (decoded back; unchanged if shorter)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens]).rstrip()


def make_prompt(tokenizer: Any, dataset: str, item: Any, max_tokens: int, chat: bool) -> str:
    """A zero-shot prompt ending right before the label token."""
    if dataset == "boolq":
        passage = truncate(tokenizer, item.meta["passage"], max_tokens)
        question = item.meta["question"].rstrip("?").strip()
        user = f"{passage}\nQuestion: {question}? Answer true or false."
        plain, lead = f"{passage}\nQuestion: {question}?\nAnswer (true or false):", "Answer:"
    else:
        review = truncate(tokenizer, item.prompt.replace("<br />", " "), max_tokens)
        user = f"Review: {review}\nIs the sentiment of this review Positive or Negative?"
        plain, lead = f"Review: {review}\nSentiment (Positive or Negative):", "Sentiment:"
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        return str(text) + lead
    return plain


def label_ids(tokenizer: Any, dataset: str) -> list[int]:
    """The two label token ids (index = gold label); raises if a label is not one token."""
    ids = []
    for word in LABELS[dataset]:
        toks = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(toks) != 1:
            raise ValueError(f"label {word!r} is {len(toks)} tokens for this tokenizer: {toks}")
        ids.append(int(toks[0]))
    return ids


def load(dataset: str, n: int | None, seed: int) -> list[Any]:
    if dataset == "sst2":
        return load_sst2("validation", n=n, seed=seed)
    if dataset == "imdb":
        return load_imdb(n=n, seed=seed)
    if dataset == "boolq":
        return load_boolq(n=n, seed=seed)
    raise SystemExit(f"unknown dataset {dataset!r}: use sst2, imdb, boolq")


def predict(model: Any, prompts: list[str], ids: list[int]) -> list[int]:
    """Index (0/1) of the preferred label token at the last position of every prompt
    (:func:`correctness` over the label tokens, 4 prompts per forward)."""
    return correctness(
        model, prompts, candidates=ids, batch_size=4, max_batch=4
    ).prediction.tolist()


# ------------------------------------------------------------------------------- metrics
@dataclasses.dataclass(frozen=True)
class Protocol:
    """What every unit scores: the metric names asked of :func:`score`, their options, and the
    run's seed (Soft draws; the ``random`` method, :func:`method_options`)."""

    metrics: tuple[str, ...]
    options: ScoreOptions
    seed: int


def protocol(args: Any, pis: list[float], *, zero_shot: bool, regression: bool) -> Protocol:
    """The metrics of a mode (module docstring) with the curve points the records keep, so
    that figures and the Pearson drop can be made from records alone (e.g. after a resumed
    run): AOPC ``comprehensiveness@K`` / ``sufficiency@K`` and dynamic-routing
    ``pi_soft_nc@π`` / ``pi_soft_ns@π``; regression: AOPC only, with the head's
    ``output_full`` and ``output_without_top@K``."""
    fractions = [float(f) for f in parse_list(args.fractions)]
    groups = metric_groups(args)
    names = []
    if "aopc" in groups:
        names += ["comprehensiveness", "sufficiency", "comprehensiveness_curve",
                  "sufficiency_curve"]  # fmt: skip
    if regression:
        if "aopc" not in groups:
            raise ValueError(
                "a regression head (STS-B) has AOPC and the Pearson drop only: include aopc in "
                "--metric-groups for it."
            )
        names += ["output_full", "output_without_top_curve"]
    else:
        if not zero_shot:
            if "aopc" in groups:
                names.append("accuracy_perturbation")
            if not args.no_curves and "curves" in groups:
                names += ["deletion_auc", "insertion_auc", "deletion_flip", "insertion_flip"]
                if getattr(args, "flip_aucs", True):
                    names += list(FLIP_AUCS)
        if "soft" in groups:
            for suffix in ("",) if args.no_fixed else ("", "_fixed"):
                names += [m + suffix for m in SOFT_BASE]
            names += ["pi_soft_nc_curve", "pi_soft_ns_curve"]
    options = ScoreOptions(
        max_batch=args.max_batch,
        seed=args.seed,
        aopc={"fractions": fractions, "label": "target"},
        curves={"steps": args.steps, "label": "target"},
        soft={"pis": pis, "n_draws": args.n_draws},
    )
    return Protocol(tuple(names), options, args.seed)


METRIC_GROUPS = ("aopc", "curves", "soft")
FLIP_AUCS = ("deletion_flip_auc", "insertion_flip_auc")
"""The flip-probability AUCs of insertion/deletion, recorded since 2026-11-27."""


def journal_has_flip_aucs(units: Units) -> bool:
    """Whether the run records :data:`FLIP_AUCS`: yes for a new journal; a journal whose
    insertion/deletion units were written before they existed keeps the metrics it has, so that
    every unit of one journal holds the same ones and no table column averages a subset of the
    items (the flip AUCs of such a run come from a ``--metric-groups curves`` run beside it)."""
    if units.journal is None:
        return True
    for line in units.journal.batches:
        names = {r.get("metric") for r in line["records"]}
        if "deletion_auc" in names:
            return FLIP_AUCS[0] in names
    return True


def metric_groups(args: Any) -> list[str]:
    """``--metric-groups`` as a list, checked."""
    groups = parse_list(getattr(args, "metric_groups", ",".join(METRIC_GROUPS)))
    unknown = [g for g in groups if g not in METRIC_GROUPS]
    if unknown or not groups:
        raise ValueError(
            f"--metric-groups: unknown {unknown or groups}; choose from {', '.join(METRIC_GROUPS)}"
        )
    return groups


def unit_records(
    model: Any,
    dataset: str,
    inputs: list[Any],
    target: Target,
    method: str,
    start: int,
    proto: Protocol,
    gold_batch: torch.Tensor | None,
    gold: list[Any],
    pred: list[Any],
    examples: list[Any] | None = None,
    options: dict[str, Any] | None = None,
    share: PoolingShare | None = None,
    memo: ForwardMemo | None = None,
    cache: tuple[AttributionCache, str] | None = None,
) -> list[dict[str, Any]]:
    """Records of one unit: ``method`` on items ``start…`` (every metric and curve point, one
    record per item × metric, and for IG its completeness gaps); ``examples`` receives the
    first item's Attribution; ``options``: the method's (default :func:`method_options`);
    ``share``: the batch's :class:`~experiments.pooling_share.PoolingShare` (one IG pass for a
    signed and a pooled unit); ``memo``: the batch's
    :class:`~lens_attrib.evaluation.ForwardMemo` (perturbed forwards shared by its units);
    ``cache``: ``--attribution-cache`` and the target's identity there."""
    name, variant = split_variant(method)
    options = method_options(name, proto.seed, variant) if options is None else options

    def call(label: str, opts: dict[str, Any]) -> Any:
        def explain() -> Any:
            return attribute(model, inputs, target, method=base_method(label), **opts)

        if cache is None:
            return explain()
        store, target_key = cache
        return store.get(base_method(label), opts, inputs, target_key, explain, target.head)

    attr = call(method, options) if share is None else share.attribution(method, call)
    if examples is not None:
        examples.append(attr[0])
    scored = score(model, attr, proto.metrics, gold=gold_batch, options=proto.options, memo=memo)
    gaps = gap_records(attr, method, {"dataset": dataset}, start)
    for row in gaps:
        row["gold"], row["prediction"] = gold[row["item"]], pred[row["item"]]
    records = [
        {
            "dataset": dataset,
            "item": start + r.item,
            "method": method,
            "metric": r.name,
            "value": r.value,
            "gold": gold[start + r.item],
            "prediction": pred[start + r.item],
        }
        for r in scored
    ]
    return records + gaps


def batch_share(
    units: Units, keys: dict[str, str], items: list[int], options: dict[str, dict[str, Any]]
) -> PoolingShare:
    """The batch's :class:`~experiments.pooling_share.PoolingShare`: its pending units are
    those the journal does not hold."""
    pending = [m for m, key in keys.items() if units.stored(key, items) is None]
    return PoolingShare(options, pending)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    args = parse_args(argv)
    model = setup(args)
    encoder = arch_of(model).encoder
    if args.datasets is None:
        args.datasets = (
            "sst2,imdb,boolq" if args.mode == "zero-shot" else "sst2,stsb" if encoder else "sst2"
        )
    methods, datasets = parse_list(args.methods), parse_list(args.datasets)
    spec = {m: METHODS[base_method(m)] for m in methods}
    skipped = [m for m in methods if not spec[m].applies_to(encoder=encoder)]
    methods = [m for m in methods if m not in skipped]
    if skipped:
        print(f"skipped (do not apply to this architecture): {', '.join(skipped)}", flush=True)
    pis = [float(p) for p in parse_list(args.pis)]
    run = run_zero_shot if args.mode == "zero-shot" else run_classifiers
    start = start_token_of(model).describe()
    units = Units(
        args.out,
        "faithfulness",
        {**manifest(args), "start_token": start},
        resume=args.resume,
        overwrite=args.overwrite,
        journal=args.journal,
        device=device_label(args.device),
        so_far=args.so_far,
    )
    args.flip_aucs = journal_has_flip_aucs(units)
    if not args.flip_aucs:
        print(
            f"{units.path}: its insertion/deletion units were written before the "
            f"flip-probability AUCs ({', '.join(FLIP_AUCS)}) existed; they are left out of the "
            "units computed now too, so that every unit holds the same metrics (a run with "
            "--metric-groups curves and a new journal records them)",
            flush=True,
        )
    result = run(model, args, datasets, methods, pis, units)
    records, accuracy, figs, examples = (
        result.records,
        result.accuracy,
        result.figures,
        result.examples,
    )
    if units.reused:
        print(f"{units.reused} units taken from {units.path}, {units.computed} computed")
    summary = summarize(records) + result.extra_rows
    table = render(
        summary, datasets, methods, accuracy, args, records=records, depths=result.depths,
        notes=setting_notes(methods, model, args), so_far=result.so_far,
    )  # fmt: skip
    print(table)
    paths = write_outputs(
        args.out,
        "faithfulness",
        config={
            **vars(args),
            "pis": pis,
            "methods": methods,
            "skipped_methods": skipped,
            "start_token": start,
        },
        summary=summary,
        records=records,
        figures=figs,
        table=table,
        extra={
            "accuracy": accuracy,
            "grad_ellm_depth": {d: c.as_dict() for d, c in result.depths.items()},
        },
        examples=examples,
        argv=argv,
        started=started,
    )
    return {
        "summary": summary,
        "accuracy": accuracy,
        "paths": paths,
        "table": table,
        "grad_ellm_depth": result.depths,
    }


def manifest(args: Any) -> dict[str, Any]:
    """What fixes the items and their scores (the journal refuses to mix other settings)."""
    keys = ("mode", "model", "seed", "n", "train_n", "dev_n", "max_tokens", "n_draws", "pis",
            "fractions", "steps", "no_curves", "no_fixed", "no_chat", "batch_size",
            "vz_aggregation", "ig_max_steps", "metric_groups")  # fmt: skip
    return (
        {k: getattr(args, k) for k in keys}
        | depth_manifest(args)
        | ({"frozen": True} if args.frozen else {})
    )


@dataclasses.dataclass
class RunResult:
    """What a mode's run gives: the records, the classifier / zero-shot score per dataset, the
    figures, one example Attribution per method, and summary rows made over whole datasets
    (the Pearson drop)."""

    records: list[dict[str, Any]]
    accuracy: dict[str, float]
    figures: list[Any]
    examples: list[Any]
    extra_rows: list[dict[str, Any]]
    depths: dict[str, DepthChoice] = dataclasses.field(default_factory=dict)
    so_far: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """``--so-far``: per dataset, the items scored (every method's batch journaled) and the
    run's items."""


def curve_figures(records: Sequence[dict[str, Any]], dataset: str, methods: Sequence[str]):
    """AOPC curves and (when computed) dynamic-routing π-Soft curves of one dataset, from the
    records' curve points (:class:`~lens_attrib.evaluation.records.AOPCCurves`,
    :class:`~lens_attrib.evaluation.records.PiCurves`)."""
    from lens_attrib.plot import aopc_curves, pi_curves

    figs = []
    if curve_points(records, "comprehensiveness@", dataset=dataset).grid:
        aopc_res = {m: AOPCCurves.from_records(records, dataset=dataset, method=m) for m in methods}
        figs.append(aopc_curves(aopc_res, title=f"{dataset}: AOPC curves"))
    pi_res = {m: PiCurves.from_records(records, dataset=dataset, method=m) for m in methods}
    soft_res = {m: c for m, c in pi_res.items() if c is not None}
    if soft_res:
        figs.append(pi_curves(soft_res, title=f"{dataset}: π-Soft curves (dynamic routing)"))
    return figs


# ------------------------------------------------------------------------------- Grad-ELLM depth
def depth_criterion(proto: Protocol, args: Any, pis: list[float], metric: str):
    """The per-item criterion on the tuning items: ``(π-Soft-NC + π-Soft-NS) / 2`` (dynamic
    routing, the run's π grid, ``--tuning-draws`` or the run's draws) or AOPC
    comprehensiveness − sufficiency (the run's fractions)."""
    if metric == "pi_soft":
        draws = args.tuning_draws or args.n_draws
        options = dataclasses.replace(proto.options, soft={"pis": pis, "n_draws": draws})
        names = ["pi_soft_nc", "pi_soft_ns"]
    else:
        options, names = proto.options, ["comprehensiveness", "sufficiency"]

    def criterion(model: Any, attr: Any) -> torch.Tensor:
        rows = score(model, attr, names, options=options)
        first = torch.tensor([r.value for r in rows if r.metric == names[0]], dtype=torch.float64)
        second = torch.tensor([r.value for r in rows if r.metric == names[1]], dtype=torch.float64)
        return (first + second) / 2 if metric == "pi_soft" else first - second

    return criterion


def choose_depth(
    model: Any,
    dataset: str,
    args: Any,
    units: Units,
    tuning: list[Any],
    target: Target,
    proto: Protocol,
    pis: list[float],
    *,
    regression: bool,
    source: str,
    key: str | None = None,
) -> DepthChoice:
    """Grad-ELLM's depth for ``dataset`` (:mod:`experiments.grad_ellm_depth`): fixed, or
    selected on the ``tuning`` inputs explained with ``target``. A regression head (STS-B) has
    no output distribution for π-Soft: it is selected by AOPC instead (stated)."""
    fixed = fixed_choice(model, args, dataset)
    if fixed is not None:
        return fixed
    metric, departure = args.depth_metric, ""
    if metric == "pi_soft" and regression:
        metric = "aopc"
        departure = (
            "Departure: π-Soft needs an output distribution, which a regression head lacks; "
            "selected by AOPC comprehensiveness − sufficiency instead."
        )
    elif metric == "aopc":
        departure = "Departure: the π-Soft paper selects by the π-Soft AUCs, here by AOPC."
    criterion = depth_criterion(proto, args, pis, metric)
    choice = select_depth(
        model, units, dataset, tuning, target, criterion, args, source=source,
        departure=departure, metric=metric, key=key,
    )  # fmt: skip
    print(f"{dataset}: {choice.note()}", flush=True)
    return choice


def classifier_tuning_inputs(
    model: Any, dataset: str, args: Any, reported: list[Any]
) -> tuple[list[Any], str]:
    """The tuning split of a classifier dataset: ``--tuning-n`` inputs of the same source (SST-2
    validation; the STS-B pairs held out from training) that are not reported, drawn with the
    tuning seed (:func:`experiments.grad_ellm_depth.disjoint_sample`). With
    ``--tuning-disjoint-from N`` (N > ``--n``) they are also not among the items a run of ``N``
    items reports, so that a smaller run (a costlier protocol on fewer items) tunes on the same
    split, and chooses the same depth, as the larger run of the same classifier."""
    tok, seed = model.tokenizer, tuning_seed(args)
    if dataset == "sst2":
        pool: list[Any] = [
            truncate(tok, it.prompt, args.max_tokens) for it in load_sst2("validation")
        ]
        source = "SST-2 validation sentences not reported"
    else:
        _, held = stsb_split()
        pool = [
            (
                truncate(tok, it.meta["sentence1"], args.max_tokens),
                truncate(tok, it.meta["sentence2"], args.max_tokens),
            )
            for it in held
        ]
        source = "held-out STS-B pairs not reported"
    excluded = set(reported)
    wider = args.tuning_disjoint_from
    if wider is not None and wider > args.n:
        wider_args = argparse.Namespace(**{**vars(args), "n": wider})
        excluded |= set(classifier_items(model, None, dataset, wider_args)[0])
        source += f" by a run of {wider} items"
    tuning = disjoint_sample(pool, excluded, lambda x: x, args.tuning_n, seed)
    check_disjoint(list(excluded), tuning, dataset)
    return tuning, source


# ------------------------------------------------------------------------------- classifiers
def classifier_items(
    model: Any, clf: Classifier | None, dataset: str, args: Any
) -> tuple[list[Any], list[Any]]:
    """(inputs, gold labels / scores) of the evaluated items: SST-2 dev sentences, or the
    STS-B pairs the regression head was not trained on as ``(sentence1, sentence2)`` tuples
    (each text truncated to ``--max-tokens``), which every forward — scoring, explaining, each
    perturbation — encodes with their segment ids, as the classifier was trained."""
    if dataset == "sst2":
        items = load_sst2("validation", n=args.n, seed=args.seed)
        sentences = [truncate(model.tokenizer, it.prompt, args.max_tokens) for it in items]
        return sentences, [it.label for it in items]
    if dataset == "stsb":
        _, held = stsb_split()
        items = held[: args.n]
        tok = model.tokenizer
        pairs = [
            (
                truncate(tok, it.meta["sentence1"], args.max_tokens),
                truncate(tok, it.meta["sentence2"], args.max_tokens),
            )
            for it in items
        ]
        return pairs, [it.meta["score"] for it in items]
    raise SystemExit(f"unknown classifier dataset {dataset!r}: use sst2 or stsb")


def classifier_outputs(model: Any, clf: Classifier, inputs: list[Any]) -> torch.Tensor:
    """The head's outputs ``[n, n_out]`` at the feature position of every input (sentence
    pairs with their segment ids)."""
    batch = to_batch(model, inputs)
    positions = clf.target().positions(batch)
    return head_outputs(
        model, batch.tokens, batch.mask, positions, head=clf.head, token_types=batch.token_types
    ).cpu()


def pearson_drop_rows(
    dataset: str,
    method: str,
    full: torch.Tensor,
    perturbed: torch.Tensor,
    gold: torch.Tensor,
    fractions: list[float],
    seed: int,
) -> list[dict[str, Any]]:
    """Summary rows of the dataset-level Pearson drop (mean over fractions; its percentile
    bootstrap over items, 1000 resamples: :func:`~lens_attrib.evaluation.stats.bootstrap_ci`
    with the drop as its statistic) and of the drop at every fraction."""
    import numpy as np

    def drop(full: torch.Tensor, perturbed: torch.Tensor, gold: torch.Tensor) -> float:
        ks = range(len(fractions))
        return float(np.mean([pearson_drop(full, perturbed[:, k], gold) for k in ks]))

    n = len(full)
    with np.errstate(invalid="ignore", divide="ignore"):  # a resample of one repeated item
        value, low, high, _ = bootstrap_ci((full, perturbed, gold), statistic=drop, seed=seed)
    row = {"dataset": dataset, "method": method, "n": n, "n_total": n}
    rows = [
        {
            **row,
            "metric": "pearson_drop",
            "mean": value,
            "ci_low": float(low),
            "ci_high": float(high),
        }
    ]
    for k, f in enumerate(fractions):
        single = pearson_drop(full, perturbed[:, k], gold)
        rows.append({**row, "metric": f"pearson_drop@{f:g}", "mean": single})
    return rows


def run_classifiers(
    model: Any,
    args: Any,
    datasets: list[str],
    methods: list[str],
    pis: list[float],
    units: Units,
) -> RunResult:
    """Faithfulness of every method on the trained classifiers (module docstring)."""
    records: list[dict[str, Any]] = []
    accuracy: dict[str, float] = {}
    figs: list[Any] = []
    examples: list[Any] = []
    extra_rows: list[dict[str, Any]] = []
    depths: dict[str, DepthChoice] = {}
    so_far: dict[str, tuple[int, int]] = {}
    fractions = [float(f) for f in parse_list(args.fractions)]
    for dataset in datasets:
        clf = load_classifier(
            f"{args.model}-{dataset}",
            model=model,
            n_train=args.train_n,
            n_dev=args.dev_n,
            frozen=args.frozen,
        )
        regression = clf.info.regression
        inputs, gold = classifier_items(clf.model, clf, dataset, args)
        out = classifier_outputs(clf.model, clf, inputs)
        pred: list[Any] = out[:, 0].tolist() if regression else out.argmax(-1).tolist()
        gold_t = torch.as_tensor(gold)
        if regression:
            accuracy[dataset] = float(
                torch.corrcoef(torch.stack([out[:, 0].double(), gold_t.double()]))[0, 1]
            )
        else:
            accuracy[dataset] = float((out.argmax(-1) == gold_t).double().mean())
        dev = clf.info.metadata.get("dev_score", float("nan"))
        print(
            f"{dataset}: {len(inputs)} items, classifier {clf.info.name} "
            f"{'Pearson r' if regression else 'accuracy'} {accuracy[dataset]:.3f} here, "
            f"{dev:.3f} on its dev set",
            flush=True,
        )
        digest = clf.digest()
        clf_id = fingerprint([clf.info.name, digest])  # the weights, not the timings
        cache = (
            None
            if args.attribution_cache is None
            else (AttributionCache(args.attribution_cache, clf.model, digest), clf.info.name)
        )
        items_id = fingerprint([inputs, gold])
        proto = protocol(args, pis, zero_shot=False, regression=regression)
        skipped = [m for m in methods if regression and base_method(m) in NO_REGRESSION]
        if skipped:
            print(f"{dataset}: skipped (no regression heads): {', '.join(skipped)}", flush=True)
        ds_methods = [m for m in methods if m not in skipped]
        depth = None
        if "grad_ellm" in ds_methods and inputs:
            tuning, source = (
                ([], "") if fixed_choice(clf.model, args, dataset) else
                classifier_tuning_inputs(clf.model, dataset, args, inputs)
            )  # fmt: skip
            depths[dataset] = choose_depth(
                clf.model, dataset, args, units, tuning, clf.target(), proto, pis,
                regression=regression, source=source, key=f"{dataset}:{clf_id}",
            )  # fmt: skip
            depth = depths[dataset].depth
        opts = {m: experiment_options(m, args.seed, clf.model, args, depth) for m in ds_methods}
        starts = range(0, len(inputs), args.batch_size)
        scored: list[int] = []
        for start in progress_bar(starts, desc=f"{dataset} batches", unit="batch"):
            sl = slice(start, start + args.batch_size)
            items = list(range(start, start + len(inputs[sl])))
            keys = {
                m: f"{dataset}:{clf_id}:{items_id}|{m}{unit_suffix(m, opts[m])}" for m in ds_methods
            }
            if units.so_far and not units.finished(keys.values(), items):
                continue
            scored += items
            share = batch_share(units, keys, items, opts)
            memo = ForwardMemo(clf.model, clf.head)
            for method in ds_methods:
                keep = examples if start == 0 and dataset == datasets[0] else None
                compute = functools.partial(
                    classifier_unit, clf.model, clf, dataset, inputs[sl], method, start, proto,
                    None if regression else gold_t[sl], gold, pred, keep, opts[method], share,
                    memo, cache,
                )  # fmt: skip
                records += units.get(keys[method], items, compute)
        if regression and scored:
            for method in ds_methods:
                where = {"dataset": dataset, "method": method}
                full = curve_points(records, "output_full", **where).values
                perturbed = curve_points(records, "output_without_top@", **where).values
                extra_rows += pearson_drop_rows(
                    dataset, method, full[:, 0], perturbed, gold_t[scored].double(), fractions,
                    args.seed,
                )  # fmt: skip
        if scored:
            figs += curve_figures(records, dataset, ds_methods)
        if units.so_far:
            so_far[dataset] = (len(scored), len(inputs))
        if cache is not None:
            print(f"{dataset}: {cache[0].describe()}", flush=True)
    return RunResult(records, accuracy, figs, examples, extra_rows, depths, so_far)


def classifier_unit(
    model: Any,
    clf: Classifier,
    dataset: str,
    inputs: list[Any],
    method: str,
    start: int,
    proto: Protocol,
    gold_batch: torch.Tensor | None,
    gold: list[Any],
    pred: list[Any],
    examples: list[Any] | None = None,
    options: dict[str, Any] | None = None,
    share: PoolingShare | None = None,
    memo: ForwardMemo | None = None,
    cache: tuple[AttributionCache, str] | None = None,
) -> list[dict[str, Any]]:
    """Records of one unit: ``method`` on the classifier's items ``start…`` (every metric of
    ``proto`` and the curve points); ``examples`` receives the first item's Attribution."""
    return unit_records(
        model, dataset, inputs, clf.target(), method, start, proto, gold_batch, gold, pred,
        examples, options, share, memo, cache,
    )  # fmt: skip


# ------------------------------------------------------------------------------- zero-shot
def run_zero_shot(
    model: Any,
    args: Any,
    datasets: list[str],
    methods: list[str],
    pis: list[float],
    units: Units,
) -> RunResult:
    """Faithfulness of every method on zero-shot label prompts (module docstring)."""
    tok = model.tokenizer
    records: list[dict[str, Any]] = []
    accuracy: dict[str, float] = {}
    figs: list[Any] = []
    examples: list[Any] = []
    depths: dict[str, DepthChoice] = {}
    so_far: dict[str, tuple[int, int]] = {}
    store = (
        None
        if args.attribution_cache is None
        else AttributionCache(args.attribution_cache, model, tensors_digest([model.state_dict()]))
    )
    for dataset in datasets:
        ids = label_ids(tok, dataset)
        items = load(dataset, args.n, args.seed)
        prompts = [make_prompt(tok, dataset, it, args.max_tokens, not args.no_chat) for it in items]
        pred = predict(model, prompts, ids)
        accuracy[dataset] = sum(int(p == it.label) for p, it in zip(pred, items)) / max(
            len(items), 1
        )
        lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        print(
            f"{dataset}: {len(items)} items, zero-shot accuracy {accuracy[dataset]:.2f}, "
            f"prompt tokens {min(lengths)}–{max(lengths)}",
            flush=True,
        )
        gold = [it.label for it in items]
        items_id = fingerprint([prompts, gold, pred])
        proto = protocol(args, pis, zero_shot=True, regression=False)
        depth = None
        if "grad_ellm" in methods and prompts:
            tuning: list[str] = []
            if fixed_choice(model, args, dataset) is None:
                tuning = zero_shot_tuning_prompts(model, dataset, args, items, prompts)
            predicted = predict(model, tuning, ids) if tuning else []
            tuning_target = Target(token=[ids[p] for p in predicted])
            depths[dataset] = choose_depth(
                model, dataset, args, units, tuning, tuning_target, proto, pis,
                regression=False, source=f"{dataset} items not reported, predicted label",
            )  # fmt: skip
            depth = depths[dataset].depth
        opts = {m: experiment_options(m, args.seed, model, args, depth) for m in methods}
        starts = range(0, len(prompts), args.batch_size)
        scored: list[int] = []
        for start in progress_bar(starts, desc=f"{dataset} batches", unit="batch"):
            sl = slice(start, start + args.batch_size)
            items = list(range(start, start + len(prompts[sl])))
            target = Target(token=[ids[p] for p in pred[sl]])
            cache = None if store is None else (store, f"token={[ids[p] for p in pred[sl]]}")
            keys = {m: f"{dataset}:{items_id}|{m}{unit_suffix(m, opts[m])}" for m in methods}
            if units.so_far and not units.finished(keys.values(), items):
                continue
            scored += items
            share = batch_share(units, keys, items, opts)
            memo = ForwardMemo(model, target.head)
            for method in methods:
                keep = examples if start == 0 and dataset == datasets[0] else None
                compute = functools.partial(
                    unit_records, model, dataset, prompts[sl], target, method, start, proto,
                    None, gold, pred, keep, opts[method], share, memo, cache,
                )  # fmt: skip
                records += units.get(keys[method], items, compute)
        if scored:
            figs += curve_figures(records, dataset, methods)
        if units.so_far:
            so_far[dataset] = (len(scored), len(prompts))
    if store is not None:
        print(store.describe(), flush=True)
    return RunResult(records, accuracy, figs, examples, [], depths, so_far)


def zero_shot_tuning_prompts(
    model: Any, dataset: str, args: Any, reported: list[Any], prompts: list[str]
) -> list[str]:
    """``--tuning-n`` prompts of ``dataset`` items that are not reported, drawn with the
    tuning seed."""

    def key(it: Any) -> str:
        return f"{it.prompt}\n{(it.meta or {}).get('passage', '')}"

    pool = load(dataset, None, args.seed)
    chosen = disjoint_sample(
        pool, {key(it) for it in reported}, key, args.tuning_n, tuning_seed(args)
    )
    tok = model.tokenizer
    tuning = [make_prompt(tok, dataset, it, args.max_tokens, not args.no_chat) for it in chosen]
    tuning = [p for p in tuning if p not in set(prompts)]
    check_disjoint(prompts, tuning, dataset)
    return tuning


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and bootstrap 95% CI per dataset × method × metric."""
    return summarize_records(records, ("dataset", "method", "metric"))


def render(
    summary: Sequence[dict[str, Any]],
    datasets: Sequence[str],
    methods: Sequence[str],
    accuracy: dict[str, float],
    args: Any,
    *,
    records: Sequence[dict[str, Any]] = (),
    depths: dict[str, DepthChoice] | None = None,
    notes: Sequence[str] = (),
    so_far: dict[str, tuple[int, int]] | None = None,
) -> str:
    """The paper-style table per dataset, with the method settings (``notes``), Grad-ELLM's
    depth and IG's completeness gaps under each table; ``so_far`` (a ``--so-far`` run): per
    dataset, the items scored of the run's items, said above its table."""
    index = {(r["dataset"], r["method"], r["metric"]): r["mean"] for r in summary}
    depths = depths or {}
    if args.mode == "zero-shot":
        setting = f"zero-shot, {'chat' if not args.no_chat else 'plain'} prompts"
    else:
        setting = "trained classifier heads"
    lines = [
        f"Faithfulness on {args.model} ({setting}, ≤{args.max_tokens} tokens per text; AOPC "
        f"fractions {args.fractions}; π grid {args.pis}, {args.n_draws} draws; mean over items)",
        *notes,
    ]
    for dataset in datasets:
        cols = [
            c for c, key in COLUMNS.items() if any(k[0] == dataset and k[2] == key for k in index)
        ]
        rows = [[m] + [index.get((dataset, m, COLUMNS[c])) for c in cols] for m in methods]
        what = "zero-shot accuracy" if args.mode == "zero-shot" else "classifier score"
        done = (so_far or {}).get(dataset)
        partial = (
            f"; so far: {done[0]} of the run's {done[1]} items (the batches every method has "
            "finished)" if done else ""
        )  # fmt: skip
        lines += [
            "",
            f"[{dataset}] {what} {accuracy.get(dataset, float('nan')):.3f}{partial}",
            format_table(rows, ["method", *cols]),
            *median_lines(records, dataset, methods),
            *reach_lines(records, dataset, methods),
            *([depths[dataset].note()] if dataset in depths else []),
            *gap_lines(records, {"dataset": dataset}, None, args.ig_max_steps),
        ]
    return "\n".join(lines)


def median_lines(
    records: Sequence[dict[str, Any]], dataset: str, methods: Sequence[str]
) -> list[str]:
    """The medians over items of the NC ratios (:data:`UNBOUNDED`), with the largest item value.

    Soft-NC divides the shift of the perturbed output by ΔP₀, the Hellinger distance between
    the outputs on the input and on the all-zero input (π-Soft paper, eq. 5), and "can exceed
    1". Where zeroing every token barely moves the prediction (a two-class head whose zero
    input predicts the item's class), ΔP₀ is small and the ratio large, so a few items can set
    the mean of a column; the medians do not follow them. Empty without NC records."""
    wanted = {COLUMNS[c]: c for c in UNBOUNDED}
    values: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for r in records:
        name = wanted.get(r.get("metric", ""))
        v = r.get("value")
        if name and r.get("dataset") == dataset and v is not None and math.isfinite(float(v)):
            values.setdefault((r["method"], name), []).append((float(v), int(r["item"])))
    cols = [c for c in UNBOUNDED if any(c == k[1] for k in values)]
    if not cols:
        return []
    rows = [
        [m] + [statistics.median(v for v, _ in values[m, c]) if (m, c) in values else None
               for c in cols]
        for m in methods
    ]  # fmt: skip
    top = [(max(got), m, c) for (m, c), got in values.items()]
    (value, item), method, col = max(top)
    bound = (
        f"; a Hellinger distance is at most 1, so ΔP₀ ≤ {1 / value:.2g} there" if value > 1 else ""
    )
    shown = f"{value:.1f}" if value >= 10 else f"{value:.3g}"
    return [
        "Medians over items of the NC ratios. Each divides by ΔP₀, the Hellinger shift that "
        "zeroing every token makes, which is small where the zero input keeps the prediction; "
        "there the ratio is large, and a few items can set a mean in the table above. Largest "
        f"item value: {col} {shown} ({method}, item {item}{bound}).",
        format_table(rows, ["method", *cols]),
    ]


REACH_SHOWN = (0.5, 0.6, 0.7, 0.8, 0.9)


def reach_lines(
    records: Sequence[dict[str, Any]], dataset: str, methods: Sequence[str]
) -> list[str]:
    """Per method, the share of items whose keep scores reach the upper π of the grid
    (:mod:`experiments.pi_reach`, read from the ``pi_soft_ns@π`` / ``pi_soft_nc@π`` curves).

    The keep scores clip negative relevance to 0, so a signed method cannot reach a π above its
    share of positive tokens; there its curve is one boundary mask's, and the π-Soft AUCs above
    hold that. Printed only when some method misses some of these π on some item; empty without
    π-Soft curves."""
    grid, _ = item_curves(records, "pi_soft_ns", {"dataset": dataset})
    shown = [p for p in REACH_SHOWN if any(abs(p - q) < 1e-12 for q in grid)]
    shown = shown or [p for p in grid if p >= 0.5]
    if not shown:
        return []
    rows = {r["method"]: r for r in reach_table(records, shown, {"dataset": dataset})}
    cells = {m: [rows[m][f"reach@{p:g}"] for p in shown] for m in methods if m in rows}
    if all(v >= 1.0 for got in cells.values() for v in got):
        return []
    table = [[m, *[f"{100 * v:.0f} %" for v in got]] for m, got in cells.items()]
    return [
        "Share of items whose keep scores reach π (s = max(r, 0)/max: a signed method cannot "
        "reach a π above its share of positive tokens, and its curve is then one boundary "
        "mask's; python -m experiments.pi_reach on the journal):",
        format_table(table, ["method", *[f"π={p:g}" for p in shown]]),
    ]


if __name__ == "__main__":
    main()
