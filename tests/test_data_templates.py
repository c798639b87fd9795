"""Template generators: determinism, counts, structure and evidence by construction."""

from __future__ import annotations

from collections import Counter

import pytest

from lens_attrib.data import (
    GENERATORS,
    TaskItem,
    as_prompts,
    generate_anaphora,
    generate_dna,
    generate_sva,
    word_spans,
)
from lens_attrib.data.lexicon import (
    ANAPHORA_FEMALE,
    ANAPHORA_MALE,
    REFLEXIVES,
    SVA_PEOPLE,
    SVA_THINGS,
)

_SVA_NUMBER = {w: i for pair in SVA_PEOPLE + SVA_THINGS for i, w in enumerate(pair)}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_seed_same_items_and_seeds_differ(name: str) -> None:
    generate = GENERATORS[name]
    first = generate(60, seed=7)
    assert first == generate(60, seed=7)
    assert first != generate(60, seed=8)
    assert generate(0) == []
    assert len(generate(37, seed=1)) == 37


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_items_are_varied_and_well_formed(name: str) -> None:
    items = GENERATORS[name](200, seed=0)
    assert len(set(as_prompts(items))) > 60
    for item in items:
        assert isinstance(item, TaskItem)
        assert item.task == name
        assert item.target is not None and item.target.startswith(" ")
        assert item.foil is not None and item.foil.startswith(" ")
        assert item.target != item.foil
        assert item.evidence_words
        assert all(0 <= i < len(item.words) for i in item.evidence_words)
        assert item.prompt == item.prompt.strip()
        hash(item)  # meta is excluded from the hash


def test_longer_runs_extend_shorter_ones() -> None:
    assert generate_sva(10, seed=3)[:5] == generate_sva(5, seed=3)


def test_sva_attractor_counts_cycle_and_are_opposite_in_number() -> None:
    items = generate_sva(80, seed=2)
    assert Counter(item.meta["n_attractors"] for item in items) == {0: 20, 1: 20, 2: 20, 3: 20}
    for item in items:
        words = item.words
        k = item.meta["n_attractors"]
        assert words[0] == "The"
        assert item.evidence_text == [item.meta["subject"]]
        plural = item.meta["number"] == "plural"
        assert _SVA_NUMBER[words[1]] == int(plural)
        singular_form, plural_form = item.meta["verb"].split("/")
        assert item.target == " " + (plural_form if plural else singular_form)
        assert item.foil == " " + (singular_form if plural else plural_form)
        # every attractor contributes exactly one "the" followed by its noun
        nouns = [words[i + 1] for i, w in enumerate(words) if w == "the"]
        assert len(nouns) == k == len(item.meta["attractor_types"])
        assert all(_SVA_NUMBER[noun] == int(not plural) for noun in nouns)
        assert words.count("that") == item.meta["attractor_types"].count("rc")


def test_sva_options() -> None:
    items = generate_sva(30, seed=4, n_attractors=2, attractor_types=("pp",))
    assert {item.meta["n_attractors"] for item in items} == {2}
    assert {item.meta["attractor_type"] for item in items} == {"pp"}
    assert all("that" not in item.words for item in items)
    rc = generate_sva(30, seed=4, n_attractors=(1,), attractor_types=("rc",))
    assert all(item.words[2] == "that" for item in rc)
    with pytest.raises(ValueError):
        generate_sva(3, attractor_types=("adverb",))
    with pytest.raises(ValueError):
        generate_sva(3, n_attractors=(-1,))
    with pytest.raises(ValueError):
        generate_sva(-1)


def test_anaphora_classes() -> None:
    classes = {w: "male" for w, _ in ANAPHORA_MALE}
    classes |= {w: "female" for w, _ in ANAPHORA_FEMALE}
    classes |= {p: "plural" for _, p in ANAPHORA_MALE + ANAPHORA_FEMALE}
    items = generate_anaphora(120, seed=5)
    assert Counter(item.meta["n_distractors"] for item in items) == {1: 60, 2: 60}
    assert {item.meta["antecedent_class"] for item in items} == {"male", "female", "plural"}
    for item in items:
        cls = item.meta["antecedent_class"]
        assert classes[item.evidence_text[0]] == cls
        assert item.target == " " + REFLEXIVES[cls]
        assert item.foil == " " + REFLEXIVES[item.meta["distractor_classes"][-1]]
        for noun, d_cls in zip(item.meta["distractors"], item.meta["distractor_classes"]):
            assert classes[noun] == d_cls != cls
        assert item.words[-1] == item.meta["verb"]
    bare = generate_anaphora(10, seed=0, n_distractors=0)
    assert all(len(item.words) == 3 and item.target != item.foil for item in bare)


def test_dna_number_follows_determiner() -> None:
    items = generate_dna(100, seed=6, determiners=("this", "that", "these", "those"))
    assert {item.meta["determiner"] for item in items} == {"this", "that", "these", "those"}
    for item in items:
        assert item.evidence_words == (2,)
        assert item.evidence_text == [item.meta["determiner"]]
        plural = item.meta["determiner"] in ("these", "those")
        singular = " " + item.meta["noun"]
        assert (item.foil if plural else item.target) == singular
        assert (item.target if plural else item.foil) != singular
    with pytest.raises(ValueError):
        generate_dna(2, determiners=("a",))


def test_word_spans_match_split() -> None:
    text = "  The keys\tnear\n the cabinet "
    assert [text[s:e] for s, e in word_spans(text)] == text.split()
