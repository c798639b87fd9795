"""The user's own items: JSONL/CSV loading, validation, and evidence positions for a real
tokenizer with the start token handled without merging."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lens_attrib.data import (
    TaskItem,
    evidence_token_positions,
    generate_sva,
    load_items,
    parse_item,
    word_spans,
)

START = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer(smollm2: Any) -> Any:
    return smollm2.tokenizer


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _rows(n: int) -> list[dict[str, Any]]:
    """Template SVA items as user rows; every other row gives character spans instead of words."""
    rows = []
    for i, item in enumerate(generate_sva(n, seed=1)):
        row: dict[str, Any] = {"prompt": item.prompt, "target": item.target, "foil": item.foil}
        if i % 2:
            spans = word_spans(item.prompt)
            row["evidence_spans"] = [list(spans[w]) for w in item.evidence_words]
        else:
            row["evidence_words"] = list(item.evidence_words)
        row["id"] = f"row{i}"
        rows.append(row)
    return rows


def test_jsonl_and_csv_give_the_same_items(tmp_path: Path) -> None:
    rows = _rows(6)
    from_jsonl = load_items(_write_jsonl(tmp_path / "mine.jsonl", rows))
    lines = ["prompt,target,foil,evidence_words,evidence_spans,id"]
    for r in rows:
        words = ";".join(str(w) for w in r.get("evidence_words", []))
        spans = ";".join(f"{s}:{e}" for s, e in r.get("evidence_spans", []))
        lines.append(f'"{r["prompt"]}","{r["target"]}","{r["foil"]}",{words},{spans},{r["id"]}')
    csv_path = tmp_path / "mine.csv"
    csv_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    from_csv = load_items(csv_path)
    assert [(i.prompt, i.target, i.foil, i.evidence_words) for i in from_jsonl] == [
        (i.prompt, i.target, i.foil, i.evidence_words) for i in from_csv
    ]
    reference = generate_sva(6, seed=1)
    assert [i.evidence_words for i in from_jsonl] == [i.evidence_words for i in reference]
    assert from_jsonl[0].task == "mine" and from_jsonl[1].meta["id"] == "row1"
    assert from_jsonl[1].meta["evidence_spans"] and "evidence_spans" not in from_jsonl[0].meta
    assert load_items(tmp_path / "mine.jsonl", n=3, seed=0) == load_items(
        tmp_path / "mine.jsonl", n=3, seed=0
    )


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"target": " is"}, "'prompt' is missing"),
        ({"prompt": "The dog"}, "'target' is missing"),
        ({"prompt": "The dog", "target": " is", "evidence_words": [2]}, "outside the 2 words"),
        ({"prompt": "The dog", "target": " is", "evidence_spans": [[4, 9]]}, "outside the prompt"),
        ({"prompt": "The dog", "target": " is", "evidence_spans": [[3, 4]]}, "only whitespace"),
        (
            {
                "prompt": "The dog",
                "target": " is",
                "evidence_words": [1],
                "evidence_spans": [[4, 7]],
            },
            "not both",
        ),
        ({"prompt": "The dog", "target": " is", "evidence_words": ["dog"]}, "word indices"),
    ],
)
def test_bad_rows_name_the_problem(row: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_item(row, where="f.jsonl:3")


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_items(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "target": " b"}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_items(bad)
    (tmp_path / "x.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown item file type"):
        load_items(tmp_path / "x.txt")


def test_span_and_word_evidence_map_to_the_same_tokens(tokenizer: Any) -> None:
    for row in _rows(10):
        item = parse_item(row)
        words = TaskItem(item.prompt, item.target, item.foil, item.evidence_words, "t", {})
        assert evidence_token_positions(item, tokenizer) == evidence_token_positions(
            words, tokenizer
        )


def test_sub_word_span_maps_to_its_token_only(tokenizer: Any) -> None:
    prompt = "The unbelievable keys"
    item = parse_item({"prompt": prompt, "target": " are", "evidence_spans": [[17, 21]]})
    positions = evidence_token_positions(item, tokenizer)
    ids = _ids(tokenizer, prompt)
    assert tokenizer.decode([ids[p] for p in positions]).strip() == "keys"


def test_start_token_shifts_positions_and_is_never_evidence(tokenizer: Any) -> None:
    n_start = len(_ids(tokenizer, START))
    assert n_start == 1
    for item in generate_sva(10, seed=2):
        plain = evidence_token_positions(item, tokenizer)
        joined = evidence_token_positions(item, tokenizer, start_token=START)
        assert joined == [p + n_start for p in plain]
        ids = _ids(tokenizer, START + item.prompt)
        assert ids[:n_start] == _ids(tokenizer, START)
        decoded = tokenizer.decode([ids[p] for p in joined]).strip()
        assert decoded == " ".join(item.evidence_text)
        assert evidence_token_positions(item, tokenizer, prepend_bos=True) == joined


def test_start_token_written_into_the_prompt_is_not_merged(tokenizer: Any) -> None:
    # "<|endoftext|>The women" splits into the words ["<|endoftext|>The", "women"]
    item = TaskItem(START + "The women", " meet", " meets", (0,), "t", {})
    positions = evidence_token_positions(item, tokenizer)
    ids = _ids(tokenizer, item.prompt)
    assert positions == [1] and tokenizer.decode([ids[1]]).strip() == "The"


def test_start_token_must_be_special(tokenizer: Any) -> None:
    item = generate_sva(1, seed=0)[0]
    with pytest.raises(ValueError, match="not a special token"):
        evidence_token_positions(item, tokenizer, start_token="START ")
