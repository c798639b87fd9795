"""The user's own items: a JSONL or CSV file of prompts, targets, foils and evidence.

Format, one item per JSONL line (or per CSV row, with the same column names):

=================  ========================================================================
field              meaning
=================  ========================================================================
``prompt``         text up to (not including) the predicted word, e.g. ``"The keys to the
                   cabinet"``. Plain text: do not write a start token here — the library
                   puts the model's start token in front (``<|endoftext|>`` on SmolLM2, see
                   :func:`lens_attrib.inputs.start_token_of`), so that it is never merged with
                   the first word.
``target``         the next word exactly as the model should predict it, with its leading
                   space, e.g. ``" are"``.
``foil``           optional: the contrastive wrong form, e.g. ``" is"`` (empty / null: none).
``evidence_words`` the evidence as word indices into ``prompt.split()``, e.g. ``[1]``
                   (CSV: ``1`` or ``1;3`` or ``[1, 3]``), **or**
``evidence_spans`` the evidence as character spans ``[start, end)`` into ``prompt``, e.g.
                   ``[[4, 8]]`` (CSV: ``4:8`` or ``4:8;13:16`` or the JSON form).
``label``          optional integer class label.
anything else      kept in ``TaskItem.meta`` (e.g. ``id``, ``condition``).
=================  ========================================================================

Example (``agreement.jsonl``)::

    {"prompt": "The keys to the cabinet", "target": " are", "foil": " is", "evidence_words": [1]}
    {"prompt": "The author that the guards like", "target": " is", "foil": " are",
     "evidence_spans": [[4, 10]]}

Items load model-agnostically; :func:`~lens_attrib.data.item_evidence_positions` maps the
evidence to token positions in the input a model gets (every token overlapping an evidence word
or span; special tokens excluded; shifted by the start token of the same policy as
``attribute`` and ``evaluate``). :func:`~lens_attrib.data.evidence_token_positions` does it for
a bare fast tokenizer, with ``prepend_bos`` / ``start_token`` saying what precedes the text.
"""

from __future__ import annotations

import csv
import json
import random
import warnings
from pathlib import Path
from typing import Any

from lens_attrib.data.items import TaskItem, word_spans
from lens_attrib.errors import InputWarning
from lens_attrib.target import precedes_spaced_word, starts_word

__all__ = ["USER_FIELDS", "load_items", "parse_item", "space_problems"]

USER_FIELDS = ("prompt", "target", "foil", "evidence_words", "evidence_spans", "label")
"""The fields :func:`load_items` interprets; any other field goes to ``meta``."""


def _fail(where: str, problem: str) -> ValueError:
    return ValueError(
        f"{where}: {problem}. Each item needs 'prompt', 'target' (with its leading space), "
        "optionally 'foil', and 'evidence_words' (word indices into prompt.split()) or "
        "'evidence_spans' (character spans [start, end)); see lens_attrib.data.user."
    )


def _csv_list(text: str) -> Any:
    text = text.strip()
    if not text:
        return None
    if text.startswith("["):
        return json.loads(text)
    return [part.strip() for part in text.replace(",", ";").split(";") if part.strip()]


def _evidence_words(value: Any, prompt: str, where: str) -> tuple[int, ...]:
    if isinstance(value, str):
        value = _csv_list(value)
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    try:
        indices = tuple(int(v) for v in value if not isinstance(v, bool))
    except (TypeError, ValueError) as err:
        raise _fail(where, f"evidence_words must be word indices, got {value!r}") from err
    if len(indices) != len(list(value)):
        raise _fail(where, f"evidence_words must be word indices, got {value!r}")
    n_words = len(prompt.split())
    bad = [i for i in indices if not 0 <= i < n_words]
    if bad:
        raise _fail(where, f"evidence_words {bad} outside the {n_words} words of {prompt!r}")
    return tuple(sorted(set(indices)))


def _evidence_spans(value: Any, prompt: str, where: str) -> list[tuple[int, int]]:
    if isinstance(value, str):
        parsed = _csv_list(value)
        if parsed and all(isinstance(p, str) for p in parsed):
            try:
                parsed = [[int(x) for x in p.split(":")] for p in parsed]
            except ValueError as err:
                raise _fail(where, f"evidence_spans {value!r} are not start:end pairs") from err
        value = parsed
    if value is None:
        return []
    spans: list[tuple[int, int]] = []
    for span in value:
        if not isinstance(span, list | tuple) or len(span) != 2:
            raise _fail(where, f"evidence span {span!r} is not a [start, end) pair")
        start, end = int(span[0]), int(span[1])
        if not 0 <= start < end <= len(prompt):
            raise _fail(where, f"evidence span {span!r} outside the prompt ({len(prompt)} chars)")
        if not prompt[start:end].strip():
            raise _fail(where, f"evidence span {span!r} holds only whitespace")
        spans.append((start, end))
    return sorted(set(spans))


def _optional_text(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value == ""):
        return None
    return str(value)


def _label(value: Any, where: str) -> int | None:
    """An integer class label (``"1"`` and ``1.0`` too); names are an error saying the fix."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise _fail(where, f"label must be an integer class index, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _fail(
        where,
        f"label must be an integer class index, got {value!r}; map class names to indices "
        "(e.g. negative → 0, positive → 1) and keep the name in another field",
    )


def space_problems(prompt: str, target: str, foil: str | None = None) -> list[str]:
    """The two silent space mistakes of an item (see :func:`lens_attrib.target.warn_about_spaces`):
    a prompt ending in a space, and a target/foil word without its leading space after a word.
    """
    if prompt.endswith((" ", "\t")):
        return [
            f"the prompt {prompt!r} ends in a space: the next word's leading space belongs to "
            f"the target; write the prompt as {prompt.rstrip(' ' + chr(9))!r} and the target with "
            "its space (' are')"
        ]
    problems = []
    for what, word in (("target", target), ("foil", foil)):
        if word is not None and starts_word(word) and precedes_spaced_word(prompt):
            problems.append(
                f"the {what} {word!r} has no leading space, but after {prompt!r} the next word "
                f"is written with one: write {' ' + word!r}"
            )
    return problems


def parse_item(row: dict[str, Any], *, task: str = "user", where: str = "item") -> TaskItem:
    """One item from a mapping with the fields of the module docstring.

    ``evidence_words`` come out as given (or, for ``evidence_spans``, the words the spans
    overlap); character spans are kept in ``meta["evidence_spans"]`` and take precedence when
    token positions are computed.

    Raises:
        ValueError: a missing or malformed field; the message names ``where`` and the fix.
    """
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _fail(where, "'prompt' is missing or empty")
    target = _optional_text(row.get("target"))
    if target is None:
        raise _fail(where, "'target' is missing")
    has_words = _optional_text(row.get("evidence_words")) is not None or isinstance(
        row.get("evidence_words"), list | int
    )
    has_spans = _optional_text(row.get("evidence_spans")) is not None or isinstance(
        row.get("evidence_spans"), list
    )
    if has_words and has_spans:
        raise _fail(where, "give 'evidence_words' or 'evidence_spans', not both")
    meta = {k: v for k, v in row.items() if k not in USER_FIELDS}
    if has_spans:
        spans = _evidence_spans(row["evidence_spans"], prompt, where)
        words = tuple(
            i
            for i, (s, e) in enumerate(word_spans(prompt))
            if any(a < e and b > s for a, b in spans)
        )
        meta["evidence_spans"] = spans
    else:
        words = _evidence_words(row.get("evidence_words"), prompt, where)
    for problem in space_problems(prompt, target, _optional_text(row.get("foil"))):
        warnings.warn(f"{where}: {problem}", InputWarning, stacklevel=2)
    label = _label(row.get("label"), where)
    return TaskItem(
        prompt=prompt,
        target=target,
        foil=_optional_text(row.get("foil")),
        evidence_words=words,
        task=task,
        meta=meta,
        label=label,
    )


def load_items(
    path: str | Path, *, n: int | None = None, seed: int | None = None, task: str | None = None
) -> list[TaskItem]:
    """Items from a ``.jsonl`` (one JSON object a line) or ``.csv`` (header row) file.

    Args:
        path: the file; the format follows its extension (``.jsonl``/``.json`` lines or ``.csv``).
        n: keep the first ``n`` items; with ``seed``, a seeded sample of ``n`` (in file order).
        seed: see ``n``.
        task: the items' task name (default: the file's stem).

    Raises:
        FileNotFoundError: no such file.
        ValueError: an unknown extension, a malformed line or an empty file (names the line).

    Warns:
        InputWarning: once per file, when items have a target/foil without its leading space
        after a word, or a prompt ending in a space (:func:`space_problems`).
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a number of items >= 1 or None (all), got {n!r}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no item file {path}")
    name = task or path.stem
    suffix = path.suffix.lower()
    rows: list[tuple[str, dict[str, Any]]] = []
    if suffix in (".jsonl", ".json", ".ndjson"):
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise _fail(f"{path}:{number}", f"not a JSON object ({err.msg})") from err
                if not isinstance(row, dict):
                    raise _fail(f"{path}:{number}", "not a JSON object")
                rows.append((f"{path}:{number}", row))
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as handle:
            for number, row in enumerate(csv.DictReader(handle), start=2):
                rows.append((f"{path}:{number}", dict(row)))
    else:
        raise ValueError(f"{path}: unknown item file type {suffix!r}; use .jsonl or .csv")
    if not rows:
        raise ValueError(f"{path} holds no items")
    with warnings.catch_warnings(record=True) as caught:  # one summary, not one per line
        warnings.simplefilter("always", InputWarning)
        items = [parse_item(row, task=name, where=where) for where, row in rows]
    spaces = [w for w in caught if issubclass(w.category, InputWarning)]
    for w in caught:
        if w not in spaces:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if spaces:
        flagged = {
            where for where, _ in rows if any(f"{where}: " in str(w.message) for w in spaces)
        }
        warnings.warn(
            f"{len(flagged)} of {len(items)} items of {path} have a space problem "
            f"({len(spaces)} in all); first: "
            f"{spaces[0].message}",
            InputWarning,
            stacklevel=2,
        )
    if n is None or n >= len(items):
        return items
    if seed is None:
        return items[:n]
    keep = sorted(random.Random(seed).sample(range(len(items)), n))
    return [items[i] for i in keep]
