"""BLiMP minimal pairs as next-word items with evidence, from any folder of BLiMP files.

A BLiMP folder holds one ``<UID>.jsonl`` per paradigm (1,000 pairs each), as released by
Warstadt et al. (2020). Paradigms come in two kinds:

- **one-prefix** (``one_prefix_method`` true): good and bad sentence share a prefix and differ
  in the next word: ``prompt = one_prefix_prefix``, ``target = " " + one_prefix_word_good``,
  ``foil = " " + one_prefix_word_bad``.
- **two-prefix** (``two_prefix_method`` true): the prefixes differ and the next word is shared
  (``"Some dog stunned this|these" + "committee"``). For the *agreement* paradigms, where the
  prefixes differ in grammatical number, the item is "good prefix + next word, other-number
  foil": ``prompt = two_prefix_prefix_good``, ``target = " " + two_prefix_word`` and ``foil`` the
  same word in the other number (``" committees"``), so that the foil would agree with the bad
  prefix. The other-number form comes from the folder's own one-prefix agreement pairs
  (``sketch``/``sketches``, ``cactus``/``cacti``, ``has``/``have``, with auxiliaries kept in
  their tense: ``is``/``are``, ``was``/``were``), else — in the regular paradigms only — from
  English's regular ``-s`` inflection (``perform``/``performs``, ``marry``/``marries``; for
  words ending in ``-ing``/``-ed`` only when the inflected form occurs in the folder). Words
  with neither (BLiMP's few non-finite rows such as ``"The cashier singing."``) are dropped,
  with a warning giving the count. For non-agreement two-prefix paradigms the rule is not
  defined and loading raises.

Evidence comes from :mod:`lens_attrib.data.blimp_evidence`; ``meta["evidence_rule"]`` names
the rule (None for paradigms that have none: their items carry no evidence).
"""

from __future__ import annotations

import json
import random
import re
import warnings
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

from lens_attrib.data.blimp_evidence import RULES_BY_TERM, blimp_evidence, rule_for
from lens_attrib.data.items import TaskItem
from lens_attrib.data.paths import data_root

__all__ = ["blimp_dir", "blimp_paradigms", "load_blimp", "number_counterpart"]

_ALIASES = {
    "determiner_noun_agreement_with_adj_1": "determiner_noun_agreement_with_adjective_1",
}
_AUXILIARIES = {
    "is": "are", "was": "were", "has": "have", "does": "do",
    "isn't": "aren't", "wasn't": "weren't", "hasn't": "haven't", "doesn't": "don't",
}  # fmt: skip
_AUXILIARY_PAIRS = {**_AUXILIARIES, **{v: k for k, v in _AUXILIARIES.items()}}
_SIBILANT = re.compile(r"(s|sh|ch|x|z|o)$")
_PARTICIPLE = re.compile(r"[aeiouy].*(ing|[^e]ed)$")
"""``singing``, ``walked`` (a vowel before the ending: not ``sing``, ``bring``, ``need``)."""


def blimp_dir(root: str | Path | None = None) -> Path:
    """The folder of BLiMP ``*.jsonl`` files.

    ``root`` may be that folder itself, or a data folder holding ``blimp/data/``; without it,
    ``$LENS_ATTRIB_DATA/blimp/data``.

    Raises:
        FileNotFoundError: no such folder, or no ``.jsonl`` files in it.
    """
    if root is not None:
        path = Path(root).expanduser()
        if not any(path.glob("*.jsonl")) and (path / "blimp" / "data").is_dir():
            path = path / "blimp" / "data"
    else:
        path = data_root() / "blimp" / "data"
    if not path.is_dir() or not any(path.glob("*.jsonl")):
        raise FileNotFoundError(
            f"no BLiMP files (<paradigm>.jsonl) in {path}; pass root= the folder holding them"
        )
    return path


@lru_cache(maxsize=8)
def _index(directory: Path) -> dict[str, dict[str, Any]]:
    """Paradigm -> its first row (split flags, linguistics_term)."""
    index: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        with path.open(encoding="utf-8") as handle:
            index[path.stem] = json.loads(handle.readline())
    return index


def _loadable(first: dict[str, Any]) -> bool:
    return bool(first.get("one_prefix_method")) or (
        bool(first.get("two_prefix_method")) and first.get("linguistics_term") in RULES_BY_TERM
    )


def blimp_paradigms(one_prefix_only: bool = False, root: str | Path | None = None) -> list[str]:
    """Names of the BLiMP paradigms present (only those with a one-prefix split if asked)."""
    index = _index(blimp_dir(root))
    return [
        name for name, first in index.items()
        if bool(first.get("one_prefix_method")) or not one_prefix_only
    ]  # fmt: skip


def _rows(directory: Path, name: str) -> list[dict[str, Any]]:
    with (directory / f"{name}.jsonl").open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@lru_cache(maxsize=8)
def _number_pairs(directory: Path) -> dict[str, str]:
    """Word -> other-number form, from the folder's one-prefix agreement pairs (most frequent)."""
    counts: dict[str, Counter[str]] = {}
    for name, first in _index(directory).items():
        if not first.get("one_prefix_method") or first.get("linguistics_term") not in (
            "determiner_noun_agreement",
            "subject_verb_agreement",
        ):
            continue
        for row in _rows(directory, name):
            good, bad = row["one_prefix_word_good"], row["one_prefix_word_bad"]
            counts.setdefault(good, Counter())[bad] += 1
            counts.setdefault(bad, Counter())[good] += 1
    return {word: c.most_common(1)[0][0] for word, c in counts.items()}


@lru_cache(maxsize=8)
def _vocabulary(directory: Path) -> frozenset[str]:
    """Every word of every sentence in the folder."""
    words: set[str] = set()
    for name in _index(directory):
        for row in _rows(directory, name):
            words.update(
                re.findall(r"[A-Za-z']+", row["sentence_good"] + " " + row["sentence_bad"])
            )
    return frozenset(words)


def _regular_counterpart(word: str) -> str | None:
    """The other number of a regular noun / present-tense verb by the ``-s`` rule."""
    head, _, last = word.rpartition(" ")
    prefix = head + " " if head else ""
    if not last.isalpha() or not last.islower():
        return None
    if last.endswith("ies"):
        return prefix + last[:-3] + "y"
    if last.endswith("es") and _SIBILANT.search(last[:-2]):
        return prefix + last[:-2]
    if last.endswith("s") and not last.endswith("ss"):
        return prefix + last[:-1]
    if last.endswith("y") and last[-2:-1] not in set("aeiou"):
        return prefix + last[:-1] + "ies"
    if _SIBILANT.search(last):
        return prefix + last + "es"
    return prefix + last + "s"


def number_counterpart(
    word: str, root: str | Path | None = None, regular: bool = True
) -> str | None:
    """``word`` in the other grammatical number (noun plural/singular, verb 3sg/base).

    Auxiliaries keep their tense (``was`` -> ``were``); other words are looked up in the BLiMP
    folder's one-prefix agreement pairs, then (``regular=True``) inflected by the regular ``-s``
    rule. None when neither applies.
    """
    if word in _AUXILIARY_PAIRS:
        return _AUXILIARY_PAIRS[word]
    found = _number_pairs(blimp_dir(root)).get(word)
    if found is not None or not regular:
        return found
    other = _regular_counterpart(word)
    if other is not None and _PARTICIPLE.search(word.rpartition(" ")[2]):
        # "singing", "walked": a participle has no number, unless the folder shows one
        return other if other.rpartition(" ")[2] in _vocabulary(blimp_dir(root)) else None
    return other


def _item(
    name: str, first: dict[str, Any], row: dict[str, Any], prompt: str, target: str, foil: str
) -> TaskItem:
    term = first.get("linguistics_term")
    rule = rule_for(name, term)
    evidence: tuple[int, ...] = ()
    if rule is not None:
        evidence, rule = blimp_evidence(name, prompt, term)
    return TaskItem(
        prompt=prompt,
        target=" " + target,
        foil=" " + foil,
        evidence_words=evidence,
        task="blimp",
        meta={
            "uid": row["UID"],
            "pair_id": row["pairID"],
            "field": row["field"],
            "linguistics_term": row["linguistics_term"],
            "sentence_good": row["sentence_good"],
            "sentence_bad": row["sentence_bad"],
            "evidence_rule": rule,
            "split": "one_prefix" if first.get("one_prefix_method") else "two_prefix",
        },
    )


def load_blimp(
    paradigm: str,
    n: int | None = None,
    seed: int | None = None,
    *,
    root: str | Path | None = None,
) -> list[TaskItem]:
    """One BLiMP paradigm as next-word items (see the module docstring for both splits).

    ``prompt + target`` is a prefix of ``sentence_good``. Evidence comes from the rules in
    :mod:`lens_attrib.data.blimp_evidence` for the agreement paradigms and is empty otherwise;
    ``meta`` holds ``uid``, ``pair_id``, ``field``, ``linguistics_term``, ``sentence_good``,
    ``sentence_bad``, ``evidence_rule`` and ``split``.

    Args:
        paradigm: the UID / file name, e.g. ``"regular_plural_subject_verb_agreement_1"``
            (``"determiner_noun_agreement_with_adj_1"`` is accepted for the file
            ``determiner_noun_agreement_with_adjective_1``).
        n: keep the first ``n`` items (each file holds 1,000 pairs).
        seed: sample ``n`` items with this seed instead (kept in file order).
        root: the folder of BLiMP files (or a data folder holding ``blimp/data``); default
            ``$LENS_ATTRIB_DATA/blimp/data``.

    Raises:
        FileNotFoundError: no such folder or paradigm file.
        ValueError: the paradigm has no one-prefix split and is not an agreement paradigm (no
            "good prefix + next word, other-number foil" item is defined); the message lists the
            paradigms that load.
    """
    directory = blimp_dir(root)
    name = _ALIASES.get(paradigm, paradigm)
    index = _index(directory)
    if name not in index:
        raise FileNotFoundError(
            f"no BLiMP paradigm {paradigm!r} in {directory}; available: {sorted(index)}"
        )
    first = index[name]
    if not _loadable(first):
        valid = [p for p, f in index.items() if _loadable(f)]
        raise ValueError(
            f"BLiMP paradigm {paradigm!r} has no one-prefix split (one_prefix_method is false) "
            f"and is not an agreement paradigm (linguistics_term {first.get('linguistics_term')!r}"
            "), so no next-word item with a foil is defined for it; paradigms that load: "
            f"{valid}"
        )
    items: list[TaskItem] = []
    dropped: list[str] = []
    regular = "irregular" not in name
    for row in _rows(directory, name):
        if first.get("one_prefix_method"):
            prompt, target = row["one_prefix_prefix"], row["one_prefix_word_good"]
            foil = row["one_prefix_word_bad"]
        else:
            prompt, target = row["two_prefix_prefix_good"], row["two_prefix_word"]
            other = number_counterpart(target, directory, regular=regular)
            if other is None or other == target:
                dropped.append(target)
                continue
            foil = other
        items.append(_item(name, first, row, prompt, target, foil))
    if dropped:
        warnings.warn(
            f"{name}: dropped {len(dropped)} of {len(dropped) + len(items)} pairs whose next word "
            f"has no other-number form ({sorted(set(dropped))[:8]})",
            stacklevel=2,
        )
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    if n is None or n >= len(items):
        return items
    if seed is None:
        return items[:n]
    keep = sorted(random.Random(seed).sample(range(len(items)), n))
    return [items[i] for i in keep]
