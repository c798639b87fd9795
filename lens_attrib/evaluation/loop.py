"""The evaluation loop's machinery: where finished batches go, how a plan runs, the
correctness pass and the record every item's rows start from.

:func:`lens_attrib.evaluation.runner.evaluate` plans the chunks and calls these; each finished
sub-batch goes to a :class:`Sink` (the journal, durably, or a list in memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lens_attrib.evaluation.batching import BatchSizer, Chunk
from lens_attrib.evaluation.items import start_of
from lens_attrib.evaluation.journal import Journal
from lens_attrib.inputs import StartTokenLike, start_token_of
from lens_attrib.progress import progress_bar
from lens_attrib.scoring import correctness

Known = dict[int, tuple[str, bool | None]]
"""Item index → (the model's prediction, whether it is right)."""
Work = Callable[[list[int]], list[dict[str, Any]]]


@dataclass
class Sink:
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


def run_plan(
    method: str,
    plan: Sequence[tuple[Chunk, list[int]]],
    sizer: BatchSizer,
    sink: Sink,
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


def base_record(
    index: int, item: Any, prediction: str, correct: bool | None, start: str | None
) -> dict[str, Any]:
    """The fields every record of item ``index`` starts with."""
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


def correctness_pass(
    model: Any,
    dataset: Sequence[Any],
    chunks: Sequence[Chunk],
    sizer: BatchSizer,
    sink: Sink,
    max_batch: int,
    show: bool,
    start_token: StartTokenLike = None,
) -> Known:
    """Prediction and correctness of every planned item (:func:`lens_attrib.scoring.correctness`,
    one record ``model_correct`` each), from the journal where it has them."""
    known = known_correctness(sink.journal)
    start = start_token_of(model, start_token)
    tok = model.tokenizer

    def work(sub: list[int]) -> list[dict[str, Any]]:
        items = [dataset[i] for i in sub]
        res = correctness(
            model,
            [it.prompt for it in items],
            [getattr(it, "target", None) for it in items],
            [getattr(it, "foil", None) for it in items],
            batch_size=len(items),
            max_batch=max_batch,
            start_token=start_token,
        )
        names = [tok.decode([int(p)]) if tok is not None else str(int(p)) for p in res.prediction]
        return [
            {
                **base_record(i, dataset[i], p, c, start_of(model, dataset[i].prompt, start)),
                "method": "model",
                "metric": "model_correct",
                "layer": None,
                "value": float("nan") if c is None else float(c),
            }
            for i, p, c in zip(sub, names, res.correct)
        ]

    plan = [(c, todo) for c in chunks if (todo := [i for i in c.items if i not in known])]
    run_plan("model", plan, sizer, sink, work, show)
    known.update(
        {
            r["item"]: (r["prediction"], r["correct"])
            for r in sink.records()
            if r["method"] == "model"
        }
    )
    return known


def known_correctness(journal: Journal | None) -> Known:
    """The correctness records a journal already holds."""
    if journal is None:
        return {}
    return {
        r["item"]: (r["prediction"], r["correct"])
        for b in journal.batches
        if b["method"] == "model"
        for r in b["records"]
    }


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


__all__ = [
    "Known",
    "Sink",
    "base_record",
    "check_evaluate_args",
    "correctness_pass",
    "known_correctness",
    "run_plan",
]
