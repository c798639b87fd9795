"""The evaluation command line: ``python -m lens_attrib.evaluation`` (or ``….evaluation.runner``).

::

    python -m lens_attrib.evaluation --model smollm2-135m --task sva \\
        --methods grad_x_input,gradient --metrics pointing_game,mrr --n 50 --shard 0/2 \\
        --out results/x.json
    torchrun --nproc-per-node 4 -m lens_attrib.evaluation --methods attnlrp \\
        --n 5000 --max-batch auto --batch-size 128 --out results/big.json

Tasks come from the registry (:func:`lens_attrib.evaluation.items.load_task`), metrics from
:data:`lens_attrib.evaluation.metrics.METRICS`; the run is :func:`~.runner.evaluate`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

import torch

from lens_attrib.cli import (
    add_methods_argument,
    add_shard_argument,
    add_start_token_argument,
    batch_or_auto,
    choice_list,
    positive_int,
)
from lens_attrib.evaluation import distributed
from lens_attrib.evaluation.items import load_task
from lens_attrib.evaluation.metrics import METRICS
from lens_attrib.evaluation.provenance import shard_journal
from lens_attrib.evaluation.records import EvalResult
from lens_attrib.evaluation.runner import evaluate

TINY_MODELS = ("tiny-gpt2", "tiny-llama", "tiny-pythia", "tiny-bert")
"""Random-weight test models (:mod:`lens_attrib.tiny_models`, seed 0) the CLI accepts by name."""


def load_named_model(name: str, device: str | torch.device | None = None) -> Any:
    """``tiny-*`` test models, else :func:`lens_attrib.models.load_model` on ``device``."""
    from lens_attrib import models, tiny_models

    if name in TINY_MODELS:
        kind = name.removeprefix("tiny-")
        build = tiny_models.tiny_bert if kind == "bert" else tiny_models.TINY_DECODERS[kind]
        model = build()
        if device is not None and torch.device(device).type != "cpu":
            model.to(str(device), print_details=False)
            model.cfg.device = str(device)
        return model
    if device is None or torch.device(device).type == "cpu":
        return models.load_model(name)
    return models.load_model(name, device=device)


def main(argv: Sequence[str] | None = None) -> EvalResult:
    parser = argparse.ArgumentParser(
        prog="python -m lens_attrib.evaluation",
        description="Evaluate attribution methods on a task dataset: records and a summary.",
        epilog="Many processes: torchrun --nproc-per-node N -m lens_attrib.evaluation "
        "... (or accelerate launch -m ...); each rank takes its shard, rank 0 writes --out.",
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="model name (smollm2-135m, minilm-l6, or the random test models "
        f"{', '.join(TINY_MODELS)}), local folder or TL name",
    )
    parser.add_argument(
        "--task",
        default="sva",
        help="sva, anaphora (ra), dna, blimp:<paradigm> (blimp_rpsv, blimp_darn, blimp_ana), "
        "linzen, or a .jsonl/.csv file of your own items",
    )
    add_methods_argument(parser, "grad_x_input")
    parser.add_argument(
        "--metrics",
        type=choice_list(list(METRICS), "metric(s)"),
        default=["pointing_game", "mrr"],
        metavar="M1,M2,…",
        help=f"comma-separated metrics, from: {', '.join(METRICS)}",
    )
    parser.add_argument(
        "--n-items",
        "--n",
        dest="n",
        type=positive_int,
        default=50,
        help="number of items (under torchrun write --n-items: torchrun reads --n as its own)",
    )
    add_shard_argument(parser)
    parser.add_argument(
        "--out",
        default=None,
        help="write records to this .json or .csv; finished batches are journaled beside it "
        "(<stem>.records.jsonl) and a rerun resumes from them",
    )
    parser.add_argument(
        "--journal",
        default=None,
        help="journal finished batches here instead of beside --out (.jsonl, or .jsonl.gz "
        "compressed: a run directory's docs/results/runs/<name>/records.jsonl.gz, with its "
        "manifest.json beside it); an existing one needs --resume or --overwrite",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --journal (finished batches reused; the journal beside "
        "--out is always resumed)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="discard an existing journal of --out instead of resuming it",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        help="items per method call (with --max-batch auto: the largest batch tried)",
    )
    parser.add_argument(
        "--max-batch",
        type=batch_or_auto,
        default=64,
        help="rows per forward in the perturbation metrics; 'auto': every method call uses "
        "the largest batch ≤ --batch-size that fits in memory (halved on out-of-memory)",
    )
    parser.add_argument(
        "--target",
        default="gold",
        choices=("gold", "prediction"),
        help="explain the gold token or the model's prediction",
    )
    parser.add_argument(
        "--contrastive", action="store_true", help="explain logit(target) − logit(foil)"
    )
    parser.add_argument(
        "--only-correct", action="store_true", help="explain only the items the model gets right"
    )
    parser.add_argument(
        "--n-draws", type=positive_int, default=15, help="Monte-Carlo draws of the soft metrics"
    )
    parser.add_argument("--seed", type=int, default=0, help="data and metric seed")
    add_start_token_argument(parser)
    parser.add_argument(
        "--quiet",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress bars and no log lines (bars alone: LENS_ATTRIB_PROGRESS=0)",
    )
    args = parser.parse_args(argv)
    if args.journal is not None and not (args.resume or args.overwrite):
        existing = shard_journal(args.journal, args.shard)
        if existing.exists():
            parser.error(
                f"{existing} holds the records of an earlier run: pass --resume to continue "
                "it (finished batches reused) or --overwrite to discard them"
            )
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rank = distributed.init_from_env()
    try:
        model = load_named_model(args.model, rank.device if rank is not None else None)
        dataset = load_task(args.task, args.n, args.seed)
        result = evaluate(
            model,
            dataset,
            args.methods,
            args.metrics,
            batch_size=args.batch_size,
            target=args.target,
            contrastive=args.contrastive,
            only_correct=args.only_correct,
            shard=args.shard,
            max_batch=args.max_batch,
            seed=args.seed,
            metric_options={"soft": {"n_draws": args.n_draws}},
            progress=not args.quiet,
            out=args.out,
            overwrite=args.overwrite,
            start_token=args.start_token,
            journal=args.journal,
        )
    finally:
        if rank is not None:
            distributed.finish()
    if rank is None or rank.is_main:
        print(result.table())  # CLI output
    return result


__all__ = ["TINY_MODELS", "load_named_model", "main"]
