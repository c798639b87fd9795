"""Loaders for the real data files under :func:`~lens_attrib.data.paths.data_root`.

Every loader returns ``list[TaskItem]`` in file order. ``n`` keeps the first ``n`` items (after
any filtering); pass ``seed`` to keep a seeded random sample of ``n`` items instead (still in file
order). The files and their formats are described in each folder's ``SOURCE.md``.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from lens_attrib.data.blimp import blimp_paradigms, load_blimp
from lens_attrib.data.items import TaskItem, word_spans
from lens_attrib.data.paths import data_root

__all__ = [
    "BOOLQ_PROMPT",
    "SQUAD_PROMPT",
    "blimp_paradigms",
    "load_blimp",
    "load_boolq",
    "load_imdb",
    "load_linzen_sva",
    "load_squad_v2",
    "load_sst2",
    "load_stsb",
]

T = TypeVar("T")

SQUAD_PROMPT = "Context: {context}\nQuestion: {question}\nAnswer:"
"""Prompt format of :func:`load_squad_v2`."""

BOOLQ_PROMPT = "{passage}\nQuestion: {question}?\nAnswer:"
"""Prompt format of :func:`load_boolq`."""

_SST2_FILES = {
    "train": ("glue/train.tsv", True),
    "validation": ("glue/dev.tsv", True),
    "dev": ("glue/dev.tsv", True),
    "test": ("labelled_test_clairett/test.tsv", False),
}


def _take(rows: Sequence[T], n: int | None, seed: int | None) -> list[T]:
    """The first ``n`` rows, or (``seed`` given) ``n`` rows sampled with that seed, in order."""
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    if n is None or n >= len(rows):
        return list(rows)
    if seed is None:
        return list(rows[:n])
    keep = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in keep]


def _folder(*parts: str) -> Path:
    path = data_root().joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"expected {path} under the data folder {data_root()}")
    return path


# ------------------------------------------------------------------------------- Linzen SVA
def load_linzen_sva(
    n: int | None = None,
    max_attractors: int | None = None,
    min_attractors: int = 0,
    seed: int | None = None,
) -> list[TaskItem]:
    """The Linzen et al. (2016) agreement test set (Gulordava et al.'s 7,489-sentence subset).

    Files: ``sva_linzen2016/linzen_testset/subj_agr_filtered.text`` (lower-cased, whitespace
    tokenised sentences ending in ``<eos>``) and ``.gold`` (tab-separated: 0-based verb index,
    correct form, wrong form, number of attractors), line-aligned.

    ``prompt`` is the words before the verb joined by spaces; ``target = " " + correct``,
    ``foil = " " + wrong``. Where the gold form differs from the sentence's word only in case
    (4 rows, e.g. gold ``"Are"`` for ``"are"``), the sentence's casing is used for both forms.
    Rows whose two forms are the same word (4 rows, e.g. ``wherein``/``wherein``) are skipped,
    leaving 7,485 items. The files do not say where the subject is, so ``evidence_words`` is
    empty.
    ``meta``: ``n_attractors``, ``row`` (0-based line), ``verb_index``, ``sentence``.

    Args:
        n: keep the first ``n`` items after filtering.
        max_attractors: keep items with at most this many attractors.
        min_attractors: keep items with at least this many attractors.
        seed: sample ``n`` items with this seed instead of taking the first ``n``.
    """
    folder = _folder("sva_linzen2016", "linzen_testset")
    texts = (folder / "subj_agr_filtered.text").read_text(encoding="utf-8").splitlines()
    golds = (folder / "subj_agr_filtered.gold").read_text(encoding="utf-8").splitlines()
    if len(texts) != len(golds):
        raise ValueError(f"{folder}: .text has {len(texts)} lines but .gold has {len(golds)}")
    items: list[TaskItem] = []
    for row, (text, gold) in enumerate(zip(texts, golds)):
        index_s, correct, wrong, attractors_s = gold.split("\t")
        index, attractors = int(index_s), int(attractors_s)
        if attractors < min_attractors or (
            max_attractors is not None and attractors > max_attractors
        ):
            continue
        words = text.split()
        if words and words[-1] == "<eos>":
            words = words[:-1]
        if index == 0 or correct.lower() == wrong.lower():  # nothing to condition on / contrast
            continue
        actual = words[index]
        if actual != correct and actual.lower() == correct.lower():
            correct = actual
            wrong = wrong.lower() if actual.islower() else wrong
        items.append(
            TaskItem(
                prompt=" ".join(words[:index]),
                target=" " + correct,
                foil=" " + wrong,
                evidence_words=(),
                task="linzen_sva",
                meta={
                    "n_attractors": attractors,
                    "row": row,
                    "verb_index": index,
                    "sentence": " ".join(words),
                },
            )
        )
    return _take(items, n, seed)


# ----------------------------------------------------------------------------------- SST-2
def _read_sentence_label_tsv(path: Path, header: bool) -> list[tuple[str, int]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    rows: list[tuple[str, int]] = []
    for line in lines[1:] if header else lines:
        if not line.strip():
            continue
        sentence, label = line.rsplit("\t", 1)
        rows.append((sentence.strip(), int(label)))
    return rows


def load_sst2(
    split: str = "validation", n: int | None = None, seed: int | None = None
) -> list[TaskItem]:
    """SST-2 sentences with binary sentiment labels (1 = positive).

    ``split``: ``"validation"`` (alias ``"dev"``; GLUE ``dev.tsv``, 872 sentences),
    ``"train"`` (GLUE ``train.tsv``, 67,349 phrases) or ``"test"`` (GLUE has no test labels, so
    this reads the labelled, lower-cased copy in ``labelled_test_clairett/test.tsv``, 1,821
    sentences). ``prompt`` is the sentence, ``label`` 0/1, ``target``/``foil`` ``None``.
    ``meta``: ``split``, ``row``.
    """
    if split not in _SST2_FILES:
        raise ValueError(f"unknown SST-2 split {split!r}; choose from {sorted(_SST2_FILES)}")
    relative, header = _SST2_FILES[split]
    path = _folder("sst2", *relative.split("/"))
    rows = _read_sentence_label_tsv(path, header)
    items = [
        TaskItem(
            prompt=sentence,
            target=None,
            foil=None,
            evidence_words=(),
            task="sst2",
            meta={"split": split, "row": i},
            label=label,
        )
        for i, (sentence, label) in enumerate(rows)
    ]
    return _take(items, n, seed)


# -------------------------------------------------------------------------------- SQuAD v2
def _overlapping_words(text: str, start: int, end: int) -> tuple[int, ...]:
    """Indices of the words of ``text`` that overlap the character span ``[start, end)``."""
    return tuple(i for i, (s, e) in enumerate(word_spans(text)) if s < end and e > start)


def load_squad_v2(
    n: int | None = None, answerable_only: bool = True, seed: int | None = None
) -> list[TaskItem]:
    """SQuAD 2.0 questions (the CS224n half of the official dev set, with gold answers).

    ``prompt`` is :data:`SQUAD_PROMPT`, i.e.
    ``"Context: {context}\\nQuestion: {question}\\nAnswer:"``. For answerable questions
    ``target`` is ``" "`` + the first word of the first gold answer and ``evidence_words`` are
    the prompt words overlapping the first gold answer's span (whole words, so they may carry
    punctuation around the answer). Unanswerable questions (``answerable_only=False``) have
    ``target=None`` and no evidence. ``foil`` is ``None``.

    ``meta``: ``context``, ``question``, ``answers`` (texts), ``answer_char_spans``
    (``(start, end)`` in the *context*, SQuAD's convention), ``prompt_char_spans`` (the same spans
    in the prompt), ``is_impossible``, ``id``, ``title``.
    """
    path = _folder("squad_v2", "cs224n_split", "dev-v2.0.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    shift = SQUAD_PROMPT.index("{context}")
    items: list[TaskItem] = []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            for qa in paragraph["qas"]:
                impossible = bool(qa.get("is_impossible", not qa["answers"]))
                if impossible and answerable_only:
                    continue
                answers = [] if impossible else qa["answers"]
                texts = [a["text"] for a in answers]
                spans = [(a["answer_start"], a["answer_start"] + len(a["text"])) for a in answers]
                prompt = SQUAD_PROMPT.format(context=context, question=qa["question"])
                prompt_spans = [(s + shift, e + shift) for s, e in spans]
                evidence = _overlapping_words(prompt, *prompt_spans[0]) if prompt_spans else ()
                first = texts[0].split() if texts else []
                items.append(
                    TaskItem(
                        prompt=prompt,
                        target=" " + first[0] if first else None,
                        foil=None,
                        evidence_words=evidence,
                        task="squad_v2",
                        meta={
                            "context": context,
                            "question": qa["question"],
                            "answers": texts,
                            "answer_char_spans": spans,
                            "prompt_char_spans": prompt_spans,
                            "is_impossible": impossible,
                            "id": qa["id"],
                            "title": article["title"],
                        },
                    )
                )
    return _take(items, n, seed)


# ---------------------------------------------------------------------------------- STS-B
def load_stsb(n: int | None = None, seed: int | None = None) -> list[TaskItem]:
    """GLUE STS-B dev sentence pairs (1,500) with similarity scores in ``[0, 5]``.

    ``prompt`` is ``sentence1``; the pair and its score are in ``meta``: ``sentence1``,
    ``sentence2``, ``score`` (float), ``genre``, ``source`` (file name column), ``row``.
    ``target``/``foil``/``label`` are ``None``.
    """
    path = _folder("glue_stsb", "dev.tsv")
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        rows: list[dict[str, Any]] = list(reader)
    items = [
        TaskItem(
            prompt=row["sentence1"],
            target=None,
            foil=None,
            evidence_words=(),
            task="stsb",
            meta={
                "sentence1": row["sentence1"],
                "sentence2": row["sentence2"],
                "score": float(row["score"]),
                "genre": row["genre"],
                "source": row["filename"],
                "row": i,
            },
        )
        for i, row in enumerate(rows)
    ]
    return _take(items, n, seed)


# ---------------------------------------------------------------------------------- BoolQ
def load_boolq(n: int | None = None, seed: int | None = None) -> list[TaskItem]:
    """BoolQ validation (3,270 passage/question pairs with yes/no answers).

    ``prompt`` is :data:`BOOLQ_PROMPT`, i.e. ``"{passage}\\nQuestion: {question}?\\nAnswer:"``
    (BoolQ questions are lower-case without a question mark). ``label`` is 1 for yes, 0 for no;
    ``target`` is ``" yes"``/``" no"`` and ``foil`` the other, for contrastive use with a
    language model. ``meta``: ``passage``, ``question``, ``answer`` (bool), ``row``.
    """
    path = _folder("boolq", "boolq_validation.json")
    rows = json.loads(path.read_text(encoding="utf-8"))
    items: list[TaskItem] = []
    for i, row in enumerate(rows):
        answer = bool(row["answer"])
        question = row["question"].rstrip("?").strip()
        items.append(
            TaskItem(
                prompt=BOOLQ_PROMPT.format(passage=row["passage"], question=question),
                target=" yes" if answer else " no",
                foil=" no" if answer else " yes",
                evidence_words=(),
                task="boolq",
                meta={
                    "passage": row["passage"],
                    "question": row["question"],
                    "answer": answer,
                    "row": i,
                },
                label=int(answer),
            )
        )
    return _take(items, n, seed)


# ----------------------------------------------------------------------------------- IMDb
def load_imdb(n: int | None = None, seed: int | None = None) -> list[TaskItem]:
    """The 199-review IMDb sample (label 1 = positive, 0 = negative).

    ``prompt`` is the review text as stored (HTML line breaks such as ``<br />`` kept).
    ``meta``: ``row``.
    """
    path = _folder("imdb_sample", "imdb_test_sample199.csv")
    with path.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    items = [
        TaskItem(
            prompt=row["text"],
            target=None,
            foil=None,
            evidence_words=(),
            task="imdb",
            meta={"row": i},
            label=int(row["label"]),
        )
        for i, row in enumerate(rows)
    ]
    return _take(items, n, seed)
