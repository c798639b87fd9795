"""Evidence words for BLiMP's agreement paradigms, from the sentence structure.

BLiMP gives no evidence annotation. In its agreement paradigms the word that decides the
target's form is found in the prompt (the words before the target) by where it sits in the
sentence, because the sentences come from a small grammar. Three rules cover every agreement
phenomenon; each is written from the structure, not from a word list of one paradigm, so it
carries over to BLiMP's other agreement paradigms:

- ``subject_head`` (subject–verb agreement, anaphor agreement, distractor agreement): the
  controller is the head noun of the sentence subject. Skip a leading determiner or quantifier
  (``"The"``, ``"Most"``, ``"A lot of"``, ...); the head is the next word (a proper name when
  there is no determiner: its last capitalized word, ``"Winston Churchill"``), or the word after
  it when the two form one of BLiMP's two-word nouns
  (``"movie theater"``, ``"art gallery"``). Post-nominal material — a relational PP (``"The
  niece of most senators"``), a relative clause (``"The boys that the teacher likes"``), the verb
  and its object (``"Susan revealed"``) — comes after the head and is skipped by construction,
  which is what makes the distractor and relative-clause paradigms work unchanged. A prompt
  that is one adjective-free noun phrase (``"The students"``) gives its last word.
- ``determiner`` (determiner–noun agreement, with or without adjectives, regular or irregular):
  the prompt ends with ``<demonstrative> <adjective>*`` and the target is the noun; the evidence
  is the last ``this``/``that``/``these``/``those``.

:data:`BLIMP_EVIDENCE_RULES` names the rule of every agreement paradigm (the twelve in the
shipped data and the others of BLiMP); :func:`rule_for` falls back on the file's
``linguistics_term`` (``subject_verb_agreement``, ``anaphor_agreement``,
``determiner_noun_agreement``) for paradigms it does not list. Paradigms without a rule raise.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "BLIMP_EVIDENCE_RULES",
    "RULES_BY_TERM",
    "blimp_evidence",
    "rule_for",
]

_DEMONSTRATIVES = frozenset({"this", "that", "these", "those"})
_DETERMINERS = frozenset(
    "the a an this that these those some all most many every each no few several".split()
)
_COMPOUNDS: dict[str, frozenset[str]] = {
    "art": frozenset({"gallery", "galleries"}),
    "movie": frozenset({"theater", "theaters"}),
    "grocery": frozenset({"store", "stores"}),
    "newspaper": frozenset({"article", "articles"}),
    "public": frozenset({"park", "parks"}),
    "high": frozenset({"school", "schools"}),
    "college": frozenset({"campus", "campuses"}),
    "ice": frozenset({"cream"}),
    "current": frozenset({"event", "events"}),
}
"""The two-word nouns of BLiMP's vocabulary: modifier -> heads it combines with."""


def _subject_head(words: list[str]) -> int | None:
    lowered = [w.lower() for w in words]
    if lowered[:3] == ["a", "lot", "of"]:
        i = 3
    elif lowered and lowered[0] in _DETERMINERS:
        i = 1
    else:
        i = 0
        while i + 1 < len(words) and words[i + 1][:1].isupper():  # "Winston Churchill"
            i += 1
    if i + 1 < len(words) and lowered[i + 1] in _COMPOUNDS.get(lowered[i], frozenset()):
        i += 1
    return i if i < len(words) else None


def _determiner(words: list[str]) -> int | None:
    for i in range(len(words) - 1, -1, -1):
        if words[i].lower() in _DEMONSTRATIVES:
            return i
    return None


RULES: dict[str, Callable[[list[str]], int | None]] = {
    "subject_head": _subject_head,
    "determiner": _determiner,
}
"""Rule name -> rule over the prompt's words returning the evidence word index (None: not
found)."""

RULES_BY_TERM: dict[str, str] = {
    "subject_verb_agreement": "subject_head",
    "anaphor_agreement": "subject_head",
    "determiner_noun_agreement": "determiner",
}
"""BLiMP ``linguistics_term`` -> rule name (for agreement paradigms not listed by name)."""

_SVA = [
    "regular_plural_subject_verb_agreement_1",
    "regular_plural_subject_verb_agreement_2",
    "irregular_plural_subject_verb_agreement_1",
    "irregular_plural_subject_verb_agreement_2",
    "distractor_agreement_relational_noun",
    "distractor_agreement_relative_clause",
    "anaphor_number_agreement",
    "anaphor_gender_agreement",
]
_DNA = [
    f"determiner_noun_agreement_{kind}{n}"
    for kind in ("", "irregular_", "with_adjective_", "with_adj_", "with_adj_irregular_")
    for n in (1, 2)
]

BLIMP_EVIDENCE_RULES: dict[str, str] = {
    **{name: "subject_head" for name in _SVA},
    **{name: "determiner" for name in _DNA},
}
"""Paradigm UID -> rule name, for all of BLiMP's agreement paradigms."""


def rule_for(paradigm: str, linguistics_term: str | None = None) -> str | None:
    """The rule name for ``paradigm`` (by name, else by ``linguistics_term``); None if none."""
    return BLIMP_EVIDENCE_RULES.get(paradigm) or RULES_BY_TERM.get(linguistics_term or "")


def blimp_evidence(
    paradigm: str, prompt: str, linguistics_term: str | None = None
) -> tuple[tuple[int, ...], str]:
    """Evidence word index in ``prompt.split()`` for an item of ``paradigm``, and the rule name.

    Raises:
        KeyError: ``paradigm`` is not an agreement paradigm (no rule by name or by term).
        ValueError: the rule finds no evidence word in ``prompt`` (not BLiMP's structure).
    """
    name = rule_for(paradigm, linguistics_term)
    if name is None:
        raise KeyError(
            f"no evidence rule for BLiMP paradigm {paradigm!r} (linguistics_term "
            f"{linguistics_term!r}); rules exist for the agreement paradigms "
            f"{sorted(BLIMP_EVIDENCE_RULES)} and the terms {sorted(RULES_BY_TERM)}"
        )
    index = RULES[name](prompt.split())
    if index is None:
        raise ValueError(
            f"evidence rule {name!r} finds no evidence word in {prompt!r} ({paradigm}); the "
            "prompt does not have the structure the rule expects"
        )
    return (index,), name
