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

Metrics: any name of the registry :data:`lens_attrib.evaluation.metrics.METRICS`
(plausibility, AOPC, insertion/deletion, Soft / π-Soft, curve points), computed by
:func:`lens_attrib.evaluation.metrics.score`; ``per_layer=True`` adds one record per layer for
methods with ``layer_scores``. Tasks: :func:`lens_attrib.evaluation.items.load_task`.

Batches, shards (``torchrun`` ranks) and resuming from the journal: see :func:`evaluate`;
the merged shards (:func:`merge_records`) equal one run exactly. The loop's machinery is in
:mod:`lens_attrib.evaluation.loop`, provenance in :mod:`lens_attrib.evaluation.provenance`.

Command line: ``python -m lens_attrib.evaluation`` (:mod:`lens_attrib.evaluation.cli`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from lens_attrib.evaluation import distributed
from lens_attrib.evaluation.batching import BatchSizer, plan_chunks
from lens_attrib.evaluation.faithfulness import special_ids_of
from lens_attrib.evaluation.items import (
    check_evidence,
    explained_target,
    item_evidence,
    token_lengths,
)
from lens_attrib.evaluation.items import method_options as seeded
from lens_attrib.evaluation.journal import Journal
from lens_attrib.evaluation.loop import (
    Known,
    Sink,
    base_record,
    check_evaluate_args,
    correctness_pass,
    run_plan,
)
from lens_attrib.evaluation.metrics import METRICS, ScoreOptions, check_metrics, score
from lens_attrib.evaluation.provenance import journal_path, run_manifest, shard_journal
from lens_attrib.evaluation.records import (
    EvalResult,
    merge_records,
    save,
    sort_records,
    summarize,
)
from lens_attrib.inputs import StartTokenLike, start_token_of
from lens_attrib.methods import attribute


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
    max_batch: int | Literal["auto"] = 64,
    seed: int = 0,
    progress: bool = True,
    out: str | Path | None = None,
    overwrite: bool = False,
    start_token: StartTokenLike = None,
    journal: str | Path | None = None,
) -> EvalResult:
    """Score ``methods`` × ``metrics`` on ``dataset`` (see the module doc).

    Start token: every prompt gets the start token of :func:`lens_attrib.inputs.start_token_of`
    (the same as ``attribute`` and the experiments: ``<|endoftext|>`` on SmolLM2; ``start_token=``
    chooses another special token, ``False`` none), for the correctness check, the
    explanations, the evidence positions and the metrics alike (an item's own
    ``.evidence_positions`` must count it too: it is real token 0). ``config["start_token"]``
    and the manifest record the policy, every record the start token its item got.

    ``method_options[name]`` go to the method; ``metric_options`` holds fields of
    :class:`~lens_attrib.evaluation.metrics.ScoreOptions` (``"aopc"``, ``"curves"`` and
    ``"soft"`` option dicts, ``max_batch``, ``seed``); ``random`` gets ``seed`` too
    (:func:`~lens_attrib.evaluation.items.method_options`). ``only_correct``: skip items the model
    gets wrong (their correctness records are kept).

    Batches: the items are sorted by token length and cut into chunks of ``batch_size``
    (:func:`~lens_attrib.evaluation.batching.plan_chunks`). ``max_batch``: rows per forward of
    the perturbation metrics; ``"auto"``: each chunk runs in the largest sub-batch (at most
    ``batch_size``) that fits in memory, found by halving on out-of-memory per method and length
    bucket (reported in ``config["batches"]``). ``shard=(i, n)``: chunks ``i, i+n, …`` only;
    under ``torchrun`` (an initialised process group) the shard is the rank's and rank 0 returns
    (and writes) the merged records of every rank.

    ``out`` (``.json`` or ``.csv``): the result is written there, and every finished batch is
    first appended to the journal ``<out stem>[.shard-i-of-n].records.jsonl``
    (:mod:`lens_attrib.evaluation.journal`). Rerunning with the same ``out`` skips the batches
    already on disk; a journal of a different run is an error unless ``overwrite``.
    ``journal``: journal there instead (``.jsonl``, or ``.jsonl.gz`` compressed, e.g. a run
    directory's ``docs/results/runs/<name>/records.jsonl.gz``, :mod:`~.evaluation.runs`; a shard
    inserts ``.shard-i-of-n`` before the extension), with or without ``out``.
    """
    check_metrics(metrics, "evaluate")
    check_evaluate_args(dataset, methods, batch_size, target)
    check_evidence(dataset, metrics, "evaluate")
    if max_batch != "auto" and (isinstance(max_batch, str) or max_batch < 1):
        raise ValueError(f"max_batch must be a positive integer or 'auto', got {max_batch!r}")
    if out is not None and Path(out).suffix not in (".json", ".csv"):
        raise ValueError(
            f"out={str(out)!r}: write the result to a .json or .csv path (the resumable "
            "journal goes beside it as <stem>.records.jsonl)."
        )
    rank = distributed.current()
    if shard is None and rank is not None:
        shard = rank.shard
    start = start_token_of(model, start_token)
    chunks = plan_chunks(token_lengths(model, dataset, start_token), batch_size, shard)
    method_options = method_options or {}
    auto = max_batch == "auto"
    metric_rows = 64 if auto else int(max_batch)
    special = sorted(special_ids_of(model, special_ids))
    opts = ScoreOptions.from_dict(
        {"max_batch": metric_rows, "seed": seed, **(metric_options or {})}
        | {"special_ids": special, "per_layer": per_layer}
    )
    config = {
        "methods": list(methods),
        "metrics": list(metrics),
        "batch_size": batch_size,
        "max_batch": max_batch,
        "target": target,
        "contrastive": contrastive,
        "only_correct": only_correct,
        "per_layer": per_layer,
        "shard": list(shard) if shard else None,
        "seed": seed,
        "n_items": sum(len(c.items) for c in chunks),
        "model": getattr(model.cfg, "model_name", None),
        "start_token": start.describe(),
    }
    records_at = (
        shard_journal(journal, shard)
        if journal is not None
        else journal_path(out, shard)
        if out is not None
        else None
    )
    opened = None
    if records_at is not None:
        facts = {"method_options": method_options, "metric_options": metric_options or {}}
        manifest = run_manifest(model, dataset, {**config, **facts, "special_ids": special})
        opened = Journal.open(records_at, manifest, overwrite=overwrite)
    explained = (True,) if only_correct else (True, False, None)  # by correctness
    sizer = BatchSizer(batch_size, auto=auto)
    sink = Sink(opened)
    show = progress and (rank is None or rank.is_main)  # and lens_attrib.progress's switch
    known = correctness_pass(model, dataset, chunks, sizer, sink, metric_rows, show, start_token)
    for method in methods:
        done = opened.finished(method) if opened is not None else set()
        plan = [
            (chunk, todo)
            for chunk in chunks
            if (todo := [i for i in chunk.items if i not in done and known[i][1] in explained])
        ]

        def explain(sub: list[int], method: str = method) -> list[dict[str, Any]]:
            return _explain_and_score(
                model,
                dataset,
                sub,
                known,
                method,
                metrics,
                target=target,
                contrastive=contrastive,
                method_options=method_options.get(method, {}),
                options=opts,
                start_token=start_token,
            )

        run_plan(method, plan, sizer, sink, explain, show)
    records = sink.records()
    config["batches"] = sizer.report() if auto else batch_size
    if rank is not None and shard == rank.shard:
        gathered = distributed.gather_to_rank0(records)
        if gathered is None:
            return EvalResult(sort_records(records), summarize(records), config)
        records = [r for part in gathered for r in part]
        config["shard"] = None
        config["world_size"] = rank.world_size
        config["n_items"] = len(dataset)
    records = sort_records(records)
    result = EvalResult(records, summarize(records), config)
    if out is not None:
        save(result, out)
    return result


def _explain_and_score(
    model: Any,
    dataset: Sequence[Any],
    indices: Sequence[int],
    known: Known,
    method: str,
    metrics: Sequence[str],
    *,
    target: str,
    contrastive: bool,
    method_options: dict[str, Any],
    options: ScoreOptions,
    start_token: StartTokenLike = None,
) -> list[dict[str, Any]]:
    """The records of ``method`` × ``metrics`` on the items ``indices`` (one method call)."""
    items = [dataset[i] for i in indices]
    evidence = [item_evidence(model, it, start_token) for it in items]
    attr = attribute(
        model,
        [it.prompt for it in items],
        explained_target(items, target, contrastive),
        method=method,
        start_token=start_token,
        **seeded(method, options.seed, method_options),
    )
    starts = attr.meta["start_token"]
    base = [base_record(i, it, *known[i], s) for i, it, s in zip(indices, items, starts)]
    return [
        {**base[r.item], "method": method, "metric": r.name, "layer": r.layer, "value": r.value}
        for r in score(model, attr, metrics, evidence=evidence, options=options)
    ]


__all__ = [
    "METRICS",
    "EvalResult",
    "evaluate",
    "merge_records",
    "save",
    "sort_records",
    "summarize",
]
