"""BLiMP from any folder: every agreement paradigm's items and evidence, checked on every item
against the sentence pair itself; two-prefix items; rules that carry over to other paradigms."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from lens_attrib.data import (
    BLIMP_EVIDENCE_RULES,
    blimp_dir,
    blimp_evidence,
    blimp_paradigms,
    load_blimp,
    number_counterpart,
)

AGREEMENT_TERMS = {"determiner_noun_agreement", "subject_verb_agreement", "anaphor_agreement"}


def _first_rows() -> dict[str, dict]:
    rows = {}
    for path in sorted(blimp_dir().glob("*.jsonl")):
        with path.open(encoding="utf-8") as handle:
            rows[path.stem] = json.loads(handle.readline())
    return rows


FIRST = _first_rows()
AGREEMENT = sorted(p for p, row in FIRST.items() if row["linguistics_term"] in AGREEMENT_TERMS)


def test_the_shipped_agreement_paradigms_all_have_rules() -> None:
    assert len(AGREEMENT) == 12
    assert all(p in BLIMP_EVIDENCE_RULES for p in AGREEMENT)


@pytest.mark.parametrize("paradigm", AGREEMENT)
def test_every_item_has_evidence_inside_the_prompt(paradigm: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        items = load_blimp(paradigm)
    assert len(items) >= 995
    rule = BLIMP_EVIDENCE_RULES[paradigm]
    two_prefix = not FIRST[paradigm]["one_prefix_method"]
    for item in items:
        assert item.target is not None and item.foil is not None and item.target != item.foil
        assert len(item.evidence_words) == 1 and item.meta["evidence_rule"] == rule
        (index,) = item.evidence_words
        words = item.words
        assert 0 <= index < len(words)
        assert words[index].lower() != item.target.strip().lower()
        good, bad = item.meta["sentence_good"], item.meta["sentence_bad"]
        assert good.startswith(item.prompt + item.target)
        if two_prefix:
            # oracle: the evidence is the one word where the good and bad prefixes differ
            bad_words = bad.split()[: len(words)]
            differ = [i for i, (a, b) in enumerate(zip(words, bad_words)) if a != b]
            assert differ == [index], (item.prompt, bad)
        else:
            assert bad.startswith(item.prompt + item.foil)
        if rule == "determiner":
            assert words[index].lower() in {"this", "that", "these", "those"}
            assert all(
                w.lower() not in {"this", "that", "these", "those"} for w in words[index + 1 :]
            )
        elif paradigm == "distractor_agreement_relational_noun":
            # oracle: the subject head is the word before the relational preposition
            assert words[index + 1] in ("of", "about")
        elif paradigm.startswith(("regular_plural", "irregular_plural")):
            # the prompt is exactly the subject noun phrase, headed by its last word
            assert index == len(words) - 1


def test_anaphor_antecedents() -> None:
    anaphor = {i.prompt: i.evidence_text[0] for i in load_blimp("anaphor_number_agreement")}
    assert anaphor["Susan revealed"] == "Susan"
    assert anaphor["A lot of waitresses complained about"] == "waitresses"
    assert anaphor["That movie has disagreed with"] == "movie"


def test_two_prefix_items_use_the_good_prefix_and_the_other_number() -> None:
    dna = load_blimp("determiner_noun_agreement_2", n=2)
    assert (dna[0].prompt, dna[0].target, dna[0].foil) == (
        "Some dog stunned this",
        " committee",
        " committees",
    )
    assert (dna[1].target, dna[1].foil) == (" art galleries", " art gallery")
    irregular = load_blimp("determiner_noun_agreement_with_adj_irregular_2", n=2)
    assert [(i.target, i.foil) for i in irregular] == [
        (" oasis", " oases"),
        (" alumni", " alumnus"),
    ]
    assert number_counterpart("was") == "were" and number_counterpart("isn't") == "aren't"
    assert number_counterpart("marry") == "marries" and number_counterpart("watches") == "watch"
    assert number_counterpart("singing") is None
    with pytest.warns(UserWarning, match="dropped 1 of 1000"):
        load_blimp("regular_plural_subject_verb_agreement_2")


def test_non_agreement_two_prefix_paradigm_raises() -> None:
    with pytest.raises(ValueError, match="not an agreement paradigm"):
        load_blimp("adjunct_island")
    with pytest.raises(KeyError, match="no evidence rule"):
        blimp_evidence("npi_present_1", "Even these trucks have")
    with pytest.raises(ValueError, match="finds no evidence word"):
        blimp_evidence("determiner_noun_agreement_1", "Raymond is selling")


def _copy(tmp_path: Path, names: list[str]) -> Path:
    folder = tmp_path / "my_blimp"
    folder.mkdir()
    for name in names:
        shutil.copy(blimp_dir() / f"{name}.jsonl", folder / f"{name}.jsonl")
    return folder


def test_root_argument_and_paradigms_brought_by_the_user(tmp_path: Path, monkeypatch) -> None:
    folder = _copy(
        tmp_path, ["determiner_noun_agreement_1", "regular_plural_subject_verb_agreement_1"]
    )
    # rows in the shape of BLiMP's other agreement paradigms (not shipped here)
    extra = {
        "distractor_agreement_relative_clause": (
            "subject_verb_agreement",
            "The boys that aren't disturbing Natalie",
            "dream",
            "dreams",
        ),
        "anaphor_gender_agreement": (
            "anaphor_agreement",
            "The actress hasn't hugged",
            "herself",
            "himself",
        ),
        "irregular_plural_subject_verb_agreement_2": (
            "subject_verb_agreement",
            None,
            "have",
            None,
        ),
    }
    for uid, (term, prefix, good, bad) in extra.items():
        row = {"field": "morphology", "linguistics_term": term, "UID": uid, "pairID": "0"}
        if prefix is not None:
            row.update(
                one_prefix_method=True,
                two_prefix_method=False,
                one_prefix_prefix=prefix,
                one_prefix_word_good=good,
                one_prefix_word_bad=bad,
                sentence_good=f"{prefix} {good}.",
                sentence_bad=f"{prefix} {bad}.",
            )
        else:
            row.update(
                one_prefix_method=False,
                two_prefix_method=True,
                two_prefix_prefix_good="The children",
                two_prefix_prefix_bad="The child",
                two_prefix_word=good,
                sentence_good="The children have left.",
                sentence_bad="The child have left.",
            )
        (folder / f"{uid}.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    monkeypatch.delenv("LENS_ATTRIB_DATA")
    assert set(blimp_paradigms(root=folder)) == {
        "determiner_noun_agreement_1",
        "regular_plural_subject_verb_agreement_1",
        *extra,
    }
    assert len(load_blimp("determiner_noun_agreement_1", root=folder)) == 1000
    relative = load_blimp("distractor_agreement_relative_clause", root=folder)[0]
    assert relative.evidence_text == ["boys"]
    gender = load_blimp("anaphor_gender_agreement", root=folder)[0]
    assert gender.evidence_text == ["actress"]
    irregular = load_blimp("irregular_plural_subject_verb_agreement_2", root=folder)[0]
    assert (irregular.prompt, irregular.target, irregular.foil) == ("The children", " have", " has")
    assert irregular.evidence_text == ["children"]
    # a data folder holding blimp/data works as root too
    assert blimp_dir(tmp_path.parent / tmp_path.name / "my_blimp") == folder
    with pytest.raises(FileNotFoundError, match="pass root="):
        load_blimp("determiner_noun_agreement_1", root=tmp_path / "nowhere")
