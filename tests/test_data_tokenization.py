"""Evidence token positions and single-token targets under the real SmolLM2 tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from lens_attrib.data import (
    GENERATORS,
    TaskItem,
    blimp_paradigms,
    evidence_token_positions,
    load_blimp,
    load_squad_v2,
    word_token_positions,
)
from lens_attrib.data.blimp_evidence import BLIMP_EVIDENCE_RULES
from lens_attrib.data.lexicon import DNA_NOUNS, REFLEXIVES, SVA_VERBS

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tokenizer(smollm2: Any) -> Any:
    """The real SmolLM2 tokenizer (from the bundled GGUF, through the session model)."""
    return smollm2.tokenizer


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _assert_evidence_decodes(item: TaskItem, tokenizer: Any) -> None:
    ids = _ids(tokenizer, item.prompt)
    positions = evidence_token_positions(item, tokenizer)
    assert positions == sorted(set(positions))
    decoded = tokenizer.decode([ids[p] for p in positions]).strip()
    assert decoded == " ".join(item.evidence_text), (item.prompt, positions)
    # BOS / [CLS] shifts
    assert evidence_token_positions(item, tokenizer, prepend_bos=True) == [p + 1 for p in positions]
    assert evidence_token_positions(item, tokenizer, offset=1) == [p + 1 for p in positions]
    shifted = evidence_token_positions(item, tokenizer, prepend_bos=True, offset=1)
    assert shifted == [p + 2 for p in positions]


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generated_evidence_and_single_token_targets(name: str, tokenizer: Any) -> None:
    for item in GENERATORS[name](200, seed=11):
        _assert_evidence_decodes(item, tokenizer)
        assert item.target is not None and item.foil is not None
        assert len(_ids(tokenizer, item.target)) == 1, item.target
        assert len(_ids(tokenizer, item.foil)) == 1, item.foil


def test_every_lexicon_target_is_one_token(tokenizer: Any) -> None:
    words = [w for pair in SVA_VERBS + DNA_NOUNS for w in pair] + list(REFLEXIVES.values())
    assert [w for w in words if len(_ids(tokenizer, " " + w)) != 1] == []


def test_multi_token_word_maps_to_all_its_tokens(tokenizer: Any) -> None:
    text = "The waitresses near the antidisestablishmentarianism"
    for index in (1, 4):
        positions = word_token_positions(text, [index], tokenizer)
        ids = _ids(tokenizer, text)
        assert len(positions) > 1
        assert tokenizer.decode([ids[p] for p in positions]).strip() == text.split()[index]
    assert word_token_positions(text, [], tokenizer) == []
    with pytest.raises(IndexError):
        word_token_positions(text, [5], tokenizer)


def test_slow_tokenizer_is_rejected() -> None:
    class Slow:
        is_fast = False

    item = GENERATORS["sva"](1)[0]
    with pytest.raises(TypeError, match="fast tokenizer"):
        evidence_token_positions(item, Slow())


STORED_RULED_PARADIGMS = sorted(set(BLIMP_EVIDENCE_RULES) & set(blimp_paradigms()))


def test_evidence_rules_cover_stored_agreement_paradigms() -> None:
    assert "regular_plural_subject_verb_agreement_1" in STORED_RULED_PARADIGMS
    assert len(STORED_RULED_PARADIGMS) >= 6


@pytest.mark.parametrize("paradigm", STORED_RULED_PARADIGMS)
def test_blimp_evidence_positions(paradigm: str, tokenizer: Any) -> None:
    items = load_blimp(paradigm, n=200)
    for item in items:
        _assert_evidence_decodes(item, tokenizer)


def test_squad_evidence_positions(tokenizer: Any) -> None:
    for item in load_squad_v2(n=100):
        ids = _ids(tokenizer, item.prompt)
        positions = evidence_token_positions(item, tokenizer)
        decoded = tokenizer.decode([ids[p] for p in positions])
        # a space that is a token of its own (before digits) belongs to no word: compare
        # without whitespace
        assert "".join(item.meta["answers"][0].split()) in "".join(decoded.split())
