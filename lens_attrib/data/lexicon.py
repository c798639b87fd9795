"""Word lists for the template generators.

Every word that a generator uses as a ``target`` or ``foil`` is a single frequent English word that
is one token, with its leading space, for GPT-2-style byte-level BPE tokenizers (checked against
the SmolLM2 / Llama-style tokenizer in the tests). Nouns are (singular, plural) pairs.
"""

from __future__ import annotations

__all__ = [
    "ANAPHORA_FEMALE",
    "ANAPHORA_MALE",
    "ANAPHORA_PREPOSITIONS",
    "ANAPHORA_VERBS",
    "DNA_NAMES",
    "DNA_NOUNS",
    "DNA_VERBS",
    "REFLEXIVES",
    "SVA_PEOPLE",
    "SVA_PREPOSITIONS",
    "SVA_RC_VERBS",
    "SVA_THINGS",
    "SVA_VERBS",
]

# ---------------------------------------------------------------- subject–verb agreement
SVA_PEOPLE: tuple[tuple[str, str], ...] = (
    ("author", "authors"),
    ("teacher", "teachers"),
    ("doctor", "doctors"),
    ("student", "students"),
    ("farmer", "farmers"),
    ("officer", "officers"),
    ("manager", "managers"),
    ("player", "players"),
    ("senator", "senators"),
    ("pilot", "pilots"),
    ("lawyer", "lawyers"),
    ("nurse", "nurses"),
    ("driver", "drivers"),
    ("singer", "singers"),
    ("artist", "artists"),
)
"""Animate nouns: subjects, attractors, and subjects of relative-clause attractors."""

SVA_THINGS: tuple[tuple[str, str], ...] = (
    ("key", "keys"),
    ("painting", "paintings"),
    ("book", "books"),
    ("car", "cars"),
    ("house", "houses"),
    ("window", "windows"),
    ("letter", "letters"),
    ("picture", "pictures"),
    ("cabinet", "cabinets"),
    ("table", "tables"),
    ("garden", "gardens"),
    ("bottle", "bottles"),
)
"""Inanimate nouns: subjects and prepositional-phrase attractors."""

SVA_VERBS: tuple[tuple[str, str], ...] = (("is", "are"), ("was", "were"), ("has", "have"))
"""(singular, plural) forms of the predicted verb."""

SVA_PREPOSITIONS: tuple[str, ...] = ("near", "behind", "beside", "above", "below", "next to")

SVA_RC_VERBS: tuple[tuple[str, str], ...] = (
    ("likes", "like"),
    ("sees", "see"),
    ("knows", "know"),
    ("loves", "love"),
    ("hates", "hate"),
    ("wants", "want"),
    ("needs", "need"),
    ("mentions", "mention"),
)
"""(agreeing with a singular, with a plural) relative-clause subject."""

# ---------------------------------------------------------------- reflexive anaphora
REFLEXIVES: dict[str, str] = {"male": "himself", "female": "herself", "plural": "themselves"}
"""Reflexive pronoun for each antecedent class."""

ANAPHORA_MALE: tuple[tuple[str, str], ...] = (
    ("king", "kings"),
    ("actor", "actors"),
    ("waiter", "waiters"),
    ("man", "men"),
    ("boy", "boys"),
    ("father", "fathers"),
    ("brother", "brothers"),
    ("son", "sons"),
    ("husband", "husbands"),
    ("prince", "princes"),
    ("gentleman", "gentlemen"),
    ("monk", "monks"),
    ("grandfather", "grandfathers"),
    ("uncle", "uncles"),
)
"""(singular, plural) nouns of male referents."""

ANAPHORA_FEMALE: tuple[tuple[str, str], ...] = (
    ("queen", "queens"),
    ("actress", "actresses"),
    ("waitress", "waitresses"),
    ("woman", "women"),
    ("girl", "girls"),
    ("mother", "mothers"),
    ("sister", "sisters"),
    ("daughter", "daughters"),
    ("wife", "wives"),
    ("princess", "princesses"),
    ("lady", "ladies"),
    ("nun", "nuns"),
    ("grandmother", "grandmothers"),
    ("aunt", "aunts"),
)
"""(singular, plural) nouns of female referents."""

ANAPHORA_PREPOSITIONS: tuple[str, ...] = ("near", "behind", "beside", "next to", "with")

ANAPHORA_VERBS: tuple[str, ...] = (
    "blamed",
    "hurt",
    "praised",
    "saw",
    "defended",
    "admired",
    "criticized",
    "introduced",
    "trusted",
    "described",
    "questioned",
    "surprised",
)
"""Past-tense transitive verbs that readily take a reflexive object."""

# ---------------------------------------------------------------- determiner–noun agreement
DNA_NAMES: tuple[str, ...] = (
    "Carl",
    "Mary",
    "John",
    "Sarah",
    "David",
    "Emma",
    "James",
    "Anna",
    "Peter",
    "Laura",
    "Mark",
    "Lisa",
    "Paul",
    "Kate",
    "Tom",
    "Jane",
    "Susan",
    "Robert",
    "Linda",
    "Steven",
)

DNA_VERBS: tuple[str, ...] = (
    "bought",
    "sold",
    "found",
    "lost",
    "moved",
    "carried",
    "dropped",
    "took",
    "wanted",
    "needed",
    "liked",
    "saw",
    "kept",
    "noticed",
    "borrowed",
    "cleaned",
)
"""Past-tense verbs that fit any of the concrete nouns below."""

DNA_NOUNS: tuple[tuple[str, str], ...] = (
    ("dish", "dishes"),
    ("book", "books"),
    ("car", "cars"),
    ("chair", "chairs"),
    ("apple", "apples"),
    ("table", "tables"),
    ("cup", "cups"),
    ("shirt", "shirts"),
    ("box", "boxes"),
    ("bottle", "bottles"),
    ("plate", "plates"),
    ("bag", "bags"),
    ("coat", "coats"),
    ("hat", "hats"),
    ("bike", "bikes"),
    ("toy", "toys"),
    ("picture", "pictures"),
    ("shoe", "shoes"),
    ("lamp", "lamps"),
    ("desk", "desks"),
    ("map", "maps"),
    ("card", "cards"),
    ("ball", "balls"),
    ("key", "keys"),
    ("phone", "phones"),
)
"""Concrete nouns whose singular and plural are both single tokens (they are targets)."""
