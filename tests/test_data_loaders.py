"""Loaders read the real shared files into well-formed items."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from lens_attrib.data import (
    BLIMP_EVIDENCE_RULES,
    DATA_ENV_VAR,
    blimp_paradigms,
    data_root,
    load_blimp,
    load_boolq,
    load_imdb,
    load_linzen_sva,
    load_squad_v2,
    load_sst2,
    load_stsb,
)


def test_data_root_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path))
    assert data_root() == tmp_path
    assert data_root(tmp_path) == tmp_path
    monkeypatch.delenv(DATA_ENV_VAR)
    with pytest.raises(FileNotFoundError, match="no data folder configured"):
        data_root()
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=DATA_ENV_VAR):
        data_root()


def test_blimp_every_one_prefix_paradigm_is_consistent() -> None:
    valid = blimp_paradigms(one_prefix_only=True)
    assert "regular_plural_subject_verb_agreement_1" in valid
    assert "adjunct_island" not in valid and "adjunct_island" in blimp_paradigms()
    for paradigm in valid:
        items = load_blimp(paradigm)
        assert len(items) == 1000
        for item in items:
            good, bad = item.meta["sentence_good"], item.meta["sentence_bad"]
            assert item.target is not None and item.foil is not None
            assert good.startswith(item.prompt + item.target)
            assert bad.startswith(item.prompt + item.foil)
            assert item.meta["uid"] == paradigm
            assert all(0 <= i < len(item.words) for i in item.evidence_words)
            if paradigm in BLIMP_EVIDENCE_RULES:
                assert len(item.evidence_words) == 1
            else:
                assert item.evidence_words == ()


def test_blimp_sentence_equals_prompt_plus_target_for_final_word_paradigm() -> None:
    for item in load_blimp("determiner_noun_agreement_1", n=50):
        assert item.target is not None
        assert item.prompt + item.target == item.meta["sentence_good"].removesuffix(".")
        assert item.evidence_text[0] in ("this", "that", "these", "those")


def test_blimp_evidence_rules() -> None:
    sva = load_blimp("regular_plural_subject_verb_agreement_1", n=5)
    assert sva[0].prompt == "Paula" and sva[0].evidence_words == (0,)
    for item in load_blimp("distractor_agreement_relational_noun", n=100):
        assert item.words[item.evidence_words[0] + 1] in ("of", "about")
    anaphor = {i.prompt: i.evidence_text[0] for i in load_blimp("anaphor_number_agreement")}
    assert anaphor["Susan revealed"] == "Susan"
    assert anaphor["A lot of waitresses complained about"] == "waitresses"
    assert anaphor["That movie has disagreed with"] == "movie"
    adj = load_blimp("determiner_noun_agreement_with_adj_1", n=3)  # alias of the file name
    assert adj[0].meta["uid"] == "determiner_noun_agreement_with_adjective_1"


def test_blimp_errors_and_sampling() -> None:
    with pytest.raises(ValueError, match="regular_plural_subject_verb_agreement_1"):
        load_blimp("adjunct_island")
    with pytest.raises(FileNotFoundError):
        load_blimp("no_such_paradigm")
    sample = load_blimp("npi_present_1", n=10, seed=3)
    assert sample == load_blimp("npi_present_1", n=10, seed=3)
    assert sample != load_blimp("npi_present_1", n=10)
    ids = [int(item.meta["pair_id"]) for item in sample]
    assert ids == sorted(ids)


def test_linzen_sva() -> None:
    items = load_linzen_sva()
    assert len(items) == 7489 - 4  # four rows whose correct and wrong forms coincide
    assert Counter(item.meta["n_attractors"] for item in items) == {
        0: 1970, 1: 1957, 2: 1943, 3: 1285, 4: 330,
    }  # fmt: skip
    for item in items:
        words = item.meta["sentence"].split()
        assert item.target is not None and item.foil is not None
        assert item.words == words[: item.meta["verb_index"]]
        assert words[item.meta["verb_index"]] == item.target.strip()
        assert item.foil.strip() != item.target.strip()
        assert item.evidence_words == ()
    few = load_linzen_sva(n=50, max_attractors=1, min_attractors=1)
    assert len(few) == 50 and {item.meta["n_attractors"] for item in few} == {1}
    assert load_linzen_sva(n=5)[0].prompt.endswith("the town")


def test_sst2_splits() -> None:
    dev = load_sst2()
    assert len(dev) == 872
    assert Counter(item.label for item in dev) == {1: 444, 0: 428}
    assert all(item.prompt and item.target is None for item in dev)
    assert len(load_sst2("test")) == 1821
    assert load_sst2("train", n=3)[0].label in (0, 1)
    with pytest.raises(ValueError):
        load_sst2("nope")


def test_squad_v2_evidence_reproduces_answer() -> None:
    items = load_squad_v2()
    assert len(items) == 6078 - 3168
    for item in items:
        context, question = item.meta["context"], item.meta["question"]
        assert item.prompt == f"Context: {context}\nQuestion: {question}\nAnswer:"
        answer = item.meta["answers"][0]
        start, end = item.meta["answer_char_spans"][0]
        assert context[start:end] == answer
        p_start, p_end = item.meta["prompt_char_spans"][0]
        assert item.prompt[p_start:p_end] == answer
        joined = " ".join(item.evidence_text)
        assert " ".join(answer.split()) in joined
        # no word beyond those needed: the first and last evidence words touch the answer
        assert answer.split()[0] in item.evidence_text[0]
        assert answer.split()[-1] in item.evidence_text[-1]
        assert item.target == " " + answer.split()[0]
    everything = load_squad_v2(answerable_only=False, n=200)
    impossible = [item for item in everything if item.meta["is_impossible"]]
    assert impossible and all(i.target is None and not i.evidence_words for i in impossible)


def test_stsb() -> None:
    items = load_stsb()
    assert len(items) == 1500
    assert items[0].prompt == "A man with a hard hat is dancing."
    assert items[0].meta["sentence2"] == "A man wearing a hard hat is dancing."
    assert items[0].meta["score"] == 5.0
    assert all(0.0 <= item.meta["score"] <= 5.0 for item in items)


def test_boolq() -> None:
    items = load_boolq()
    assert len(items) == 3270
    assert Counter(item.label for item in items) == {1: 2033, 0: 1237}
    for item in items[:100]:
        assert item.target == (" yes" if item.label else " no")
        assert item.foil == (" no" if item.label else " yes")
        assert item.prompt.startswith(item.meta["passage"])
        assert re.search(r"\nQuestion: .+\?\nAnswer:$", item.prompt)


def test_imdb() -> None:
    items = load_imdb()
    assert len(items) == 199
    assert Counter(item.label for item in items) == {0: 104, 1: 95}
    assert len(load_imdb(n=10, seed=0)) == 10
    with pytest.raises(ValueError):
        load_imdb(n=-1)
