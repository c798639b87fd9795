"""Seeded template generators whose evidence is known by construction.

Each generator is ``generate_X(n, seed=0, **options) -> list[TaskItem]``: the same arguments give
the same items (a private ``random.Random(seed)`` drives every choice), and the evidence word index
is recorded while the prompt is built, so it is exact. Word lists live in
:mod:`lens_attrib.data.lexicon`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from lens_attrib.data.items import TaskItem
from lens_attrib.data.lexicon import (
    ANAPHORA_FEMALE,
    ANAPHORA_MALE,
    ANAPHORA_PREPOSITIONS,
    ANAPHORA_VERBS,
    DNA_NAMES,
    DNA_NOUNS,
    DNA_VERBS,
    REFLEXIVES,
    SVA_PEOPLE,
    SVA_PREPOSITIONS,
    SVA_RC_VERBS,
    SVA_THINGS,
    SVA_VERBS,
)

__all__ = ["generate_anaphora", "generate_dna", "generate_sva"]

_ATTRACTOR_TYPES = ("pp", "rc")
_ANTECEDENT_CLASSES = ("male", "female", "plural")
_DETERMINERS = {"this": False, "that": False, "these": True, "those": True}  # -> is plural


def _count_cycle(counts: int | Sequence[int], name: str) -> tuple[int, ...]:
    """Normalise an ``int`` or a sequence of ints into a non-empty tuple of counts ≥ 0."""
    values = (counts,) if isinstance(counts, int) else tuple(counts)
    if not values or any(not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"{name} must be a non-negative int or a non-empty sequence of them")
    return values


def _check_n(n: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def _pick_distinct(
    rng: random.Random, pool: Sequence[tuple[str, str]], used: set[str]
) -> tuple[str, str]:
    """Pick a noun pair whose singular is not in ``used`` (if possible) and mark it used."""
    fresh = [pair for pair in pool if pair[0] not in used]
    pair = rng.choice(fresh or list(pool))
    used.add(pair[0])
    return pair


def _attractor_label(types: Sequence[str]) -> str:
    if not types:
        return "none"
    return types[0] if len(set(types)) == 1 else "mixed"


def generate_sva(
    n: int,
    seed: int = 0,
    n_attractors: int | Sequence[int] = (0, 1, 2, 3),
    attractor_types: Sequence[str] = _ATTRACTOR_TYPES,
) -> list[TaskItem]:
    """Subject–verb agreement with attractors.

    Prompt: ``"The <subject> <attractor>* "`` where each attractor is a prepositional phrase
    (``"near the cabinets"``) or an object relative clause (``"that the lawyers like"``) whose
    noun has the number opposite to the subject. Prepositional phrases come before relative
    clauses. The target is the verb (``is/are``, ``was/were`` or ``has/have``) in the subject's
    number, the foil the other form; the evidence is the subject noun (word index 1).

    Args:
        n: number of items.
        seed: random seed.
        n_attractors: an attractor count, or counts that items cycle through in order
            (item ``i`` gets ``n_attractors[i % len(n_attractors)]``), so counts are balanced.
        attractor_types: which attractor kinds to draw from, ``"pp"`` and/or ``"rc"``.

    ``meta``: ``n_attractors``, ``attractor_types`` (tuple, in prompt order), ``attractor_type``
    (``"none"``, ``"pp"``, ``"rc"`` or ``"mixed"``), ``number`` (``"singular"``/``"plural"``),
    ``subject`` and ``verb`` (the lemma pair, e.g. ``"is/are"``).
    """
    _check_n(n)
    counts = _count_cycle(n_attractors, "n_attractors")
    kinds = tuple(attractor_types)
    if not kinds or any(k not in _ATTRACTOR_TYPES for k in kinds):
        raise ValueError(f"attractor_types must be a non-empty subset of {_ATTRACTOR_TYPES}")
    rng = random.Random(seed)
    items: list[TaskItem] = []
    for i in range(n):
        k = counts[i % len(counts)]
        plural = rng.random() < 0.5
        used: set[str] = set()
        subject = _pick_distinct(rng, SVA_PEOPLE + SVA_THINGS, used)[int(plural)]
        words = ["The", subject]
        types = sorted((rng.choice(kinds) for _ in range(k)), key=_ATTRACTOR_TYPES.index)
        for kind in types:
            if kind == "pp":
                noun = _pick_distinct(rng, SVA_PEOPLE + SVA_THINGS, used)[int(not plural)]
                words += [*rng.choice(SVA_PREPOSITIONS).split(), "the", noun]
            else:
                noun = _pick_distinct(rng, SVA_PEOPLE, used)[int(not plural)]
                words += ["that", "the", noun, rng.choice(SVA_RC_VERBS)[int(not plural)]]
        verb = rng.choice(SVA_VERBS)
        items.append(
            TaskItem(
                prompt=" ".join(words),
                target=" " + verb[int(plural)],
                foil=" " + verb[int(not plural)],
                evidence_words=(1,),
                task="sva",
                meta={
                    "n_attractors": k,
                    "attractor_types": tuple(types),
                    "attractor_type": _attractor_label(types),
                    "number": "plural" if plural else "singular",
                    "subject": subject,
                    "verb": "/".join(verb),
                },
            )
        )
    return items


def _anaphora_noun(rng: random.Random, cls: str, used: set[str]) -> str:
    """A noun of antecedent class ``cls`` (``male``, ``female`` or ``plural``)."""
    if cls == "male":
        return _pick_distinct(rng, ANAPHORA_MALE, used)[0]
    if cls == "female":
        return _pick_distinct(rng, ANAPHORA_FEMALE, used)[0]
    return _pick_distinct(rng, ANAPHORA_MALE + ANAPHORA_FEMALE, used)[1]


def generate_anaphora(
    n: int, seed: int = 0, n_distractors: int | Sequence[int] = (1, 2)
) -> list[TaskItem]:
    """Reflexive anaphora with distractor nouns.

    Prompt: ``"The <antecedent> (<prep> the <distractor>)* <verb past>"``, e.g.
    ``"The king near the queens blamed"``. The antecedent is a male or female singular noun or a
    plural noun; every distractor belongs to one of the two *other* classes. Target: the reflexive
    of the antecedent (``" himself"``, ``" herself"``, ``" themselves"``); foil: the reflexive
    of the distractor nearest to the verb (a random other class when there is no distractor).
    Evidence: the antecedent noun (word index 1).

    Args:
        n: number of items.
        seed: random seed.
        n_distractors: a distractor count or counts that items cycle through.

    ``meta``: ``antecedent``, ``antecedent_class``, ``distractors``, ``distractor_classes``
    (tuples in prompt order), ``n_distractors``, ``verb``.
    """
    _check_n(n)
    counts = _count_cycle(n_distractors, "n_distractors")
    rng = random.Random(seed)
    items: list[TaskItem] = []
    for i in range(n):
        k = counts[i % len(counts)]
        cls = rng.choice(_ANTECEDENT_CLASSES)
        others = [c for c in _ANTECEDENT_CLASSES if c != cls]
        used: set[str] = set()
        antecedent = _anaphora_noun(rng, cls, used)
        words = ["The", antecedent]
        classes: list[str] = []
        nouns: list[str] = []
        for _ in range(k):
            d_cls = rng.choice(others)
            noun = _anaphora_noun(rng, d_cls, used)
            words += [*rng.choice(ANAPHORA_PREPOSITIONS).split(), "the", noun]
            classes.append(d_cls)
            nouns.append(noun)
        verb = rng.choice(ANAPHORA_VERBS)
        words.append(verb)
        foil_cls = classes[-1] if classes else rng.choice(others)
        items.append(
            TaskItem(
                prompt=" ".join(words),
                target=" " + REFLEXIVES[cls],
                foil=" " + REFLEXIVES[foil_cls],
                evidence_words=(1,),
                task="anaphora",
                meta={
                    "antecedent": antecedent,
                    "antecedent_class": cls,
                    "distractors": tuple(nouns),
                    "distractor_classes": tuple(classes),
                    "n_distractors": k,
                    "verb": verb,
                },
            )
        )
    return items


def generate_dna(
    n: int, seed: int = 0, determiners: Sequence[str] = ("this", "these")
) -> list[TaskItem]:
    """Determiner–noun agreement: the prompt ends right before the noun.

    Prompt: ``"<Name> <verb past> <determiner>"``, e.g. ``"Carl cleaned these"``. Target: a
    concrete noun in the determiner's number (``" dishes"``), foil: the same noun in the other
    number (``" dish"``); both forms are single tokens. Evidence: the determiner (word index 2).

    Args:
        n: number of items.
        seed: random seed.
        determiners: determiners to draw from, a subset of ``this``, ``that``, ``these``,
            ``those``.

    ``meta``: ``determiner``, ``number``, ``noun`` (singular lemma), ``name``, ``verb``.
    """
    _check_n(n)
    dets = tuple(determiners)
    if not dets or any(d not in _DETERMINERS for d in dets):
        raise ValueError(f"determiners must be a non-empty subset of {sorted(_DETERMINERS)}")
    rng = random.Random(seed)
    items: list[TaskItem] = []
    for _ in range(n):
        name = rng.choice(DNA_NAMES)
        verb = rng.choice(DNA_VERBS)
        det = rng.choice(dets)
        plural = _DETERMINERS[det]
        noun = rng.choice(DNA_NOUNS)
        items.append(
            TaskItem(
                prompt=f"{name} {verb} {det}",
                target=" " + noun[int(plural)],
                foil=" " + noun[int(not plural)],
                evidence_words=(2,),
                task="dna",
                meta={
                    "determiner": det,
                    "number": "plural" if plural else "singular",
                    "noun": noun[0],
                    "name": name,
                    "verb": verb,
                },
            )
        )
    return items
