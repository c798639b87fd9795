"""The task/item registry: every task's items come through :func:`load_task`.

A task name is one of

- a template generator of :data:`lens_attrib.data.GENERATORS` (``sva``, ``anaphora``, ``dna``;
  seeded, evidence by construction), or an alias of one (``ra`` → ``anaphora``);
- ``blimp:<UID>`` or an alias of one (``blimp_rpsv``, ``blimp_darn``, ``blimp_ana``): a seeded
  sample of a BLiMP paradigm (``blimp_root``: another folder of BLiMP files), evidence from
  :mod:`lens_attrib.data.blimp_evidence`;
- ``linzen``: a seeded sample of the Linzen et al. agreement set (no evidence);
- the user's own items: a name given in ``files`` (name → ``.jsonl``/``.csv`` path) or a path
  itself (:mod:`lens_attrib.data.user`).

An item is anything with ``.prompt``, ``.target``, ``.foil`` and evidence (``.evidence_words``,
``meta["evidence_spans"]`` or ``.evidence_positions``). :func:`item_evidence` maps the evidence
to token positions of the model's input, :func:`explained_target` makes the Target a batch of
items is explained with, :func:`token_lengths` the lengths the batches are planned from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lens_attrib.evaluation.metrics import METRICS
from lens_attrib.inputs import StartToken, StartTokenLike, prompt_ids, to_batch
from lens_attrib.target import Target

ALIASES = {
    "ra": "anaphora",
    "blimp_rpsv": "blimp:regular_plural_subject_verb_agreement_1",
    "blimp_darn": "blimp:distractor_agreement_relational_noun",
    "blimp_ana": "blimp:anaphor_number_agreement",
}
"""Short task names → registry names."""
USER_SUFFIXES = (".jsonl", ".csv")


def canonical(task: str) -> str:
    """The registry name of ``task`` (aliases resolved)."""
    return ALIASES.get(task, task)


def is_blimp(task: str) -> bool:
    """Whether ``task`` names a BLiMP paradigm (``blimp:<UID>`` or an alias of one)."""
    return canonical(task).startswith("blimp:")


def task_names() -> list[str]:
    """The built-in names (generators, aliases, ``linzen``) for messages and ``--help``."""
    from lens_attrib import data

    return [*data.GENERATORS, *ALIASES, "linzen"]


def load_task(
    task: str,
    n: int | None,
    seed: int = 0,
    *,
    files: Mapping[str, str | Path] | None = None,
    blimp_root: str | Path | None = None,
) -> list[Any]:
    """``n`` items of ``task`` (module docstring); a user file gives all its items."""
    from lens_attrib import data

    files = files or {}
    if task in files:
        return list(data.load_items(files[task]))
    name = canonical(task)
    if name in data.GENERATORS:
        return list(data.GENERATORS[name](n, seed=seed))
    if name.startswith("blimp:"):
        return list(data.load_blimp(name.split(":", 1)[1], n=n, seed=seed, root=blimp_root))
    if name == "linzen":
        return list(data.load_linzen_sva(n=n, seed=seed))
    if task.endswith(USER_SUFFIXES):
        return list(data.load_items(task))
    raise KeyError(
        f"Unknown task {task!r}: use {', '.join(task_names())}, 'blimp:<paradigm>', a "
        f".jsonl/.csv file of your own items{' or ' + ', '.join(files) if files else ''}."
    )


def item_evidence(model: Any, item: Any, start_token: StartTokenLike = None) -> list[int]:
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


def has_evidence(item: Any) -> bool:
    """Whether ``item`` names any evidence (positions, words or character spans)."""
    if getattr(item, "evidence_positions", None) is not None:
        return len(item.evidence_positions) > 0
    meta = getattr(item, "meta", None) or {}
    return bool(getattr(item, "evidence_words", None) or meta.get("evidence_spans"))


def check_evidence(dataset: Sequence[Any], metrics: Sequence[str], caller: str) -> None:
    """Refuse plausibility metrics on items of which none names evidence (e.g. ``linzen``):
    every record would be NaN. Items with and without evidence mixed stay allowed (the
    evidence-free ones score NaN and are left out of the means, ``n`` counting the others)."""
    wanted = [m for m in metrics if m in METRICS and METRICS[m].family == "plausibility"]
    if wanted and dataset and not any(has_evidence(item) for item in dataset):
        raise ValueError(
            f"{caller}: the plausibility metrics {wanted} score where the evidence lies, and "
            f"none of the {len(dataset)} items names evidence (the linzen task has none). "
            "Choose a task with evidence (sva, ra, blimp_rpsv, blimp_darn, blimp_ana, or items "
            "with evidence_words / evidence_positions) or perturbation metrics "
            "(comprehensiveness, sufficiency, soft_ns, pi_soft_ns, deletion_auc, …)."
        )


def explained_target(items: Sequence[Any], target: str, contrastive: bool) -> Target:
    """The Target of a batch: ``"gold"`` explains each item's ``.target`` (minus its ``.foil``
    when ``contrastive``), ``"prediction"`` the model's own prediction."""
    if target not in ("gold", "prediction"):
        raise ValueError(f"target must be 'gold' or 'prediction', got {target!r}")
    gold = target == "gold" and all(getattr(it, "target", None) is not None for it in items)
    foil = None
    if contrastive:
        if not all(getattr(it, "foil", None) is not None for it in items):
            raise ValueError("contrastive=True needs a .foil on every item.")
        foil = [it.foil for it in items]
    return Target(token=[it.target for it in items] if gold else None, foil=foil)


def method_options(
    method: str, seed: int, options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The options ``method`` is called with in an evaluation: the caller's, and for the
    ``random`` baseline the run's ``seed`` (unless the caller set one). The one seeding rule of
    the runner and the experiments: ``random`` seeds each item from this seed and the item's
    own token ids (:func:`lens_attrib.methods.perturbation.item_seed`), so an item gets the
    same random scores in every batch, shard, run and experiment with the same seed."""
    options = dict(options or {})
    if method == "random":
        options.setdefault("seed", seed)
    return options


def start_of(model: Any, prompt: str, start: StartToken) -> str | None:
    """The start token ``prompt``'s model input begins with under ``start`` (or ``None``)."""
    ids, _ = prompt_ids(model, prompt, start)
    return start.text if start.id is not None and ids and ids[0] == start.id else None


def token_lengths(
    model: Any, dataset: Sequence[Any], start_token: StartTokenLike = None
) -> list[int]:
    """Every item's number of tokens as the model sees it (with its start token / CLS and SEP)."""
    if not len(dataset):
        return []
    batch = to_batch(model, [it.prompt for it in dataset], start_token=start_token)
    return batch.lengths.tolist()


__all__ = [
    "ALIASES",
    "canonical",
    "check_evidence",
    "explained_target",
    "has_evidence",
    "is_blimp",
    "item_evidence",
    "load_task",
    "method_options",
    "start_of",
    "task_names",
    "token_lengths",
]
