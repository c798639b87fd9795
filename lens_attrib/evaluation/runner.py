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

Batches and shards: items are sorted by token length and cut into chunks of ``batch_size``;
``shard=(i, n)`` keeps chunks ``i, i+n, …``, so every item is computed in the same batch however
the run is split, and the merged shards (:func:`merge_records`) equal one run exactly. Under
``torchrun`` each rank takes its own shard and rank 0 gathers the records.
``max_batch="auto"`` finds the largest sub-batch that fits in memory by halving.

Resuming: with ``out``, every finished batch is appended (flushed and fsynced) to the journal
``<out stem>.records.jsonl`` after a manifest of the run; rerunning the same command skips what
is on disk (see :mod:`lens_attrib.evaluation.journal`).

CLI::

    python -m lens_attrib.evaluation.runner --model smollm2-135m --task sva \\
        --methods grad_x_input,gradient --metrics pointing_game,mrr --n 50 --shard 0/2 \\
        --out results/x.json
    torchrun --nproc-per-node 4 -m lens_attrib.evaluation.runner --methods attnlrp \\
        --n 5000 --max-batch auto --batch-size 128 --out results/big.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lens_attrib.attribution import Attribution
from lens_attrib.cli import (
    add_methods_argument,
    add_shard_argument,
    add_start_token_argument,
    batch_or_auto,
    choice_list,
    positive_int,
)
from lens_attrib.evaluation import distributed
from lens_attrib.evaluation.batching import BatchSizer, Chunk, plan_chunks
from lens_attrib.evaluation.faithfulness import aopc, insertion_deletion, special_ids_of
from lens_attrib.evaluation.journal import Journal
from lens_attrib.evaluation.plausibility import PLAUSIBILITY_METRICS, plausibility
from lens_attrib.evaluation.records import (
    EvalResult,
    merge_records,
    save,
    sort_records,
    summarize,
)
from lens_attrib.evaluation.soft import soft_metrics
from lens_attrib.forward import head_outputs
from lens_attrib.inputs import (
    StartToken,
    StartTokenLike,
    prompt_ids,
    start_token_of,
    to_batch,
)
from lens_attrib.methods import attribute
from lens_attrib.progress import progress_bar
from lens_attrib.target import Target

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


# --------------------------------------------------------------------------- items
def _evidence(model: Any, item: Any, start_token: StartTokenLike) -> list[int]:
    """``item.evidence_positions`` as given, else its evidence words / spans in the model's
    input under the run's start token (:func:`lens_attrib.data.item_evidence_positions`)."""
    if getattr(item, "evidence_positions", None) is not None:
        return [int(p) for p in item.evidence_positions]
    words = getattr(item, "evidence_words", None)
    spans = (getattr(item, "meta", None) or {}).get("evidence_spans")
    if not words and not spans:
        return []
    from lens_attrib.data import item_evidence_positions

    return item_evidence_positions(model, item, start_token=start_token)


def _start_of(model: Any, prompt: str, start: StartToken) -> str | None:
    """The start token ``prompt``'s model input begins with under ``start`` (or ``None``)."""
    ids, _ = prompt_ids(model, prompt, start)
    return start.text if start.id is not None and ids and ids[0] == start.id else None


def _correctness(
    model: Any, items: Sequence[Any], max_batch: int, start_token: StartTokenLike = None
) -> tuple[list[bool | None], list[str]]:
    """Per item: is the gold target preferred (over the foil, or as argmax); the prediction.

    The explained scalar of the gold Target (``logit(target) − logit(foil)``) comes from
    :meth:`ResolvedTarget.select`, like every method's.
    """
    batch = to_batch(model, [it.prompt for it in items], start_token=start_token)
    logits = head_outputs(
        model, batch.tokens, batch.mask, batch.last_real, max_batch=max_batch
    ).cpu()
    pred = logits.argmax(-1)
    has_target = [getattr(it, "target", None) is not None for it in items]
    has_foil = [h and getattr(it, "foil", None) is not None for h, it in zip(has_target, items)]
    correct: list[bool | None] = [None] * len(items)
    if any(has_target):
        rows = [i for i, h in enumerate(has_target) if h]
        foil_rows = [i for i in rows if has_foil[i]]
        sub = batch.select(rows)
        gold = Target(token=[items[i].target for i in rows]).resolve(model, sub, logits[rows])
        for r, i in enumerate(rows):
            correct[i] = bool(pred[i] == gold.token_ids[r])
        if foil_rows:
            sub = batch.select(foil_rows)
            tgt = Target(
                token=[items[i].target for i in foil_rows], foil=[items[i].foil for i in foil_rows]
            )
            value = tgt.resolve(model, sub, logits[foil_rows]).select(logits[foil_rows])
            for r, i in enumerate(foil_rows):
                correct[i] = bool(value[r] > 0)
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
                numbers = attr.meta.get("layers") or list(range(v.shape[1]))
                out += [(m, numbers[i], v[:, i]) for i in range(v.shape[1])]
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


def _base(
    index: int, item: Any, prediction: str, correct: bool | None, start: str | None
) -> dict[str, Any]:
    return {
        "item": index,
        "task": getattr(item, "task", None),
        "prompt": item.prompt,
        "start_token": start,
        "target": getattr(item, "target", None),
        "foil": getattr(item, "foil", None),
        "prediction": prediction,
        "correct": correct,
    }


def token_lengths(
    model: Any, dataset: Sequence[Any], start_token: StartTokenLike = None
) -> list[int]:
    """Every item's number of tokens as the model sees it (with its start token / CLS and SEP)."""
    if not len(dataset):
        return []
    batch = to_batch(model, [it.prompt for it in dataset], start_token=start_token)
    return batch.lengths.tolist()


def data_hash(dataset: Sequence[Any]) -> str:
    """SHA-256 of every item's prompt, target, foil, task and evidence (the manifest's data id)."""
    digest = hashlib.sha256()
    for it in dataset:
        fields = {
            k: getattr(it, k, None)
            for k in ("prompt", "target", "foil", "task", "evidence_words", "evidence_positions")
        }
        digest.update(json.dumps(fields, default=repr, sort_keys=True).encode())
    return digest.hexdigest()


def code_version() -> dict[str, str | None]:
    """The package version and, when the code is a git checkout, its commit (``+dirty``)."""
    try:
        version: str | None = importlib.metadata.version("lens-attrib")
    except importlib.metadata.PackageNotFoundError:
        version = None
    root = Path(__file__).resolve().parents[2]
    commit = None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        commit = head or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"package": version, "git": commit}


def journal_path(out: str | Path, shard: tuple[int, int] | None) -> Path:
    """Where the records of ``out`` are journaled: ``<out stem>[.shard-i-of-n].records.jsonl``."""
    out = Path(out)
    tag = f".shard-{shard[0]}-of-{shard[1]}" if shard is not None else ""
    return out.with_name(f"{out.stem}{tag}.records.jsonl")


def check_evaluate_args(
    dataset: Sequence[Any], methods: Sequence[str], batch_size: Any, target: str
) -> None:
    """Clear errors for an empty dataset, a method list given as a string, bad counts."""
    if len(dataset) == 0:
        raise ValueError("evaluate: the dataset is empty; pass at least one item.")
    if isinstance(methods, str):
        raise TypeError(
            f"evaluate: methods must be a list of method names, got the string {methods!r}: "
            f"write [{methods!r}]."
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be an integer >= 1, got {batch_size!r}.")
    if target not in ("gold", "prediction"):
        raise ValueError(f"evaluate: target must be 'gold' or 'prediction', got {target!r}.")
    from lens_attrib.methods import METHODS
    from lens_attrib.methods.registry import unknown_method_message

    for name in methods:
        if name not in METHODS:
            raise KeyError(f"evaluate: {unknown_method_message(name)}")


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
) -> EvalResult:
    """Score ``methods`` × ``metrics`` on ``dataset`` (see the module doc).

    Start token: every prompt gets the start token of :func:`lens_attrib.inputs.start_token_of`
    (the same as ``attribute`` and the experiments: ``<|endoftext|>`` on SmolLM2; ``start_token=``
    chooses another special token, ``False`` none), for the correctness check, the
    explanations, the evidence positions and the metrics alike (an item's own
    ``.evidence_positions`` must count it too: it is real token 0). ``config["start_token"]``
    and the manifest record the policy, every record the start token its item got.

    ``method_options[name]`` go to the method; ``metric_options`` may hold ``"aopc"``,
    ``"curves"`` and ``"soft"`` option dicts for :func:`aopc`, :func:`insertion_deletion` and
    :func:`soft_metrics`. ``only_correct``: skip items the model gets wrong (their correctness
    records are kept).

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
    """
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise KeyError(f"Unknown metrics {unknown}; known: {list(METRICS)}")
    check_evaluate_args(dataset, methods, batch_size, target)
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
    opts = {"max_batch": metric_rows, "seed": seed, **(metric_options or {})}
    special = sorted(special_ids_of(model, special_ids))
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
    journal = None
    if out is not None:
        manifest = {
            **config,
            "model": {
                "name": getattr(model.cfg, "model_name", None),
                "dtype": str(model.cfg.dtype),
                "n_layers": model.cfg.n_layers,
                "d_model": model.cfg.d_model,
                "d_vocab": model.cfg.d_vocab,
            },
            "method_options": method_options,
            "metric_options": metric_options or {},
            "special_ids": special,
            "data_hash": data_hash(dataset),
            "dataset_size": len(dataset),
            "code_version": code_version(),
        }
        journal = Journal.open(journal_path(out, shard), manifest, overwrite=overwrite)
    explained = (True,) if only_correct else (True, False, None)  # by correctness
    sizer = BatchSizer(batch_size, auto=auto)
    sink = _Sink(journal)
    show = progress and (rank is None or rank.is_main)  # and lens_attrib.progress's switch
    known = _correctness_pass(model, dataset, chunks, sizer, sink, metric_rows, show, start_token)
    for method in methods:
        done = journal.finished(method) if journal is not None else set()
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
                opts=opts,
                special=special,
                per_layer=per_layer,
                start_token=start_token,
            )

        _run_plan(method, plan, sizer, sink, explain, show)
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


@dataclass
class _Sink:
    """Where finished batches go: the journal (durably) or a list in memory."""

    journal: Journal | None
    kept: list[dict[str, Any]] = field(default_factory=list)

    def put(
        self,
        method: str,
        items: Sequence[int],
        records: list[dict[str, Any]],
        size: int,
        bucket: int,
    ) -> None:
        if self.journal is not None:
            self.journal.append(method, items, records, batch_size=size, bucket=bucket)
        else:
            self.kept.extend(records)

    def records(self) -> list[dict[str, Any]]:
        return self.journal.records() if self.journal is not None else self.kept


Work = Callable[[list[int]], list[dict[str, Any]]]


def _run_plan(
    method: str,
    plan: Sequence[tuple[Chunk, list[int]]],
    sizer: BatchSizer,
    sink: _Sink,
    work: Work,
    show: bool,
) -> None:
    """Run ``work`` on every chunk's items in sub-batches; each finished one goes to ``sink``."""
    total = sum(len(items) for _, items in plan)
    with progress_bar(desc=method, total=total, unit="item", enabled=show) as bar:
        for chunk, items in plan:
            for sub, records, size in sizer.run(method, chunk.bucket, items, work):
                sink.put(method, sub, records, size, chunk.bucket)
                bar.update(len(sub))


def _correctness_pass(
    model: Any,
    dataset: Sequence[Any],
    chunks: Sequence[Chunk],
    sizer: BatchSizer,
    sink: _Sink,
    max_batch: int,
    show: bool,
    start_token: StartTokenLike = None,
) -> dict[int, tuple[str, bool | None]]:
    """Prediction and correctness of every planned item (from the journal where it has them)."""
    known = _known_correctness(sink.journal)
    start = start_token_of(model, start_token)

    def correctness(sub: list[int]) -> list[dict[str, Any]]:
        items = [dataset[i] for i in sub]
        correct, predicted = _correctness(model, items, max_batch, start_token)
        return [
            {
                **_base(i, dataset[i], p, c, _start_of(model, dataset[i].prompt, start)),
                "method": "model",
                "metric": "model_correct",
                "layer": None,
                "value": float("nan") if c is None else float(c),
            }
            for i, p, c in zip(sub, predicted, correct)
        ]

    plan = [(c, todo) for c in chunks if (todo := [i for i in c.items if i not in known])]
    _run_plan("model", plan, sizer, sink, correctness, show)
    known.update(
        {
            r["item"]: (r["prediction"], r["correct"])
            for r in sink.records()
            if r["method"] == "model"
        }
    )
    return known


def _known_correctness(journal: Journal | None) -> dict[int, tuple[str, bool | None]]:
    if journal is None:
        return {}
    return {
        r["item"]: (r["prediction"], r["correct"])
        for b in journal.batches
        if b["method"] == "model"
        for r in b["records"]
    }


def _explain_and_score(
    model: Any,
    dataset: Sequence[Any],
    indices: Sequence[int],
    known: dict[int, tuple[str, bool | None]],
    method: str,
    metrics: Sequence[str],
    *,
    target: str,
    contrastive: bool,
    method_options: dict[str, Any],
    opts: dict[str, Any],
    special: list[int],
    per_layer: bool,
    start_token: StartTokenLike = None,
) -> list[dict[str, Any]]:
    """The records of ``method`` × ``metrics`` on the items ``indices`` (one method call)."""
    items = [dataset[i] for i in indices]
    evidence = [_evidence(model, it, start_token) for it in items]
    attr = attribute(
        model,
        [it.prompt for it in items],
        _target(items, target, contrastive),
        method=method,
        start_token=start_token,
        **method_options,
    )
    starts = attr.meta["start_token"]
    base = [_base(i, it, *known[i], s) for i, it, s in zip(indices, items, starts)]
    records = []
    for metric, layer, values in _score(model, attr, metrics, evidence, opts, special, per_layer):
        for b, v in zip(base, values.tolist()):
            records.append(
                {**b, "method": method, "metric": metric, "layer": layer, "value": float(v)}
            )
    return records


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
        description=__doc__.split("\n")[0],
        epilog="Many processes: torchrun --nproc-per-node N -m lens_attrib.evaluation.runner "
        "... (or accelerate launch -m ...); each rank takes its shard, rank 0 writes --out.",
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="model name (smollm2-135m, minilm-l6, or the random test models "
        f"{', '.join(TINY_MODELS)}), local folder or TL name",
    )
    parser.add_argument(
        "--task", default="sva", help="sva, anaphora, dna, blimp:<paradigm> or linzen"
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
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rank = distributed.init_from_env()
    try:
        model = load_named_model(args.model, rank.device if rank is not None else None)
        dataset = _load_task(args.task, args.n, args.seed)
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
        )
    finally:
        if rank is not None:
            distributed.finish()
    if rank is None or rank.is_main:
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
