"""Best-effort evidence words for BLiMP agreement paradigms (one-prefix split).

BLiMP gives no evidence annotation; for the agreement paradigms the controlling word is easy to
find in the prefix with a rule, because the sentences come from a small grammar:

- ``subject_np`` (``regular_plural_subject_verb_agreement_1``,
  ``irregular_plural_subject_verb_agreement_1``): the prefix is exactly the subject noun phrase
  (``"A lot of hypotheses"``, ``"Tamara"``), so the evidence is its last word, the head noun.
- ``head_before_preposition`` (``distractor_agreement_relational_noun``): the subject is
  ``"<Det> <head> of/about <distractor>"`` (``"The niece of most senators"``); the evidence is the
  word before the first ``of``/``about``.
- ``last_determiner`` (``determiner_noun_agreement_*`` with a one-prefix split): the prefix ends
  with the determiner, possibly followed by adjectives (``"... those good"``); the evidence is the
  last ``this``/``that``/``these``/``those``.
- ``subject_head`` (``anaphor_number_agreement``, ``anaphor_gender_agreement``): the antecedent is
  the sentence subject. Skip a leading quantifier/determiner (``"A lot of"``, ``"The"``,
  ``"Most"``, ...) and take the next word as the head noun (a proper name when there is no
  determiner), or the word after it when the two form one of BLiMP's two-word nouns
  (``"movie theater"``, ``"art gallery"``).

Other paradigms get no evidence (empty tuple). A rule that finds nothing also gives ``()``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["BLIMP_EVIDENCE_RULES", "blimp_evidence"]

_DEMONSTRATIVES = frozenset({"this", "that", "these", "those"})
_RELATIONAL_PREPOSITIONS = frozenset({"of", "about"})
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
}
"""The two-word nouns of BLiMP's vocabulary: modifier -> heads it combines with."""


def _subject_np(words: list[str]) -> int | None:
    return len(words) - 1 if words else None


def _head_before_preposition(words: list[str]) -> int | None:
    for i, word in enumerate(words):
        if i > 0 and word.lower() in _RELATIONAL_PREPOSITIONS:
            return i - 1
    return None


def _last_determiner(words: list[str]) -> int | None:
    for i in range(len(words) - 1, -1, -1):
        if words[i].lower() in _DEMONSTRATIVES:
            return i
    return None


def _subject_head(words: list[str]) -> int | None:
    lowered = [w.lower() for w in words]
    if lowered[:3] == ["a", "lot", "of"]:
        i = 3
    elif lowered and lowered[0] in _DETERMINERS:
        i = 1
    else:
        i = 0
    if i + 1 < len(words) and lowered[i + 1] in _COMPOUNDS.get(lowered[i], frozenset()):
        i += 1
    return i if i < len(words) else None


BLIMP_EVIDENCE_RULES: dict[str, tuple[str, Callable[[list[str]], int | None]]] = {
    "regular_plural_subject_verb_agreement_1": ("subject_np", _subject_np),
    "irregular_plural_subject_verb_agreement_1": ("subject_np", _subject_np),
    "distractor_agreement_relational_noun": ("head_before_preposition", _head_before_preposition),
    "determiner_noun_agreement_1": ("last_determiner", _last_determiner),
    "determiner_noun_agreement_irregular_1": ("last_determiner", _last_determiner),
    "determiner_noun_agreement_with_adjective_1": ("last_determiner", _last_determiner),
    "determiner_noun_agreement_with_adj_irregular_1": ("last_determiner", _last_determiner),
    "anaphor_number_agreement": ("subject_head", _subject_head),
    "anaphor_gender_agreement": ("subject_head", _subject_head),
}
"""Paradigm UID -> (rule name, rule over the prefix words returning a word index or None)."""


def blimp_evidence(paradigm: str, prefix: str) -> tuple[tuple[int, ...], str | None]:
    """Evidence word indices in ``prefix.split()`` for ``paradigm``, and the rule's name.

    Returns ``((), None)`` for paradigms without a rule and ``((), rule)`` when the rule finds
    nothing.
    """
    rule = BLIMP_EVIDENCE_RULES.get(paradigm)
    if rule is None:
        return (), None
    name, find = rule
    index = find(prefix.split())
    return ((index,) if index is not None else ()), name
